// sample_file_checker_test.cc: the writer and the checker of the sample file
// side by side. A file WriteSampleFile wrote verifies against its journal line
// and input line; each class of damage or disagreement is reported, naming it.
#include "format/sample_file_checker.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "base/file_util.h"
#include "format/safetensors.h"
#include "format/sample_file.h"
#include "format/test_values.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

using ::hsx::testing::EncodeStates;
using ::hsx::testing::FloatStates;

// This process's directory for hs_3.safetensors: ctest runs each test of the
// file as its own process, in parallel, and they must not write one file.
std::filesystem::path OwnDir() {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("hsx_checker_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

constexpr int64_t kTokens = 3;
constexpr int64_t kHidden = 4;

// A sample as the writer and the journal see it.
struct Written {
  InputSample input;
  JournalEntry entry;
  std::string bytes;
};

InputSample MakeInput() {
  InputSample in;
  in.index = 3;
  in.line = 4;
  in.id = "s-3";
  in.input_ids = {5, 6, 7};
  in.loss_mask = std::vector<int64_t>{0, 1, 1};
  return in;
}

FloatStates MakeStates() {
  FloatStates s;
  s.capture_ids = {2, 4};
  s.tokens = kTokens;
  s.hidden = kHidden;
  for (int i = 0; i < kTokens * 2 * kHidden; ++i) s.hidden_states.push_back(0.5f * (i % 7) - 1.0f);
  for (int i = 0; i < kTokens * kHidden; ++i) s.final_norm.push_back(1.0f + i);
  return s;
}

// Writes the sample (after `edit` changes its states or input) and journals it.
Written Write(const std::function<void(FloatStates&, InputSample&)>& edit = nullptr,
              OutputDType dtype = OutputDType::kBf16) {
  FloatStates states = MakeStates();
  InputSample input = MakeInput();
  if (edit) edit(states, input);
  SampleFileInfo info;
  info.model_name = "tiny";
  info.num_layers = 4;
  info.model_revision = "rev";
  info.compute_precision = "fp32";
  const std::string path = (OwnDir() / SampleFileName(input.index)).string();
  const absl::Status s = WriteSampleFile(path, input, EncodeStates(states, dtype), info);
  EXPECT_TRUE(s.ok()) << s;
  Written w;
  w.bytes = ReadFileToString(path).value_or("");
  w.input = MakeInput();  // the input line as read, before any edit
  JournalEntry& e = w.entry;
  e.index = input.index;
  e.id = input.id;
  e.file = SampleFileName(input.index);
  e.tokens = kTokens;
  e.bytes = static_cast<int64_t>(w.bytes.size());
  e.xxh64 = Xxh64Hex(w.bytes.data(), w.bytes.size());
  e.capture_ids = states.capture_ids;
  e.final_norm = !states.final_norm.empty();
  e.dtype = OutputDTypeName(dtype);
  e.model = "tiny";
  e.model_revision = "rev";
  e.compute_precision = "fp32";
  const std::vector<int64_t> ids(input.input_ids.begin(), input.input_ids.end());
  e.token_ids_xxh64 = Int64Xxh64Hex(ids);
  if (input.loss_mask) e.loss_mask_xxh64 = Int64Xxh64Hex(*input.loss_mask);
  return w;
}

std::vector<std::string> Check(const Written& w, const InputSample* input) {
  return CheckSampleFileBytes({reinterpret_cast<const uint8_t*>(w.bytes.data()), w.bytes.size()}, "hs_3",
                              w.entry, input);
}

TEST(SampleFileCheckerTest, WrittenFileVerifies) {
  const Written w = Write();
  EXPECT_EQ(Check(w, &w.input), std::vector<std::string>());
  EXPECT_EQ(Check(w, nullptr), std::vector<std::string>());
}

TEST(SampleFileCheckerTest, CheckSampleFileMapsTheFile) {
  const Written w = Write();
  const std::string path = (OwnDir() / "hs_3.safetensors").string();
  EXPECT_EQ(CheckSampleFile(path, w.entry, &w.input), std::vector<std::string>());
  absl::StatusOr<int> n = SampleFileNumLayers(path);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 4);
  const std::vector<std::string> missing = CheckSampleFile(path + ".gone", w.entry, nullptr);
  ASSERT_EQ(missing.size(), 1u);
  EXPECT_EQ(missing[0].rfind("cannot open", 0), 0u) << missing[0];  // the caller names the file
}

// One class of problem: how to make it, and the substring of the one error expected.
struct Damage {
  const char* name;
  std::function<void(Written&)> apply;
  const char* message;
};

Written WriteWith(std::function<void(FloatStates&, InputSample&)> edit) { return Write(edit); }

const Damage kDamage[] = {
    {"size", [](Written& w) { w.entry.bytes += 1; }, "bytes, the journal says"},
    {"file hash", [](Written& w) { w.entry.xxh64 = "0000000000000000"; }, "(changed or corrupted since it was written)"},
    {"truncated header", [](Written& w) { w = WriteWith(nullptr); w.bytes.resize(20); w.entry.bytes = 20;
                                          w.entry.xxh64 = Xxh64Hex(w.bytes.data(), 20); }, "invalid safetensors"},
    {"sample index", [](Written& w) { w.entry.index = 4; w.entry.file = "hs_4.safetensors"; }, "metadata sample_index '3', the journal says '4'"},
    {"sample id", [](Written& w) { w.entry.id = "other"; }, "metadata sample_id 's-3', the journal says 'other'"},
    {"model", [](Written& w) { w.entry.model = "big"; }, "metadata model 'tiny'"},
    {"model revision", [](Written& w) { w.entry.model_revision = "rev2"; }, "metadata model_revision 'rev'"},
    {"compute precision", [](Written& w) { w.entry.compute_precision = "bf16"; }, "metadata compute_precision 'fp32'"},
    {"capture ids", [](Written& w) { w.entry.capture_ids = {2, 3}; }, "metadata capture_ids '[2,4]', the journal says [2,3]"},
    {"journal dtype", [](Written& w) { w.entry.dtype = "int8"; }, "journal dtype 'int8' is not bf16, fp16, fp32 or fp8"},
    {"token count", [](Written& w) { w.entry.tokens = 2; }, "hidden_states is BF16 [3, 2, 4], expected BF16 [2, 2, 4]"},
    {"final norm journaled, not written", [](Written& w) { w = WriteWith([](FloatStates& s, InputSample&) { s.final_norm.clear(); });
                                                           w.entry.final_norm = true; }, "no tensor final_norm_hidden_states"},
    {"loss mask written, not journaled", [](Written& w) { w.entry.loss_mask_xxh64.clear(); w.input.loss_mask.reset(); },
     "unexpected tensor loss_mask (not in the journal)"},
    {"token hash", [](Written& w) { w.entry.token_ids_xxh64 = "0000000000000000"; }, "token_ids hash to"},
    {"loss mask hash", [](Written& w) { w.entry.loss_mask_xxh64 = "0000000000000000"; }, "loss_mask hashes to"},
    {"loss mask values", [](Written& w) { w = WriteWith([](FloatStates&, InputSample& in) { (*in.loss_mask)[1] = 2; });
                                          w.input.loss_mask = std::vector<int64_t>{0, 2, 1}; },
     "loss_mask has values other than 0 and 1"},
    {"non-finite value", [](Written& w) { w = WriteWith([](FloatStates& s, InputSample&) { s.hidden_states[9] = NAN; }); },
     "non-finite value (nan) in hidden_states capture id 2 row 1 column 1"},
    {"all-zero layer", [](Written& w) { w = WriteWith([](FloatStates& s, InputSample&) {
                                          for (int64_t t = 0; t < kTokens; ++t)
                                            for (int64_t j = 0; j < kHidden; ++j) s.hidden_states[(t * 2) * kHidden + j] = 0.0f;
                                        }); },
     "hidden_states capture id 2 is all zeros"},
    {"non-finite final norm", [](Written& w) { w = WriteWith([](FloatStates& s, InputSample&) { s.final_norm[0] = INFINITY; }); },
     "non-finite value (inf) in final_norm_hidden_states row 0 column 0"},
    {"input token ids", [](Written& w) { w.input.input_ids[2] = 8; }, "token_ids differ from line 4 of the input"},
    {"input loss mask", [](Written& w) { (*w.input.loss_mask)[0] = 1; }, "loss_mask differs from line 4 of the input"},
    {"input id", [](Written& w) { w.input.id = "s-9"; }, "id 's-3' differs from 's-9' on line 4 of the input"},
    {"input has a loss mask, the file none", [](Written& w) { w = WriteWith([](FloatStates&, InputSample& in) { in.loss_mask.reset(); }); },
     "no loss_mask, but line 4 of the input has one"},
};

TEST(SampleFileCheckerTest, EveryClassOfDamageIsReported) {
  for (const Damage& d : kDamage) {
    SCOPED_TRACE(d.name);
    Written w = Write();
    d.apply(w);
    const std::vector<std::string> errors = Check(w, &w.input);
    ASSERT_FALSE(errors.empty());
    EXPECT_TRUE(std::any_of(errors.begin(), errors.end(),
                            [&](const std::string& e) { return e.find(d.message) != std::string::npos; }))
        << absl::StrJoin(errors, "\n");
  }
}

TEST(SampleFileCheckerTest, AFlippedDataByteFailsBothHashes) {
  Written w = Write();
  w.bytes[w.bytes.size() - 30] ^= 0x01;  // inside the data section (the last tensor)
  const std::string all = absl::StrJoin(Check(w, &w.input), "\n");
  EXPECT_NE(all.find("(changed or corrupted since it was written)"), std::string::npos) << all;
  EXPECT_NE(all.find("data hashes to"), std::string::npos) << all;
}

// The bytes of tensor `name` within a written file.
char* TensorBytes(Written& w, const std::string& name) {
  const absl::StatusOr<SafetensorsHeader> h =
      ParseSafetensors({reinterpret_cast<const uint8_t*>(w.bytes.data()), w.bytes.size()}, "hs_3");
  EXPECT_TRUE(h.ok()) << h.status();
  for (const TensorInfo& t : h->tensors) {
    if (t.name == name) return w.bytes.data() + h->data_start + t.begin;
  }
  ADD_FAILURE() << "no tensor " << name;
  return w.bytes.data();
}

TEST(SampleFileCheckerTest, Fp8FileHasScalesAndVerifies) {
  const Written w = Write(nullptr, OutputDType::kFp8);
  EXPECT_EQ(Check(w, &w.input), std::vector<std::string>());
  const absl::StatusOr<SafetensorsHeader> h =
      ParseSafetensors({reinterpret_cast<const uint8_t*>(w.bytes.data()), w.bytes.size()}, "hs_3");
  ASSERT_TRUE(h.ok()) << h.status();
  std::map<std::string, std::string> layout;
  for (const TensorInfo& t : h->tensors) layout[t.name] = std::string(DTypeName(t.dtype)) + " " + std::to_string(t.num_bytes());
  EXPECT_EQ(layout["hidden_states"], "F8_E4M3 24");  // [3, 2, 4]
  EXPECT_EQ(layout["hidden_states_scales"], "F32 24");  // [3, 2, 1]
  EXPECT_EQ(layout["final_norm_hidden_states"], "F8_E4M3 12");
  EXPECT_EQ(layout["final_norm_hidden_states_scales"], "F32 12");
  // Row 1 of capture id 4 holds 1.5, 2, -1, -0.5: amax 2, scale 2 / 448.
  float scale;
  std::memcpy(&scale, TensorBytes(const_cast<Written&>(w), "hidden_states_scales") + 4 * (1 * 2 + 1), 4);
  EXPECT_EQ(scale, 2.0f / 448);
}

TEST(SampleFileCheckerTest, Fp8BadScalesAndPayloadAreReported) {
  struct Case {
    const char* name;
    float scale;  // written into row 1 of capture id 4, or NaN payload when 1
    const char* message;
  };
  const Case cases[] = {
      {"nan scale", NAN, "scale (nan) of hidden_states capture id 4 row 1 is not finite and positive"},
      {"inf scale", INFINITY, "scale (inf) of hidden_states capture id 4 row 1 is not finite and positive"},
      {"zero scale", 0.0f, "scale (0) of hidden_states capture id 4 row 1 is not finite and positive"},
      {"negative scale", -2.0f, "scale (-2) of hidden_states capture id 4 row 1 is not finite and positive"},
      {"nan payload", 1.0f, "non-finite value (nan) in hidden_states capture id 4 row 1 column 2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Written w = Write(nullptr, OutputDType::kFp8);
    if (c.scale == 1.0f) {
      TensorBytes(w, "hidden_states")[(1 * 2 + 1) * kHidden + 2] = 0x7f;
    } else {
      std::memcpy(TensorBytes(w, "hidden_states_scales") + 4 * (1 * 2 + 1), &c.scale, 4);
    }
    const std::string all = absl::StrJoin(Check(w, &w.input), "\n");
    EXPECT_NE(all.find(c.message), std::string::npos) << all;
    EXPECT_NE(all.find("data hashes to"), std::string::npos) << all;  // the checksum covers them too
  }
  Written w = Write(nullptr, OutputDType::kFp8);
  const float nan = NAN;
  std::memcpy(TensorBytes(w, "final_norm_hidden_states_scales") + 4 * 2, &nan, 4);
  const std::string all = absl::StrJoin(Check(w, &w.input), "\n");
  EXPECT_NE(all.find("scale (nan) of final_norm_hidden_states row 2 is not finite and positive"), std::string::npos)
      << all;
}

}  // namespace
}  // namespace hsx
