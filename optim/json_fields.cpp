#include "json_fields.h"

#include <algorithm>

#include "deltatrain/core/error.h"

namespace deltatrain::optim {

using nlohmann::json;

void invalid_json_file(const std::string& file, const std::string& what) {
  throw Failure(file + " is not valid: " + what);
}

const json& field(const json& object, const std::string& key, const std::string& where, const std::string& file) {
  if (!object.is_object() || !object.contains(key)) invalid_json_file(file, where + key + " is missing");
  return object.at(key);
}

std::int64_t integer_field(const json& object, const std::string& key, std::int64_t min, std::int64_t max,
                           const std::string& where, const std::string& file) {
  const json& value = field(object, key, where, file);
  const bool in_range = value.is_number_unsigned()  ? value.get<std::uint64_t>() <= static_cast<std::uint64_t>(max) &&
                                                         static_cast<std::int64_t>(value.get<std::uint64_t>()) >= min
                        : value.is_number_integer() ? value.get<std::int64_t>() >= min && value.get<std::int64_t>() <= max
                                                    : false;
  if (!in_range) {
    invalid_json_file(file, where + key + " must be an integer in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "], got " + value.dump());
  }
  return value.get<std::int64_t>();
}

double number_field(const json& object, const std::string& key, const std::string& where, const std::string& file) {
  const json& value = field(object, key, where, file);
  if (!value.is_number()) invalid_json_file(file, where + key + " must be a number, got " + value.dump());
  return value.get<double>();
}

std::string string_field(const json& object, const std::string& key, const std::string& where,
                         const std::string& file) {
  const json& value = field(object, key, where, file);
  if (!value.is_string()) invalid_json_file(file, where + key + " must be a string, got " + value.dump());
  return value.get<std::string>();
}

const json& array_field(const json& object, const std::string& key, const std::string& where,
                        const std::string& file) {
  const json& value = field(object, key, where, file);
  if (!value.is_array()) invalid_json_file(file, where + key + " must be an array, got " + value.dump());
  return value;
}

void only_known_fields(const json& object, std::initializer_list<std::string_view> known, const std::string& where,
                       const std::string& file) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      invalid_json_file(file, where + key + " is not a field of this file");
    }
  }
}

}  // namespace deltatrain::optim
