// Version strings from drivers, runtimes and libraries come in many spellings:
// "12.8", "12.8rc1", "2.8a0", "2.9.0+cu128", "13.0.88", "v1.2-beta". parse_version reads them all;
// anything else is an InvalidArgument that quotes the text, never an exception from deep inside.
#pragma once

#include <compare>
#include <string>
#include <string_view>

namespace deltatrain {

struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;
  std::string prerelease;  // "rc1", "a0", "dev3": kept for display, ignored by comparisons
  std::string local;       // after '+': "cu128", "git1234"

  // Compares the release numbers only: a 12.8 release candidate satisfies "needs 12.8".
  std::strong_ordering operator<=>(const Version& other) const;
  bool operator==(const Version& other) const;
  std::string str() const;
};

// `what` names the source in the error message ("torch version", "CUDA runtime version").
Version parse_version(std::string_view text, std::string_view what = "version");

// CUDA encodes versions as 1000*major + 10*minor (12080 is 12.8).
Version version_from_cuda_int(int encoded);

}  // namespace deltatrain
