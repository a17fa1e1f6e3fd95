#include "deltatrain/rl/tasks.h"

#include <algorithm>
#include <set>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/rollout/sampling.h"

namespace deltatrain::rl {
namespace {

constexpr std::string_view kCharacters = "0123456789+=>abcdefghijklmnopqrstuvwxyz";

// Which problems are held out: a fixed hash of the problem's key, one in eight, the same for every seed.
bool held_out(std::uint64_t key) { return rollout::uniform(0x5eedc0de, key, 0) < 0.125; }

// Uniform integer in [0, n) from the counter-based draw.
std::uint64_t draw(std::uint64_t seed, std::uint64_t index, std::uint64_t which, std::uint64_t n) {
  return std::min<std::uint64_t>(n - 1, static_cast<std::uint64_t>(rollout::uniform(seed, index, which) * double(n)));
}

// Draws keyed by (seed, index, attempt) until a problem is not held out: the stream stays a pure function of
// (seed, index), and about one draw in eight is redrawn.
template <class Make>
Problem first_not_held_out(std::uint64_t seed, std::uint64_t index, const Make& make) {
  for (std::uint64_t attempt = 0;; ++attempt) {
    std::uint64_t key = 0;
    Problem problem = make(seed, index * 64 + attempt, key);
    if (!held_out(key)) return problem;
  }
}

// "a+b=" with a, b in [0, 100).
class Arithmetic final : public Task {
 public:
  static constexpr std::uint64_t kRange = 100;
  std::string name() const override { return "arithmetic"; }

  Problem train_problem(std::uint64_t seed, std::uint64_t index) const override {
    return first_not_held_out(seed, index, [](std::uint64_t s, std::uint64_t i, std::uint64_t& key) {
      const std::uint64_t a = draw(s, i, 0, kRange), b = draw(s, i, 1, kRange);
      key = a * kRange + b;
      return make(a, b);
    });
  }

  std::vector<Problem> eval_problems(std::int64_t count) const override {
    std::vector<Problem> all;
    // A fixed order that mixes small and large operands: the key's hash order.
    std::vector<std::pair<double, std::uint64_t>> keys;
    for (std::uint64_t key = 0; key < kRange * kRange; ++key) {
      if (held_out(key)) keys.push_back({rollout::uniform(0xe7a1, key, 1), key});
    }
    std::sort(keys.begin(), keys.end());
    if (count < 0 || count > static_cast<std::int64_t>(keys.size())) {
      throw InvalidArgument("eval-prompts", "must be in [0, " + std::to_string(keys.size()) + "] for arithmetic, got " +
                                                std::to_string(count));
    }
    for (std::int64_t i = 0; i < count; ++i) all.push_back(make(keys[i].second / kRange, keys[i].second % kRange));
    return all;
  }

  double reward(const Problem& problem, std::string_view completion) const override {
    return completion == problem.answer ? 1.0 : 0.0;
  }
  std::int64_t max_prompt_length() const override { return 6; }  // "99+99="
  std::int64_t max_answer_length() const override { return 3; }  // "198"

 private:
  static Problem make(std::uint64_t a, std::uint64_t b) {
    return {std::to_string(a) + "+" + std::to_string(b) + "=", std::to_string(a + b)};
  }
};

// "word>" -> the word reversed; words of 3 to 8 letters.
class Reverse final : public Task {
 public:
  static constexpr std::uint64_t kMinLength = 3, kMaxLength = 8, kLetters = 26;
  std::string name() const override { return "reverse"; }

  Problem train_problem(std::uint64_t seed, std::uint64_t index) const override {
    return first_not_held_out(seed, index, [](std::uint64_t s, std::uint64_t i, std::uint64_t& key) {
      const std::uint64_t length = kMinLength + draw(s, i, 0, kMaxLength - kMinLength + 1);
      std::string word;
      for (std::uint64_t c = 0; c < length; ++c) word += static_cast<char>('a' + draw(s, i, 1 + c, kLetters));
      key = word_key(word);
      return make(word);
    });
  }

  std::vector<Problem> eval_problems(std::int64_t count) const override {
    if (count < 0 || count > kMaxEval) {
      throw InvalidArgument("eval-prompts", "must be in [0, " + std::to_string(kMaxEval) + "] for reverse, got " +
                                                std::to_string(count));
    }
    // Held-out words from a stream of their own, in order, each once.
    std::vector<Problem> all;
    std::set<std::string> taken;
    for (std::uint64_t i = 0; static_cast<std::int64_t>(all.size()) < count; ++i) {
      const std::uint64_t length = kMinLength + draw(0xe7a1, i, 0, kMaxLength - kMinLength + 1);
      std::string word;
      for (std::uint64_t c = 0; c < length; ++c) word += static_cast<char>('a' + draw(0xe7a1, i, 1 + c, kLetters));
      if (held_out(word_key(word)) && taken.insert(word).second) all.push_back(make(word));
    }
    return all;
  }

  double reward(const Problem& problem, std::string_view completion) const override {
    const std::size_t longest = std::max(completion.size(), problem.answer.size());
    if (longest == 0) return 1.0;
    return static_cast<double>(longest_common_subsequence(completion, problem.answer)) / static_cast<double>(longest);
  }
  std::int64_t max_prompt_length() const override { return kMaxLength + 1; }
  std::int64_t max_answer_length() const override { return kMaxLength; }

 private:
  static constexpr std::int64_t kMaxEval = 4096;
  // Base-27 digits of the word: distinct words, distinct keys.
  static std::uint64_t word_key(const std::string& word) {
    std::uint64_t key = 0;
    for (char c : word) key = key * 27 + static_cast<std::uint64_t>(c - 'a' + 1);
    return key;
  }
  static Problem make(const std::string& word) { return {word + ">", std::string(word.rbegin(), word.rend())}; }
};

}  // namespace

std::string_view Alphabet::characters() { return kCharacters; }
std::int32_t Alphabet::size() { return static_cast<std::int32_t>(kCharacters.size()) + 1; }

std::vector<std::int32_t> Alphabet::encode(std::string_view text, const std::string& argument) {
  std::vector<std::int32_t> tokens;
  tokens.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const std::size_t at = kCharacters.find(text[i]);
    if (at == std::string_view::npos) {
      throw InvalidArgument(argument, "character " + std::to_string(i) + " ('" + std::string(1, text[i]) +
                                          "') is not in the task alphabet \"" + std::string(kCharacters) + "\"");
    }
    tokens.push_back(static_cast<std::int32_t>(at) + 1);
  }
  return tokens;
}

std::string Alphabet::decode(std::span<const std::int32_t> tokens) {
  std::string text;
  for (const std::int32_t token : tokens) {
    if (token == kEnd) break;
    text += token > 0 && token < size() ? kCharacters[token - 1] : '?';
  }
  return text;
}

std::vector<std::string> task_names() { return {"arithmetic", "reverse"}; }

std::unique_ptr<Task> make_task(const std::string& name) {
  if (name == "arithmetic") return std::make_unique<Arithmetic>();
  if (name == "reverse") return std::make_unique<Reverse>();
  std::string known;
  for (const std::string& n : task_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("task", "no task is called '" + name + "' (known: " + known + ")");
}

std::int64_t longest_common_subsequence(std::string_view a, std::string_view b) {
  std::vector<std::int64_t> row(b.size() + 1, 0), next(b.size() + 1, 0);
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (std::size_t j = 0; j < b.size(); ++j) {
      next[j + 1] = a[i] == b[j] ? row[j] + 1 : std::max(row[j + 1], next[j]);
    }
    std::swap(row, next);
  }
  return row[b.size()];
}

}  // namespace deltatrain::rl
