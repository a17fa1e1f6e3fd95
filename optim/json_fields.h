// Strict readers of a JSON file's fields (a checkpoint's metadata.json, a trainer's trainer.json): the wrong JSON
// type, a value out of range or a key the format does not have is a Failure "<file> is not valid: <where><key>
// ...", where nlohmann's get<> would truncate a step of 1.5 to 1 or wrap 2^40 into an int. `file` names the
// file as its reader's messages do ("checkpoint metadata /ckpt/step-00000002/metadata.json"); `where` is the
// path of the object inside it ("layout.buffers[0].", "" at the top).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace deltatrain::optim {

[[noreturn]] void invalid_json_file(const std::string& file, const std::string& what);

const nlohmann::json& field(const nlohmann::json& object, const std::string& key, const std::string& where,
                            const std::string& file);
std::int64_t integer_field(const nlohmann::json& object, const std::string& key, std::int64_t min, std::int64_t max,
                           const std::string& where, const std::string& file);
double number_field(const nlohmann::json& object, const std::string& key, const std::string& where,
                    const std::string& file);
std::string string_field(const nlohmann::json& object, const std::string& key, const std::string& where,
                         const std::string& file);
const nlohmann::json& array_field(const nlohmann::json& object, const std::string& key, const std::string& where,
                                  const std::string& file);
// Refuses a key of `object` outside `known`: a misspelt or foreign field is not silently ignored.
void only_known_fields(const nlohmann::json& object, std::initializer_list<std::string_view> known,
                       const std::string& where, const std::string& file);

}  // namespace deltatrain::optim
