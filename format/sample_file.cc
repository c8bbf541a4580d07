// sample_file.cc: encoding, checksums and the atomic write of one sample.
#include "format/sample_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/safetensors_writer.h"
#include "format/fp8.h"
#include "format/tensor_encoding.h"
#include "format/xxh64_stream.h"

namespace hsx {
namespace {


std::span<const uint8_t> AsBytes(const std::vector<int64_t>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(int64_t)};
}

}  // namespace

std::string SampleFileName(int64_t index) { return absl::StrCat("hs_", index, ".safetensors"); }

std::string Int64Xxh64Hex(std::span<const int64_t> values) {
  return Xxh64Hex(values.data(), values.size() * sizeof(int64_t));
}

absl::Status BadScale(float scale, const std::string& name, int64_t row) {
  return absl::DataLossError(absl::StrCat("scale (", scale, ") of ", name, " row ", row,
                                          " is not finite and positive"));
}

absl::Status CheckEncodedValues(std::span<const uint8_t> bytes, OutputDType dtype, int64_t tokens,
                                int64_t layers, int64_t hidden,
                                const std::vector<std::string>& names, std::span<const uint8_t> scales) {
  const int64_t size = OutputDTypeSize(dtype);
  const bool fp8 = dtype == OutputDType::kFp8;
  if (static_cast<int64_t>(bytes.size()) != tokens * layers * hidden * size ||
      (fp8 && static_cast<int64_t>(scales.size()) != tokens * layers * kFp8ScaleBytes)) {
    return absl::DataLossError(absl::StrCat(bytes.size(), " bytes", fp8 ? absl::StrCat(" and ", scales.size(),
                                            " bytes of scales") : "", " for [", tokens, ", ", layers, ", ",
                                            hidden, "] values of ", OutputDTypeName(dtype)));
  }
  std::vector<char> nonzero(static_cast<size_t>(layers), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t l = 0; l < layers; ++l) {
      if (fp8) {
        float scale;
        std::memcpy(&scale, scales.data() + (t * layers + l) * kFp8ScaleBytes, sizeof(scale));
        if (!ValidFp8Scale(scale)) return BadScale(scale, names[l], t);
      }
      const uint8_t* row = bytes.data() + ((t * layers + l) * hidden) * size;
      bool any = false;
      if (const int64_t i = CheckEncoded(row, hidden, dtype, &any); i >= 0) {
        const float value = fp8 ? Fp8E4m3ToFloat(row[i])
                                : DecodeValues(std::span<const uint8_t>(row + size * i, size), dtype)[0];
        return absl::DataLossError(absl::StrCat("non-finite value (", value, ") in ", names[l], " row ", t,
                                                " column ", i));
      }
      nonzero[l] |= any;
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    if (!nonzero[l]) return absl::DataLossError(absl::StrCat(names[l], " is all zeros"));
  }
  return absl::OkStatus();
}

namespace {

// The tensor's findings: its own, or made here from its bytes.
TensorFindings FindingsOf(const SampleTensors& sample, const SampleTensor& tensor) {
  if (tensor.findings.has_value()) return *tensor.findings;
  const std::string bytes = TensorString(tensor);
  const int64_t size = OutputDTypeSize(sample.dtype);
  TensorFindings found;
  if (sample.dtype == OutputDType::kFp8) {
    return CheckFp8Rows(bytes.data(), static_cast<int64_t>(bytes.size()) / sample.row_bytes(), sample.hidden);
  }
  found.bad_index = CheckEncoded(bytes.data(), static_cast<int64_t>(bytes.size()) / size, sample.dtype,
                                 &found.nonzero);
  if (found.bad_index >= 0) {
    const auto* value = reinterpret_cast<const uint8_t*>(bytes.data()) + found.bad_index * size;
    found.bad_value = DecodeValues(std::span<const uint8_t>(value, static_cast<size_t>(size)), sample.dtype)[0];
  }
  return found;
}

// CheckEncodedValues' errors from the findings of `count` tensors starting at
// `first`, in its order: the first non-finite value by row, then by layer;
// then the first all-zero layer. A value the encoder found over the output
// dtype's range (fp16) is reported as what it became: an infinity.
absl::Status CheckedStatus(const std::vector<TensorFindings>& found, int64_t hidden, size_t first, size_t count,
                           const std::vector<std::string>& names) {
  int64_t bad_row = -1;
  size_t bad = 0;
  for (size_t l = 0; l < count; ++l) {
    const int64_t at = found[first + l].bad_index;
    if (at >= 0 && (bad_row < 0 || at / hidden < bad_row)) {
      bad_row = at / hidden;
      bad = l;
    }
  }
  if (bad_row >= 0) {
    const TensorFindings& f = found[first + bad];
    if (f.bad_scale) return BadScale(f.bad_value, names[bad], bad_row);
    const float value = std::isfinite(f.bad_value) ? std::copysign(INFINITY, f.bad_value) : f.bad_value;
    return absl::DataLossError(absl::StrCat("non-finite value (", value, ") in ", names[bad], " row ", bad_row,
                                            " column ", f.bad_index % hidden));
  }
  for (size_t l = 0; l < count; ++l) {
    if (!found[first + l].nonzero) return absl::DataLossError(absl::StrCat(names[l], " is all zeros"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSampleValues(const SampleTensors& sample) {
  std::vector<std::string> names;
  for (int id : sample.capture_ids) names.push_back(absl::StrCat("capture id ", id));
  return CheckSampleValues(sample, names);
}

absl::Status CheckSampleValues(const SampleTensors& sample, const std::vector<std::string>& names) {
  std::vector<TensorFindings> found;
  for (const SampleTensor& tensor : sample.tensors) {
    if (sample.dropped && !tensor.findings.has_value()) {
      return absl::DataLossError("the states were dropped without a record of their value check");
    }
    if (!tensor.findings.has_value() && tensor.bytes != sample.tokens * sample.row_bytes()) {
      return absl::DataLossError(absl::StrCat(tensor.bytes, " bytes for [", sample.tokens, ", 1, ", sample.hidden,
                                              "] values of ", OutputDTypeName(sample.dtype)));
    }
    found.push_back(FindingsOf(sample, tensor));
  }
  const size_t layers = std::min(sample.capture_ids.size(), found.size());
  if (absl::Status s = CheckedStatus(found, sample.hidden, 0, layers, names); !s.ok()) return s;
  if (sample.has_final_norm()) return CheckedStatus(found, sample.hidden, layers, 1, {"the final-norm state"});
  return absl::OkStatus();
}

namespace {

// Appends `piece` to `out`, joined with the last piece when they lie end to end.
void AppendJoined(const BytePiece& piece, std::vector<BytePiece>* out) {
  if (!out->empty() && out->back().data() + out->back().size() == piece.data()) {
    out->back() = BytePiece(out->back().data(), out->back().size() + piece.size());
  } else {
    out->push_back(piece);
  }
}

// The sample's hidden states and final norm as pieces in file order,
// hidden_states' rows walked t-major (row t of every layer, then row t + 1),
// pieces that lie end to end in memory joined. False when the tensors are
// misshapen.
bool FilePieces(const SampleTensors& sample, std::vector<BytePiece>* hidden, std::vector<BytePiece>* final_norm) {
  const size_t layers = sample.capture_ids.size();
  const int64_t row = sample.row_bytes();
  if (sample.tensors.size() != layers + (sample.has_final_norm() ? 1 : 0)) return false;
  for (const SampleTensor& tensor : sample.tensors) {
    int64_t bytes = 0;
    for (const BytePiece& piece : tensor.pieces) bytes += static_cast<int64_t>(piece.size());
    if (bytes != sample.tokens * row) return false;
  }
  if (sample.has_final_norm()) *final_norm = sample.tensors[layers].pieces;
  if (layers == 1) {
    *hidden = sample.tensors[0].pieces;
    return true;
  }
  std::vector<PieceReader> readers;
  for (size_t l = 0; l < layers; ++l) readers.emplace_back(sample.tensors[l].pieces);
  hidden->reserve(static_cast<size_t>(sample.tokens) * layers);
  std::vector<BytePiece> row_pieces;
  for (int64_t t = 0; t < sample.tokens; ++t) {
    for (PieceReader& reader : readers) {
      row_pieces.clear();
      if (!reader.Take(static_cast<uint64_t>(row), &row_pieces)) return false;
      for (const BytePiece& piece : row_pieces) AppendJoined(piece, hidden);
    }
  }
  return true;
}

// The XXH64 of a tensor the file holds as it is, when its findings have it.
std::optional<uint64_t> KnownXxh64(const SampleTensor& tensor) {
  if (!tensor.findings.has_value() || tensor.findings->checksum_kind != ChecksumKind::kXxh64 ||
      tensor.findings->bad_index >= 0) {
    return std::nullopt;
  }
  return tensor.findings->checksum;
}

// fp8 rows (a scale, then `hidden` bytes, each) as two tensors' pieces: the
// values and the scales, in row order (`rows` may be *values).
void SplitFp8Rows(const std::vector<BytePiece>& rows, int64_t hidden, std::vector<BytePiece>* values,
                  std::vector<BytePiece>* scales) {
  std::vector<BytePiece> out_values;
  int64_t position = 0;
  for (const BytePiece& piece : rows) {
    ForEachFp8RowPart(position, reinterpret_cast<const char*>(piece.data()), piece.size(), hidden,
                      [&](int64_t, int64_t at, const char* part, size_t n) {
                        AppendJoined(BytePiece(reinterpret_cast<const uint8_t*>(part), n),
                                     at < kFp8ScaleBytes ? scales : &out_values);
                      });
    position += static_cast<int64_t>(piece.size());
  }
  *values = std::move(out_values);
}

std::string PiecesXxh64Hex(const std::vector<BytePiece>& pieces) {
  Xxh64Stream hash;
  for (const BytePiece& piece : pieces) hash.Update(piece.data(), piece.size());
  return hash.HexDigest();
}

}  // namespace

absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const SampleTensors& sample, const SampleFileInfo& info,
                             WrittenDigest* digest) {
  const int64_t tokens = sample.tokens;
  const int64_t layers = static_cast<int64_t>(sample.capture_ids.size());
  std::vector<BytePiece> hidden_pieces, final_pieces;
  if (tokens != static_cast<int64_t>(input.input_ids.size()) || sample.dropped ||
      !FilePieces(sample, &hidden_pieces, &final_pieces)) {
    return absl::InternalError(absl::StrCat("sample ", input.index, ": ", tokens,
                                            " rows of states for ", input.input_ids.size(),
                                            " tokens, or misshapen states"));
  }
  SafetensorsWriter writer;
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  // The writer writes these pieces straight to the file (no copy of the
  // states); `sample`, `ids` and `input` outlive writer.Write below.
  auto add = [&](const std::string& name, DType type, std::vector<int64_t> shape,
                 std::vector<BytePiece> pieces, std::optional<uint64_t> known = std::nullopt) {
    checksums[name] = known ? absl::StrFormat("%016x", *known) : PiecesXxh64Hex(pieces);
    writer.AddPieces(name, type, std::move(shape), std::move(pieces));
  };
  const DType type = ToSafetensorsDType(sample.dtype);
  const bool fp8 = sample.dtype == OutputDType::kFp8;
  std::vector<BytePiece> hidden_scales, final_scales;
  if (fp8) {
    SplitFp8Rows(hidden_pieces, sample.hidden, &hidden_pieces, &hidden_scales);
    SplitFp8Rows(final_pieces, sample.hidden, &final_pieces, &final_scales);
  }
  const std::optional<uint64_t> hidden_xxh64 =
      layers == 1 && !fp8 ? KnownXxh64(sample.tensors[0]) : std::nullopt;
  add("hidden_states", type, {tokens, layers, sample.hidden}, std::move(hidden_pieces), hidden_xxh64);
  if (fp8) add("hidden_states_scales", DType::kF32, {tokens, layers, 1}, std::move(hidden_scales));
  const std::vector<int64_t> ids(input.input_ids.begin(), input.input_ids.end());
  add("token_ids", DType::kI64, {tokens}, {AsBytes(ids)});
  if (input.loss_mask) add("loss_mask", DType::kI64, {tokens}, {AsBytes(*input.loss_mask)});
  if (sample.has_final_norm()) {
    add("final_norm_hidden_states", type, {tokens, sample.hidden}, std::move(final_pieces),
        fp8 ? std::nullopt : KnownXxh64(sample.tensors.back()));
    if (fp8) add("final_norm_hidden_states_scales", DType::kF32, {tokens, 1}, std::move(final_scales));
  }
  const bool has_last = !sample.capture_ids.empty() && sample.capture_ids.back() == info.num_layers;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("hsx_format", "1");
  writer.SetMetadata("sample_id", input.id);
  writer.SetMetadata("sample_index", std::to_string(input.index));
  writer.SetMetadata("capture_ids", nlohmann::json(sample.capture_ids).dump());
  writer.SetMetadata("layer_convention", kLayerConvention);
  writer.SetMetadata("last_layer_state", has_last ? "pre-norm" : "not captured");
  writer.SetMetadata("final_norm", sample.has_final_norm() ? "post-norm (lm_head input)" : "absent");
  writer.SetMetadata("model", info.model_name);
  if (!info.model_revision.empty()) writer.SetMetadata("model_revision", info.model_revision);
  if (!info.compute_precision.empty()) writer.SetMetadata("compute_precision", info.compute_precision);
  writer.SetMetadata("num_layers", std::to_string(info.num_layers));
  writer.SetMetadata("dtype", OutputDTypeName(sample.dtype));
  writer.SetMetadata("checksums_xxh64", checksums.dump());
  return writer.Write(path, digest);
}

}  // namespace hsx
