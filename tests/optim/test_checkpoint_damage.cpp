// Damaged checkpoints: every edit of metadata.json, every single-bit flip in it, shards that are not
// regular files and a `latest` that names nothing are refused with an error naming the file; nothing
// loads a wrong state, and nothing hangs. Format 1 checkpoints (no digest of their own) still load, and
// their metadata is still checked against the layout it implies and the shards' headers.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <random>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint_testing.h"

namespace deltatrain::optim {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_all(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A checkpoint of the synthetic demo at step 2 (one rank), made once per test in a fresh root.
class DamagedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fresh_temp_root("deltatrain-damage-");
    const ChildResult made = save_step_2_checkpoint(root_);
    ASSERT_EQ(made.exit_code, 0) << made.message;
    digest_ = made.message;
    dir_ = root_ / checkpoint_dir_name(2);
    metadata_file_ = dir_ / "metadata.json";
    original_ = read_all(metadata_file_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Loading `root_` in a child: its digest, or exit code 1 and the error.
  ChildResult load() const {
    return run_child([&] { return loaded_digest(root_); });
  }

  // The metadata as JSON, edited by `edit`, written back without touching its digest.
  void edit_metadata(const std::function<void(json&)>& edit) const {
    json j = json::parse(original_);
    edit(j);
    write_all(metadata_file_, j.dump(2));
  }

  // The checkpoint as format 1 wrote it: no digest of its own, each file's plain SHA-256.
  void as_format_1(json& j) const {
    j.erase("metadata_sha256");
    j.erase("digest_piece_bytes");
    j["format_version"] = 1;
    for (json& file : j["files"]) {
      file.erase("sha256_of_pieces");
      file["sha256"] = file_digest(dir_ / file["name"].get<std::string>(), 0);
    }
  }

  fs::path root_, dir_, metadata_file_;
  std::string digest_, original_;
};

struct Edit {
  const char* name;
  std::function<void(json&)> apply;
};

const Edit kEdits[] = {
    {"param_offset_plus_one", [](json& j) { j["layout"]["buffers"][0]["params"][1]["offset"] = j["layout"]["buffers"][0]["params"][1]["offset"].get<std::int64_t>() + 1; }},
    {"step_7", [](json& j) { j["step"] = 7; }},
    {"step_2_pow_62", [](json& j) { j["step"] = std::int64_t{1} << 62; }},
    {"step_1_5", [](json& j) { j["step"] = 1.5; }},
    {"lr", [](json& j) { j["optimizer"]["lr"] = 0.5; }},
    {"beta1", [](json& j) { j["optimizer"]["beta1"] = 0.5; }},
    {"beta2", [](json& j) { j["optimizer"]["beta2"] = 0.5; }},
    {"eps", [](json& j) { j["optimizer"]["eps"] = 1e-3; }},
    {"weight_decay", [](json& j) { j["optimizer"]["weight_decay"] = 0.5; }},
    {"max_grad_norm_off", [](json& j) { j["optimizer"]["max_grad_norm"] = 0.0; }},
    {"alignment", [](json& j) { j["layout"]["alignment"] = 32; }},
    {"bucket_numel", [](json& j) { j["layout"]["bucket_numel"] = 1024; }},
};

TEST_F(DamagedCheckpoint, EveryEditOfTheMetadataIsRefusedNamingTheFile) {
  for (const Edit& edit : kEdits) {
    SCOPED_TRACE(edit.name);
    edit_metadata(edit.apply);
    const ChildResult loaded = load();
    EXPECT_EQ(loaded.exit_code, 1) << "loaded: " << loaded.message;
    EXPECT_NE(loaded.message.find(metadata_file_.string()), std::string::npos) << loaded.message;
    EXPECT_NE(loaded.message.find("edited or damaged"), std::string::npos) << loaded.message;
    EXPECT_THROW(read_checkpoint_metadata(root_), Failure);
  }
  write_all(metadata_file_, original_);
  const ChildResult loaded = load();
  ASSERT_EQ(loaded.exit_code, 0) << loaded.message;
  EXPECT_EQ(loaded.message, digest_);
}

// Every single-bit flip of metadata.json is refused, or leaves the metadata's meaning unchanged (a flip
// that turns "e" into "E" in a number, say).
TEST_F(DamagedCheckpoint, NoSingleBitFlipOfTheMetadataChangesWhatLoads) {
  const CheckpointMetadata original = read_checkpoint_metadata(root_);
  const std::string canonical = metadata_to_json(original);
  int refused = 0, harmless = 0;
  for (std::size_t byte = 0; byte < original_.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = original_;
      flipped[byte] = static_cast<char>(flipped[byte] ^ (1 << bit));
      try {
        const CheckpointMetadata m = metadata_from_json(flipped, "metadata.json");
        ASSERT_EQ(metadata_to_json(m), canonical) << "byte " << byte << " bit " << bit << " changed the metadata";
        ++harmless;
      } catch (const Failure& e) {
        ASSERT_NE(std::string(e.what()).find("metadata.json"), std::string::npos) << e.what();
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  RecordProperty("refused", refused);
  RecordProperty("harmless", harmless);
}

TEST_F(DamagedCheckpoint, Format1StillLoadsAndSaysItIsUnprotected) {
  edit_metadata([&](json& j) { as_format_1(j); });
  const CheckpointMetadata m = read_checkpoint_metadata(root_);
  EXPECT_EQ(m.format_version, 1);
  EXPECT_FALSE(m.digest_checked);
  const ChildResult loaded = load();
  ASSERT_EQ(loaded.exit_code, 0) << loaded.message;
  EXPECT_EQ(loaded.message, digest_);
}

// Format 2: a digest of its own, and each file's plain SHA-256 (which one stream hashes, so its loads run at
// one core's SHA-256 rate). Still loads, and a flipped bit in a shard is still found.
TEST_F(DamagedCheckpoint, Format2StillLoadsAndItsFilesAreStillChecked) {
  json j = json::parse(original_);
  as_format_1(j);
  CheckpointMetadata format_2 = metadata_from_json(j.dump(), "format 1 metadata");
  format_2.format_version = 2;
  write_all(metadata_file_, metadata_to_json(format_2));
  const CheckpointMetadata m = read_checkpoint_metadata(root_);
  EXPECT_EQ(m.format_version, 2);
  EXPECT_TRUE(m.digest_checked);
  EXPECT_EQ(m.digest_piece_bytes, 0u);
  EXPECT_NE(read_all(metadata_file_).find("\"sha256\""), std::string::npos);
  const ChildResult loaded = load();
  ASSERT_EQ(loaded.exit_code, 0) << loaded.message;
  EXPECT_EQ(loaded.message, digest_);

  const fs::path shard = dir_ / shard_file_name(0, 1);
  std::string bytes = read_all(shard);
  bytes[bytes.size() - 1 - std::random_device{}() % 64] ^= 4;
  write_all(shard, bytes);
  const ChildResult damaged = load();
  EXPECT_EQ(damaged.exit_code, 1) << "loaded: " << damaged.message;
  EXPECT_NE(damaged.message.find(shard.string() + " is corrupted: its sha256"), std::string::npos) << damaged.message;
}

// Without a digest, what can be checked still is: the layout against the one its parameters imply, the
// step against the shards' headers, every field's type and range.
TEST_F(DamagedCheckpoint, Format1EditsThatCanBeCheckedAreRefused) {
  const std::pair<const char*, const char*> expected[] = {
      {"param_offset_plus_one", "offset"}, {"step_7", "step"},        {"step_1_5", "step must be an integer"},
      {"lr", nullptr},                     {"alignment", "alignment"}, {"bucket_numel", "bucket"}};
  for (const auto& [name, detail] : expected) {
    SCOPED_TRACE(name);
    const Edit& edit = *std::find_if(std::begin(kEdits), std::end(kEdits),
                                     [&](const Edit& e) { return std::string(e.name) == name; });
    if (detail == nullptr) continue;  // a valid lr: undetectable without a digest
    edit_metadata([&](json& j) {
      as_format_1(j);
      edit.apply(j);
    });
    const ChildResult loaded = load();
    EXPECT_EQ(loaded.exit_code, 1) << "loaded: " << loaded.message;
    EXPECT_NE(loaded.message.find(detail), std::string::npos) << loaded.message;
  }
  edit_metadata([&](json& j) {
    as_format_1(j);
    j["optimizer"]["beta2"] = 1.5;
  });
  const ChildResult loaded = load();
  EXPECT_EQ(loaded.exit_code, 1);
  EXPECT_NE(loaded.message.find(metadata_file_.string()), std::string::npos) << loaded.message;
  EXPECT_NE(loaded.message.find("beta2"), std::string::npos) << loaded.message;
}

TEST_F(DamagedCheckpoint, AShardThatIsAFifoOrADeviceIsRefusedNamingIt) {
  const fs::path shard = dir_ / shard_file_name(0, 1);
  const CheckpointMetadata m = read_checkpoint_metadata(root_);
  fs::remove(shard);
  ASSERT_EQ(mkfifo(shard.c_str(), 0644), 0);
  for (const bool verify : {true, false}) {
    const ChildResult loaded = run_child([&] {
      const std::unique_ptr<comm::Group> group = comm::make_mpi_group(MPI_COMM_WORLD);
      const SyntheticRegression problem;
      DistributedAdamW optimizer(*group, problem.params(), AdamWConfig{}, DemoOptions{}.layout);
      load_checkpoint(optimizer, root_, {verify});
      return std::string("loaded");
    });
    EXPECT_EQ(loaded.exit_code, 1) << "signal " << loaded.signal << ": " << loaded.message;
    EXPECT_NE(loaded.message.find(shard.string() + " is a FIFO, not a regular file"), std::string::npos)
        << loaded.message;
  }
  fs::remove(shard);
  fs::create_symlink("/dev/zero", shard);
  try {
    verify_checkpoint_file(dir_, m, m.files[0]);
    ADD_FAILURE() << "a symlink to /dev/zero verified";
  } catch (const Failure& e) {
    EXPECT_NE(std::string(e.what()).find("is a character device"), std::string::npos) << e.what();
  }
}

TEST_F(DamagedCheckpoint, ALatestThatNamesNoCheckpointIsRefusedNamingIt) {
  const fs::path latest = root_ / "latest";
  for (const std::string& text : {std::string("garbage\n"), std::string("step-0") + '\0' + "000002\n", std::string("../x"),
                                  std::string("step-00000009\n")}) {
    write_all(latest, text);
    try {
      resolve_checkpoint(root_);
      ADD_FAILURE() << "resolved " << text;
    } catch (const Failure& e) {
      EXPECT_NE(std::string(e.what()).find("file " + latest.string()), std::string::npos) << e.what();
    }
  }
  write_all(latest, checkpoint_dir_name(2) + "\n");
  EXPECT_EQ(resolve_checkpoint(root_), dir_);
}

}  // namespace
}  // namespace deltatrain::optim
