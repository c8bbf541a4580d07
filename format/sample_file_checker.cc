// sample_file_checker.cc: the checks of one sample file, messages naming
// what differs and what the journal (or input) says instead.
#include "format/sample_file_checker.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "format/encoding.h"
#include "format/mapped_file.h"
#include "format/safetensors.h"
#include "format/sample_file.h"

namespace hsx {
namespace {

std::string Hex(std::span<const uint8_t> bytes) { return Xxh64Hex(bytes.data(), bytes.size()); }

std::vector<int64_t> Int64s(std::span<const uint8_t> bytes) {
  std::vector<int64_t> values(bytes.size() / sizeof(int64_t));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(int64_t));
  return values;
}

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

}  // namespace

std::vector<std::string> CheckSampleFileBytes(std::span<const uint8_t> bytes, absl::string_view file_name,
                                              const JournalEntry& e, const InputSample* input) {
  std::vector<std::string> errors;
  if (static_cast<int64_t>(bytes.size()) != e.bytes) {
    errors.push_back(absl::StrCat("size ", bytes.size(), " bytes, the journal says ", e.bytes));
  }
  if (const std::string hash = Hex(bytes); hash != e.xxh64) {
    errors.push_back(absl::StrCat("xxh64 ", hash, ", the journal says ", e.xxh64,
                                  " (changed or corrupted since it was written)"));
  }
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensors(bytes, file_name);
  if (!header.ok()) {
    errors.push_back(absl::StrCat("invalid safetensors: ", header.status().message()));
    return errors;
  }
  const auto& meta = header->metadata;
  auto meta_value = [&](const std::string& key) -> std::string {
    auto it = meta.find(key);
    return it == meta.end() ? std::string("<missing>") : it->second;
  };
  auto expect_meta = [&](const std::string& key, const std::string& want) {
    if (const std::string got = meta_value(key); got != want) {
      errors.push_back(absl::StrCat("metadata ", key, " '", got, "', the journal says '", want, "'"));
    }
  };
  expect_meta("hsx_format", "1");
  expect_meta("sample_index", std::to_string(e.index));
  expect_meta("sample_id", e.id);
  expect_meta("dtype", e.dtype);
  expect_meta("model", e.model);
  if (meta.count("model_revision") || !e.model_revision.empty()) expect_meta("model_revision", e.model_revision);
  if (meta.count("compute_precision") || !e.compute_precision.empty()) {
    expect_meta("compute_precision", e.compute_precision);
  }
  {
    const nlohmann::json ids = nlohmann::json::parse(meta_value("capture_ids"), nullptr, false);
    if (ids.is_discarded() || !ids.is_array() || ids != nlohmann::json(e.capture_ids)) {
      errors.push_back(absl::StrCat("metadata capture_ids '", meta_value("capture_ids"), "', the journal says ",
                                    nlohmann::json(e.capture_ids).dump()));
    }
  }
  absl::StatusOr<OutputDType> dtype = ParseOutputDType(e.dtype);
  if (!dtype.ok()) {
    errors.push_back(absl::StrCat("journal dtype '", e.dtype, "' is not bf16, fp16 or fp32"));
    return errors;
  }
  const nlohmann::json checksums = nlohmann::json::parse(meta_value("checksums_xxh64"), nullptr, false);
  if (checksums.is_discarded() || !checksums.is_object()) {
    errors.push_back("metadata checksums_xxh64 is missing or not a JSON object");
  }

  const int64_t tokens = e.tokens;
  const int64_t layers = static_cast<int64_t>(e.capture_ids.size());
  const DType value_type = ToSafetensorsDType(*dtype);
  std::map<std::string, const TensorInfo*> tensors;
  for (const TensorInfo& t : header->tensors) tensors[t.name] = &t;
  auto data = [&](const TensorInfo& t) { return bytes.subspan(header->data_start + t.begin, t.num_bytes()); };
  auto expect_tensor = [&](const std::string& name, DType type,
                           const std::vector<int64_t>& shape) -> const TensorInfo* {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      errors.push_back(absl::StrCat("no tensor ", name));
      return nullptr;
    }
    const TensorInfo& t = *it->second;
    if (t.dtype != type || t.shape != shape) {
      errors.push_back(absl::StrCat(name, " is ", DTypeName(t.dtype), " ", ShapeText(t.shape), ", expected ",
                                    DTypeName(type), " ", ShapeText(shape)));
      return nullptr;
    }
    return &t;
  };
  // The shape of hidden_states gives H.
  int64_t hidden = 0;
  if (auto it = tensors.find("hidden_states"); it != tensors.end() && it->second->shape.size() == 3) {
    hidden = it->second->shape[2];
  }
  if (hidden < 1) {
    errors.push_back(absl::StrCat("hidden_states is missing or not [T, L, H] with H >= 1"));
    return errors;
  }
  std::set<std::string> expected = {"hidden_states", "token_ids"};
  const TensorInfo* hs = expect_tensor("hidden_states", value_type, {tokens, layers, hidden});
  const TensorInfo* ids = expect_tensor("token_ids", DType::kI64, {tokens});
  const TensorInfo* mask = nullptr;
  const TensorInfo* final_norm = nullptr;
  if (!e.loss_mask_xxh64.empty()) {
    expected.insert("loss_mask");
    mask = expect_tensor("loss_mask", DType::kI64, {tokens});
  }
  if (e.final_norm) {
    expected.insert("final_norm_hidden_states");
    final_norm = expect_tensor("final_norm_hidden_states", value_type, {tokens, hidden});
  }
  for (const auto& [name, t] : tensors) {
    if (!expected.count(name)) errors.push_back(absl::StrCat("unexpected tensor ", name, " (not in the journal)"));
  }
  if (checksums.is_object()) {
    for (const auto& [name, t] : tensors) {
      auto it = checksums.find(name);
      if (it == checksums.end() || !it->is_string()) {
        errors.push_back(absl::StrCat("metadata checksums_xxh64 has no checksum for ", name));
      } else if (const std::string hash = Hex(data(*t)); hash != it->get<std::string>()) {
        errors.push_back(absl::StrCat(name, ": data hashes to ", hash, ", the metadata checksum is ",
                                      it->get<std::string>()));
      }
    }
  }
  if (ids != nullptr) {
    const std::vector<int64_t> values = Int64s(data(*ids));
    if (const std::string hash = Int64Xxh64Hex(values); hash != e.token_ids_xxh64) {
      errors.push_back(absl::StrCat("token_ids hash to ", hash, ", the journal says ", e.token_ids_xxh64));
    }
    if (input != nullptr &&
        !std::equal(values.begin(), values.end(), input->input_ids.begin(), input->input_ids.end())) {
      errors.push_back(absl::StrCat("token_ids differ from line ", input->line, " of the input"));
    }
  }
  if (mask != nullptr) {
    const std::vector<int64_t> values = Int64s(data(*mask));
    if (const std::string hash = Int64Xxh64Hex(values); hash != e.loss_mask_xxh64) {
      errors.push_back(absl::StrCat("loss_mask hashes to ", hash, ", the journal says ", e.loss_mask_xxh64));
    }
    if (std::any_of(values.begin(), values.end(), [](int64_t v) { return v != 0 && v != 1; })) {
      errors.push_back("loss_mask has values other than 0 and 1");
    }
    if (input != nullptr && (!input->loss_mask || *input->loss_mask != values)) {
      errors.push_back(absl::StrCat("loss_mask differs from line ", input->line, " of the input"));
    }
  } else if (input != nullptr && input->loss_mask && e.loss_mask_xxh64.empty()) {
    errors.push_back(absl::StrCat("no loss_mask, but line ", input->line, " of the input has one"));
  }
  if (input != nullptr && input->id != e.id) {
    errors.push_back(absl::StrCat("id '", e.id, "' differs from '", input->id, "' on line ", input->line,
                                  " of the input"));
  }
  if (hs != nullptr) {
    std::vector<std::string> names;
    for (int id : e.capture_ids) names.push_back(absl::StrCat("hidden_states capture id ", id));
    if (absl::Status s = CheckEncodedValues(data(*hs), *dtype, tokens, layers, hidden, names); !s.ok()) {
      errors.push_back(std::string(s.message()));
    }
  }
  if (final_norm != nullptr) {
    if (absl::Status s = CheckEncodedValues(data(*final_norm), *dtype, tokens, 1, hidden,
                                                 {"final_norm_hidden_states"});
        !s.ok()) {
      errors.push_back(std::string(s.message()));
    }
  }
  return errors;
}

std::vector<std::string> CheckSampleFile(const std::string& path, const JournalEntry& entry,
                                         const InputSample* input) {
  absl::StatusOr<std::unique_ptr<MappedFile>> file = MappedFile::Open(path);
  if (!file.ok()) {
    // The caller names the file; the problem is what follows the path.
    absl::string_view what = file.status().message();
    absl::ConsumePrefix(&what, absl::StrCat(path, ": "));
    return {std::string(what)};
  }
  return CheckSampleFileBytes((*file)->bytes(), path, entry, input);
}

absl::StatusOr<int> SampleFileNumLayers(const std::string& path) {
  absl::StatusOr<std::unique_ptr<MappedFile>> file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensors((*file)->bytes(), path);
  if (!header.ok()) return header.status();
  auto it = header->metadata.find("num_layers");
  int n = 0;
  if (it == header->metadata.end() || !absl::SimpleAtoi(it->second, &n) || n < 1) {
    return absl::DataLossError("metadata num_layers is missing or not a positive integer");
  }
  return n;
}

}  // namespace hsx
