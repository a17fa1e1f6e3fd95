// TensorView: sizes, row-major strides, the contiguity rule and the names used in error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/core/tensor.h"

namespace deltatrain {
namespace {

TEST(DType, SizesNamesAndKinds) {
  struct Row {
    DType dtype;
    std::size_t size;
    const char* name;
    bool floating;
  };
  const Row rows[] = {{DType::f16, sizeof(std::uint16_t), "float16", true},
                      {DType::bf16, sizeof(std::uint16_t), "bfloat16", true},
                      {DType::f32, sizeof(float), "float32", true},
                      {DType::f64, sizeof(double), "float64", true},
                      {DType::i32, sizeof(std::int32_t), "int32", false},
                      {DType::i64, sizeof(std::int64_t), "int64", false},
                      {DType::u8, sizeof(std::uint8_t), "uint8", false}};
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    EXPECT_EQ(dtype_size(row.dtype), row.size);
    EXPECT_STREQ(dtype_name(row.dtype), row.name);
    EXPECT_EQ(is_floating(row.dtype), row.floating);
  }
}

TEST(Device, Names) {
  EXPECT_EQ(device_name(Device{}), "cpu");
  EXPECT_EQ(device_name(Device{DeviceType::cuda, 3}), "cuda:3");
  EXPECT_FALSE((Device{DeviceType::cuda, 0}) == (Device{DeviceType::cuda, 1}));
}

// Random shapes: the strides of a contiguous view are the products of the later extents, and the element
// at a multi-index lies at the offset a row-major walk of the array reaches it.
TEST(TensorView, ContiguousViewsOfRandomShapes) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 100; ++trial) {
    const int rank = std::uniform_int_distribution<int>(0, TensorView::kMaxDims)(rng);
    std::vector<std::int64_t> shape(rank);
    for (auto& extent : shape) extent = std::uniform_int_distribution<int>(1, 5)(rng);
    TensorView view;
    switch (rank) {  // contiguous() takes an initializer list
      case 0: view = TensorView::contiguous(nullptr, DType::f32, {}); break;
      case 1: view = TensorView::contiguous(nullptr, DType::f32, {shape[0]}); break;
      case 2: view = TensorView::contiguous(nullptr, DType::f32, {shape[0], shape[1]}); break;
      case 3: view = TensorView::contiguous(nullptr, DType::f32, {shape[0], shape[1], shape[2]}); break;
      case 4: view = TensorView::contiguous(nullptr, DType::f32, {shape[0], shape[1], shape[2], shape[3]}); break;
      case 5:
        view = TensorView::contiguous(nullptr, DType::f32, {shape[0], shape[1], shape[2], shape[3], shape[4]});
        break;
      default:
        view = TensorView::contiguous(nullptr, DType::f32,
                                      {shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]});
    }
    ASSERT_EQ(view.ndim, rank);
    const std::int64_t count = std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
    EXPECT_EQ(view.numel(), count);
    EXPECT_EQ(view.nbytes(), static_cast<std::size_t>(count) * sizeof(float));
    EXPECT_TRUE(view.is_contiguous());

    // Walk the multi-indices in row-major order; the k-th one must sit at offset k.
    std::vector<std::int64_t> index(rank, 0);
    for (std::int64_t k = 0; k < count; ++k) {
      std::int64_t offset = 0;
      for (int d = 0; d < rank; ++d) offset += index[d] * view.strides[d];
      ASSERT_EQ(offset, k);
      for (int d = rank - 1; d >= 0 && ++index[d] == shape[d]; --d) index[d] = 0;
    }

    std::string expected = "[";
    for (int d = 0; d < rank; ++d) expected += (d ? ", " : "") + std::to_string(shape[d]);
    EXPECT_EQ(view.shape_string(), expected + "]");
  }
}

TEST(TensorView, StridesOtherThanRowMajorAreNotContiguous) {
  TensorView view = TensorView::contiguous(nullptr, DType::bf16, {4, 3, 2});
  std::swap(view.strides[0], view.strides[1]);
  std::swap(view.shape[0], view.shape[1]);  // a transpose
  EXPECT_FALSE(view.is_contiguous());

  TensorView every_other = TensorView::contiguous(nullptr, DType::f32, {4, 3});
  every_other.strides[0] = 6;  // a[::2]-like gap between rows
  EXPECT_FALSE(every_other.is_contiguous());

  // A dimension of extent 1 is never stepped over, so its stride does not matter.
  TensorView single = TensorView::contiguous(nullptr, DType::f32, {1, 5, 1});
  single.strides[0] = 12345;
  single.strides[2] = -7;
  EXPECT_TRUE(single.is_contiguous());
}

TEST(TensorView, TooManyDimensionsIsAnInvalidArgument) {
  try {
    TensorView::contiguous(nullptr, DType::f32, {1, 2, 3, 4, 5, 6, 7});
    ADD_FAILURE() << "accepted 7 dimensions";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "shape");
    EXPECT_NE(std::string(e.what()).find(std::to_string(TensorView::kMaxDims)), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace deltatrain
