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

// The checks of one file's bytes, in the order their errors are reported:
// the whole file, the metadata, the tensors' layout, their checksums, the
// token ids and loss mask, the values. Each step appends to errors_.
class SampleFileCheck {
 public:
  SampleFileCheck(std::span<const uint8_t> bytes, const JournalEntry& entry, const InputSample* input)
      : bytes_(bytes), e_(entry), input_(input) {}

  std::vector<std::string> Run(absl::string_view file_name) {
    CheckWholeFile();
    absl::StatusOr<SafetensorsHeader> header = ParseSafetensors(bytes_, file_name);
    if (!header.ok()) {
      errors_.push_back(absl::StrCat("invalid safetensors: ", header.status().message()));
      return errors_;
    }
    header_ = &*header;
    CheckMetadata();
    absl::StatusOr<OutputDType> dtype = ParseOutputDType(e_.dtype);
    if (!dtype.ok()) {
      errors_.push_back(absl::StrCat("journal dtype '", e_.dtype, "' is not bf16, fp16, fp32 or fp8"));
      return errors_;
    }
    const nlohmann::json checksums = nlohmann::json::parse(MetaValue("checksums_xxh64"), nullptr, false);
    if (checksums.is_discarded() || !checksums.is_object()) {
      errors_.push_back("metadata checksums_xxh64 is missing or not a JSON object");
    }
    for (const TensorInfo& t : header_->tensors) tensors_[t.name] = &t;
    if (!CheckLayout(*dtype)) return errors_;
    if (checksums.is_object()) CheckChecksums(checksums);
    CheckTokenIds();
    CheckLossMask();
    if (input_ != nullptr && input_->id != e_.id) {
      errors_.push_back(absl::StrCat("id '", e_.id, "' differs from '", input_->id, "' on line ", input_->line,
                                     " of the input"));
    }
    CheckValues(*dtype);
    return errors_;
  }

 private:
  std::span<const uint8_t> Data(const TensorInfo& t) const {
    return bytes_.subspan(header_->data_start + t.begin, t.num_bytes());
  }

  std::string MetaValue(const std::string& key) const {
    auto it = header_->metadata.find(key);
    return it == header_->metadata.end() ? std::string("<missing>") : it->second;
  }

  void ExpectMeta(const std::string& key, const std::string& want) {
    if (const std::string got = MetaValue(key); got != want) {
      errors_.push_back(absl::StrCat("metadata ", key, " '", got, "', the journal says '", want, "'"));
    }
  }

  void CheckWholeFile() {
    if (static_cast<int64_t>(bytes_.size()) != e_.bytes) {
      errors_.push_back(absl::StrCat("size ", bytes_.size(), " bytes, the journal says ", e_.bytes));
    }
    if (const std::string hash = Hex(bytes_); hash != e_.xxh64) {
      errors_.push_back(absl::StrCat("xxh64 ", hash, ", the journal says ", e_.xxh64,
                                     " (changed or corrupted since it was written)"));
    }
  }

  void CheckMetadata() {
    const auto& meta = header_->metadata;
    ExpectMeta("hsx_format", "1");
    ExpectMeta("sample_index", std::to_string(e_.index));
    ExpectMeta("sample_id", e_.id);
    ExpectMeta("dtype", e_.dtype);
    ExpectMeta("model", e_.model);
    if (meta.count("model_revision") || !e_.model_revision.empty()) ExpectMeta("model_revision", e_.model_revision);
    if (meta.count("compute_precision") || !e_.compute_precision.empty()) {
      ExpectMeta("compute_precision", e_.compute_precision);
    }
    const nlohmann::json ids = nlohmann::json::parse(MetaValue("capture_ids"), nullptr, false);
    if (ids.is_discarded() || !ids.is_array() || ids != nlohmann::json(e_.capture_ids)) {
      errors_.push_back(absl::StrCat("metadata capture_ids '", MetaValue("capture_ids"), "', the journal says ",
                                     nlohmann::json(e_.capture_ids).dump()));
    }
  }

  // The tensor `name` when it is there with this type and shape, else null
  // (with the error).
  const TensorInfo* ExpectTensor(const std::string& name, DType type, const std::vector<int64_t>& shape) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      errors_.push_back(absl::StrCat("no tensor ", name));
      return nullptr;
    }
    const TensorInfo& t = *it->second;
    if (t.dtype != type || t.shape != shape) {
      errors_.push_back(absl::StrCat(name, " is ", DTypeName(t.dtype), " ", ShapeText(t.shape), ", expected ",
                                     DTypeName(type), " ", ShapeText(shape)));
      return nullptr;
    }
    return &t;
  }

  // The tensors the journal says the file holds, and nothing else. False
  // when hidden_states does not even give H (nothing more can be checked).
  bool CheckLayout(OutputDType dtype) {
    // The shape of hidden_states gives H.
    if (auto it = tensors_.find("hidden_states"); it != tensors_.end() && it->second->shape.size() == 3) {
      hidden_ = it->second->shape[2];
    }
    if (hidden_ < 1) {
      errors_.push_back(absl::StrCat("hidden_states is missing or not [T, L, H] with H >= 1"));
      return false;
    }
    const int64_t tokens = e_.tokens;
    const DType value_type = ToSafetensorsDType(dtype);
    std::set<std::string> expected = {"hidden_states", "token_ids"};
    hs_ = ExpectTensor("hidden_states", value_type, {tokens, static_cast<int64_t>(e_.capture_ids.size()), hidden_});
    const int64_t layers = static_cast<int64_t>(e_.capture_ids.size());
    if (dtype == OutputDType::kFp8) {
      expected.insert("hidden_states_scales");
      hs_scales_ = ExpectTensor("hidden_states_scales", DType::kF32, {tokens, layers, 1});
    }
    ids_ = ExpectTensor("token_ids", DType::kI64, {tokens});
    if (!e_.loss_mask_xxh64.empty()) {
      expected.insert("loss_mask");
      mask_ = ExpectTensor("loss_mask", DType::kI64, {tokens});
    }
    if (e_.final_norm) {
      expected.insert("final_norm_hidden_states");
      final_norm_ = ExpectTensor("final_norm_hidden_states", value_type, {tokens, hidden_});
      if (dtype == OutputDType::kFp8) {
        expected.insert("final_norm_hidden_states_scales");
        final_scales_ = ExpectTensor("final_norm_hidden_states_scales", DType::kF32, {tokens, 1});
      }
    }
    for (const auto& [name, t] : tensors_) {
      if (!expected.count(name)) errors_.push_back(absl::StrCat("unexpected tensor ", name, " (not in the journal)"));
    }
    return true;
  }

  void CheckChecksums(const nlohmann::json& checksums) {
    for (const auto& [name, t] : tensors_) {
      auto it = checksums.find(name);
      if (it == checksums.end() || !it->is_string()) {
        errors_.push_back(absl::StrCat("metadata checksums_xxh64 has no checksum for ", name));
      } else if (const std::string hash = Hex(Data(*t)); hash != it->get<std::string>()) {
        errors_.push_back(absl::StrCat(name, ": data hashes to ", hash, ", the metadata checksum is ",
                                       it->get<std::string>()));
      }
    }
  }

  void CheckTokenIds() {
    if (ids_ == nullptr) return;
    const std::vector<int64_t> values = Int64s(Data(*ids_));
    if (const std::string hash = Int64Xxh64Hex(values); hash != e_.token_ids_xxh64) {
      errors_.push_back(absl::StrCat("token_ids hash to ", hash, ", the journal says ", e_.token_ids_xxh64));
    }
    if (input_ != nullptr &&
        !std::equal(values.begin(), values.end(), input_->input_ids.begin(), input_->input_ids.end())) {
      errors_.push_back(absl::StrCat("token_ids differ from line ", input_->line, " of the input"));
    }
  }

  void CheckLossMask() {
    if (mask_ == nullptr) {
      if (input_ != nullptr && input_->loss_mask && e_.loss_mask_xxh64.empty()) {
        errors_.push_back(absl::StrCat("no loss_mask, but line ", input_->line, " of the input has one"));
      }
      return;
    }
    const std::vector<int64_t> values = Int64s(Data(*mask_));
    if (const std::string hash = Int64Xxh64Hex(values); hash != e_.loss_mask_xxh64) {
      errors_.push_back(absl::StrCat("loss_mask hashes to ", hash, ", the journal says ", e_.loss_mask_xxh64));
    }
    if (std::any_of(values.begin(), values.end(), [](int64_t v) { return v != 0 && v != 1; })) {
      errors_.push_back("loss_mask has values other than 0 and 1");
    }
    if (input_ != nullptr && (!input_->loss_mask || *input_->loss_mask != values)) {
      errors_.push_back(absl::StrCat("loss_mask differs from line ", input_->line, " of the input"));
    }
  }

  // Every value finite, no layer all zeros.
  void CheckValues(OutputDType dtype) {
    const bool fp8 = dtype == OutputDType::kFp8;  // the values need their scales (missing: reported)
    if (hs_ != nullptr && (!fp8 || hs_scales_ != nullptr)) {
      std::vector<std::string> names;
      for (int id : e_.capture_ids) names.push_back(absl::StrCat("hidden_states capture id ", id));
      const int64_t layers = static_cast<int64_t>(e_.capture_ids.size());
      const std::span<const uint8_t> scales = hs_scales_ != nullptr ? Data(*hs_scales_) : std::span<const uint8_t>();
      if (absl::Status s = CheckEncodedValues(Data(*hs_), dtype, e_.tokens, layers, hidden_, names, scales);
          !s.ok()) {
        errors_.push_back(std::string(s.message()));
      }
    }
    if (final_norm_ != nullptr && (!fp8 || final_scales_ != nullptr)) {
      const std::span<const uint8_t> scales =
          final_scales_ != nullptr ? Data(*final_scales_) : std::span<const uint8_t>();
      if (absl::Status s = CheckEncodedValues(Data(*final_norm_), dtype, e_.tokens, 1, hidden_,
                                              {"final_norm_hidden_states"}, scales);
          !s.ok()) {
        errors_.push_back(std::string(s.message()));
      }
    }
  }

  const std::span<const uint8_t> bytes_;
  const JournalEntry& e_;
  const InputSample* const input_;
  std::vector<std::string> errors_;
  const SafetensorsHeader* header_ = nullptr;
  std::map<std::string, const TensorInfo*> tensors_;
  int64_t hidden_ = 0;
  const TensorInfo* hs_ = nullptr;
  const TensorInfo* ids_ = nullptr;
  const TensorInfo* mask_ = nullptr;
  const TensorInfo* final_norm_ = nullptr;
  const TensorInfo* hs_scales_ = nullptr;     // fp8
  const TensorInfo* final_scales_ = nullptr;  // fp8, with the final norm
};

}  // namespace

std::vector<std::string> CheckSampleFileBytes(std::span<const uint8_t> bytes, absl::string_view file_name,
                                              const JournalEntry& e, const InputSample* input) {
  return SampleFileCheck(bytes, e, input).Run(file_name);
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
