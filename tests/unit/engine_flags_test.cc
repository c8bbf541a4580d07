// engine_flags_test.cc: the one parser of the engine flags (server/runtime/
// engine_flags.h): what it accepts, the message of each refusal, and that
// hsx-server's options parser returns that same message (hsx-dump calls the
// parser directly; tests/python/test_engine_flags.py runs both binaries).
#include "server/runtime/engine_flags.h"

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "server/service/service_options.h"

namespace hsx {
namespace {

// Sets flag `name` from its command-line text, as the parser of argv would.
void SetFlag(const char* name, const std::string& text) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << name;
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(text, &error)) << name << "=" << text << ": " << error;
}

TEST(EngineFlags, TheDefaultsAreAUsableEngine) {
  absl::FlagSaver saver;
  absl::StatusOr<EngineFlags> flags = EngineFlagsFromCommandLine();
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->engine.device, Device::kCpu);
  EXPECT_EQ(flags->engine.tp, 1);
  EXPECT_EQ(flags->engine.ranks_per_device, 1);
  EXPECT_EQ(flags->engine.attention, CudaAttention::kReference);
  EXPECT_EQ(flags->engine.precision, ElementType::kBf16);
  EXPECT_EQ(flags->engine.threads, 0);
  EXPECT_EQ(flags->engine.max_batch_tokens, 8192);
  EXPECT_EQ(flags->capture, "eagle3");
  EXPECT_FALSE(flags->final_norm);
  EXPECT_EQ(flags->max_tokens_per_sample, 0);
}

TEST(EngineFlags, ValuesGivenReachTheEngineOptions) {
  absl::FlagSaver saver;
  SetFlag("tp", "2");
  SetFlag("threads", "1024");
  SetFlag("precision", "fp32");
  SetFlag("max_batch_tokens", "16777216");
  SetFlag("max_tokens_per_sample", "100");
  SetFlag("capture", "1,2");
  SetFlag("final_norm", "true");
  absl::StatusOr<EngineFlags> flags = EngineFlagsFromCommandLine();
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->engine.tp, 2);
  EXPECT_EQ(flags->engine.threads, 1024);
  EXPECT_EQ(flags->engine.precision, ElementType::kF32);
  EXPECT_EQ(flags->engine.max_batch_tokens, 16777216);
  EXPECT_EQ(flags->max_tokens_per_sample, 100);
  EXPECT_EQ(flags->capture, "1,2");
  EXPECT_TRUE(flags->final_norm);
}

struct BadValue {
  const char* flag;
  const char* value;
  const char* message;
};

const BadValue kBadValues[] = {
    {"threads", "-1", "--threads -1: expected 0 (all cores) to 1024"},
    {"threads", "1025", "--threads 1025: expected 0 (all cores) to 1024"},
    {"tp", "0", "--tp must be at least 1"},
    {"device", "tpu", "--device 'tpu': expected cpu or cuda"},
    {"attention", "flash", "--attention 'flash': expected reference or cudnn"},
    {"attention", "cudnn", "--attention=cudnn: applies to --device cuda only"},
    {"ranks_per_device", "2", "--ranks-per-device 2: applies to --device cuda only (CPU ranks are threads)"},
    {"precision", "fp16", "--precision 'fp16': expected bf16 or fp32"},
    {"max_batch_tokens", "0", "--max-batch-tokens 0: expected 1 to 16777216 (the activations of a batch live at once)"},
    {"max_batch_tokens", "16777217",
     "--max-batch-tokens 16777217: expected 1 to 16777216 (the activations of a batch live at once)"},
    {"max_tokens_per_sample", "-1", "--max-tokens-per-sample must be 0 (auto) or more"},
};

TEST(EngineFlags, EachBadValueIsRefusedNamingTheFlag) {
  for (const BadValue& bad : kBadValues) {
    SCOPED_TRACE(absl::StrCat("--", bad.flag, " ", bad.value));
    absl::FlagSaver saver;
    SetFlag(bad.flag, bad.value);
    absl::StatusOr<EngineFlags> flags = EngineFlagsFromCommandLine();
    EXPECT_EQ(flags.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(flags.status().message(), bad.message);
  }
}

TEST(EngineFlags, TheServerRefusesEachBadValueWithTheSameStatus) {
  for (const BadValue& bad : kBadValues) {
    SCOPED_TRACE(absl::StrCat("--", bad.flag, " ", bad.value));
    absl::FlagSaver saver;
    SetFlag("model", "/nonexistent");  // read later, with config.json
    SetFlag(bad.flag, bad.value);
    const absl::Status engine = EngineFlagsFromCommandLine().status();
    const absl::Status server = OptionsFromFlags().status();
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(server, engine);
  }
}

ModelConfig ConfigWithPositions(int64_t max_position_embeddings) {
  ModelConfig config;
  config.max_position_embeddings = max_position_embeddings;
  return config;
}

TEST(EngineFlags, NoSampleLimitGivenIsTheModelsCappedByTheBatch) {
  EngineFlags flags;
  flags.engine.max_batch_tokens = 8192;
  ASSERT_TRUE(ResolveMaxTokensPerSample(ConfigWithPositions(4096), &flags).ok());
  EXPECT_EQ(flags.max_tokens_per_sample, 4096);
  flags.max_tokens_per_sample = 0;
  ASSERT_TRUE(ResolveMaxTokensPerSample(ConfigWithPositions(163840), &flags).ok());
  EXPECT_EQ(flags.max_tokens_per_sample, 8192);
}

TEST(EngineFlags, ASampleLimitGivenMustFitTheBatchAndTheModel) {
  EngineFlags flags;
  flags.engine.max_batch_tokens = 1000;
  flags.max_tokens_per_sample = 1000;
  ASSERT_TRUE(ResolveMaxTokensPerSample(ConfigWithPositions(4096), &flags).ok());
  EXPECT_EQ(flags.max_tokens_per_sample, 1000);

  flags.max_tokens_per_sample = 1001;
  EXPECT_EQ(ResolveMaxTokensPerSample(ConfigWithPositions(4096), &flags).message(),
            "--max-tokens-per-sample 1001 exceeds --max-batch-tokens 1000: a sample must fit in one batch");
  flags.max_tokens_per_sample = 1000;
  EXPECT_EQ(ResolveMaxTokensPerSample(ConfigWithPositions(512), &flags).message(),
            "--max-tokens-per-sample 1000 exceeds the model's max_position_embeddings 512");
}

TEST(EngineFlags, PrecisionNamesAreTheFlagsSpelling) {
  EXPECT_STREQ(PrecisionName(ElementType::kBf16), "bf16");
  EXPECT_STREQ(PrecisionName(ElementType::kF32), "fp32");
}

}  // namespace
}  // namespace hsx
