// libFuzzer target: the client's stream assembler (format/stream_assembler.h).
//
// Structure-aware: the input bytes drive a sequence of operations, each one
// either the correct next message of a valid stream (op byte 0 mod 5, so an
// all-zero input is a whole valid stream) or a message made wrong on purpose
// in one field. Streams carry XXH64 or XXH3, named in the header or not (an
// older server's XXH64). A shadow copy tracks what a correct assembly holds. The
// target traps when
//   - a message made wrong is accepted (a check is missing),
//   - a correct message is rejected (a check is too strict), or
//   - a stream the assembler calls complete differs from the shadow in any
//     byte (the reassembly is wrong), or
//   - a second assembler in verify-only mode (hsx-dump --discard), fed the
//     same messages' bytes cut into slices of a fuzzed length (values split
//     between slices), reaches another verdict or other value findings.
#include <fuzzer/FuzzedDataProvider.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "format/sample_tensors.h"
#include "format/stream_assembler.h"

#include <grpcpp/support/byte_buffer.h>

namespace {

using hsx::OutputDType;
using hsx::StreamExpectation;

struct Shadow {
  StreamExpectation expect;
  int64_t hidden = 4;
  int64_t row_bytes = 0;
  std::vector<int> tensors;  // capture ids, then -1
  size_t current = 0;
  int64_t rows = 0;
  bool header = false;
  std::vector<std::string> received;  // per tensor, rows in order
  std::string hidden_states, final_norm;

  bool all_done() const { return header && current == tensors.size(); }
  // Whether the header names the checksum (a server that knows the field);
  // a header without one is an older server's, which sends XXH64.
  bool name_checksum = false;
  hsx::ChecksumKind wire() const { return name_checksum ? expect.checksum : hsx::ChecksumKind::kXxh64; }
};

hsx::v1::ExtractResponse Header(const Shadow& s) {
  hsx::v1::ExtractResponse r;
  hsx::v1::Header* h = r.mutable_header();
  h->set_sample_id(s.expect.sample_id);
  h->set_num_tokens(s.expect.num_tokens);
  h->set_token_ids_xxh64(s.expect.token_ids_xxh64);
  for (int id : s.expect.capture_ids) h->add_capture_ids(id);
  h->set_final_norm(*s.expect.final_norm);
  h->set_dtype(hsx::OutputDTypeToProto(s.expect.dtype));
  h->set_hidden_size(s.hidden);
  h->set_num_layers(s.expect.num_layers);
  h->set_model_name(s.expect.model_name);
  if (s.name_checksum) h->set_checksum(hsx::ChecksumKindToProto(s.expect.checksum));
  return r;
}

// A header with exactly one field wrong.
hsx::v1::ExtractResponse BadHeader(const Shadow& s, uint8_t which) {
  hsx::v1::ExtractResponse r = Header(s);
  hsx::v1::Header* h = r.mutable_header();
  switch (which % 11) {
    case 0: h->set_sample_id(s.expect.sample_id + "x"); break;
    case 1: h->set_num_tokens(s.expect.num_tokens + 1); break;
    case 2: h->set_token_ids_xxh64(s.expect.token_ids_xxh64 ^ 1); break;
    case 3: h->add_capture_ids(99); break;
    case 4: h->set_final_norm(!*s.expect.final_norm); break;
    case 5: h->set_dtype(s.expect.dtype == OutputDType::kFp32 ? hsx::v1::DTYPE_BF16 : hsx::v1::DTYPE_FP32); break;
    case 6: h->set_hidden_size(s.hidden + 1); break;  // the model's hidden size is known
    case 7: h->set_num_layers(s.expect.num_layers + 1); break;  // known: nonzero
    case 8: h->set_model_name(s.expect.model_name + "-other"); break;
    case 9:  // names the checksum that was not asked for
      h->set_checksum(s.expect.checksum == hsx::ChecksumKind::kXxh3 ? hsx::v1::CHECKSUM_XXH64
                                                                    : hsx::v1::CHECKSUM_XXH3_64);
      break;
    case 10: h->set_checksum(static_cast<hsx::v1::Checksum>(7)); break;  // one no client knows
  }
  return r;
}

hsx::v1::ExtractResponse Chunk(int capture_id, int64_t first, int64_t count, std::string data) {
  hsx::v1::ExtractResponse r;
  hsx::v1::Chunk* c = r.mutable_chunk();
  c->set_capture_id(capture_id);
  c->set_first_row(first);
  c->set_num_rows(count);
  c->set_data(std::move(data));
  return r;
}

std::string Bytes(FuzzedDataProvider& in, size_t n) {
  std::string data = in.ConsumeBytesAsString(n);
  data.resize(n, '\x01');
  return data;
}

hsx::v1::ExtractResponse Trailer(const Shadow& s) {
  hsx::v1::ExtractResponse r;
  hsx::v1::Trailer* t = r.mutable_trailer();
  t->set_token_ids_xxh64(s.expect.token_ids_xxh64);
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    hsx::v1::TensorChecksum* c = t->add_checksums();
    c->set_capture_id(s.tensors[i]);
    if (s.wire() == hsx::ChecksumKind::kXxh3) {
      c->set_xxh3_64(XXH3_64bits(s.received[i].data(), s.received[i].size()));
    } else {
      c->set_xxh64(XXH64(s.received[i].data(), s.received[i].size(), 0));
    }
  }
  return r;
}

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

// The message's bytes in slices of `cut` bytes.
grpc::ByteBuffer Sliced(const hsx::v1::ExtractResponse& message, size_t cut) {
  const std::string bytes = message.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += cut) slices.emplace_back(bytes.data() + at, std::min(cut, bytes.size() - at));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The expectation and shape of the stream the input asks for.
Shadow MakeShadow(FuzzedDataProvider& in) {
  Shadow s;
  s.expect.sample_id = "7";
  s.expect.num_tokens = 1 + in.ConsumeIntegralInRange<int64_t>(0, 4);
  s.expect.token_ids_xxh64 = 0x1234;
  const uint8_t shape = in.ConsumeIntegral<uint8_t>();
  s.expect.capture_ids = shape % 3 == 0 ? std::vector<int>{2} : shape % 3 == 1 ? std::vector<int>{0, 3} : std::vector<int>{1, 2, 5};
  s.expect.final_norm = (shape & 4) != 0;
  s.expect.dtype = shape & 8 ? OutputDType::kFp32 : (shape & 16 ? OutputDType::kFp16 : OutputDType::kBf16);
  s.expect.hidden_size = s.hidden;
  s.expect.num_layers = 6;
  s.expect.model_name = "m";
  s.expect.checksum = shape & 32 ? hsx::ChecksumKind::kXxh3 : hsx::ChecksumKind::kXxh64;
  s.name_checksum = (shape & 64) != 0;
  s.row_bytes = hsx::RowBytes(s.expect.dtype, s.hidden);
  s.tensors = s.expect.capture_ids;
  if (*s.expect.final_norm) s.tensors.push_back(-1);
  s.received.resize(s.tensors.size());
  return s;
}

// The correct next message; `sent` gets the rows a chunk adds.
hsx::v1::ExtractResponse NextMessage(FuzzedDataProvider& in, const Shadow& s, uint8_t which, std::string* sent) {
  if (!s.header) return Header(s);
  if (s.all_done()) return Trailer(s);
  const int64_t left = s.expect.num_tokens - s.rows;
  const int64_t count = 1 + which % left;
  *sent = Bytes(in, static_cast<size_t>(count * s.row_bytes));
  return Chunk(s.tensors[s.current], s.rows, count, *sent);
}

// A chunk with one thing wrong: another tensor, a gap, no rows, too many
// rows, not whole rows, an overlap; any chunk before the header or after the
// last row.
hsx::v1::ExtractResponse BadChunk(FuzzedDataProvider& in, const Shadow& s, uint8_t which) {
  const size_t row = static_cast<size_t>(s.row_bytes);
  if (!s.header || s.all_done()) return Chunk(s.tensors[0], 0, 1, Bytes(in, row));
  const int want = s.tensors[s.current];
  const int64_t left = s.expect.num_tokens - s.rows;
  if (which % 5 == 1 && s.rows > 0 && which & 0x80) {
    Bytes(in, row);  // the input as the gap's rows would have consumed it
    return Chunk(want, s.rows - 1, 1, Bytes(in, row));  // an overlap
  }
  switch (which % 5) {
    case 0: return Chunk(want < 0 ? 0 : want + 1, s.rows, 1, Bytes(in, row));
    case 1: return Chunk(want, s.rows + 1, 1, Bytes(in, row));  // a gap
    case 2: return Chunk(want, s.rows, 0, "");
    case 3: return Chunk(want, s.rows, left + 1, Bytes(in, static_cast<size_t>((left + 1) * s.row_bytes)));
    default: return Chunk(want, s.rows, 1, Bytes(in, row + 1));  // not whole rows
  }
}

// A trailer with one thing wrong (any trailer before the last row is).
hsx::v1::ExtractResponse BadTrailer(const Shadow& s, uint8_t which) {
  hsx::v1::ExtractResponse message = Trailer(s);
  hsx::v1::Trailer* t = message.mutable_trailer();
  if (!s.all_done()) return message;  // too early is wrong already
  switch (which % 5) {
    case 0: t->set_token_ids_xxh64(s.expect.token_ids_xxh64 + 1); break;
    case 1: t->mutable_checksums()->RemoveLast(); break;
    case 2: *t->add_checksums() = t->checksums(0); break;  // duplicate
    case 3: {
      hsx::v1::TensorChecksum* extra = t->add_checksums();
      extra->set_capture_id(42);
      extra->set_xxh64(0);
      break;
    }
    case 4: {
      hsx::v1::TensorChecksum* c = t->mutable_checksums(which % t->checksums_size());
      if (s.wire() == hsx::ChecksumKind::kXxh3) {
        c->set_xxh3_64(c->xxh3_64() ^ 0x10);
      } else {
        c->set_xxh64(c->xxh64() ^ 0x10);
      }
      break;
    }
  }
  return message;
}

// The message the op byte asks for; `valid` says whether a correct
// assembler accepts it (before the trailer).
hsx::v1::ExtractResponse MakeMessage(FuzzedDataProvider& in, const Shadow& s, uint8_t op, uint8_t which,
                                     bool* valid, std::string* sent) {
  *valid = op % 5 == 0;
  switch (op % 5) {
    case 0: return NextMessage(in, s, which, sent);
    case 1: return s.header ? Header(s) : BadHeader(s, which);  // a wrong header (or a second one)
    case 2: return BadChunk(in, s, which);
    case 3: return BadTrailer(s, which);
    default: {  // not a stream message at all
      hsx::v1::ExtractResponse message;
      if (which & 1) message.mutable_summary();
      return message;
    }
  }
}

// The shadow after an accepted message.
void Advance(Shadow& s, const hsx::v1::ExtractResponse& message, const std::string& sent) {
  if (message.has_header()) s.header = true;
  if (!message.has_chunk()) return;
  s.received[s.current] += sent;
  s.rows += message.chunk().num_rows();
  if (s.rows == s.expect.num_tokens) {
    ++s.current;
    s.rows = 0;
  }
}

// The kept slices hold each tensor's rows, in order, the messages gone.
void CheckKept(const Shadow& s, const hsx::SampleTensors& kept, const hsx::SampleTensors& sample) {
  Check(!kept.dropped && kept.tensors.size() == s.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    Check(hsx::TensorString(kept.tensors[i]) == s.received[i]);
    Check(kept.tensors[i].findings->bad_index == sample.tensors[i].findings->bad_index);
  }
}

// Verify-only mode kept nothing and found what the assembler found: the
// first bad value (NaN != NaN: its bits compared) and, for a tensor without
// one, whether any value is non-zero (after a bad value the rest of a tensor
// is not looked at: the error is decided).
void CheckVerified(const hsx::SampleTensors& verified, const hsx::SampleTensors& sample) {
  Check(verified.dropped && verified.tensors.size() == sample.tensors.size());
  for (size_t i = 0; i < sample.tensors.size(); ++i) {
    const hsx::SampleTensor& got = verified.tensors[i];
    const hsx::SampleTensor& want = sample.tensors[i];
    Check(got.pieces.empty() && got.bytes == want.bytes);
    Check(got.findings->bad_index == want.findings->bad_index);
    Check(std::memcmp(&got.findings->bad_value, &want.findings->bad_value, sizeof(float)) == 0);
    Check(want.findings->bad_index >= 0 || got.findings->nonzero == want.findings->nonzero);
  }
}

// The assembled block is the shadow's rows, interleaved [T, L, H] as the
// file holds them; the final norm's block its rows.
void CheckAssembled(const Shadow& s, const hsx::SampleTensors& sample) {
  const size_t layers = s.expect.capture_ids.size();
  Check(sample.tokens == s.expect.num_tokens && sample.hidden == s.hidden);
  Check(sample.capture_ids == s.expect.capture_ids && sample.has_final_norm() == *s.expect.final_norm);
  const std::string_view hidden(reinterpret_cast<const char*>(sample.tensors[0].pieces[0].data()),
                                static_cast<size_t>(sample.layer_bytes()));
  for (int64_t t = 0; t < s.expect.num_tokens; ++t) {
    for (size_t l = 0; l < layers; ++l) {
      Check(hidden.compare((t * layers + l) * s.row_bytes, s.row_bytes, s.received[l], t * s.row_bytes,
                           s.row_bytes) == 0);
    }
  }
  if (*s.expect.final_norm) Check(hsx::TensorString(sample.tensors.back()) == s.received.back());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Shadow s = MakeShadow(in);
  hsx::StreamAssembler assembler(s.expect);
  hsx::StreamAssembler verifier(s.expect, hsx::StreamAssembler::Mode::kVerifyOnly);
  hsx::StreamAssembler keeper(s.expect, hsx::StreamAssembler::Mode::kKeepReceived);
  // No fp8 here (the shadow's dtypes): this mode is then kAssemble, from other cuts.
  hsx::StreamAssembler dequantizer(s.expect, hsx::StreamAssembler::Mode::kAssembleDequantized);
  const size_t cut = 1 + in.ConsumeIntegralInRange<size_t>(0, 12);
  while (in.remaining_bytes() > 0) {
    const uint8_t op = in.ConsumeIntegral<uint8_t>();
    const uint8_t which = in.ConsumeIntegral<uint8_t>();
    bool valid = true;
    std::string sent;  // rows a valid chunk adds
    const hsx::v1::ExtractResponse message = MakeMessage(in, s, op, which, &valid, &sent);
    if (assembler.complete()) valid = false;  // nothing may follow the trailer
    const absl::Status status = assembler.Consume(message);
    Check(status.ok() == valid);
    Check(verifier.Consume(Sliced(message, cut)) == status);
    Check(keeper.Consume(Sliced(message, cut + 1)) == status);
    Check(dequantizer.Consume(Sliced(message, cut + 2)) == status);
    if (!status.ok()) return 0;
    Advance(s, message, sent);
  }
  if (!assembler.complete()) return 0;
  Check(verifier.complete() && keeper.complete() && dequantizer.complete());
  const hsx::SampleTensors sample = assembler.Take();
  CheckVerified(verifier.Take(), sample);
  CheckKept(s, keeper.Take(), sample);
  CheckAssembled(s, sample);
  CheckAssembled(s, dequantizer.Take());
  return 0;
}
