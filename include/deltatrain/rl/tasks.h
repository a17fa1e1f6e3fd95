// Verifiable tasks for RL, generated procedurally (nothing is downloaded): each has an exact reward, a stream
// of training problems that is a pure function of (seed, index) (a resumed run draws the same ones) and a
// held-out evaluation set that the training stream never draws from.
//
//   arithmetic  "37+58="   -> "95"      reward 1 for the exact sum, else 0
//   reverse     "abcde>"   -> "edcba"   reward = LCS(completion, answer) / max(lengths), 1 only when exact
//
// Tasks write in a small character alphabet (Alphabet): token 0 ends a completion, tokens 1.. are characters.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace deltatrain::rl {

class Alphabet {
 public:
  static constexpr std::int32_t kEnd = 0;  // the end of a completion
  // The characters the tasks use; token i + 1 is characters()[i].
  static std::string_view characters();
  static std::int32_t size();  // tokens, kEnd included
  // InvalidArgument naming `argument` for a character outside the alphabet.
  static std::vector<std::int32_t> encode(std::string_view text, const std::string& argument = "text");
  // Characters up to the first kEnd (excluded); tokens outside the alphabet become '?'.
  static std::string decode(std::span<const std::int32_t> tokens);
};

struct Problem {
  std::string prompt;
  std::string answer;  // the completion that earns reward 1 (without the end token)
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  // Training problem `index` of the stream of `seed`; never one of the held-out problems.
  virtual Problem train_problem(std::uint64_t seed, std::uint64_t index) const = 0;
  // The first `count` problems of the held-out set, the same for every seed. InvalidArgument naming
  // `eval-prompts` when the set is smaller.
  virtual std::vector<Problem> eval_problems(std::int64_t count) const = 0;
  // In [0, 1]; 1 exactly when `completion` (decoded, without the end token) is the answer.
  virtual double reward(const Problem& problem, std::string_view completion) const = 0;
  // The longest prompt and answer in characters (for the rollout's cache length).
  virtual std::int64_t max_prompt_length() const = 0;
  virtual std::int64_t max_answer_length() const = 0;
};

std::vector<std::string> task_names();  // "arithmetic", "reverse"
// InvalidArgument naming "task" and listing the known tasks for an unknown name.
std::unique_ptr<Task> make_task(const std::string& name);

// Length of the longest common subsequence (the reverse task's reward).
std::int64_t longest_common_subsequence(std::string_view a, std::string_view b);

}  // namespace deltatrain::rl
