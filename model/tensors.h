// The views the model's step takes of its tensors: row and column slices of 2-D matrices, slices of
// vectors and the 4-D shapes the GDN operator wants, all without copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "deltatrain/core/tensor.h"

namespace deltatrain::model {

// The same memory seen as a row-major matrix [rows, cols] (a contiguous tensor of rows * cols elements).
inline TensorView as_matrix(const TensorView& v, std::int64_t rows, std::int64_t cols) {
  return TensorView::contiguous(v.data, v.dtype, {rows, cols}, v.device);
}

// Rows [begin, end) of a matrix.
inline TensorView row_slice(const TensorView& m, std::int64_t begin, std::int64_t end) {
  TensorView out = m;
  out.data = static_cast<std::byte*>(m.data) + begin * m.strides[0] * static_cast<std::int64_t>(dtype_size(m.dtype));
  out.shape[0] = end - begin;
  return out;
}

// Elements [begin, begin + count) of a contiguous vector.
inline TensorView vector_slice(const TensorView& v, std::int64_t begin, std::int64_t count) {
  TensorView out = v;
  out.data = static_cast<std::byte*>(v.data) + begin * static_cast<std::int64_t>(dtype_size(v.dtype));
  out.shape[0] = count;
  return out;
}

// Columns [begin, end) of a matrix: same rows, same row stride.
inline TensorView col_slice(const TensorView& m, std::int64_t begin, std::int64_t end) {
  TensorView out = m;
  out.data = static_cast<std::byte*>(m.data) + begin * static_cast<std::int64_t>(dtype_size(m.dtype));
  out.shape[1] = end - begin;
  return out;
}

// A matrix [T, groups * 2 * width] seen as [T * groups, width] rows: the first (part 0) or second (part 1)
// half of each group. Qwen's q_proj output interleaves each head's query and gate this way.
inline TensorView interleaved_half(const TensorView& m, std::int64_t groups, std::int64_t width, int part) {
  TensorView out = m;
  out.data = static_cast<std::byte*>(m.data) + part * width * static_cast<std::int64_t>(dtype_size(m.dtype));
  out.shape[0] = m.shape[0] * groups;
  out.shape[1] = width;
  out.strides[0] = 2 * width;
  return out;
}

// Contiguous matrices [rows_i, cols] that follow one another in memory (each starting where the previous one
// ends) seen as one matrix [sum rows_i, cols]: the weights of projections that read the same input, whose
// product is then one GEMM writing their outputs side by side. An empty view (null data) when they are not so
// laid out (weights bound from elsewhere), and the caller keeps one product per part.
inline TensorView stacked_rows(std::initializer_list<TensorView> parts) {
  const TensorView& first = *parts.begin();
  std::int64_t rows = 0;
  const std::byte* next = static_cast<const std::byte*>(first.data);
  for (const TensorView& p : parts) {
    if (p.ndim != 2 || !p.is_contiguous() || p.dtype != first.dtype || p.device != first.device ||
        p.shape[1] != first.shape[1] || p.data == nullptr || p.data != next)
      return TensorView{};
    rows += p.shape[0];
    next += p.shape[0] * p.shape[1] * static_cast<std::int64_t>(dtype_size(p.dtype));
  }
  return TensorView::contiguous(first.data, first.dtype, {rows, first.shape[1]}, first.device);
}

// A contiguous tensor's memory seen with another shape of the same element count.
inline TensorView reshaped(const TensorView& v, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(v.data, v.dtype, shape, v.device);
}

}  // namespace deltatrain::model
