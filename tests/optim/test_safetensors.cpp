// The safetensors writer and header reader, checked against the format read independently (the
// length bytes assembled by hand, the JSON parsed apart), tensors that come chunk by chunk through staging
// buffers (as a GPU's do) against the same tensors in host memory, plus the errors for damaged files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/safetensors.h"

namespace deltatrain::optim {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
    dir_ = fs::temp_directory_path() / ("deltatrain-safetensors-" + std::to_string(seed_) + "-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string bytes_of(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  std::string error_of(const fs::path& path) {
    try {
      read_safetensors_header(path);
    } catch (const Failure& e) {
      return e.what();
    }
    return "(no error)";
  }

  std::uint64_t seed_ = 0;
  fs::path dir_;
};

TEST_F(SafetensorsTest, WritesTheFormatByteForByteAndReadsItBack) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::mt19937_64 rng(seed_);
  struct Source {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<char> bytes;
  };
  std::vector<Source> sources;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f64, DType::i64, DType::u8};
  for (int t = 0; t < 6; ++t) {
    Source s{"tensor." + std::to_string(t), dtypes[rng() % 5], {}, {}};
    const int dims = static_cast<int>(rng() % 3);  // 0: a scalar
    for (int d = 0; d < dims; ++d) s.shape.push_back(static_cast<std::int64_t>(rng() % 9));  // 0-size dims too
    std::int64_t numel = 1;
    for (std::int64_t d : s.shape) numel *= d;
    s.bytes.resize(numel * dtype_size(s.dtype));
    for (char& c : s.bytes) c = static_cast<char>(rng());
    sources.push_back(std::move(s));
  }
  std::vector<TensorToWrite> tensors;
  for (const Source& s : sources) tensors.push_back({s.name, s.dtype, s.shape, s.bytes.data()});
  const fs::path path = dir_ / "a.safetensors";
  std::vector<std::size_t> progress;
  const std::string sha =
      write_safetensors(path, tensors, {{"rank", "3"}, {"note", "x"}},
                        {.after_tensor = [&](std::size_t written) { progress.push_back(written); }});
  EXPECT_EQ(sha, file_digest(path, kDigestPieceBytes));
  EXPECT_EQ(progress, (std::vector<std::size_t>{1, 2, 3, 4, 5, 6}));

  // Independently: 8 little-endian length bytes, a JSON object, then the data.
  const std::string file = bytes_of(path);
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(file[i]);
  ASSERT_EQ((8 + length) % 8, 0u) << "data starts 8-byte aligned";
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, length));
  EXPECT_EQ(header["__metadata__"]["rank"], "3");
  std::uint64_t expected_offset = 0;
  const char* names[] = {"F32", "BF16", "F64", "I64", "U8"};
  for (const Source& s : sources) {
    const nlohmann::json& entry = header.at(s.name);
    EXPECT_EQ(entry["dtype"], names[std::find(std::begin(dtypes), std::end(dtypes), s.dtype) - std::begin(dtypes)]);
    EXPECT_EQ(entry["shape"].get<std::vector<std::int64_t>>(), s.shape);
    const auto offsets = entry["data_offsets"].get<std::vector<std::uint64_t>>();
    EXPECT_EQ(offsets[0], expected_offset) << "tensors are contiguous, in order";
    EXPECT_EQ(offsets[1] - offsets[0], s.bytes.size());
    EXPECT_EQ(file.substr(8 + length + offsets[0], s.bytes.size()), std::string(s.bytes.begin(), s.bytes.end()));
    expected_offset = offsets[1];
  }
  EXPECT_EQ(file.size(), 8 + length + expected_offset) << "nothing after the last tensor";

  const SafetensorsHeader read = read_safetensors_header(path);
  EXPECT_EQ(read.data_start, 8 + length);
  EXPECT_EQ(read.metadata.at("note"), "x");
  ASSERT_EQ(read.tensors.size(), sources.size());
  for (const Source& s : sources) {
    const SafetensorsEntry* entry = read.find(s.name);
    ASSERT_NE(entry, nullptr) << s.name;
    EXPECT_EQ(entry->dtype, s.dtype);
    EXPECT_EQ(entry->shape, s.shape);
    EXPECT_EQ(entry->end - entry->begin, s.bytes.size());
  }
  EXPECT_EQ(read.find("absent"), nullptr);
}

TEST_F(SafetensorsTest, TensorsReadChunkByChunkThroughStagingWriteTheSameBytesAsFromHostMemory) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::mt19937_64 rng(seed_);
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f64, DType::u8};
  std::vector<std::string> names;
  std::vector<DType> types;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<char>> sources;
  for (int t = 0; t < 7; ++t) {
    names.push_back("state." + std::to_string(t));
    types.push_back(dtypes[rng() % 4]);
    // A scalar, an empty tensor, and tensors of up to a few thousand elements.
    if (t == 0) {
      shapes.push_back({});
    } else if (t == 1) {
      shapes.push_back({0});
    } else {
      shapes.push_back({static_cast<std::int64_t>(rng() % 3000), 3});
    }
    std::int64_t numel = 1;
    for (std::int64_t d : shapes.back()) numel *= d;
    sources.emplace_back(numel * dtype_size(types.back()));
    for (char& c : sources.back()) c = static_cast<char>(rng());
  }
  // Smaller than most tensors and not a multiple of any element size: chunks end inside elements.
  const std::size_t chunk_bytes = 1 + rng() % 997;
  const std::map<std::string, std::string> metadata{{"rank", std::to_string(rng() % 8)}};

  std::vector<TensorToWrite> from_host, staged;
  struct Request {
    std::size_t tensor;
    std::uint64_t offset;
    std::size_t bytes;
  };
  std::vector<Request> requests;
  std::set<void*> staging_buffers;
  for (std::size_t t = 0; t < sources.size(); ++t) {
    from_host.push_back({names[t], types[t], shapes[t], sources[t].data()});
    TensorToWrite tensor{names[t], types[t], shapes[t]};
    tensor.read = [&, t](std::uint64_t offset, std::size_t bytes, void* staging) {
      requests.push_back({t, offset, bytes});
      staging_buffers.insert(staging);
      std::memcpy(staging, sources[t].data() + offset, bytes);
    };
    staged.push_back(std::move(tensor));
  }
  std::vector<std::size_t> host_progress, staged_progress;
  const fs::path host_path = dir_ / "host.safetensors", staged_path = dir_ / "staged.safetensors";
  const std::string host_sha = write_safetensors(
      host_path, from_host, metadata, {.after_tensor = [&](std::size_t written) { host_progress.push_back(written); }});
  const std::string staged_sha =
      write_safetensors(staged_path, staged, metadata,
                        {.after_tensor = [&](std::size_t written) { staged_progress.push_back(written); },
                         .chunk_bytes = chunk_bytes});

  const std::string file = bytes_of(staged_path);
  EXPECT_EQ(file, bytes_of(host_path));
  EXPECT_EQ(staged_sha, host_sha);
  EXPECT_EQ(staged_sha, file_digest(staged_path, kDigestPieceBytes));
  EXPECT_EQ(staged_progress, host_progress);
  EXPECT_EQ(staged_progress, (std::vector<std::size_t>{1, 2, 3, 4, 5, 6, 7}));
  // Independently: after the header, the tensors' bytes back to back.
  std::string data;
  for (const std::vector<char>& source : sources) data.append(source.begin(), source.end());
  EXPECT_EQ(file.substr(read_safetensors_header(staged_path).data_start), data);

  // Each tensor was asked for in order, in chunks of at most chunk_bytes, through two staging buffers; empty
  // tensors not at all.
  std::vector<std::uint64_t> asked(sources.size(), 0);
  std::size_t last_tensor = 0;
  for (const Request& request : requests) {
    EXPECT_GE(request.tensor, last_tensor);
    EXPECT_EQ(request.offset, asked[request.tensor]) << "tensor " << request.tensor;
    EXPECT_GT(request.bytes, 0u);
    EXPECT_LE(request.bytes, chunk_bytes);
    asked[request.tensor] += request.bytes;
    last_tensor = request.tensor;
  }
  for (std::size_t t = 0; t < sources.size(); ++t) EXPECT_EQ(asked[t], sources[t].size()) << "tensor " << t;
  EXPECT_EQ(staging_buffers.size(), std::min<std::size_t>(2, requests.size()));

  // The host path in the same small chunks writes the same bytes too.
  const fs::path chunked_host_path = dir_ / "chunked-host.safetensors";
  EXPECT_EQ(write_safetensors(chunked_host_path, from_host, metadata, {.chunk_bytes = chunk_bytes}), host_sha);
  EXPECT_EQ(bytes_of(chunked_host_path), file);

  // Without a digest (a file whose digest nobody records): the same bytes, and no digest returned.
  const fs::path undigested_path = dir_ / "undigested.safetensors";
  EXPECT_EQ(write_safetensors(undigested_path, staged, metadata,
                              {.chunk_bytes = chunk_bytes, .digest_piece_bytes = std::nullopt}),
            "");
  EXPECT_EQ(bytes_of(undigested_path), file);
}

TEST_F(SafetensorsTest, ATensorWithNeitherDataNorReadIsRefusedNamingIt) {
  const float value = 1;
  try {
    write_safetensors(dir_ / "x.safetensors", {{"fine", DType::f32, {}, &value}, {"hollow", DType::f32, {2}}}, {});
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("hollow"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, NeverOverwritesAnExistingFile) {
  const fs::path path = dir_ / "kept.safetensors";
  std::ofstream(path) << "precious";
  const float value = 1;
  EXPECT_THROW(write_safetensors(path, {{"x", DType::f32, {}, &value}}, {}), Failure);
  EXPECT_EQ(bytes_of(path), "precious");
}

TEST_F(SafetensorsTest, DamagedFilesAreReportedWithTheirNameAndWhatIsWrong) {
  std::mt19937_64 rng(seed_);
  std::vector<float> values(100 + rng() % 100);
  for (float& v : values) v = static_cast<float>(rng() % 1000);
  const fs::path good = dir_ / "good.safetensors";
  write_safetensors(good, {{"w", DType::f32, {static_cast<std::int64_t>(values.size())}, values.data()}}, {});
  const std::string original = bytes_of(good);

  auto damaged = [&](const std::string& name, const std::string& content) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << content;
    return std::make_pair(path.filename().string(), error_of(path));
  };
  for (const auto& [name, error] : {damaged("cut.safetensors", original.substr(0, original.size() - 1 - rng() % 50)),
                                    damaged("short.safetensors", original.substr(0, 5))}) {
    EXPECT_NE(error.find(name), std::string::npos) << error;
    EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  }
  std::string not_json = original;
  not_json[8] = '[';
  not_json[9] = '!';
  std::string huge = original;
  huge[6] = 0x7f;
  std::string lying = original;
  const std::size_t shape_at = lying.find(std::to_string(values.size()));
  lying[shape_at] = lying[shape_at] == '1' ? '2' : '1';  // a shape that no longer matches the bytes
  for (const auto& [name, error] : {damaged("json.safetensors", not_json), damaged("huge.safetensors", huge),
                                    damaged("lying.safetensors", lying)}) {
    EXPECT_NE(error.find(name), std::string::npos) << error;
    EXPECT_NE(error.find("bad safetensors header"), std::string::npos) << error;
  }
}

TEST(SafetensorsDtypes, NamesRoundTripAndUnknownNamesAreRejected) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::f64, DType::i32, DType::i64, DType::u8}) {
    EXPECT_EQ(dtype_from_safetensors(safetensors_dtype(dtype)), dtype);
  }
  EXPECT_THROW(dtype_from_safetensors("F8_E4M3"), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::optim
