// Runs the shared malformed-stream table (tests/streams/malformed_streams.json)
// through the C++ client's checks: the stream assembler, then the value checks
// hsx-dump applies before it writes (VerifySample), in the order the remote
// extractor applies them (a rejected message wins over the status the stream
// ends with; an OK end without a trailer is incomplete). The Python client runs
// the same table (tests/python/test_stream_table.py); each case must reach the
// same verdict in both, with the same message fragment. Each case runs twice:
// assembling the sample from the parsed messages (hsx-dump writing files),
// and verifying in place without keeping the states (hsx-dump --discard),
// from the messages' bytes cut into 3-byte slices so that values straddle
// slices.
#include <algorithm>
#include <fstream>
#include <ostream>
#include <sstream>
#include <limits>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/dump/dump_job.h"
#include "format/encoding.h"
#include "format/stream_assembler.h"
#include "gtest/gtest.h"
#include "hsx/v1/hsx.pb.h"

namespace hsx {
namespace {

using json = nlohmann::json;

json LoadTable() {
  std::ifstream in(std::string(HSX_SOURCE_DIR) + "/tests/streams/malformed_streams.json");
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

// One row of the table (a struct, so that gtest prints its name, not the JSON).
struct Case {
  json row;
};
void PrintTo(const Case& c, std::ostream* out) { *out << c.row["name"].get<std::string>(); }

std::vector<Case> Cases() {
  const json table = LoadTable();
  if (!table.is_object() || !table.contains("cases")) return {Case{json::object({{"name", "table_missing"}})}};
  std::vector<Case> cases;
  for (const json& row : table["cases"]) cases.push_back({row});
  return cases;
}

// What the C++ client concludes about one stream: "ok", "data_loss", or the
// name of the status the server ended it with; and the message.
struct Verdict {
  std::string kind;
  std::string message;
};

// The serialized message in slices of 3 bytes (values of every dtype split).
grpc::ByteBuffer InSlices(const v1::ExtractResponse& response) {
  const std::string bytes = response.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 3) slices.emplace_back(bytes.data() + at, std::min<size_t>(3, bytes.size() - at));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

Verdict Judge(const json& c, StreamAssembler::Mode mode) {
  const json& r = c["request"];
  InputSample input;
  input.id = r["sample_id"].get<std::string>();
  input.input_ids = r["token_ids"].get<std::vector<int32_t>>();
  ExtractSpec spec;
  absl::StatusOr<CaptureSpec> capture = CaptureSpec::Make(r["capture_ids"].get<std::vector<int>>(), r["final_norm"].get<bool>(),
                                                          std::numeric_limits<int>::max());
  if (!capture.ok()) return {"bad_table", std::string(capture.status().message())};
  spec.capture = *capture;
  absl::StatusOr<OutputDType> dtype = ParseOutputDType(r["dtype"].get<std::string>());
  if (!dtype.ok()) return {"bad_table", std::string(dtype.status().message())};
  spec.dtype = *dtype;
  const std::optional<ChecksumKind> checksum = ParseChecksumKind(r["checksum"].get<std::string>());
  if (!checksum) return {"bad_table", r["checksum"].dump()};
  spec.checksum = *checksum;
  spec.keep_states = mode == StreamAssembler::Mode::kAssemble;  // as DumpRun sets it for --discard
  StreamExpectation expect;  // as remote_extractor.cc's Attempt::Expectation fills it
  expect.sample_id = input.id;
  expect.num_tokens = static_cast<int64_t>(input.input_ids.size());
  expect.token_ids_xxh64 = TokenIdsHash(input.input_ids);
  expect.capture_ids = spec.capture.ids();
  expect.final_norm = spec.capture.final_norm();
  expect.dtype = spec.dtype;
  expect.checksum = spec.checksum;
  expect.hidden_size = r["hidden_size"].get<int64_t>();
  expect.num_layers = r["num_layers"].get<int64_t>();
  expect.model_name = r["model_name"].get<std::string>();

  StreamAssembler assembler(expect, mode);
  for (const json& m : c["messages"]) {
    v1::ExtractResponse response;
    if (!google::protobuf::util::JsonStringToMessage(m.dump(), &response).ok()) return {"bad_table", m.dump()};
    const absl::Status s =
        mode == StreamAssembler::Mode::kAssemble ? assembler.Consume(response) : assembler.Consume(InSlices(response));
    if (!s.ok()) {
      return {absl::IsDataLoss(s) ? "data_loss" : "other", std::string(s.message())};
    }
  }
  if (c.contains("end")) return {c["end"]["code"].get<std::string>(), c["end"]["message"].get<std::string>()};
  if (absl::Status end = assembler.EndOfStream(); !end.ok()) return {"data_loss", std::string(end.message())};
  if (absl::Status s = VerifySample(input, spec, assembler.Take()); !s.ok()) {
    return {absl::IsDataLoss(s) ? "data_loss" : "other", std::string(s.message())};
  }
  return {"ok", ""};
}

class StreamTable : public ::testing::TestWithParam<Case> {};

void ExpectTableVerdict(const json& c, StreamAssembler::Mode mode) {
  ASSERT_TRUE(c.contains("messages")) << "tests/streams/malformed_streams.json is missing or unreadable";
  const Verdict v = Judge(c, mode);
  EXPECT_EQ(v.kind, c["verdict"].get<std::string>()) << c["what"] << ": " << v.message;
  EXPECT_NE(v.message.find(c["message"].get<std::string>()), std::string::npos)
      << c["what"] << ": expected '" << c["message"].get<std::string>() << "' in '" << v.message << "'";
}

TEST_P(StreamTable, SameVerdictAsThePythonClient) { ExpectTableVerdict(GetParam().row, StreamAssembler::Mode::kAssemble); }

TEST_P(StreamTable, SameVerdictWhenVerifyingInPlace) {
  ExpectTableVerdict(GetParam().row, StreamAssembler::Mode::kVerifyOnly);
}

INSTANTIATE_TEST_SUITE_P(Cases, StreamTable, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.row["name"].get<std::string>();
                         });

TEST(StreamTableFile, HoldsTheCasesIssue14Names) {
  std::vector<std::string> names;
  for (const Case& c : Cases()) names.push_back(c.row["name"].get<std::string>());
  for (const char* name : {"sample_id", "token_hash", "capture_ids", "hidden", "gap", "overlap", "partial",
                           "order", "checksum", "trailer_token_hash", "no_trailer", "nan", "zero", "invalid",
                           "dtype", "duplicate_trailer"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
}

}  // namespace
}  // namespace hsx
