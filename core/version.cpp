#include "deltatrain/core/version.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <iterator>

#include "deltatrain/core/error.h"

namespace deltatrain {

std::strong_ordering Version::operator<=>(const Version& other) const {
  if (auto c = major <=> other.major; c != 0) return c;
  if (auto c = minor <=> other.minor; c != 0) return c;
  return patch <=> other.patch;
}

bool Version::operator==(const Version& other) const { return (*this <=> other) == 0; }

std::string Version::str() const {
  std::string text = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  if (!prerelease.empty()) text += prerelease;
  if (!local.empty()) text += "+" + local;
  return text;
}

namespace {

bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }
bool is_alnum(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }
bool is_alpha(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; }

// PEP 440 and semantic-versioning labels, as CUDA, compilers and Python packages spell them.
constexpr std::string_view kReleaseLabels[] = {"a", "b", "c", "rc", "alpha", "beta", "pre", "preview", "dev", "post"};

}  // namespace

Version parse_version(std::string_view text, std::string_view what) {
  const std::string quoted = "'" + std::string(text) + "'";
  auto fail = [&](const std::string& why) -> InvalidArgument {
    return InvalidArgument(std::string(what),
                           quoted + " is not a version (" + why +
                               "); expected MAJOR[.MINOR[.PATCH[.BUILD]]][pre-release][+local], e.g. 12.8, "
                               "12.8rc1, 2.9.0+cu128");
  };

  std::string_view rest = text;
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) rest.remove_prefix(1);
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.back()))) rest.remove_suffix(1);
  if (rest.empty()) throw fail("empty");
  if (rest.front() == 'v' || rest.front() == 'V') rest.remove_prefix(1);

  // Release numbers: up to four dot-separated integers; the fourth (a build number) is read and dropped.
  int numbers[4] = {0, 0, 0, 0};
  int count = 0;
  while (true) {
    if (rest.empty() || !is_digit(rest.front())) {
      throw fail(count == 0 ? "it does not start with a number" : "a '.' is not followed by a number");
    }
    const char* begin = rest.data();
    const char* end = begin;
    while (end != rest.data() + rest.size() && is_digit(*end)) ++end;
    if (count == 4) throw fail("more than four release numbers");
    auto [ptr, ec] = std::from_chars(begin, end, numbers[count]);
    if (ec != std::errc()) throw fail("a release number is out of range");
    ++count;
    rest.remove_prefix(static_cast<std::size_t>(end - begin));
    if (rest.size() >= 2 && rest.front() == '.' && is_digit(rest[1])) {
      rest.remove_prefix(1);
      continue;
    }
    break;
  }

  Version version{numbers[0], numbers[1], numbers[2], {}, {}};
  std::string_view prerelease = rest.substr(0, rest.find('+'));
  rest.remove_prefix(prerelease.size());
  if (!prerelease.empty()) {
    // "rc1", "a0", ".dev3", "-beta.2": a separator, then letters and digits (and dots between them).
    std::string_view body = prerelease;
    if (body.front() == '.' || body.front() == '-' || body.front() == '_') body.remove_prefix(1);
    // The label must be one of the pre-/post-release words, so that "1.2.x" is not read as 1.2 label "x".
    const std::string_view label = body.substr(0, std::find_if_not(body.begin(), body.end(), is_alpha) - body.begin());
    if (std::find(std::begin(kReleaseLabels), std::end(kReleaseLabels), label) == std::end(kReleaseLabels)) {
      throw fail("unexpected '" + std::string(prerelease) + "' after the release numbers");
    }
    for (char c : body) {
      if (!is_alnum(c) && c != '.' && c != '-') throw fail("bad character in '" + std::string(prerelease) + "'");
    }
    version.prerelease = std::string(prerelease);
  }
  if (!rest.empty()) {  // "+local"
    std::string_view local = rest.substr(1);
    if (local.empty()) throw fail("empty local part after '+'");
    for (char c : local) {
      if (!is_alnum(c) && c != '.' && c != '-' && c != '_') throw fail("bad character in local part");
    }
    version.local = std::string(local);
  }
  return version;
}

Version version_from_cuda_int(int encoded) {
  if (encoded <= 0) throw InvalidArgument("CUDA version", "encoded value must be positive, got " + std::to_string(encoded));
  return Version{encoded / 1000, (encoded % 1000) / 10, 0, {}, {}};
}

}  // namespace deltatrain
