// The in-kernel q/k L2 norm, y = x / sqrt(sum x^2 + eps), and its backward; shared by the host backends.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "deltatrain/gdn/backend.h"
#include "host/host_tensors.h"

namespace deltatrain::gdn::host {

// Writes y.
template <class T>
void l2_normalize(const T* x, T* y, std::int64_t n) {
  T sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const T r = T(1) / std::sqrt(sum + T(kL2NormEps));
  for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
}

// The gradient of the raw row x from that of y = x r, in place on dy:
//   dx_i = r dy_i - r^3 x_i (x . dy) = r^3 ((s + eps) dy_i - x_i (x . dy)),   s = x . x.
// dx is dy with its component along x removed, and that subtraction cancels: for a row dominated by
// one element (always, when K = 1: dx = r^3 eps dy) a float32 bracket, or one formed from the rounded
// y, keeps no correct digit. Taking element i's own terms out of both sums first,
//   (s + eps) dy_i - x_i (x . dy) = (eps + s - x_i^2) dy_i - x_i (x . dy - x_i dy_i),
// and forming them in float64 from the raw x (a product of two float32 values is exact there) leaves
// only the rounding of the other elements' terms: for K = 1 the bracket is exactly eps dy.
template <class T>
void l2_normalize_backward(const T* x, T* dy, std::int64_t n) {
  double s = 0, x_dot_dy = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    s += static_cast<double>(x[i]) * x[i];
    x_dot_dy += static_cast<double>(x[i]) * dy[i];
  }
  const double r = 1.0 / std::sqrt(s + kL2NormEps);
  const double r3 = r * r * r;
  for (std::int64_t i = 0; i < n; ++i) {
    const double xi = x[i], dyi = dy[i];
    const double others_s = s - xi * xi, others_dot = x_dot_dy - xi * dyi;
    dy[i] = static_cast<T>(r3 * ((kL2NormEps + others_s) * dyi - xi * others_dot));
  }
}

// Writes the gradients of sequence n's raw q and k rows of q/k head `qk_head` from dq_hat and dk_hat
// ([length, K], overwritten), those of the rows the backend used: through the norm when it is on.
template <class T>
void store_qk_gradients(const Problem& p, std::int64_t n, std::int64_t qk_head, const InputArrays<T>& a, T* dq_hat,
                        T* dk_hat, BackwardArrays<T>& grads) {
  const std::int64_t K = p.K, begin = p.offsets[n], length = p.offsets[n + 1] - begin;
  for (std::int64_t t = 0; t < length; ++t) {
    const std::int64_t offset = ((begin + t) * p.H + qk_head) * K;
    if (p.l2norm) {
      l2_normalize_backward(&a.q[offset], &dq_hat[t * K], K);
      l2_normalize_backward(&a.k[offset], &dk_hat[t * K], K);
    }
    std::copy_n(&dq_hat[t * K], K, &grads.dq[offset]);
    std::copy_n(&dk_hat[t * K], K, &grads.dk[offset]);
  }
}

}  // namespace deltatrain::gdn::host
