// Checkpoints of DistributedAdamW: exact, crash-safe, reshardable to any data-parallel size.
//
// On disk, under a root directory:
//   root/step-00000010/metadata.json                        format version, step (once), dp size,
//                                                           hyper-parameters, layout, file checksums
//   root/step-00000010/shard-00000-of-00004.safetensors     rank 0's shards: per buffer b, bucket k,
//   ...                                                     "fp32_param|exp_avg|exp_avg_sq.buffer<b>.bucket<k>"
//   root/latest                                             "step-00000010", replaced last, atomically
//
// Saving writes into root/.tmp-step-00000010, fsyncs every file and the directory, renames it into
// place, then replaces `latest`: a process killed at any point leaves the previous checkpoint whole
// and `latest` naming it. Nothing existing is overwritten.
//
// Loading reads each new rank's shard ranges from whichever files hold them (the byte ranges that
// plan_reshard computes), so the dp size may differ from the one at save. Each file is read once, in chunks
// through a small staging buffer, each chunk hashed and copied to the device while the next is read; the
// new state is assembled beside the old one on the device and replaces it only once every check passed. Adam's
// step comes from metadata.json alone. A legacy shard that also carries per-parameter step tensors
// ("<param>.step", 0-dim, as torch Adam and Megatron leaked them) loads: those tensors are ignored
// and the stored scalar wins.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/layout.h"
#include "deltatrain/optim/safetensors.h"

namespace deltatrain::optim {

// 2: metadata.json carries "metadata_sha256", the SHA-256 of its own canonical form (the JSON without
// that key, keys sorted, compact), so an edit or a flipped bit anywhere in it is found on load. Format 1
// checkpoints still load; their metadata is checked field by field but has no digest of its own.
// 3: a file's digest is digest.h's PieceDigest ("sha256_of_pieces", over pieces of "digest_piece_bytes"), which
// a load verifies at the disk's rate; formats 1 and 2 record the plain SHA-256 of each file ("sha256").
inline constexpr int kCheckpointFormatVersion = 3;
inline constexpr int kOldestCheckpointFormatVersion = 1;

struct CheckpointFile {
  std::string name;
  int rank = 0;
  std::uint64_t bytes = 0;
  std::string digest;  // PieceDigest(CheckpointMetadata::digest_piece_bytes) of the file
};

struct CheckpointMetadata {
  int format_version = kCheckpointFormatVersion;
  std::uint64_t digest_piece_bytes = kDigestPieceBytes;  // 0 in formats 1 and 2
  std::int64_t step = 0;
  int dp_size = 1;
  AdamWConfig config;
  ParamLayout layout;
  std::vector<CheckpointFile> files;
  // Whether metadata.json carried a digest of itself (format 2 on); format 1 metadata is unprotected.
  bool digest_checked = true;
};

std::string metadata_to_json(const CheckpointMetadata& metadata);
// Failure naming `source` (the file it came from) when the text is not valid metadata.
CheckpointMetadata metadata_from_json(const std::string& text, const std::string& source);

std::string checkpoint_dir_name(std::int64_t step);            // "step-00000010"
// The step a checkpoint directory name denotes; nullopt for any other name.
std::optional<std::int64_t> checkpoint_dir_step(const std::string& name);
// Whether a save of `step` under `root` replaces an existing step directory: false when there is none; true when
// there is one but `latest` names an earlier step or is absent (a save killed after its rename and before
// `latest` moved left it, and it is replaced in one atomic exchange once the new one is complete); Failure
// when `latest` names this step and it exists (nothing is overwritten) or names a later step (`latest` never
// moves back, whether or not this step's directory exists). The rule of every step-directory save.
bool save_replaces_leftover(const std::filesystem::path& root, std::int64_t step);
std::string shard_file_name(int rank, int dp_size);            // "shard-00001-of-00004.safetensors"
std::string shard_tensor_name(StateTensor tensor, int buffer, int bucket);
std::string legacy_step_tensor_name(const std::string& param);  // "<param>.step"

// Points in a save, for observers (and for tests that kill a save part-way).
enum class SaveStage {
  shard_partly_written,  // every rank: its shard file holds its first tensor only
  shards_written,        // every rank: its shard file is complete and fsynced
  metadata_written,      // rank 0: metadata.json is in the temporary directory
  renamed,               // rank 0: the checkpoint directory is in place; `latest` is not yet updated
  latest_updated,        // rank 0: done
};

struct SaveOptions {
  std::function<void(SaveStage)> on_stage;
};

struct LoadOptions {
  // Each file's SHA-256 is checked against metadata.json by one rank per file (the lowest that reads any of
  // it, which then reads all of it), while it is read; the state changes only once every file has passed.
  bool verify_checksums = true;
  // Each file is read once, in chunks of this many bytes, each hashed and copied to the device while the next
  // is read.
  std::size_t chunk_bytes = kDefaultChunkBytes;
};

// Collective. Returns the new checkpoint's directory. Failure (on every rank) if it already exists and
// `latest` names it or a later step. A directory of a later step than `latest` names (or any, without
// `latest`) is what a save killed after its rename and before `latest` moved leaves: it is replaced, in
// one atomic exchange once the new one is complete.
std::filesystem::path save_checkpoint(const DistributedAdamW& optimizer, const std::filesystem::path& root,
                                      const SaveOptions& options = {});

// Collective. `path` is a checkpoint directory, or a root whose `latest` names one. Restores the
// state shards, the step and the hyper-parameters, then rebuilds the model parameters. Every rank
// raises the same error when any rank finds a problem: a missing, truncated or corrupted file
// (named, with what is wrong), or a layout that does not match the model (InvalidArgument); the
// optimizer then keeps the state it had. Needs room for a second copy of this rank's state on its
// device while it runs.
void load_checkpoint(DistributedAdamW& optimizer, const std::filesystem::path& path, const LoadOptions& options = {});

// The checkpoint directory `path` denotes (itself, or what its `latest` names). Failure naming `latest`
// when it does not hold a checkpoint directory name (step-NNNNNNNN) or names no directory.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);
// Checks one file of checkpoint `dir` against its record: a regular file (not a FIFO or a device) of
// the recorded size, whose digest (of the metadata's kind) matches. Failure naming the file and what is wrong.
void verify_checkpoint_file(const std::filesystem::path& dir, const CheckpointMetadata& metadata,
                            const CheckpointFile& record);
CheckpointMetadata read_checkpoint_metadata(const std::filesystem::path& path);
// The name of each file's digest in metadata.json, by the digest's kind: "sha256_of_pieces" (format 3 on) or
// "sha256" (the plain SHA-256 of formats 1 and 2, digest_piece_bytes 0).
const char* file_digest_key(std::uint64_t digest_piece_bytes);

}  // namespace deltatrain::optim
