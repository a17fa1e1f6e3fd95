// parse_version reads the spellings that drivers, runtimes and Python packages use, compares release
// numbers only, and rejects garbage with an InvalidArgument that quotes the text.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/core/version.h"

namespace deltatrain {
namespace {

struct Spelling {
  const char* text;
  int major, minor, patch;
  const char* prerelease;
  const char* local;
};

TEST(Version, ParsesTheSpellingsInTheWild) {
  const Spelling spellings[] = {
      {"12.8", 12, 8, 0, "", ""},
      {"12.8rc1", 12, 8, 0, "rc1", ""},
      {"2.8a0", 2, 8, 0, "a0", ""},
      {"2.9.0+cu128", 2, 9, 0, "", "cu128"},
      {"13.0.88", 13, 0, 88, "", ""},
      {"v1.2", 1, 2, 0, "", ""},
      {"2.8.0a0+gitabc123", 2, 8, 0, "a0", "gitabc123"},
      {"7", 7, 0, 0, "", ""},
      {"1.2.3.4", 1, 2, 3, "", ""},
      {"v1.2-beta", 1, 2, 0, "-beta", ""},
      {"1.2.dev3", 1, 2, 0, ".dev3", ""},
      {" 12.4 \n", 12, 4, 0, "", ""},
  };
  for (const Spelling& s : spellings) {
    SCOPED_TRACE(std::string("text '") + s.text + "'");
    const Version v = parse_version(s.text);
    EXPECT_EQ(v.major, s.major);
    EXPECT_EQ(v.minor, s.minor);
    EXPECT_EQ(v.patch, s.patch);
    EXPECT_EQ(v.prerelease, s.prerelease);
    EXPECT_EQ(v.local, s.local);
  }
}

TEST(Version, ComparesReleaseNumbersNumerically) {
  EXPECT_LT(parse_version("12.8"), parse_version("12.10"));  // not a string comparison
  EXPECT_LT(parse_version("2.8a0"), parse_version("2.9.0+cu128"));
  EXPECT_GT(parse_version("13.0.88"), parse_version("12.9"));
  EXPECT_LT(parse_version("12.8"), parse_version("12.8.1"));
  // A release candidate of 12.8 satisfies "needs 12.8": prerelease and local parts do not order.
  EXPECT_EQ(parse_version("12.8rc1"), parse_version("12.8"));
  EXPECT_GE(parse_version("12.8rc1"), parse_version("12.8"));
  EXPECT_EQ(parse_version("2.9.0+cu128"), parse_version("2.9"));
}

TEST(Version, RandomReleaseNumbersRoundTripAndOrderLikeTuples) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> number(0, 200);
  for (int trial = 0; trial < 200; ++trial) {
    const int a[3] = {number(rng), number(rng), number(rng)};
    const int b[3] = {number(rng), number(rng) % 3, number(rng)};
    const auto text = [](const int* n) {
      return std::to_string(n[0]) + "." + std::to_string(n[1]) + "." + std::to_string(n[2]);
    };
    const Version va = parse_version(text(a) + "rc2"), vb = parse_version(text(b) + "+cu" + std::to_string(b[0]));
    EXPECT_EQ(va.str(), text(a) + "rc2");
    EXPECT_EQ(va <=> vb, std::tie(a[0], a[1], a[2]) <=> std::tie(b[0], b[1], b[2]));
  }
}

TEST(Version, GarbageIsAnInvalidArgumentQuotingTheText) {
  for (const char* text : {"", "abc", "1..2", "1.2.x", "+cu1", "1.2+", "12.8 rc1", "1.2.3.4.5", "99999999999.1"}) {
    SCOPED_TRACE(std::string("text '") + text + "'");
    try {
      parse_version(text, "CUDA runtime version");
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "CUDA runtime version");
      EXPECT_NE(std::string(e.what()).find(std::string("'") + text + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(Version, DecodesCudaIntegers) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    const int major = std::uniform_int_distribution<int>(9, 20)(rng);
    const int minor = std::uniform_int_distribution<int>(0, 9)(rng);
    const Version v = version_from_cuda_int(1000 * major + 10 * minor);
    EXPECT_EQ(v, parse_version(std::to_string(major) + "." + std::to_string(minor)));
  }
  EXPECT_THROW(version_from_cuda_int(0), InvalidArgument);
  EXPECT_THROW(version_from_cuda_int(-12080), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain
