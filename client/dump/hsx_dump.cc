// hsx-dump: extracts hidden states for every sample of a JSONL file and writes
// one verified hs_{i}.safetensors per sample, plus its shard's journal
// (manifest.jsonl, or journal/shard-I-of-N.jsonl), quarantine and status files
// (dump_dir.h); `hsx-dump status DIR` reports on all shards.
// Two transports, one code path after them (dump_job.h):
//   --model DIR       the engine runs inside the tool, no server needed
//   --server ADDR,... remote hsx-server(s), round-robin, with retries
// A rerun with the same arguments resumes: journaled samples are skipped.
#include <csignal>
#include <ctime>
#include <map>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <malloc.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/dump/dump_job.h"
#include "client/dump/extractor.h"
#include "client/dump/fault.h"
#include "client/dump/in_process_extractor.h"
#include "client/dump/input.h"
#include "client/dump/dump_status.h"
#include "client/dump/journal.h"
#include "client/dump/remote_extractor.h"
#include "format/sample_file.h"
#include "kernels/backend.h"
#include "server/model/checkpoint.h"
#include "server/model/config.h"
#include "server/runtime/engine_flags.h"
#include "format/capture_spec.h"
#include "base/cli.h"
#include "base/file_util.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory to run in-process (instead of --server).");
ABSL_FLAG(std::string, server, "", "hsx-server address(es), comma-separated (host:port, dns:///name:port, "
          "unix:path); samples go round-robin over them (instead of --model). The run starts with the "
          "addresses that answer; one that does not is logged, asked again with backoff, and used once it "
          "answers. No answering address after --retries rounds is an error.");
ABSL_FLAG(std::string, input, "", "JSON Lines input: {\"input_ids\": [...], \"loss_mask\": [...]?, "
          "\"id\": ...?} per line.");
ABSL_FLAG(std::string, out, "", "Output directory; sample i (0-based line among samples) goes to "
          "hs_{i}.safetensors, and the journal records what is complete: manifest.jsonl for --shard 0/1, "
          "journal/shard-I-of-N.jsonl for shard I of N > 1. Rerunning resumes: samples journaled in any "
          "journal of the directory are skipped, and one whose file is missing or not the journaled size is "
          "redone.");
ABSL_FLAG(std::string, dtype, "bf16",
          "Output dtype: bf16, fp16, fp32 or fp8 (e4m3 with a float32 scale per token per layer, docs/formats.md).");
ABSL_FLAG(int, concurrency, 64, "Samples in flight at once.");
ABSL_FLAG(std::string, max_in_flight_bytes, "4GiB", "Bytes of hidden states in flight at once (received "
          "or being written; e.g. 500MB, 8GiB); fewer samples are started when they are long.");
ABSL_FLAG(std::string, shard, "0/1", "I/N: process only the samples whose index % N == I (several "
          "processes, on any hosts, may share one --out directory; each shard has its own journal, "
          "quarantine and status file; run all shards of a directory with the same N at once).");
ABSL_FLAG(int64_t, max_failures, 0, "Samples that may fail (after --retries) by their own fault before the run "
          "stops: each is written to OUT/quarantine/shard-I-of-N.jsonl with its id and the reason, and the "
          "run goes on; one more fails the run (exit status 1; that sample is not quarantined, a rerun "
          "takes it up). A failure of the environment (disk full or an I/O error, servers busy, unreachable "
          "or too slow after the retries) is never quarantined: it stops the run with exit status 75. With a value above 0, an input "
          "sample beyond the model's limits (a token id outside the vocabulary, too many tokens, a media "
          "placeholder) is quarantined too instead of refusing the input. 0: the first failure stops the run.");
ABSL_FLAG(bool, retry_quarantined, false, "Take up again the samples that earlier runs quarantined (without it "
          "they are skipped, and the run ends with exit status 3 while any is left).");
ABSL_FLAG(std::string, layout, "flat", "Where sample files go: flat (OUT/hs_{i}.safetensors, one directory: "
          "what speculators reads) or nested (OUT/{i/1000 as 5 digits}/hs_{i}.safetensors: at most 1000 files "
          "per directory, for large dumps read through the journals: hsx.journal, hsx.convert, hsx-verify). "
          "The journal's \"file\" names the path either way.");
ABSL_FLAG(bool, json, false, "hsx-dump status: print the report as one JSON object.");
ABSL_FLAG(double, deadline, 600, "--server: seconds one attempt of one sample may take.");
ABSL_FLAG(int, retries, 8, "--server: retries of a sample after UNAVAILABLE, DEADLINE_EXCEEDED or "
          "RESOURCE_EXHAUSTED (exponential backoff with jitter); after them the run stops (exit status 75). "
          "Other errors fail the sample (see --max-failures).");
ABSL_FLAG(std::string, auth_token_file, "", "--server: file holding a token sent as "
          "'authorization: Bearer <token>'.");
ABSL_FLAG(std::string, tls_ca, "", "--server: PEM file of the CA that signed the server's "
          "certificate; turns TLS on.");
ABSL_FLAG(std::string, tls_cert, "", "--server: PEM client certificate chain for mTLS (with "
          "--tls-key); turns TLS on.");
ABSL_FLAG(std::string, tls_key, "", "--server: PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_server_name, "", "--server: the name to check the server's certificate "
          "against, when the address is not that name.");
ABSL_FLAG(std::string, stream_window, "4MiB", "--server: the HTTP/2 flow-control window of each "
          "sample's stream, how far the server may send ahead of what hsx-dump has read: 64KiB to 1GiB, "
          "or 0 for gRPC's automatic window (BDP probing). A stream moves at most one window per round "
          "trip (4 MiB: 4 GB/s at 1 ms); the automatic window grows the buffers and cost hsx-dump "
          "5-9% more CPU per byte on loopback (docs/BENCHMARKS.md).");
ABSL_FLAG(std::string, progress, "auto", "auto (a bar on a terminal, else a line every "
          "--progress-interval seconds), bar, plain or none.");
ABSL_FLAG(double, progress_interval, 10, "Seconds between plain progress lines.");
ABSL_FLAG(int, writer_threads, 2, "Threads that verify, write and journal samples.");
ABSL_FLAG(bool, discard, false, "Verify every sample, then drop it: no files and no journal "
          "(a throughput or smoke run against a server). Every check of a written sample runs (echoes, "
          "shapes, row order, checksums, finite and non-zero values), on the received bytes as they "
          "arrive, without assembling the sample. --out gets only an empty journal.");
ABSL_FLAG(std::string, wire_checksum, "xxh3", "--server: the checksum each sample's stream carries "
          "and hsx-dump verifies: xxh3 (the server's CPU per byte is its scarce resource, and XXH3 costs "
          "it a third of XXH64 with AVX2; servers that predate the choice send XXH64, which is then "
          "verified) or xxh64 (files of one captured layer then take their checksums_xxh64 from the "
          "stream instead of hashing the bytes once more).");

namespace {

std::atomic<bool> g_interrupted{false};
int64_t g_quarantined = 0;  // samples of the shard left in quarantine by the run

// The exit status of a run that completed with samples quarantined.
constexpr int kExitQuarantined = 3;

void OnSignal(int sig) {
  if (g_interrupted.exchange(true)) {  // a second signal: stop now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

// Whether a flag was set to something other than its default (this Abseil
// keeps IsSpecifiedOnCommandLine private).
bool Specified(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && flag->CurrentValue() != flag->DefaultValue();
}

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> text = hsx::ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("--", flag, " ", path, ": cannot open"));
  return text;
}

struct Transport {
  std::unique_ptr<hsx::Checkpoint> checkpoint;
  std::unique_ptr<hsx::Engine> engine;
  std::unique_ptr<hsx::Extractor> extractor;
  std::function<int64_t()> retries;  // the transport's retries so far (remote only)
  // The model's shape, what capture ids, input limits and states are checked against.
  int num_layers = 0;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  hsx::SampleFileInfo info;
  int64_t max_tokens_per_sample = 0;
  // --model: the token ids refused as media (the server checks for --server).
  std::vector<hsx::MediaPlaceholder> media_placeholders;
};

absl::StatusOr<Transport> MakeInProcess(const std::string& model_dir, hsx::EngineFlags flags) {
  for (absl::string_view flag : {"deadline", "retries", "auth_token_file", "tls_ca", "tls_cert", "tls_key",
                                 "tls_server_name", "stream_window"}) {
    if (Specified(flag)) return absl::InvalidArgumentError(absl::StrCat("--", flag, " needs --server"));
  }
  Transport t;
  absl::StatusOr<std::unique_ptr<hsx::Checkpoint>> checkpoint = hsx::Checkpoint::Open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  t.checkpoint = *std::move(checkpoint);
  const hsx::ModelConfig& config = t.checkpoint->config();
  t.num_layers = static_cast<int>(config.num_hidden_layers);
  t.hidden_size = config.hidden_size;
  t.vocab_size = config.vocab_size;
  absl::StatusOr<std::string> revision = hsx::CheckpointRevision(model_dir);
  if (!revision.ok()) return revision.status();
  t.info = {hsx::CheckpointName(model_dir), t.num_layers, *revision, hsx::PrecisionName(flags.engine.precision)};
  if (absl::Status s = hsx::ResolveMaxTokensPerSample(config, &flags); !s.ok()) return s;
  t.max_tokens_per_sample = flags.max_tokens_per_sample;
  t.media_placeholders = hsx::RefusedMediaPlaceholders(config, flags);
  absl::StatusOr<std::unique_ptr<hsx::Engine>> engine = hsx::Engine::Create(*t.checkpoint, flags.engine);
  if (!engine.ok()) return engine.status();
  t.engine = *std::move(engine);
  hsx::BatcherOptions batcher_options;
  batcher_options.max_batch_tokens = flags.engine.max_batch_tokens;
  t.extractor = std::make_unique<hsx::InProcessExtractor>(*t.engine, batcher_options);
  return t;
}

absl::StatusOr<Transport> MakeRemote(const std::string& servers, const hsx::EngineFlags& flags) {
  for (absl::string_view flag : hsx::kLocalEngineFlagNames) {
    if (Specified(flag)) return absl::InvalidArgumentError(absl::StrCat("--", flag, " applies to --model only"));
  }
  hsx::RemoteOptions options;
  for (absl::string_view address : absl::StrSplit(servers, ',', absl::SkipWhitespace())) {
    options.servers.emplace_back(absl::StripAsciiWhitespace(address));
  }
  if (options.servers.empty()) return absl::InvalidArgumentError("--server: no address");
  options.deadline_seconds = absl::GetFlag(FLAGS_deadline);
  if (!(options.deadline_seconds > 0)) return absl::InvalidArgumentError("--deadline must be positive");
  options.retries = absl::GetFlag(FLAGS_retries);
  if (options.retries < 0) return absl::InvalidArgumentError("--retries must be at least 0");
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = ReadFile(file, "auth-token-file");
    if (!token.ok()) return token.status();
    options.auth_token = std::string(absl::StripAsciiWhitespace(*token));
    if (options.auth_token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--auth-token-file ", file, ": empty"));
    }
  }
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  options.tls = !ca.empty() || !cert.empty();
  for (auto [path, flag, out] : {std::tuple{&ca, "tls-ca", &options.tls_ca_pem},
                                 std::tuple{&cert, "tls-cert", &options.tls_cert_pem},
                                 std::tuple{&key, "tls-key", &options.tls_key_pem}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> pem = ReadFile(*path, flag);
    if (!pem.ok()) return pem.status();
    *out = *std::move(pem);
  }
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  const std::string window_text = absl::GetFlag(FLAGS_stream_window);
  absl::StatusOr<int64_t> window = window_text == "0" ? 0 : hsx::ParseByteSize(window_text);
  if (!window.ok()) return absl::InvalidArgumentError(absl::StrCat("--stream-window: ", window.status().message()));
  if (absl::Status valid = hsx::CheckStreamWindow(*window); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--stream-window ", window_text, ": ", valid.message()));
  }
  options.stream_window_bytes = *window;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  options.log = [tty](const std::string& line) {
    std::fprintf(stderr, "%s%s\n", tty ? "\r\033[K" : "", line.c_str());
  };

  absl::StatusOr<std::unique_ptr<hsx::RemoteExtractor>> remote = hsx::RemoteExtractor::Create(options);
  if (!remote.ok()) return remote.status();
  absl::StatusOr<hsx::RemoteModelInfo> model = (*remote)->FetchModelInfo();
  if (!model.ok()) return model.status();
  const std::string precision = hsx::PrecisionName(flags.engine.precision);
  if (Specified("precision") && model->compute_precision != precision) {
    return absl::FailedPreconditionError(
        absl::StrCat("--precision ", precision, ": the server computes in ", model->compute_precision));
  }
  Transport t;
  t.num_layers = model->num_layers;
  t.hidden_size = model->hidden_size;
  t.vocab_size = model->vocab_size;
  t.info = {model->model_name, model->num_layers, model->model_revision, model->compute_precision};
  t.max_tokens_per_sample = model->max_tokens_per_sample;
  if (flags.max_tokens_per_sample > 0 &&
      (t.max_tokens_per_sample == 0 || flags.max_tokens_per_sample < t.max_tokens_per_sample)) {
    t.max_tokens_per_sample = flags.max_tokens_per_sample;
  }
  hsx::RemoteExtractor* raw = remote->get();
  t.retries = [raw] { return raw->retries(); };
  t.extractor = *std::move(remote);
  return t;
}

absl::StatusOr<hsx::ProgressMode> ParseProgressMode(const std::string& name) {
  if (name == "auto") return hsx::ProgressMode::kAuto;
  if (name == "bar") return hsx::ProgressMode::kBar;
  if (name == "plain") return hsx::ProgressMode::kPlain;
  if (name == "none") return hsx::ProgressMode::kNone;
  return absl::InvalidArgumentError(absl::StrCat("--progress '", name, "': expected auto, bar, plain or none"));
}

// The dump job's own flags (not the engine's, not the transport's); the
// capture set, the model's shape and the input's hash come later.
absl::StatusOr<hsx::DumpOptions> DumpOptionsFromFlags() {
  hsx::DumpOptions dump;
  dump.out_dir = absl::GetFlag(FLAGS_out);
  absl::StatusOr<hsx::OutputDType> dtype = hsx::ParseOutputDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--dtype: ", dtype.status().message()));
  dump.dtype = *dtype;
  dump.concurrency = absl::GetFlag(FLAGS_concurrency);
  if (dump.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be at least 1");
  dump.writer_threads = absl::GetFlag(FLAGS_writer_threads);
  if (dump.writer_threads < 1) return absl::InvalidArgumentError("--writer-threads must be at least 1");
  absl::StatusOr<int64_t> max_in_flight_bytes = hsx::ParseByteSize(absl::GetFlag(FLAGS_max_in_flight_bytes));
  if (!max_in_flight_bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--max-in-flight-bytes: ", max_in_flight_bytes.status().message()));
  }
  dump.max_in_flight_bytes = *max_in_flight_bytes;
  absl::StatusOr<hsx::ShardSpec> shard = hsx::ParseShard(absl::GetFlag(FLAGS_shard));
  if (!shard.ok()) return absl::InvalidArgumentError(absl::StrCat("--shard: ", shard.status().message()));
  dump.shard = *shard;
  absl::StatusOr<hsx::ProgressMode> progress = ParseProgressMode(absl::GetFlag(FLAGS_progress));
  if (!progress.ok()) return progress.status();
  dump.progress = *progress;
  dump.progress_interval_seconds = absl::GetFlag(FLAGS_progress_interval);
  const std::string wire_checksum = absl::GetFlag(FLAGS_wire_checksum);
  const std::optional<hsx::ChecksumKind> checksum = hsx::ParseChecksumKind(wire_checksum);
  if (!checksum) {
    return absl::InvalidArgumentError(absl::StrCat("--wire-checksum '", wire_checksum, "': expected xxh3 or xxh64"));
  }
  dump.wire_checksum = *checksum;
  dump.discard = absl::GetFlag(FLAGS_discard);
  dump.max_failures = absl::GetFlag(FLAGS_max_failures);
  if (dump.max_failures < 0) return absl::InvalidArgumentError("--max-failures must be at least 0");
  dump.retry_quarantined = absl::GetFlag(FLAGS_retry_quarantined);
  absl::StatusOr<hsx::SampleLayout> layout = hsx::ParseSampleLayout(absl::GetFlag(FLAGS_layout));
  if (!layout.ok()) return absl::InvalidArgumentError(absl::StrCat("--layout ", layout.status().message()));
  dump.layout = *layout;
  return dump;
}

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string servers = absl::GetFlag(FLAGS_server);
  const std::string input_path = absl::GetFlag(FLAGS_input);
  if (model_dir.empty() == servers.empty()) {
    return absl::InvalidArgumentError("give exactly one of --model (in-process) and --server (see --help)");
  }
  if (input_path.empty() || absl::GetFlag(FLAGS_out).empty()) {
    return absl::InvalidArgumentError("--input and --out are required (see --help)");
  }
  absl::StatusOr<hsx::EngineFlags> engine = hsx::EngineFlagsFromCommandLine();
  if (!engine.ok()) return engine.status();
  absl::StatusOr<hsx::DumpOptions> dump = DumpOptionsFromFlags();
  if (!dump.ok()) return dump.status();

  absl::StatusOr<Transport> transport = servers.empty() ? MakeInProcess(model_dir, *engine) : MakeRemote(servers, *engine);
  if (!transport.ok()) return transport.status();
  absl::StatusOr<hsx::CaptureSpec> capture =
      hsx::CaptureSpec::Parse(engine->capture, transport->num_layers, engine->final_norm);
  if (!capture.ok()) return absl::InvalidArgumentError(absl::StrCat("--capture: ", capture.status().message()));
  if (!servers.empty() && capture->ids().empty()) {
    return absl::InvalidArgumentError("--capture: --server needs at least one capture id");
  }
  hsx::InputLimits limits;
  limits.vocab_size = transport->vocab_size;
  limits.max_tokens_per_sample = transport->max_tokens_per_sample;
  limits.media_placeholders = transport->media_placeholders;
  std::string input_xxh64;  // hashed while parsing: a pipe or FIFO is read once
  std::map<int64_t, std::string> out_of_limits;  // quarantined, with --max-failures
  absl::StatusOr<std::vector<hsx::InputSample>> samples = hsx::ReadInputFile(
      input_path, limits, &input_xxh64, dump->max_failures > 0 ? &out_of_limits : nullptr);
  if (!samples.ok()) return samples.status();

  dump->capture = *capture;
  dump->hidden_size = transport->hidden_size;
  dump->info = transport->info;
  dump->input_xxh64 = input_xxh64;
  dump->invalid_inputs = std::move(out_of_limits);
  dump->retries = transport->retries;
  dump->interrupted = &g_interrupted;
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  hsx::DumpStats stats;
  const absl::Status status = hsx::RunDump(*samples, *transport->extractor, *dump, &stats);
  std::printf("%s\n", hsx::FormatDumpSummary(stats, dump->out_dir, dump->discard).c_str());
  std::fflush(stdout);
  g_quarantined = stats.quarantined + stats.quarantined_before;
  return status;
}

// hsx-dump status DIR [--json].
absl::Status Status(const std::vector<char*>& args) {
  if (args.size() != 3) return absl::InvalidArgumentError("usage: hsx-dump status DIR [--json]");
  absl::StatusOr<hsx::DumpStatusReport> report = hsx::ReadDumpStatus(args[2], std::time(nullptr));
  if (!report.ok()) return report.status();
  std::printf("%s", absl::GetFlag(FLAGS_json) ? hsx::DumpStatusJson(*report).c_str()
                                              : hsx::DumpStatusText(*report).c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Extracts hidden states for every sample of a JSONL file into one hs_{i}.safetensors each\n"
      "(hidden_states [T, L, H], token_ids [T] int64, loss_mask when given) and records each\n"
      "completed sample in its shard's journal (OUT/manifest.jsonl, or OUT/journal/shard-I-of-N.jsonl);\n"
      "a rerun resumes. Flags accept - or _.\n\n"
      "  hsx-dump (--model DIR | --server HOST:PORT[,HOST:PORT...]) --input samples.jsonl --out OUT\n"
      "           [--capture eagle3|all|speculators|specforge|modelopt|2,30,58,61]\n"
      "           [--final-norm] [--precision bf16|fp32]\n"
      "           [--dtype bf16|fp16|fp32|fp8] [--concurrency N] [--shard I/N] [--layout flat|nested]\n"
      "           [--max-failures N] [--retry-quarantined]\n"
      "           [--deadline S] [--retries N] [--auth-token-file F] [--tls-ca F] [--tls-cert F --tls-key F]\n"
      "           [--device cpu|cuda] [--tp N] [--threads N] [--max-batch-tokens N]\n\n"
      "The engine flags (--device, --tp, --ranks-per-device, --attention, --precision, --threads,\n"
      "--max-batch-tokens, --max-tokens-per-sample, --capture, --final-norm, --allow-media-placeholder)\n"
      "are hsx-server's, with the same checks; --device, --tp, --ranks-per-device, --attention, --threads,\n"
      "--max-batch-tokens and --allow-media-placeholder apply to --model only.\n\n"
      "  hsx-dump status DIR [--json]\n"
      "Progress of a dump over all its shards' journals, quarantine and status files: samples done of\n"
      "the input's total, failures (quarantined), retries, the smoothed rate and the ETA.\n\n"
      "Exit status: 0 when every sample of the shard is done; 3 when the run completed but samples are\n"
      "quarantined (OUT/quarantine/; rerun with --retry-quarantined to take them up); 75 when the\n"
      "environment stopped the run, not a sample: a full disk or an I/O error while writing, or the servers\n"
      "busy (RESOURCE_EXHAUSTED), unreachable (UNAVAILABLE) or too slow (DEADLINE_EXCEEDED) after the\n"
      "retries, or refusing the credentials; no sample is quarantined for it, and the same command resumes once\n"
      "the cause is gone; 1 on any other error (including more than --max-failures failed samples, and\n"
      "no server answering at the start). Only a sample's own fault is quarantined: refused by the server\n"
      "as invalid (INVALID_ARGUMENT, OUT_OF_RANGE), states that fail a check (DATA_LOSS), INTERNAL.");
  hsx::ListFlagsInHelp("client/dump/hsx_dump.cc");  // this file's flags and the engine's
  hsx::AcceptDashedFlags(argc, argv);
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  // Every sample is a few large buffers, allocated and freed over and over.
  // glibc would mmap each one (a page fault per 4 KiB on first touch, an
  // munmap on free); keep blocks up to its ceiling (32 MiB) in the heap
  // instead, and do not trim freed memory back below 1 GiB, so that the
  // next sample reuses warm pages (this was ~15% of hsx-dump's CPU).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // One arena: the samples are allocated on gRPC's threads and freed on the
  // writers', and the extra arenas' heaps (64 MiB each) hold barely two of
  // them, so blocks went back to the kernel and came back as fresh pages
  // (page faults were ~15% of --discard's CPU). The few large allocations
  // per sample make the single arena's lock cheap.
  mallopt(M_ARENA_MAX, 1);
  hsx::SkipMutexDeadlockDetection();
  if (args.size() >= 2 && std::string(args[1]) == "status") return hsx::ExitWithStatus("hsx-dump status", Status(args));
  if (args.size() > 1) {
    return hsx::ExitWithStatus("hsx-dump", absl::InvalidArgumentError(absl::StrCat(
                                               "unexpected argument '", args[1], "' (see --help)")));
  }
  const absl::Status status = Run();
  if (hsx::IsEnvironmentFault(status)) {
    std::fprintf(stderr, "hsx-dump: %s; exit status %d\n", std::string(status.message()).c_str(),
                 hsx::kExitEnvironment);
    return hsx::kExitEnvironment;
  }
  if (status.ok() && g_quarantined > 0) {
    std::fprintf(stderr, "hsx-dump: %lld samples of this shard are quarantined (%s/quarantine/); exit status %d\n",
                 static_cast<long long>(g_quarantined), absl::GetFlag(FLAGS_out).c_str(), kExitQuarantined);
    return kExitQuarantined;
  }
  return hsx::ExitWithStatus("hsx-dump", status);
}
