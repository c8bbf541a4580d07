// row_io.h: float32 access to the rows of a Matrix for the CPU backend's ops.
//
// An op reads and writes matrices of either element type through float32
// rows: an f32 row is used in place, a bf16 row is converted into a scratch
// row (ReadRow) or computed in one and rounded back (WriteTarget, Commit).
// Rounding a value that is already bf16 is exact, so a round trip changes
// nothing.
#ifndef HSX_KERNELS_CPU_ROW_IO_H_
#define HSX_KERNELS_CPU_ROW_IO_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bf16.h"

namespace hsx {

// Row r of m as float32: m's own memory when it is f32, else the row converted
// into `scratch` (which must hold m.cols floats).
inline const float* ReadRow(const Matrix& m, int64_t r, float* scratch) {
  if (m.type == ElementType::kF32) return static_cast<const float*>(m.at(r, 0));
  const uint16_t* bits = static_cast<const uint16_t*>(m.at(r, 0));
  for (int64_t c = 0; c < m.cols; ++c) scratch[c] = Bf16ToFloat(bits[c]);
  return scratch;
}

// Where to compute row r of m in float32: m's own memory when it is f32, else `scratch`.
inline float* WriteTarget(const Matrix& m, int64_t r, float* scratch) {
  return m.type == ElementType::kF32 ? static_cast<float*>(m.at(r, 0)) : scratch;
}

// Stores a row computed in WriteTarget's memory (a no-op for f32; bf16 rounds,
// which is exact for values already rounded).
inline void Commit(const Matrix& m, int64_t r, const float* values) {
  if (m.type == ElementType::kF32) return;
  uint16_t* bits = static_cast<uint16_t*>(m.at(r, 0));
  for (int64_t c = 0; c < m.cols; ++c) bits[c] = FloatToBf16(values[c]);
}

// A per-thread float row of at least n values (index picks one of a few).
inline float* ThreadRow(int index, int64_t n) {
  thread_local std::vector<float> rows[4];
  if (rows[index].size() < static_cast<size_t>(n)) rows[index].resize(static_cast<size_t>(n));
  return rows[index].data();
}

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_ROW_IO_H_
