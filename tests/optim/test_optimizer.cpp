// DistributedAdamW and its checkpoints under mpirun, on both engines (NCCL where every rank has a
// GPU): the sharded step against a plain fp64 AdamW, bitwise resume, resharding to smaller dp sizes (also
// read in chunks smaller than a tensor),
// the stored step, legacy per-parameter steps, and the errors for damaged or mismatched files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/safetensors.h"
#include "deltatrain/optim/synthetic.h"
#include "test_support.h"

namespace deltatrain::optim {
namespace {

namespace fs = std::filesystem;
using testing_support::copy_from;
using testing_support::copy_into;
using testing_support::SharedTempDir;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// bf16 round-to-nearest-even, written independently of the library's bit trick: via fp64 rounding.
float round_to_bf16(float x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int exponent = 0;
  std::frexp(static_cast<double>(x), &exponent);        // |x| in [2^(e-1), 2^e)
  const double quantum = std::ldexp(1.0, exponent - 8);  // 8 significant bits
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / quantum) * quantum);
}

std::vector<float> bf16_bits_to_float(const std::vector<std::uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    const std::uint32_t wide = static_cast<std::uint32_t>(bits[i]) << 16;
    std::memcpy(&out[i], &wide, sizeof wide);
  }
  return out;
}

// Trains the synthetic problem `steps` steps from scratch and saves a checkpoint under `root` at the end.
DemoResult train_and_save(comm::Group& group, const fs::path& root, std::int64_t steps) {
  DemoOptions save;
  save.steps = steps;
  save.save_at = steps;
  save.checkpoint_root = root;
  return run_demo(group, save);
}

class OptimizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    group_ = make_group(MPI_COMM_WORLD);
    if (!group_) GTEST_SKIP() << skip_;
    seed_ = testing_support::shared_seed();
    trace_.emplace(__FILE__, __LINE__, "seed " + std::to_string(seed_));  // printed with every failure
  }
  std::unique_ptr<comm::Group> make_group(MPI_Comm members) {
    return testing_support::make_group(GetParam(), members, &skip_);
  }

  std::unique_ptr<comm::Group> group_;
  std::string skip_;
  std::uint64_t seed_ = 0;
  std::optional<::testing::ScopedTrace> trace_;
};

// A plain, unsharded AdamW in fp64 with torch's clipping, fed the mean of every rank's gradients.
struct ReferenceAdamW {
  std::vector<double> param, exp_avg, exp_avg_sq;
  double last_norm = 0;

  void step(const std::vector<double>& grad, const AdamWConfig& c, int t) {
    double sum_squares = 0;
    for (double g : grad) sum_squares += g * g;
    last_norm = std::sqrt(sum_squares);
    const double clip = c.max_grad_norm > 0 ? std::min(1.0, c.max_grad_norm / (last_norm + 1e-6)) : 1.0;
    for (std::size_t i = 0; i < param.size(); ++i) {
      const double g = grad[i] * clip;
      param[i] *= 1 - c.lr * c.weight_decay;
      exp_avg[i] = c.beta1 * exp_avg[i] + (1 - c.beta1) * g;
      exp_avg_sq[i] = c.beta2 * exp_avg_sq[i] + (1 - c.beta2) * g * g;
      const double denom = std::sqrt(exp_avg_sq[i]) / std::sqrt(1 - std::pow(c.beta2, t)) + c.eps;
      param[i] -= c.lr / (1 - std::pow(c.beta1, t)) * exp_avg[i] / denom;
    }
  }
};

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol, double atol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], atol + rtol * std::abs(want[i])) << what << " element " << i;
  }
}

TEST_P(OptimizerTest, ShardedStepMatchesPlainAdamWInFp64) {
  std::mt19937_64 rng(seed_);
  std::uniform_real_distribution<double> uniform(0, 1);
  std::normal_distribution<float> normal;
  // Random parameters of both dtypes, random alignment and bucket size: several buffers and buckets.
  std::vector<ParamSpec> specs;
  const int count = 3 + static_cast<int>(rng() % 4);
  for (int p = 0; p < count; ++p) {
    std::vector<std::int64_t> shape{1 + static_cast<std::int64_t>(rng() % 40)};
    if (rng() % 2) shape.push_back(1 + static_cast<std::int64_t>(rng() % 30));
    specs.push_back({"p" + std::to_string(p), shape, rng() % 2 ? DType::bf16 : DType::f32});
  }
  const LayoutOptions options{1 + static_cast<std::int64_t>(rng() % 64), 1 + static_cast<std::int64_t>(rng() % 900)};
  AdamWConfig config{1e-3 + 9e-3 * uniform(rng), 0.8 + 0.15 * uniform(rng), 0.95 + 0.049 * uniform(rng),
                     1e-8, 0.1 * uniform(rng), 0};
  DistributedAdamW optimizer(*group_, specs, config, options);
  const std::vector<ParamSpec> ordered = param_specs(optimizer.layout());  // the order gather_state uses

  ReferenceAdamW reference;
  for (const ParamSpec& spec : ordered) {
    const TensorView view = optimizer.param(spec.name);
    std::vector<float> values(view.numel());
    for (float& v : values) v = normal(rng);
    if (spec.dtype == DType::bf16) {
      std::vector<std::uint16_t> bits(values.size());
      for (std::size_t i = 0; i < values.size(); ++i) {
        const float rounded = round_to_bf16(values[i]);
        std::uint32_t wide;
        std::memcpy(&wide, &rounded, sizeof wide);
        bits[i] = static_cast<std::uint16_t>(wide >> 16);
        values[i] = rounded;
      }
      copy_into(view, bits.data());
    } else {
      copy_into(view, values.data());
    }
    reference.param.insert(reference.param.end(), values.begin(), values.end());
  }
  optimizer.initialize_from_params();
  reference.exp_avg.assign(reference.param.size(), 0);
  reference.exp_avg_sq.assign(reference.param.size(), 0);

  const int ranks = group_->size();
  for (int t = 1; t <= 5; ++t) {
    std::vector<double> mean(reference.param.size(), 0);
    for (int r = 0; r < ranks; ++r) {
      std::mt19937_64 grad_rng(seed_ ^ (static_cast<std::uint64_t>(t) << 20) ^ static_cast<std::uint64_t>(r));
      std::size_t at = 0;
      for (const ParamSpec& spec : ordered) {
        const TensorView view = optimizer.grad(spec.name);
        std::vector<float> grad(view.numel());
        for (float& g : grad) g = normal(grad_rng) * (1 + t);
        if (r == group_->rank()) copy_into(view, grad.data());
        for (float g : grad) mean[at++] += static_cast<double>(g) / ranks;
      }
    }
    // Clip on some steps only: a threshold between the smallest and largest expected norms.
    config.max_grad_norm = t % 2 ? 0.5 * std::sqrt(static_cast<double>(mean.size()) / ranks) * (1 + t) : 0;
    optimizer.set_config(config);
    optimizer.step();
    reference.step(mean, config, t);
    EXPECT_NEAR(optimizer.grad_norm(), reference.last_norm, 1e-5 * reference.last_norm) << "step " << t;
  }
  EXPECT_EQ(optimizer.step_count(), 5);
  expect_close(optimizer.gather_state(StateTensor::main_param), reference.param, 1e-5, 1e-6, "fp32_param");
  expect_close(optimizer.gather_state(StateTensor::exp_avg), reference.exp_avg, 1e-5, 1e-7, "exp_avg");
  expect_close(optimizer.gather_state(StateTensor::exp_avg_sq), reference.exp_avg_sq, 1e-5, 1e-9, "exp_avg_sq");

  // The model parameters on every rank are the main parameters cast to the model dtype.
  const std::vector<float> main = optimizer.gather_state(StateTensor::main_param);
  std::size_t at = 0;
  for (const ParamSpec& spec : ordered) {
    const TensorView view = optimizer.param(spec.name);
    std::vector<float> model(view.numel());
    if (spec.dtype == DType::bf16) {
      std::vector<std::uint16_t> bits(view.numel());
      copy_from(view, bits.data());
      model = bf16_bits_to_float(bits);
    } else {
      copy_from(view, model.data());
    }
    for (std::size_t i = 0; i < model.size(); ++i, ++at) {
      const float expected = spec.dtype == DType::bf16 ? round_to_bf16(main[at]) : main[at];
      ASSERT_EQ(model[i], expected) << spec.name << "[" << i << "]";
    }
  }
}

TEST_P(OptimizerTest, StraightRunEqualsSaveLoadAndContinueBitForBit) {
  SharedTempDir dir;
  for (DType dtype : {DType::f32, DType::bf16}) {
    DemoOptions straight;
    straight.steps = 6;
    straight.problem.dtype = dtype;
    const DemoResult full = run_demo(*group_, straight);

    DemoOptions first = straight;
    first.steps = 3;
    first.save_at = 3;
    first.checkpoint_root = dir.path() / dtype_name(dtype);
    const DemoResult half = run_demo(*group_, first);
    ASSERT_FALSE(half.saved.empty());

    DemoOptions second = straight;
    second.steps = 3;
    second.resume_from = first.checkpoint_root;  // through `latest`
    const DemoResult resumed = run_demo(*group_, second);

    EXPECT_EQ(resumed.step, 6) << dtype_name(dtype);
    EXPECT_EQ(resumed.digest.params, full.digest.params) << dtype_name(dtype);
    EXPECT_EQ(resumed.digest.state, full.digest.state) << dtype_name(dtype);
    EXPECT_EQ(std::memcmp(&resumed.loss, &full.loss, sizeof(double)), 0) << resumed.loss << " vs " << full.loss;
    EXPECT_LT(full.loss, run_demo(*group_, DemoOptions{}).loss) << "training should lower the loss";
  }
}

TEST_P(OptimizerTest, LoadingAtSmallerDpSizesRestoresTheSavedStateExactlyAndTrainingContinues) {
  SharedTempDir dir;
  const DemoResult saved = train_and_save(*group_, dir.path(), 3);
  EXPECT_EQ(read_checkpoint_metadata(dir.path()).dp_size, group_->size());

  // Continue at the saved size as the yardstick for continuing elsewhere.
  const SyntheticRegression problem;
  auto continue_training = [&](comm::Group& group) {
    DistributedAdamW optimizer(group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
    load_checkpoint(optimizer, dir.path());
    EXPECT_EQ(optimizer.step_count(), 3) << "step restored from its one stored value";
    EXPECT_EQ(digest_state(optimizer).state, saved.digest.state) << "at dp " << group.size();
    EXPECT_EQ(digest_state(optimizer).params, saved.digest.params) << "at dp " << group.size();
    for (int i = 0; i < 3; ++i) {
      optimizer.zero_grad();
      problem.forward_backward(optimizer);
      optimizer.step();
    }
    EXPECT_EQ(optimizer.step_count(), 6);
    return optimizer.gather_state(StateTensor::main_param);
  };
  const std::vector<float> at_saved_size = continue_training(*group_);

  std::set<int> smaller_sizes{world_size() / 2, 1};
  smaller_sizes.erase(0);
  smaller_sizes.erase(world_size());
  for (int size : smaller_sizes) {
    MPI_Comm members = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() < size ? 0 : MPI_UNDEFINED, world_rank(), &members);
    if (members != MPI_COMM_NULL) {
      std::string skip;
      std::unique_ptr<comm::Group> smaller = testing_support::make_group(GetParam(), members, &skip);
      const std::vector<float> continued = continue_training(*smaller);
      ASSERT_EQ(continued.size(), at_saved_size.size());
      for (std::size_t i = 0; i < continued.size(); ++i) {
        // Only the order of floating-point sums differs from the run at the saved size.
        ASSERT_NEAR(continued[i], at_saved_size[i], 1e-4 * (1 + std::abs(at_saved_size[i]))) << "dp " << size;
      }
      smaller.reset();
      MPI_Comm_free(&members);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_P(OptimizerTest, LoadsInChunksSmallerThanATensorRestoreTheStateExactlyAtEveryDpSize) {
  SharedTempDir dir;
  const DemoResult saved = train_and_save(*group_, dir.path(), 3);
  std::mt19937_64 rng(seed_);  // the same draws on every rank
  const SyntheticRegression problem;
  std::set<int> sizes{world_size(), world_size() / 2, 1};
  sizes.erase(0);
  for (int size : sizes) {
    MPI_Comm members = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() < size ? 0 : MPI_UNDEFINED, world_rank(), &members);
    for (bool verify : {true, false}) {
      // Not a multiple of a float: chunks end inside elements, and every tensor spans several chunks.
      const std::size_t chunk_bytes = 1 + rng() % 257;
      if (members == MPI_COMM_NULL) continue;
      std::string skip;
      std::unique_ptr<comm::Group> group = testing_support::make_group(GetParam(), members, &skip);
      DistributedAdamW optimizer(*group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
      load_checkpoint(optimizer, dir.path(), {.verify_checksums = verify, .chunk_bytes = chunk_bytes});
      const std::string at = "dp " + std::to_string(size) + ", chunks of " + std::to_string(chunk_bytes) +
                             " bytes, checksums " + (verify ? "on" : "off");
      EXPECT_EQ(optimizer.step_count(), 3) << at;
      const StateDigest loaded = digest_state(optimizer);
      EXPECT_EQ(loaded.state, saved.digest.state) << at;
      EXPECT_EQ(loaded.params, saved.digest.params) << at;
      group.reset();
    }
    if (members != MPI_COMM_NULL) MPI_Comm_free(&members);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// Rank 0 edits files of a copy of the checkpoint; then every rank tries to load it.
class DamagedCheckpoint {
 public:
  DamagedCheckpoint(const fs::path& source, const fs::path& copy) : dir_(copy / source.filename()) {
    if (world_rank() == 0) {
      fs::create_directories(dir_);
      fs::copy(source, dir_, fs::copy_options::recursive);
    }
  }
  const fs::path& dir() const { return dir_; }
  fs::path shard(int rank) const { return dir_ / shard_file_name(rank, world_size()); }

 private:
  fs::path dir_;
};

std::string load_error(comm::Group& group, const fs::path& dir, const SyntheticConfig& problem_config = {}) {
  MPI_Barrier(MPI_COMM_WORLD);  // rank 0's edits are done
  const SyntheticRegression problem(problem_config);
  DistributedAdamW optimizer(group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
  try {
    load_checkpoint(optimizer, dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Edits metadata.json as a writer would, sealed with a fresh digest of its own: read back as format 1
// (which has none, and whose files' digests are called "sha256") and written as the current format.
void rewrite_metadata(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json metadata = nlohmann::json::parse(std::ifstream(dir / "metadata.json"));
  edit(metadata);
  const std::uint64_t piece_bytes = metadata.at("digest_piece_bytes");
  for (nlohmann::json& file : metadata["files"]) {
    file["sha256"] = file.at("sha256_of_pieces");
    file.erase("sha256_of_pieces");
  }
  metadata.erase("metadata_sha256");
  metadata["format_version"] = 1;
  CheckpointMetadata sealed = metadata_from_json(metadata.dump(), "the edited metadata");
  sealed.format_version = kCheckpointFormatVersion;
  sealed.digest_piece_bytes = piece_bytes;
  std::ofstream(dir / "metadata.json", std::ios::trunc) << metadata_to_json(sealed);
}

TEST_P(OptimizerTest, DamagedOrMismatchedCheckpointsFailOnEveryRankNamingTheFile) {
  SharedTempDir dir;
  const fs::path saved = train_and_save(*group_, dir.path() / "run", 2).saved;
  const int victim = static_cast<int>(seed_ % world_size());
  SCOPED_TRACE("damaged shard " + std::to_string(victim));

  {  // one flipped bit in the data of one shard
    DamagedCheckpoint copy(saved, dir.path() / "flipped");
    if (world_rank() == 0) {
      const std::uint64_t data_start = read_safetensors_header(copy.shard(victim)).data_start;
      std::fstream file(copy.shard(victim), std::ios::in | std::ios::out | std::ios::binary);
      file.seekg(static_cast<std::streamoff>(data_start + seed_ % 64));
      char byte = 0;
      file.read(&byte, 1);
      byte ^= static_cast<char>(1 << (seed_ % 8));
      file.seekp(static_cast<std::streamoff>(data_start + seed_ % 64));
      file.write(&byte, 1);
    }
    const std::string error = load_error(*group_, copy.dir());
    EXPECT_NE(error.find(copy.shard(victim).filename().string()), std::string::npos) << error;
    EXPECT_NE(error.find("corrupted"), std::string::npos) << error;

    // The corruption is found while the state is read, and the optimizer keeps the state it had.
    const SyntheticRegression problem;
    DistributedAdamW optimizer(*group_, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
    load_checkpoint(optimizer, saved);
    const StateDigest before = digest_state(optimizer);
    EXPECT_THROW(load_checkpoint(optimizer, copy.dir(), {.chunk_bytes = 1 + seed_ % 100}), Failure);
    EXPECT_EQ(optimizer.step_count(), 2);
    EXPECT_EQ(digest_state(optimizer).state, before.state);
    EXPECT_EQ(digest_state(optimizer).params, before.params);
  }
  {  // a shard cut short
    DamagedCheckpoint copy(saved, dir.path() / "truncated");
    if (world_rank() == 0) fs::resize_file(copy.shard(victim), fs::file_size(copy.shard(victim)) - 1 - seed_ % 100);
    const std::string error = load_error(*group_, copy.dir());
    EXPECT_NE(error.find(copy.shard(victim).filename().string()), std::string::npos) << error;
    EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  }
  {  // a shard missing
    DamagedCheckpoint copy(saved, dir.path() / "missing");
    if (world_rank() == 0) fs::remove(copy.shard(victim));
    const std::string error = load_error(*group_, copy.dir());
    EXPECT_NE(error.find(copy.shard(victim).filename().string()), std::string::npos) << error;
  }
  {  // two shards swapped, checksums and sizes updated to match: the header names the wrong rank
    DamagedCheckpoint copy(saved, dir.path() / "swapped");
    if (world_rank() == 0 && world_size() > 1) {
      const fs::path other = copy.shard((victim + 1) % world_size());
      fs::rename(copy.shard(victim), copy.dir() / "x");
      fs::rename(other, copy.shard(victim));
      fs::rename(copy.dir() / "x", other);
      rewrite_metadata(copy.dir(), [&](nlohmann::json& m) {
        for (auto& f : m["files"]) {
          f["sha256_of_pieces"] = file_digest(copy.dir() / f["name"].get<std::string>(), kDigestPieceBytes);
          f["bytes"] = fs::file_size(copy.dir() / f["name"].get<std::string>());
        }
      });
    }
    if (world_size() > 1) {
      const std::string error = load_error(*group_, copy.dir());
      EXPECT_NE(error.find("does not match"), std::string::npos) << error;
    }
  }
  {  // metadata.json that is not JSON
    DamagedCheckpoint copy(saved, dir.path() / "metadata");
    if (world_rank() == 0) std::ofstream(copy.dir() / "metadata.json", std::ios::trunc) << "{\"format\": ";
    const std::string error = load_error(*group_, copy.dir());
    EXPECT_NE(error.find("metadata.json"), std::string::npos) << error;
  }
  {  // a model whose parameters differ from the checkpoint's
    SyntheticConfig other;
    other.hidden = 33;
    const std::string error = load_error(*group_, saved, other);
    EXPECT_NE(error.find("layer1.weight"), std::string::npos) << error;
    EXPECT_NE(error.find("invalid argument"), std::string::npos) << error;
  }
  {  // saving the same step again refuses and leaves every file as it was
    std::vector<std::string> before;
    for (int r = 0; r < world_size(); ++r) before.push_back(file_digest(saved / shard_file_name(r, world_size()), 0));
    EXPECT_THROW(train_and_save(*group_, dir.path() / "run", 2), Failure);
    for (int r = 0; r < world_size(); ++r) {
      EXPECT_EQ(file_digest(saved / shard_file_name(r, world_size()), 0), before[r]) << "shard " << r;
    }
  }
}

TEST_P(OptimizerTest, LegacyShardsWithPerParameterStepsLoadAndTheStoredScalarWins) {
  SharedTempDir dir;
  const DemoResult saved = train_and_save(*group_, dir.path() / "run", 4);
  const fs::path legacy = dir.path() / "legacy";
  if (world_rank() == 0) {
    // The legacy form: every shard also carries "<param>.step" 0-dim tensors, here with the stale
    // values that reset (1) or per-parameter advance (step * params) would leave behind.
    fs::create_directories(legacy);
    const CheckpointMetadata metadata = read_checkpoint_metadata(saved.saved);
    for (const CheckpointFile& file : metadata.files) {
      const fs::path source = saved.saved / file.name;
      const SafetensorsHeader header = read_safetensors_header(source);
      std::ifstream in(source, std::ios::binary);
      std::vector<std::vector<char>> bytes;
      std::vector<TensorToWrite> tensors;
      for (const SafetensorsEntry& entry : header.tensors) {
        bytes.emplace_back(entry.end - entry.begin);
        in.seekg(static_cast<std::streamoff>(header.data_start + entry.begin));
        in.read(bytes.back().data(), static_cast<std::streamsize>(bytes.back().size()));
      }
      for (std::size_t t = 0; t < header.tensors.size(); ++t) {
        tensors.push_back({header.tensors[t].name, header.tensors[t].dtype, header.tensors[t].shape, bytes[t].data()});
      }
      std::vector<float> stale;
      const std::vector<ParamSpec> specs = param_specs(metadata.layout);
      for (std::size_t p = 0; p < specs.size(); ++p) stale.push_back(p % 2 ? 1.0f : 4.0f * specs.size());
      for (std::size_t p = 0; p < specs.size(); ++p) {
        tensors.push_back({legacy_step_tensor_name(specs[p].name), DType::f32, {}, &stale[p]});
      }
      write_safetensors(legacy / file.name, tensors, header.metadata);
    }
    fs::copy_file(saved.saved / "metadata.json", legacy / "metadata.json");
    rewrite_metadata(legacy, [&](nlohmann::json& m) {
      for (auto& f : m["files"]) {
        f["sha256_of_pieces"] = file_digest(legacy / f["name"].get<std::string>(), kDigestPieceBytes);
        f["bytes"] = fs::file_size(legacy / f["name"].get<std::string>());
      }
    });
    ASSERT_NE(read_safetensors_header(legacy / metadata.files[0].name).find("layer1.weight.step"), nullptr);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  DemoOptions resume;
  resume.resume_from = legacy;
  const DemoResult loaded = run_demo(*group_, resume);
  EXPECT_EQ(loaded.step, 4);
  EXPECT_EQ(loaded.digest.state, saved.digest.state);
  EXPECT_EQ(loaded.digest.params, saved.digest.params);

  // And one more step from the legacy checkpoint equals one more step from the clean one.
  resume.steps = 1;
  DemoOptions clean = resume;
  clean.resume_from = saved.saved;
  EXPECT_EQ(run_demo(*group_, resume).digest.state, run_demo(*group_, clean).digest.state);
}

INSTANTIATE_TEST_SUITE_P(Engines, OptimizerTest, ::testing::Values("mpi", "nccl"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace deltatrain::optim
