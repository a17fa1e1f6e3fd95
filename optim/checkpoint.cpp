#include "deltatrain/optim/checkpoint.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/safetensors.h"
#include "chunked_read.h"
#include "file_io.h"
#include "json_fields.h"
#include "memory.h"

namespace deltatrain::optim {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "deltatrain.optim.checkpoint";
constexpr const char* kLatest = "latest";
constexpr const char* kMetadata = "metadata.json";
constexpr const char* kDigestKey = "metadata_sha256";

// How errors name metadata.json at `source`, for the strict field readers (json_fields.h).
std::string metadata_file(const std::string& source) { return "checkpoint metadata " + source; }

[[noreturn]] void bad_metadata(const std::string& source, const std::string& what) {
  invalid_json_file(metadata_file(source), what);
}

json layout_to_json(const ParamLayout& layout) {
  json buffers = json::array();
  for (const BufferLayout& buffer : layout.buffers) {
    json params = json::array();
    for (const ParamSlot& p : buffer.params) {
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"numel", p.numel},
                        {"bucket", p.bucket}});
    }
    json buckets = json::array();
    for (const Bucket& b : buffer.buckets) buckets.push_back({{"offset", b.offset}, {"numel", b.numel}});
    buffers.push_back({{"dtype", safetensors_dtype(buffer.dtype)},
                       {"numel", buffer.numel},
                       {"params", params},
                       {"buckets", buckets}});
  }
  return {{"alignment", layout.options.alignment}, {"bucket_numel", layout.options.bucket_numel},
          {"buffers", buffers}};
}

// SHA-256 of the metadata's canonical form: compact, keys sorted (nlohmann::json keeps them so), without
// the digest itself. A digest of the meaning rather than of the bytes: reformatting changes nothing.
std::string metadata_digest(json metadata) {
  metadata.erase(kDigestKey);
  const std::string text = metadata.dump();
  Sha256 sha;
  sha.update(text.data(), text.size());
  return sha.hex_digest();
}

// The stored layout is the truth about the files, so it must be the very layout its own parameters,
// options and dp size imply (make_param_layout is a pure function): then no edited offset, size or
// bucket can steer a read.
void check_layout(const ParamLayout& stored, const std::string& source) {
  ParamLayout implied;
  try {
    implied = make_param_layout(param_specs(stored), stored.dp_size, stored.options);
  } catch (const InvalidArgument& e) {
    bad_metadata(source, std::string("its layout's parameters do not make a layout: ") + e.what());
  }
  const auto differs = [&](const std::string& what, std::int64_t stored_value, std::int64_t implied_value) {
    if (stored_value != implied_value) {
      bad_metadata(source, what + " is " + std::to_string(stored_value) + " but the layout its parameters, alignment " +
                               std::to_string(stored.options.alignment) + ", bucket_numel " +
                               std::to_string(stored.options.bucket_numel) + " and dp size " +
                               std::to_string(stored.dp_size) + " imply has " + std::to_string(implied_value));
    }
  };
  differs("the number of buffers", static_cast<std::int64_t>(stored.buffers.size()),
          static_cast<std::int64_t>(implied.buffers.size()));
  for (std::size_t b = 0; b < stored.buffers.size(); ++b) {
    const BufferLayout &have = stored.buffers[b], &want = implied.buffers[b];
    const std::string buffer = "buffer " + std::to_string(b);
    differs(buffer + "'s numel", have.numel, want.numel);
    differs(buffer + "'s number of buckets", static_cast<std::int64_t>(have.buckets.size()),
            static_cast<std::int64_t>(want.buckets.size()));
    for (std::size_t k = 0; k < have.buckets.size(); ++k) {
      const std::string bucket = buffer + "'s bucket " + std::to_string(k);
      differs(bucket + "'s offset", have.buckets[k].offset, want.buckets[k].offset);
      differs(bucket + "'s numel", have.buckets[k].numel, want.buckets[k].numel);
    }
    for (std::size_t i = 0; i < have.params.size(); ++i) {
      const std::string param = "parameter '" + have.params[i].name + "'";
      differs(param + "'s offset", have.params[i].offset, want.params[i].offset);
      differs(param + "'s numel", have.params[i].numel, want.params[i].numel);
      differs(param + "'s bucket", have.params[i].bucket, want.params[i].bucket);
    }
  }
}

ParamLayout layout_from_json(const json& j, int dp_size, const std::string& source) {
  const std::string file = metadata_file(source);
  constexpr std::int64_t kMax = INT64_MAX;
  ParamLayout layout;
  layout.dp_size = dp_size;
  layout.options.alignment = integer_field(j, "alignment", 1, kMax, "layout.", file);
  layout.options.bucket_numel = integer_field(j, "bucket_numel", 1, kMax, "layout.", file);
  const json& buffers = array_field(j, "buffers", "layout.", file);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const std::string where = "layout.buffers[" + std::to_string(b) + "].";
    BufferLayout buffer;
    buffer.dtype = dtype_from_safetensors(string_field(buffers[b], "dtype", where, file));
    buffer.numel = integer_field(buffers[b], "numel", 0, kMax, where, file);
    const json& params = array_field(buffers[b], "params", where, file);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::string at = where + "params[" + std::to_string(i) + "].";
      const json& p = params[i];
      std::vector<std::int64_t> shape;
      const json& dims = array_field(p, "shape", at, file);
      for (std::size_t d = 0; d < dims.size(); ++d) {
        shape.push_back(integer_field(json{{"dim", dims[d]}}, "dim", 1, kMax, at + "shape[" + std::to_string(d) + "].",
                                      file));
      }
      buffer.params.push_back({string_field(p, "name", at, file), std::move(shape),
                               integer_field(p, "offset", 0, kMax, at, file), integer_field(p, "numel", 1, kMax, at, file),
                               static_cast<int>(integer_field(p, "bucket", 0, INT_MAX, at, file))});
    }
    const json& buckets = array_field(buffers[b], "buckets", where, file);
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const std::string at = where + "buckets[" + std::to_string(k) + "].";
      buffer.buckets.push_back(
          {integer_field(buckets[k], "offset", 0, kMax, at, file), integer_field(buckets[k], "numel", 1, kMax, at, file)});
    }
    layout.buffers.push_back(std::move(buffer));
  }
  check_layout(layout, source);
  return layout;
}

// What a rank's shard file must hold; the legacy per-parameter step tensors are tolerated.
void check_shard_header(const SafetensorsHeader& header, const fs::path& file, const CheckpointMetadata& metadata,
                        int rank) {
  const ParamLayout& layout = metadata.layout;
  auto mismatch = [&](const std::string& what) {
    throw Failure("file " + file.string() + " does not match the checkpoint's metadata.json: " + what);
  };
  auto it = header.metadata.find("rank");
  if (it == header.metadata.end() || it->second != std::to_string(rank)) {
    mismatch("it should hold rank " + std::to_string(rank) + "'s shards but its header says rank '" +
             (it == header.metadata.end() ? std::string("(none)") : it->second) + "'");
  }
  // The step is stored once, in metadata.json; the copy every shard's header carries (absent in shards of
  // older writers) is a cross-check that an unprotected format 1 metadata.json still gets.
  it = header.metadata.find("step");
  if (it != header.metadata.end() && it->second != std::to_string(metadata.step)) {
    mismatch("its header says step " + it->second + " but metadata.json says " + std::to_string(metadata.step));
  }
  std::set<std::string> expected;
  for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
    const BufferLayout& buffer = layout.buffers[b];
    for (std::size_t k = 0; k < buffer.buckets.size(); ++k) {
      for (StateTensor tensor : kStateTensors) {
        const std::string name = shard_tensor_name(tensor, static_cast<int>(b), static_cast<int>(k));
        expected.insert(name);
        const SafetensorsEntry* entry = header.find(name);
        const std::vector<std::int64_t> shape{layout.shard_numel(buffer.buckets[k])};
        if (entry == nullptr) mismatch("tensor '" + name + "' is missing");
        if (entry->dtype != DType::f32 || entry->shape != shape) {
          mismatch("tensor '" + name + "' is " + safetensors_dtype(entry->dtype) + " of " +
                   std::to_string(entry->shape.empty() ? 0 : entry->shape[0]) + " elements; expected F32 of " +
                   std::to_string(shape[0]));
        }
      }
    }
    for (const ParamSlot& p : buffer.params) expected.insert(legacy_step_tensor_name(p.name));
  }
  for (const SafetensorsEntry& entry : header.tensors) {
    if (!expected.count(entry.name)) mismatch("it holds an unexpected tensor '" + entry.name + "'");
  }
}

void check_file_size(const File& file, const CheckpointFile& record) {
  const std::uint64_t size = file.size();
  if (size < record.bytes) {
    throw Failure("file " + file.path().string() + " is truncated: metadata.json records " +
                  std::to_string(record.bytes) + " bytes, the file has " + std::to_string(size));
  }
  if (size > record.bytes) {
    throw Failure("file " + file.path().string() + " has " + std::to_string(size) + " bytes but metadata.json records " +
                  std::to_string(record.bytes));
  }
}

void check_digest(const fs::path& file, const std::string& digest, const CheckpointMetadata& metadata,
                  const CheckpointFile& record) {
  if (digest != record.digest) {
    throw Failure("file " + file.string() + " is corrupted: its " + file_digest_key(metadata.digest_piece_bytes) +
                  " is " + digest + " but metadata.json records " + record.digest);
  }
}

}  // namespace

const char* file_digest_key(std::uint64_t digest_piece_bytes) {
  return digest_piece_bytes == 0 ? "sha256" : "sha256_of_pieces";
}

std::string checkpoint_dir_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

std::optional<std::int64_t> checkpoint_dir_step(const std::string& name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  const char* first = name.data() + kPrefix.size();
  const char* last = name.data() + name.size();
  std::int64_t step = 0;
  const auto [end, error] = std::from_chars(first, last, step);
  if (!std::isdigit(static_cast<unsigned char>(*first)) || error != std::errc() || end != last) return std::nullopt;
  return step;
}

std::string shard_file_name(int rank, int dp_size) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-of-%05d.safetensors", rank, dp_size);
  return name;
}

std::string shard_tensor_name(StateTensor tensor, int buffer, int bucket) {
  return std::string(state_tensor_name(tensor)) + ".buffer" + std::to_string(buffer) + ".bucket" + std::to_string(bucket);
}

std::string legacy_step_tensor_name(const std::string& param) { return param + ".step"; }

std::string metadata_to_json(const CheckpointMetadata& m) {
  json files = json::array();
  for (const CheckpointFile& f : m.files) {
    files.push_back({{"name", f.name},
                     {"rank", f.rank},
                     {"bytes", f.bytes},
                     {file_digest_key(m.digest_piece_bytes), f.digest}});
  }
  json state = json::array();
  for (StateTensor tensor : kStateTensors) state.push_back(state_tensor_name(tensor));
  json j = {
      {"format", kFormat},
      {"format_version", m.format_version},
      {"step", m.step},
      {"dp_size", m.dp_size},
      {"optimizer",
       {{"name", "adamw"},
        {"lr", m.config.lr},
        {"beta1", m.config.beta1},
        {"beta2", m.config.beta2},
        {"eps", m.config.eps},
        {"weight_decay", m.config.weight_decay},
        {"max_grad_norm", m.config.max_grad_norm}}},
      {"state_tensors", state},
      {"layout", layout_to_json(m.layout)},
      {"files", files},
  };
  if (m.digest_piece_bytes != 0) j["digest_piece_bytes"] = m.digest_piece_bytes;
  if (m.format_version >= 2) j[kDigestKey] = metadata_digest(j);
  return j.dump(2) + "\n";
}

CheckpointMetadata metadata_from_json(const std::string& text, const std::string& source) {
  const std::string file = metadata_file(source);
  CheckpointMetadata m;
  try {
    const json j = json::parse(text);
    if (!j.is_object()) bad_metadata(source, "it is not a JSON object");
    const std::string format = string_field(j, "format", "", file);
    if (format != kFormat) bad_metadata(source, "its format is '" + format + "', not '" + kFormat + "'");
    const json& version = field(j, "format_version", "", file);
    if (!version.is_number_integer() || version.get<std::int64_t>() < kOldestCheckpointFormatVersion ||
        version.get<std::int64_t>() > kCheckpointFormatVersion) {
      bad_metadata(source, "format version " + version.dump() + " is not supported (this build reads " +
                               std::to_string(kOldestCheckpointFormatVersion) + " to " +
                               std::to_string(kCheckpointFormatVersion) + ")");
    }
    m.format_version = version.get<int>();
    m.digest_checked = m.format_version >= 2;
    m.digest_piece_bytes = m.format_version >= 3 ? static_cast<std::uint64_t>(integer_field(
                                                       j, "digest_piece_bytes", 1, INT64_MAX, "", file))
                                                 : 0;
    if (m.digest_checked) {
      const std::string recorded = string_field(j, kDigestKey, "", file);
      const std::string actual = metadata_digest(j);
      if (recorded != actual) {
        bad_metadata(source, std::string("its content does not match its ") + kDigestKey + " (recorded " + recorded +
                                 ", computed " + actual + "): it was edited or damaged after the save");
      }
    }
    m.step = integer_field(j, "step", 0, INT64_MAX, "", file);
    m.dp_size = static_cast<int>(integer_field(j, "dp_size", 1, INT_MAX, "", file));
    const json& o = field(j, "optimizer", "", file);
    m.config = {number_field(o, "lr", "optimizer.", file),           number_field(o, "beta1", "optimizer.", file),
                number_field(o, "beta2", "optimizer.", file),        number_field(o, "eps", "optimizer.", file),
                number_field(o, "weight_decay", "optimizer.", file), number_field(o, "max_grad_norm", "optimizer.", file)};
    check_config(m.config);
    m.layout = layout_from_json(field(j, "layout", "", file), m.dp_size, source);
    const json& files = array_field(j, "files", "", file);
    for (std::size_t f = 0; f < files.size(); ++f) {
      const std::string where = "files[" + std::to_string(f) + "].";
      m.files.push_back({string_field(files[f], "name", where, file),
                         static_cast<int>(integer_field(files[f], "rank", 0, INT_MAX, where, file)),
                         static_cast<std::uint64_t>(integer_field(files[f], "bytes", 0, INT64_MAX, where, file)),
                         string_field(files[f], file_digest_key(m.digest_piece_bytes), where, file)});
    }
  } catch (const json::exception& e) {
    bad_metadata(source, e.what());
  } catch (const InvalidArgument& e) {
    bad_metadata(source, e.what());
  }
  if (static_cast<int>(m.files.size()) != m.dp_size) {
    bad_metadata(source, "it lists " + std::to_string(m.files.size()) + " files for dp size " + std::to_string(m.dp_size));
  }
  for (int rank = 0; rank < m.dp_size; ++rank) {
    if (m.files[rank].rank != rank || m.files[rank].name != shard_file_name(rank, m.dp_size)) {
      bad_metadata(source, "file entry " + std::to_string(rank) + " is '" + m.files[rank].name + "'");
    }
  }
  return m;
}

namespace {

// `text` for a message: printable characters as they are, others as \xNN, at most 64 of them.
std::string printable(const std::string& text) {
  std::string shown = "'";
  for (std::size_t i = 0; i < text.size() && i < 64; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (std::isprint(c)) {
      shown += static_cast<char>(c);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      shown += escaped;
    }
  }
  return shown + (text.size() > 64 ? "'..." : "'");
}

// The checkpoint directory name root/latest holds; Failure naming `latest` when it holds anything else.
std::string read_latest(const fs::path& root) {
  const fs::path file = root / kLatest;
  std::string name = read_text_file(file);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!checkpoint_dir_step(name)) {
    throw Failure("file " + file.string() + " does not name a checkpoint directory (step-NNNNNNNN): it holds " +
                  printable(name));
  }
  return name;
}

}  // namespace

bool save_replaces_leftover(const fs::path& root, std::int64_t step) {
  const fs::path dir = root / checkpoint_dir_name(step);
  // -1 without `latest`: below every step. read_latest refuses a name that is not a step's.
  const std::int64_t latest = fs::exists(root / kLatest) ? *checkpoint_dir_step(read_latest(root)) : -1;
  if (latest > step) {
    throw Failure("`latest` in " + root.string() + " names step " + std::to_string(latest) + ", after step " +
                  std::to_string(step) + "; a save never moves `latest` back, so nothing is written");
  }
  if (!fs::exists(dir)) return false;
  if (latest == step) {
    throw Failure("checkpoint " + dir.string() + " already exists and `latest` names it; nothing is overwritten");
  }
  return true;
}

fs::path resolve_checkpoint(const fs::path& path) {
  if (fs::exists(path / kMetadata)) return path;
  if (fs::exists(path / kLatest)) {
    const std::string name = read_latest(path);
    if (!fs::is_directory(path / name)) {
      throw Failure("file " + (path / kLatest).string() + " names " + name + ", which is not a directory in " +
                    path.string());
    }
    return path / name;
  }
  throw Failure("no checkpoint at " + path.string() + ": it holds neither " + kMetadata + " nor " + kLatest);
}

void verify_checkpoint_file(const fs::path& dir, const CheckpointMetadata& metadata, const CheckpointFile& record) {
  const fs::path file = dir / record.name;
  check_file_size(File::open_read(file), record);
  check_digest(file, file_digest(file, metadata.digest_piece_bytes), metadata, record);
}

CheckpointMetadata read_checkpoint_metadata(const fs::path& path) {
  const fs::path file = resolve_checkpoint(path) / kMetadata;
  return metadata_from_json(read_text_file(file), file.string());
}

fs::path save_checkpoint(const DistributedAdamW& optimizer, const fs::path& root, const SaveOptions& options) {
  comm::Group& group = optimizer.group();
  const int rank = group.rank();
  const int dp_size = group.size();
  const ParamLayout& layout = optimizer.layout();
  const std::string name = checkpoint_dir_name(optimizer.step_count());
  const fs::path final_dir = root / name;
  const fs::path temp_dir = root / (".tmp-" + name);
  auto reached = [&](SaveStage stage) {
    if (options.on_stage) options.on_stage(stage);
  };

  bool replacing = false;  // rank 0: final_dir is an interrupted save's, which `latest` never named
  collectively(group, [&] {
    if (rank != 0) return;
    replacing = save_replaces_leftover(root, optimizer.step_count());
    fs::create_directories(root);
    fs::remove_all(temp_dir);  // left by a save that was killed
    fs::create_directory(temp_dir);
  });

  std::string file_record;
  collectively(group, [&] {
    // Straight from the state: host state is written as it is, a GPU's is fetched chunk by chunk into a small
    // staging buffer while the last chunk is written and hashed (no host copy of the whole state).
    std::vector<TensorToWrite> tensors;
    for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
      const BufferLayout& buffer = layout.buffers[b];
      for (std::size_t k = 0; k < buffer.buckets.size(); ++k) {
        for (StateTensor state : kStateTensors) {
          const TensorView local = optimizer.local_state(state, static_cast<int>(b));
          const char* shard =
              static_cast<const char*>(local.data) + layout.local_offset(buffer.buckets[k]) * sizeof(float);
          TensorToWrite tensor{shard_tensor_name(state, static_cast<int>(b), static_cast<int>(k)), DType::f32,
                               {layout.shard_numel(buffer.buckets[k])}};
          if (local.device.type == DeviceType::cpu) {
            tensor.data = shard;
          } else {
            tensor.read = [shard, device = local.device, stream = optimizer.stream()](
                              std::uint64_t offset, std::size_t bytes, void* staging) {
              copy_bytes(staging, shard + offset, bytes, device, stream);
              synchronize(device, stream);
            };
          }
          tensors.push_back(std::move(tensor));
        }
      }
    }
    const fs::path file = temp_dir / shard_file_name(rank, dp_size);
    const std::string digest = write_safetensors(
        file, tensors,
        {{"format", kFormat}, {"rank", std::to_string(rank)}, {"dp_size", std::to_string(dp_size)},
         {"step", std::to_string(optimizer.step_count())}},
        {.after_tensor = [&](std::size_t written) {
          if (written == 1) reached(SaveStage::shard_partly_written);
        }});
    file_record = digest + " " + std::to_string(fs::file_size(file));
  });
  reached(SaveStage::shards_written);

  const std::vector<std::string> records = group.all_gather_object(file_record);
  collectively(group, [&] {
    if (rank != 0) return;
    CheckpointMetadata metadata;
    metadata.step = optimizer.step_count();
    metadata.dp_size = dp_size;
    metadata.config = optimizer.config();
    metadata.layout = layout;
    for (int r = 0; r < dp_size; ++r) {
      const std::size_t space = records[r].find(' ');
      metadata.files.push_back(
          {shard_file_name(r, dp_size), r, std::stoull(records[r].substr(space + 1)), records[r].substr(0, space)});
    }
    write_new_file(temp_dir / kMetadata, metadata_to_json(metadata));
    reached(SaveStage::metadata_written);
    sync_directory(temp_dir);
    if (replacing) {
      // One atomic exchange: at any kill the step's name holds a complete checkpoint, and the one it
      // held, now under the temporary name, is removed here or by the next save.
      exchange_paths(temp_dir, final_dir);
      sync_directory(root);
      fs::remove_all(temp_dir);
    } else {
      rename_no_replace(temp_dir, final_dir);
      sync_directory(root);
    }
    reached(SaveStage::renamed);
    replace_file_atomically(root / kLatest, name + "\n");
    reached(SaveStage::latest_updated);
  });
  return final_dir;
}

void load_checkpoint(DistributedAdamW& optimizer, const fs::path& path, const LoadOptions& options) {
  comm::Group& group = optimizer.group();
  const int rank = group.rank();
  const ParamLayout& layout = optimizer.layout();
  const Device device = optimizer.local_state(StateTensor::main_param, 0).device;
  CheckpointMetadata metadata;
  // The new shards are assembled beside the state, on its device, and replace it only once every rank has read
  // and checked everything: a failed load leaves the optimizer as it was. Zero-filled: padding and alignment
  // gaps, which no copy covers, stay zero.
  std::vector<DeviceBuffer> staged;  // [buffer * 3 + tensor], this rank's shards
  for (const BufferLayout& buffer : layout.buffers) {
    for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
      staged.emplace_back(device, static_cast<std::size_t>(layout.local_numel(buffer)) * sizeof(float));
    }
  }

  collectively(group, [&] {
    const fs::path dir = resolve_checkpoint(path);
    metadata = metadata_from_json(read_text_file(dir / kMetadata), (dir / kMetadata).string());
    // Every rank's plan (pure arithmetic), so that each file's checksum is checked by one rank that reads the
    // whole file anyway where there is one: the lowest rank that needs any of it; a file no rank needs is
    // checked by rank f % size.
    std::vector<std::set<int>> sources_of_rank(group.size());
    std::vector<ShardCopy> plan;
    try {
      for (int r = 0; r < group.size(); ++r) {
        std::vector<ShardCopy> copies = plan_reshard(metadata.layout, layout, r);
        for (const ShardCopy& copy : copies) sources_of_rank[r].insert(copy.source_rank);
        if (r == rank) plan = std::move(copies);
      }
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("checkpoint", std::string(e.what()) + " (checkpoint " + dir.string() + ")");
    }
    for (int source = 0; source < metadata.dp_size; ++source) {
      int checker = source % group.size();
      for (int r = group.size() - 1; r >= 0; --r) {
        if (sources_of_rank[r].count(source) != 0) checker = r;
      }
      const bool check = options.verify_checksums && checker == rank;
      const bool needed = sources_of_rank[rank].count(source) != 0;
      if (!needed) {
        if (check) verify_checkpoint_file(dir, metadata, metadata.files[source]);
        continue;
      }
      const CheckpointFile& record = metadata.files[source];
      const fs::path path_of_file = dir / record.name;
      const File file = File::open_read(path_of_file);
      check_file_size(file, record);
      SafetensorsHeader header;
      try {
        header = read_safetensors_header(path_of_file);
        check_shard_header(header, path_of_file, metadata, source);
      } catch (const Failure&) {
        // A damaged header is, first of all, a file whose checksum does not match: say so, as a checksum
        // pass ahead of the header would.
        if (check) verify_checkpoint_file(dir, metadata, record);
        throw;
      }
      // This rank's byte ranges of the file, each with where its bytes go.
      struct Placement {
        ByteRange bytes;
        char* target;
      };
      std::vector<Placement> placements;
      for (const ShardCopy& copy : plan) {
        if (copy.source_rank != source) continue;
        const std::int64_t target = layout.local_offset(layout.buffers[copy.buffer].buckets[copy.target_bucket]) +
                                    copy.target_offset;
        for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
          const SafetensorsEntry* entry = header.find(shard_tensor_name(kStateTensors[t], copy.buffer, copy.source_bucket));
          const std::uint64_t begin = header.data_start + entry->begin + copy.source_offset * sizeof(float);
          placements.push_back({{begin, begin + copy.numel * sizeof(float)},
                                staged[copy.buffer * 3 + t].as<char>() + target * sizeof(float)});
        }
      }
      std::sort(placements.begin(), placements.end(),
                [](const Placement& a, const Placement& b) { return a.bytes.begin < b.bytes.begin; });
      // Checked: the whole file, once, hashed on the way. Otherwise only the ranges, adjacent ones merged.
      ChunkedRead read{.chunk_bytes = options.chunk_bytes, .device = device, .stream = optimizer.stream()};
      PieceDigest digest(metadata.digest_piece_bytes);
      if (check) {
        read.ranges = {{0, record.bytes}};
        read.digest = &digest;
      } else {
        for (const Placement& placement : placements) {
          if (!read.ranges.empty() && read.ranges.back().end == placement.bytes.begin) {
            read.ranges.back().end = placement.bytes.end;
          } else {
            read.ranges.push_back(placement.bytes);
          }
        }
      }
      // Chunks come in file order, so one cursor walks the sorted placements.
      std::size_t next = 0;
      read.deliver = [&](std::uint64_t offset, const char* data, std::size_t bytes) {
        const std::uint64_t end = offset + bytes;
        while (next < placements.size() && placements[next].bytes.end <= offset) ++next;
        for (std::size_t p = next; p < placements.size() && placements[p].bytes.begin < end; ++p) {
          const Placement& placement = placements[p];
          const std::uint64_t from = std::max(offset, placement.bytes.begin);
          const std::uint64_t to = std::min(end, placement.bytes.end);
          copy_bytes(placement.target + (from - placement.bytes.begin), data + (from - offset), to - from, device,
                     optimizer.stream());
        }
      };
      read_chunked(file, read);
      if (check) check_digest(path_of_file, digest.hex_digest(), metadata, record);
    }
  });

  for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
    for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
      const TensorView local = optimizer.local_state(kStateTensors[t], static_cast<int>(b));
      copy_bytes(local.data, staged[b * 3 + t].data(), local.nbytes(), device, optimizer.stream());
    }
  }
  synchronize(device, optimizer.stream());  // before the staged buffers go
  optimizer.restore_step(metadata.step);
  optimizer.set_config(metadata.config);
  optimizer.sync_params_from_main();
}

}  // namespace deltatrain::optim
