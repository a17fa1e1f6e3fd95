#include "deltatrain/model/hf_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <system_error>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/device_memory.h"  // the device side of a streamed save
#include "deltatrain/optim/safetensors.h"
#include "optim/file_io.h"

namespace deltatrain::model {

namespace {

namespace fs = std::filesystem;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
// Bytes of a tensor read (and converted) at a time.
constexpr std::size_t kReadChunk = std::size_t{16} << 20;

// HF's multimodal Qwen3.5 (Qwen3_5ForConditionalGeneration) keeps the text model under this prefix.
constexpr std::string_view kLanguageModelPrefix = "model.language_model.";
// Tensors of such checkpoints that are not part of the text model: the vision tower, the multi-token
// prediction head.
constexpr std::string_view kSkippedPrefixes[] = {"model.visual.", "mtp."};

// --- element conversion --------------------------------------------------------------------------------

struct Bf16 {
  std::uint16_t bits;
};
inline double to_double(float v) { return v; }
inline double to_double(double v) { return v; }
inline double to_double(_Float16 v) { return static_cast<double>(v); }
inline double to_double(Bf16 v) { return bf16_to_float(v.bits); }
inline void from_double(double x, float& out) { out = static_cast<float>(x); }
inline void from_double(double x, double& out) { out = x; }
inline void from_double(double x, _Float16& out) { out = static_cast<_Float16>(x); }
// Through float: a float64 value is rounded twice (to float32, then to bf16 with round-to-nearest-even).
inline void from_double(double x, Bf16& out) { out.bits = float_to_bf16(static_cast<float>(x)); }

template <class Visit>
void visit_float_type(DType dtype, Visit&& visit) {
  switch (dtype) {
    case DType::f16:
      return visit(_Float16{});
    case DType::bf16:
      return visit(Bf16{});
    case DType::f32:
      return visit(float{});
    case DType::f64:
      return visit(double{});
    default:
      throw InvalidArgument("dtype", std::string("must be f16, bf16, f32 or f64; got ") + dtype_name(dtype));
  }
}

// n elements from `src` (src_dtype) to `dst` (dst_dtype), both floating-point.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, n * dtype_size(src_dtype));
    return;
  }
  visit_float_type(src_dtype, [&](auto s) {
    visit_float_type(dst_dtype, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      const S* in = static_cast<const S*>(src);
      D* out = static_cast<D*>(dst);
      for (std::size_t i = 0; i < n; ++i) from_double(to_double(in[i]), out[i]);
    });
  });
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32 || dtype == DType::f64;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// A parameter's view, as `role` ("source" or "destination") of a copy: host memory, contiguous, the shape
// the config gives, and a dtype that role can take.
void check_view(const TensorView& view, const ParamInfo& info, bool destination) {
  auto fail = [&](const std::string& rule) {
    throw InvalidArgument(info.name, std::string(destination ? "the destination" : "the source") + " view " + rule);
  };
  if (destination && view.device.type != DeviceType::cpu) {
    fail("must be in host memory; it is on " + device_name(view.device));
  }
  std::vector<std::int64_t> shape(view.shape.begin(),
                                  view.shape.begin() + std::clamp(view.ndim, 0, TensorView::kMaxDims));
  if (shape != info.shape) fail("has shape " + shape_string(shape) + "; the config needs " + shape_string(info.shape));
  const bool dtype_ok = destination
                            ? (view.dtype == DType::f32 || view.dtype == DType::f64 || view.dtype == DType::bf16)
                            : is_float_dtype(view.dtype);
  if (!dtype_ok) {
    fail(std::string("has dtype ") + dtype_name(view.dtype) + "; it must be " +
         (destination ? "f32, f64 or bf16" : "f16, bf16, f32 or f64"));
  }
  if (!view.is_contiguous()) fail("must be contiguous");
  if (view.data == nullptr && view.numel() > 0) fail("has no data");
}

[[noreturn]] void fail_fs(const std::string& what, const fs::path& path, const std::error_code& error) {
  throw Failure(what + " " + path.string() + " failed: " + error.message());
}

// --- reading --------------------------------------------------------------------------------------------

// A tensor of the checkpoint: where it is and what the file calls it.
struct Found {
  std::size_t file = 0;   // index into the files
  std::size_t entry = 0;  // index into that file's header
  std::string file_name;  // as the file spells it
};

// The model's name for a tensor the file calls `name`; nullopt for tensors that are not the text model's.
std::optional<std::string> model_name(const std::string& name) {
  for (std::string_view skipped : kSkippedPrefixes) {
    if (name.starts_with(skipped)) return std::nullopt;
  }
  if (name.starts_with(kLanguageModelPrefix)) return "model." + name.substr(kLanguageModelPrefix.size());
  return name;
}

// The files of the checkpoint in `dir`, and for sharded checkpoints the weight map (tensor -> file).
struct Files {
  std::vector<fs::path> paths;
  std::optional<std::map<std::string, std::string>> weight_map;
  fs::path index;
};

Files find_files(const fs::path& dir) {
  Files files;
  std::error_code error;
  if (fs::is_regular_file(dir, error)) {  // a model.safetensors given directly
    files.paths.push_back(dir);
    return files;
  }
  files.index = dir / kIndexFile;
  if (fs::exists(files.index, error)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(optim::read_text_file(files.index));
    } catch (const nlohmann::json::exception& e) {
      throw Failure("file " + files.index.string() + " is not valid JSON: " + e.what());
    }
    const auto map = index.is_object() ? index.find("weight_map") : index.end();
    if (map == index.end() || !map->is_object()) {
      throw Failure("file " + files.index.string() + " has no \"weight_map\" object (tensor name -> file)");
    }
    files.weight_map.emplace();
    std::set<std::string> shards;
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          fs::path(file.get<std::string>()).filename() != fs::path(file.get<std::string>())) {
        throw Failure("file " + files.index.string() + " maps tensor '" + name + "' to " + file.dump() +
                      ", which is not a file name in its directory");
      }
      (*files.weight_map)[name] = file.get<std::string>();
      if (shards.insert(file.get<std::string>()).second) files.paths.push_back(dir / file.get<std::string>());
    }
    return files;
  }
  if (fs::exists(dir / kWeightsFile, error)) {
    files.paths.push_back(dir / kWeightsFile);
    return files;
  }
  throw InvalidArgument("dir", "'" + dir.string() + "' holds neither " + kWeightsFile + " nor " + kIndexFile);
}

// Streams tensor `entry` of `file` in chunks of whole elements: visit(bytes, elements, first element).
template <class Visit>
void stream_tensor(const optim::File& file, const optim::SafetensorsHeader& header,
                   const optim::SafetensorsEntry& entry, std::vector<std::byte>& buffer, Visit&& visit) {
  const std::size_t element = dtype_size(entry.dtype);
  const std::size_t per_chunk = std::max<std::size_t>(1, kReadChunk / element);
  const std::size_t total = (entry.end - entry.begin) / element;
  buffer.resize(std::min(total, per_chunk) * element);
  for (std::size_t first = 0; first < total; first += per_chunk) {
    const std::size_t count = std::min(per_chunk, total - first);
    file.read_exact(buffer.data(), count * element, header.data_start + entry.begin + first * element);
    visit(buffer.data(), count, first);
  }
}

}  // namespace

void save_hf_model(const fs::path& dir, const Config& config, const TensorLookup& params, DType file_dtype) {
  const std::vector<ParamInfo> infos = param_infos(config);
  if (file_dtype != DType::f32 && file_dtype != DType::bf16) {
    throw InvalidArgument("file_dtype", std::string("must be f32 or bf16; got ") + dtype_name(file_dtype));
  }
  fs::path target = dir.lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  if (target.empty()) throw InvalidArgument("dir", "must name a directory to create; got '" + dir.string() + "'");
  std::error_code error;
  if (fs::exists(target, error)) {
    throw Failure("model directory " + target.string() + " already exists; nothing is overwritten");
  }

  // Every view is checked before anything is written.
  std::vector<TensorView> views;
  for (const ParamInfo& info : infos) {
    views.push_back(params(info.name));
    check_view(views.back(), info, /*destination=*/false);
  }
  std::vector<std::vector<std::byte>> converted;
  std::vector<optim::TensorToWrite> tensors;
  converted.reserve(infos.size());
  for (std::size_t i = 0; i < infos.size(); ++i) {
    const TensorView& view = views[i];
    if (view.device.type != DeviceType::cpu) {
      // Streamed by the writer from the device, chunk by chunk: no host copy of the model is made.
      if (view.dtype != file_dtype) {
        throw InvalidArgument(infos[i].name, std::string("the source view on ") + device_name(view.device) +
                                                 " has dtype " + dtype_name(view.dtype) +
                                                 "; a device view must already be in the file's dtype (" +
                                                 dtype_name(file_dtype) + ")");
      }
      tensors.push_back({infos[i].name, file_dtype, infos[i].shape, nullptr,
                         [view](std::uint64_t offset, std::size_t bytes, void* staging) {
                           copy_bytes(staging, static_cast<const std::byte*>(view.data) + offset, bytes,
                                        view.device, nullptr);
                           synchronize(view.device, nullptr);
                         }});
      continue;
    }
    const void* data = views[i].data;
    if (views[i].dtype != file_dtype) {
      converted.emplace_back(static_cast<std::size_t>(infos[i].numel()) * dtype_size(file_dtype));
      convert(views[i].data, views[i].dtype, converted.back().data(), file_dtype,
              static_cast<std::size_t>(infos[i].numel()));
      data = converted.back().data();
    }
    tensors.push_back({infos[i].name, file_dtype, infos[i].shape, data});
  }

  const fs::path parent = target.parent_path();
  const fs::path temporary = parent / (".tmp-" + target.filename().string());
  if (!parent.empty()) {
    fs::create_directories(parent, error);
    if (error) fail_fs("create directory", parent, error);
  }
  fs::remove_all(temporary, error);  // left by a save that was killed
  if (error) fail_fs("remove", temporary, error);
  try {
    if (!fs::create_directory(temporary, error) || error) fail_fs("create directory", temporary, error);
    optim::write_new_file(temporary / kConfigFile, config_to_hf_json(config));
    // "format": "pt" is what transformers expects of a safetensors file's metadata. No digest: none is recorded.
    optim::write_safetensors(temporary / kWeightsFile, tensors, {{"format", "pt"}},
                             {.digest_piece_bytes = std::nullopt});
    optim::sync_directory(temporary);
    optim::rename_no_replace(temporary, target);
    optim::sync_directory(parent);
  } catch (...) {
    fs::remove_all(temporary, error);
    throw;
  }
}

void load_hf_weights(const fs::path& dir, const Config& config, const TensorLookup& params) {
  const std::vector<ParamInfo> infos = param_infos(config);
  const Files files = find_files(dir);

  std::vector<optim::SafetensorsHeader> headers;
  std::map<std::string, Found> found;  // by the model's name
  for (std::size_t f = 0; f < files.paths.size(); ++f) {
    headers.push_back(optim::read_safetensors_header(files.paths[f]));
    const std::string file_name = files.paths[f].filename().string();
    for (std::size_t e = 0; e < headers[f].tensors.size(); ++e) {
      const std::string& name = headers[f].tensors[e].name;
      if (files.weight_map) {
        const auto it = files.weight_map->find(name);
        if (it == files.weight_map->end() || it->second != file_name) {
          throw Failure("file " + files.paths[f].string() + " holds tensor '" + name + "', but " +
                        files.index.string() + " " +
                        (it == files.weight_map->end() ? "does not list it" : "places it in " + it->second));
        }
      }
      const std::optional<std::string> mapped = model_name(name);
      if (!mapped) continue;
      const auto [it, fresh] = found.try_emplace(*mapped, Found{f, e, name});
      if (!fresh) {
        throw InvalidArgument(name, "in " + files.paths[f].string() + " is the model's '" + *mapped +
                                        "', which the checkpoint already holds as '" + it->second.file_name + "' in " +
                                        files.paths[it->second.file].string());
      }
    }
  }
  if (files.weight_map) {
    for (const auto& [name, file] : *files.weight_map) {
      const std::size_t f =
          static_cast<std::size_t>(std::find(files.paths.begin(), files.paths.end(), dir / file) - files.paths.begin());
      if (headers[f].find(name) == nullptr) {
        throw Failure("file " + files.index.string() + " places tensor '" + name + "' in " + file +
                      ", which does not hold it");
      }
    }
  }
  auto where = [&](const Found& source) { return files.paths[source.file].string(); };
  auto entry_of = [&](const Found& source) -> const optim::SafetensorsEntry& {
    return headers[source.file].tensors[source.entry];
  };
  auto check_entry = [&](const Found& source, const std::vector<std::int64_t>& shape) {
    const optim::SafetensorsEntry& entry = entry_of(source);
    if (!is_float_dtype(entry.dtype)) {
      throw InvalidArgument(source.file_name, "in " + where(source) + " has dtype " +
                                                  optim::safetensors_dtype(entry.dtype) +
                                                  "; only F32, BF16, F16 and F64 tensors load");
    }
    if (entry.shape != shape) {
      throw InvalidArgument(source.file_name, "in " + where(source) + " has shape " + shape_string(entry.shape) +
                                                  "; the config needs " + shape_string(shape));
    }
  };

  // Everything is checked before anything is written.
  std::vector<const Found*> sources;
  std::vector<TensorView> views;
  std::set<std::string> expected;
  for (const ParamInfo& info : infos) {
    const auto it = found.find(info.name);
    if (it == found.end()) {
      std::string list;
      for (const fs::path& path : files.paths) list += (list.empty() ? "" : ", ") + path.string();
      throw InvalidArgument(info.name, "is missing from the checkpoint (" + list + ")");
    }
    check_entry(it->second, info.shape);
    sources.push_back(&it->second);
    views.push_back(params(info.name));
    check_view(views.back(), info, /*destination=*/true);
    expected.insert(info.name);
  }
  const Found* tied_head = nullptr;
  for (const auto& [name, source] : found) {
    if (expected.count(name)) continue;
    if (name == "lm_head.weight" && config.tie_word_embeddings) {
      check_entry(source, infos.front().shape);  // the embedding's
      tied_head = &source;
      continue;
    }
    throw InvalidArgument(source.file_name, "in " + where(source) + " is not a parameter of this model");
  }

  std::vector<std::optional<optim::File>> open(files.paths.size());
  auto file_of = [&](const Found& source) -> const optim::File& {
    if (!open[source.file]) open[source.file].emplace(optim::File::open_read(files.paths[source.file]));
    return *open[source.file];
  };
  std::vector<std::byte> buffer;
  if (tied_head != nullptr) {  // an lm_head.weight beside a tied embedding must be that embedding
    const Found& embedding = *sources.front();
    const optim::SafetensorsEntry& head_entry = entry_of(*tied_head);
    std::vector<double> head_values, embedding_values;
    std::vector<std::byte> other;
    stream_tensor(
        file_of(*tied_head), headers[tied_head->file], head_entry, buffer,
        [&](const std::byte* bytes, std::size_t count, std::size_t first) {
          head_values.resize(count);
          convert(bytes, head_entry.dtype, head_values.data(), DType::f64, count);
          const optim::SafetensorsEntry& e = entry_of(embedding);
          other.resize(count * dtype_size(e.dtype));
          file_of(embedding).read_exact(other.data(), other.size(),
                                        headers[embedding.file].data_start + e.begin + first * dtype_size(e.dtype));
          embedding_values.resize(count);
          convert(other.data(), e.dtype, embedding_values.data(), DType::f64, count);
          for (std::size_t i = 0; i < count; ++i) {
            if (head_values[i] != embedding_values[i]) {
              throw InvalidArgument(tied_head->file_name, "in " + where(*tied_head) +
                                                              " differs from the embedding (element " +
                                                              std::to_string(first + i) +
                                                              "), but the config ties them (tie_word_embeddings true)");
            }
          }
        });
  }

  for (std::size_t i = 0; i < infos.size(); ++i) {
    const Found& source = *sources[i];
    const optim::SafetensorsEntry& entry = entry_of(source);
    const TensorView& view = views[i];
    const std::size_t out_element = dtype_size(view.dtype);
    if (entry.dtype == view.dtype) {  // straight into the destination
      file_of(source).read_exact(view.data, view.nbytes(), headers[source.file].data_start + entry.begin);
      continue;
    }
    stream_tensor(file_of(source), headers[source.file], entry, buffer,
                  [&](const std::byte* bytes, std::size_t count, std::size_t first) {
                    convert(bytes, entry.dtype, static_cast<std::byte*>(view.data) + first * out_element, view.dtype,
                            count);
                  });
  }
}

}  // namespace deltatrain::model
