// The in-kernel q/k L2 norm, y = x / sqrt(sum x^2 + eps), and its backward; shared by the host backends.
#pragma once

#include <cmath>
#include <cstdint>

#include "deltatrain/gdn/gdn.h"

namespace deltatrain::gdn::host {

// Writes y and returns r = 1 / sqrt(sum x^2 + eps), which the backward needs.
template <class T>
T l2_normalize(const T* x, T* y, std::int64_t n) {
  T sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const T r = T(1) / std::sqrt(sum + T(kL2NormEps));
  for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
  return r;
}

// dx = r * (dy - y * (y . dy)), in place on dy.
template <class T>
void l2_normalize_backward(const T* y, T r, T* dy, std::int64_t n) {
  T dot = 0;
  for (std::int64_t i = 0; i < n; ++i) dot += y[i] * dy[i];
  for (std::int64_t i = 0; i < n; ++i) dy[i] = r * (dy[i] - y[i] * dot);
}

}  // namespace deltatrain::gdn::host
