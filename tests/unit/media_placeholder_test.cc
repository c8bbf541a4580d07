// media_placeholder_test.cc: the multimodal guard on both paths a sample
// takes into the engine. hsx-server's request validator and hsx-dump --model's
// input check refuse a sample that holds the model's media placeholder (the
// text model would compute states for it as if it were text), naming the
// sample and the position; --allow-media-placeholder lets it through.
// tests/python/test_media_placeholder.py runs both binaries.
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "client/dump/input.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/runtime/engine_flags.h"
#include "server/service/request_validator.h"
#include "server/service/service_options.h"

namespace hsx {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int32_t kPlaceholder = 163605;  // Kimi-K2.5's media_placeholder_token_id
const std::vector<MediaPlaceholder> kK25 = {{kPlaceholder, "media_placeholder_token_id"}};

RequestLimits K25Limits() {
  RequestLimits limits;
  limits.vocab_size = 163840;
  limits.num_layers = 61;
  limits.max_tokens_per_sample = 4096;
  limits.default_capture = CaptureSpec::Eagle3(61);
  limits.media_placeholders = kK25;
  return limits;
}

v1::ExtractRequest Request(const std::string& sample_id, const std::vector<int32_t>& ids) {
  v1::ExtractRequest request;
  request.set_sample_id(sample_id);
  for (int32_t id : ids) request.add_token_ids(id);
  return request;
}

TEST(MediaPlaceholder, TheValidatorRefusesItNamingTheSampleAndThePosition) {
  std::vector<int32_t> ids(20, 100);
  ids[17] = kPlaceholder;
  ids[19] = kPlaceholder;  // the first one is named
  const absl::Status status = ValidateExtractRequest(Request("chat-42", ids), K25Limits()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), StartsWith("sample_id 'chat-42': token_ids[17] = 163605 is the model's media "
                                           "placeholder (media_placeholder_token_id); hsx extracts text only: "));
  EXPECT_THAT(status.message(), HasSubstr("--allow-media-placeholder"));
  // At either end too.
  EXPECT_THAT(ValidateExtractRequest(Request("a", {kPlaceholder, 1}), K25Limits()).status().message(),
              HasSubstr("token_ids[0] = 163605"));
  EXPECT_THAT(ValidateExtractRequest(Request("b", {1, 2, kPlaceholder}), K25Limits()).status().message(),
              HasSubstr("sample_id 'b': token_ids[2] = 163605"));
}

TEST(MediaPlaceholder, TheValidatorPassesTextAndWhatTheOperatorAllows) {
  EXPECT_TRUE(ValidateExtractRequest(Request("text", {1, 163604, 163606, 2}), K25Limits()).ok());
  RequestLimits allowed = K25Limits();
  allowed.media_placeholders.clear();  // --allow-media-placeholder
  EXPECT_TRUE(ValidateExtractRequest(Request("media", {1, kPlaceholder, 2}), allowed).ok());
}

// What the flag makes of the model's placeholders, for hsx-server (ServiceOptions)
// and hsx-dump --model (RefusedMediaPlaceholders directly).
TEST(MediaPlaceholder, TheFlagTurnsTheRefusalOff) {
  ModelConfig config;
  config.media_placeholders = kK25;
  EngineFlags flags;
  EXPECT_EQ(RefusedMediaPlaceholders(config, flags), kK25);
  flags.allow_media_placeholder = true;
  EXPECT_TRUE(RefusedMediaPlaceholders(config, flags).empty());

  absl::FlagSaver saver;
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag("allow_media_placeholder");
  ASSERT_NE(flag, nullptr);
  absl::StatusOr<EngineFlags> parsed = EngineFlagsFromCommandLine();
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->allow_media_placeholder);  // refused by default
  std::string error;
  ASSERT_TRUE(flag->ParseFrom("true", &error)) << error;
  parsed = EngineFlagsFromCommandLine();
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->allow_media_placeholder);
}

TEST(MediaPlaceholder, ServiceOptionsCarryTheRefusedIdsToTheValidator) {
  ModelConfig config;
  config.num_hidden_layers = 8;
  config.hidden_size = 128;
  config.max_position_embeddings = 4096;
  config.media_placeholders = kK25;
  ServiceOptions options;
  ASSERT_TRUE(ResolveModelLimits(config, &options).ok());
  EXPECT_EQ(options.refused_media_placeholders, kK25);
  EXPECT_THAT(DescribeOptions(options, config), HasSubstr("; media placeholder 163605 refused"));
  ServiceOptions allowing;
  allowing.engine_flags.allow_media_placeholder = true;
  ASSERT_TRUE(ResolveModelLimits(config, &allowing).ok());
  EXPECT_TRUE(allowing.refused_media_placeholders.empty());
  EXPECT_THAT(DescribeOptions(allowing, config), HasSubstr("163605 allowed (--allow-media-placeholder)"));
}

TEST(MediaPlaceholder, HsxDumpModelInputRefusesItLikeTheServer) {
  InputLimits limits;
  limits.vocab_size = 163840;
  limits.media_placeholders = kK25;
  const std::string line = R"({"input_ids": [1, 2, 163605, 3]})";
  const absl::Status parsed = ParseInputLine(line, limits).status();
  EXPECT_EQ(parsed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.message()), StartsWith("input_ids[2] = 163605 is the model's media placeholder "
                                           "(media_placeholder_token_id); hsx extracts text only: "));
  // With --max-failures the line parses and OutOfLimits says why it is quarantined.
  InputLimits lenient = limits;
  lenient.ids_any_int32 = true;
  absl::StatusOr<InputSample> sample = ParseInputLine(line, lenient);
  ASSERT_TRUE(sample.ok()) << sample.status();
  EXPECT_THAT(OutOfLimits(*sample, limits), StartsWith("input_ids[2] = 163605 is the model's media placeholder"));
  // Allowed (no ids refused), and text.
  limits.media_placeholders.clear();
  EXPECT_TRUE(ParseInputLine(line, limits).ok());
  EXPECT_EQ(OutOfLimits(*sample, limits), "");
  limits.media_placeholders = kK25;
  EXPECT_TRUE(ParseInputLine(R"({"input_ids": [1, 2, 163604]})", limits).ok());
}

}  // namespace
}  // namespace hsx
