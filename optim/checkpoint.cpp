#include "deltatrain/optim/checkpoint.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "deltatrain/core/error.h"
#include "deltatrain/optim/digest.h"
#include "deltatrain/optim/safetensors.h"
#include "file_io.h"
#include "memory.h"

namespace deltatrain::optim {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "deltatrain.optim.checkpoint";
constexpr const char* kLatest = "latest";
constexpr const char* kMetadata = "metadata.json";

// Runs `work` on this rank, then lets every rank learn whether any rank failed: all of them raise
// the first failure (by rank), with its type, so no rank walks on into a collective alone.
template <class Work>
void collectively(comm::Group& group, Work&& work) {
  std::string failure;  // empty: success; else a kind letter, then what the kind needs
  try {
    work();
  } catch (const InvalidArgument& e) {
    failure = "I" + e.argument() + '\n' + e.what();
  } catch (const StateError& e) {
    failure = std::string("S") + e.what();
  } catch (const std::exception& e) {
    failure = std::string("F") + e.what();
  }
  const std::vector<std::string> all = group.all_gather_object(failure);
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    const std::string& f = all[rank];
    if (f.empty()) continue;
    const std::string text = f.substr(1);
    if (f[0] == 'I') {
      const std::string argument = text.substr(0, text.find('\n'));
      const std::string what = text.substr(text.find('\n') + 1);
      const std::string prefix = "invalid argument '" + argument + "': ";
      throw InvalidArgument(argument, what.substr(std::min(prefix.size(), what.size())));
    }
    const std::string message = text + (all.size() > 1 ? " (on rank " + std::to_string(rank) + ")" : "");
    if (f[0] == 'S') throw StateError(message);
    throw Failure(message);
  }
}

[[noreturn]] void bad_metadata(const std::string& source, const std::string& what) {
  throw Failure("checkpoint metadata " + source + " is not valid: " + what);
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

// The stored layout is the truth about the files; these checks keep a damaged one from steering reads.
void check_layout(const ParamLayout& layout, const std::string& source) {
  for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
    const BufferLayout& buffer = layout.buffers[b];
    std::int64_t cursor = 0;
    for (const Bucket& bucket : buffer.buckets) {
      if (bucket.offset != cursor || bucket.numel <= 0 || bucket.numel % layout.dp_size != 0) {
        bad_metadata(source, "buffer " + std::to_string(b) + " has a bucket at offset " + std::to_string(bucket.offset) +
                                 " of " + std::to_string(bucket.numel) + " elements, which does not tile the buffer " +
                                 "in multiples of the dp size " + std::to_string(layout.dp_size));
      }
      cursor += bucket.numel;
    }
    if (cursor != buffer.numel) bad_metadata(source, "buffer " + std::to_string(b) + "'s buckets do not sum to its numel");
    for (const ParamSlot& p : buffer.params) {
      std::int64_t numel = 1;
      for (std::int64_t dim : p.shape) numel *= dim;
      const bool inside = p.bucket >= 0 && p.bucket < static_cast<int>(buffer.buckets.size()) &&
                          p.offset >= buffer.buckets[p.bucket].offset &&
                          p.offset + p.numel <= buffer.buckets[p.bucket].offset + buffer.buckets[p.bucket].numel;
      if (numel != p.numel || !inside) {
        bad_metadata(source, "parameter '" + p.name + "' does not fit its shape or its bucket");
      }
    }
  }
}

ParamLayout layout_from_json(const json& j, int dp_size, const std::string& source) {
  ParamLayout layout;
  layout.dp_size = dp_size;
  layout.options.alignment = j.at("alignment").get<std::int64_t>();
  layout.options.bucket_numel = j.at("bucket_numel").get<std::int64_t>();
  for (const json& b : j.at("buffers")) {
    BufferLayout buffer;
    buffer.dtype = dtype_from_safetensors(b.at("dtype").get<std::string>());
    buffer.numel = b.at("numel").get<std::int64_t>();
    for (const json& p : b.at("params")) {
      buffer.params.push_back({p.at("name").get<std::string>(), p.at("shape").get<std::vector<std::int64_t>>(),
                               p.at("offset").get<std::int64_t>(), p.at("numel").get<std::int64_t>(),
                               p.at("bucket").get<int>()});
    }
    for (const json& k : b.at("buckets")) {
      buffer.buckets.push_back({k.at("offset").get<std::int64_t>(), k.at("numel").get<std::int64_t>()});
    }
    layout.buffers.push_back(std::move(buffer));
  }
  check_layout(layout, source);
  return layout;
}

// What a rank's shard file must hold; the legacy per-parameter step tensors are tolerated.
void check_shard_header(const SafetensorsHeader& header, const fs::path& file, const ParamLayout& layout, int rank) {
  auto mismatch = [&](const std::string& what) {
    throw Failure("file " + file.string() + " does not match the checkpoint's metadata.json: " + what);
  };
  auto it = header.metadata.find("rank");
  if (it == header.metadata.end() || it->second != std::to_string(rank)) {
    mismatch("it should hold rank " + std::to_string(rank) + "'s shards but its header says rank '" +
             (it == header.metadata.end() ? std::string("(none)") : it->second) + "'");
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

}  // namespace

std::string checkpoint_dir_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
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
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  }
  json state = json::array();
  for (StateTensor tensor : kStateTensors) state.push_back(state_tensor_name(tensor));
  const json j = {
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
  return j.dump(2) + "\n";
}

CheckpointMetadata metadata_from_json(const std::string& text, const std::string& source) {
  CheckpointMetadata m;
  try {
    const json j = json::parse(text);
    if (j.at("format").get<std::string>() != kFormat) {
      bad_metadata(source, "its format is '" + j.at("format").get<std::string>() + "', not '" + kFormat + "'");
    }
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version != kCheckpointFormatVersion) {
      bad_metadata(source, "format version " + std::to_string(m.format_version) + " is not supported (this build reads " +
                               std::to_string(kCheckpointFormatVersion) + ")");
    }
    m.step = j.at("step").get<std::int64_t>();
    m.dp_size = j.at("dp_size").get<int>();
    if (m.step < 0 || m.dp_size < 1) bad_metadata(source, "step must be >= 0 and dp_size >= 1");
    const json& o = j.at("optimizer");
    m.config = {o.at("lr").get<double>(),  o.at("beta1").get<double>(),        o.at("beta2").get<double>(),
                o.at("eps").get<double>(), o.at("weight_decay").get<double>(), o.at("max_grad_norm").get<double>()};
    m.layout = layout_from_json(j.at("layout"), m.dp_size, source);
    for (const json& f : j.at("files")) {
      m.files.push_back({f.at("name").get<std::string>(), f.at("rank").get<int>(), f.at("bytes").get<std::uint64_t>(),
                         f.at("sha256").get<std::string>()});
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

fs::path resolve_checkpoint(const fs::path& path) {
  if (fs::exists(path / kMetadata)) return path;
  if (fs::exists(path / kLatest)) {
    std::string name = read_text_file(path / kLatest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.empty() || name.find('/') != std::string::npos) {
      throw Failure("file " + (path / kLatest).string() + " does not name a checkpoint directory");
    }
    return path / name;
  }
  throw Failure("no checkpoint at " + path.string() + ": it holds neither " + kMetadata + " nor " + kLatest);
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

  collectively(group, [&] {
    if (rank != 0) return;
    if (fs::exists(final_dir)) throw Failure("checkpoint " + final_dir.string() + " already exists; nothing is overwritten");
    fs::create_directories(root);
    fs::remove_all(temp_dir);  // left by a save that was killed
    fs::create_directory(temp_dir);
  });

  std::string file_record;
  collectively(group, [&] {
    std::vector<std::vector<float>> host;  // [buffer * 3 + tensor]
    std::vector<TensorToWrite> tensors;
    for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
      for (StateTensor tensor : kStateTensors) {
        const TensorView local = optimizer.local_state(tensor, static_cast<int>(b));
        host.emplace_back(local.numel());
        copy_to_host(host.back().data(), local.data, local.nbytes(), local.device, optimizer.stream());
      }
    }
    for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
      const BufferLayout& buffer = layout.buffers[b];
      for (std::size_t k = 0; k < buffer.buckets.size(); ++k) {
        for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
          tensors.push_back({shard_tensor_name(kStateTensors[t], static_cast<int>(b), static_cast<int>(k)), DType::f32,
                             {layout.shard_numel(buffer.buckets[k])},
                             host[b * 3 + t].data() + layout.local_offset(buffer.buckets[k])});
        }
      }
    }
    const fs::path file = temp_dir / shard_file_name(rank, dp_size);
    const std::string sha = write_safetensors(
        file, tensors,
        {{"format", kFormat}, {"rank", std::to_string(rank)}, {"dp_size", std::to_string(dp_size)},
         {"step", std::to_string(optimizer.step_count())}},
        [&](std::size_t written) {
          if (written == 1) reached(SaveStage::shard_partly_written);
        });
    file_record = sha + " " + std::to_string(fs::file_size(file));
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
    const std::string text = metadata_to_json(metadata);
    File file = File::create_new(temp_dir / kMetadata);
    file.write_all(text.data(), text.size());
    file.sync();
    reached(SaveStage::metadata_written);
    sync_directory(temp_dir);
    rename_no_replace(temp_dir, final_dir);
    sync_directory(root);
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
  CheckpointMetadata metadata;
  std::vector<std::vector<float>> host;  // [buffer * 3 + tensor], this rank's shards
  for (const BufferLayout& buffer : layout.buffers) {
    for (std::size_t t = 0; t < std::size(kStateTensors); ++t) host.emplace_back(layout.local_numel(buffer), 0.0f);
  }

  collectively(group, [&] {
    const fs::path dir = resolve_checkpoint(path);
    metadata = metadata_from_json(read_text_file(dir / kMetadata), (dir / kMetadata).string());
    std::vector<ShardCopy> plan;
    try {
      plan = plan_reshard(metadata.layout, layout, rank);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("checkpoint", std::string(e.what()) + " (checkpoint " + dir.string() + ")");
    }
    for (int f = rank; f < metadata.dp_size && options.verify_checksums; f += group.size()) {
      const fs::path file = dir / metadata.files[f].name;
      check_file_size(File::open_read(file), metadata.files[f]);
      const std::string sha = sha256_file(file);
      if (sha != metadata.files[f].sha256) {
        throw Failure("file " + file.string() + " is corrupted: its SHA-256 is " + sha + " but metadata.json records " +
                      metadata.files[f].sha256);
      }
    }
    std::set<int> sources;
    for (const ShardCopy& copy : plan) sources.insert(copy.source_rank);
    for (int source : sources) {
      const fs::path path_of_file = dir / metadata.files[source].name;
      const File file = File::open_read(path_of_file);
      check_file_size(file, metadata.files[source]);
      const SafetensorsHeader header = read_safetensors_header(path_of_file);
      check_shard_header(header, path_of_file, metadata.layout, source);
      for (const ShardCopy& copy : plan) {
        if (copy.source_rank != source) continue;
        const std::int64_t target = layout.local_offset(layout.buffers[copy.buffer].buckets[copy.target_bucket]) +
                                    copy.target_offset;
        for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
          const SafetensorsEntry* entry = header.find(shard_tensor_name(kStateTensors[t], copy.buffer, copy.source_bucket));
          file.read_exact(host[copy.buffer * 3 + t].data() + target, copy.numel * sizeof(float),
                          header.data_start + entry->begin + copy.source_offset * sizeof(float));
        }
      }
    }
  });

  for (std::size_t b = 0; b < layout.buffers.size(); ++b) {
    for (std::size_t t = 0; t < std::size(kStateTensors); ++t) {
      const TensorView local = optimizer.local_state(kStateTensors[t], static_cast<int>(b));
      copy_from_host(local.data, local.device, host[b * 3 + t].data(), local.nbytes(), optimizer.stream());
    }
  }
  optimizer.restore_step(metadata.step);
  optimizer.set_config(metadata.config);
  optimizer.sync_params_from_main();
}

}  // namespace deltatrain::optim
