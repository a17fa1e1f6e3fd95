#include "deltatrain/train/plan.h"

#include <algorithm>
#include <string>

#include "deltatrain/core/error.h"

namespace deltatrain::train {

namespace {

// splitmix64: a fixed, portable generator for the permutations.
std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

void check_plan_options(const PlanOptions& options) {
  if (options.seq_len < 2) throw InvalidArgument("seq-len", "must be >= 2; got " + std::to_string(options.seq_len));
  if (options.dp_size < 1) throw InvalidArgument("ranks", "must be >= 1; got " + std::to_string(options.dp_size));
  const std::int64_t unit = options.seq_len * options.dp_size;
  if (options.tokens_per_step < unit || options.tokens_per_step % unit != 0) {
    throw InvalidArgument("tokens-per-step",
                          "must be a positive multiple of seq-len x ranks = " + std::to_string(options.seq_len) + " x " +
                              std::to_string(options.dp_size) + " (each rank packs whole rows of seq-len tokens); got " +
                              std::to_string(options.tokens_per_step));
  }
}

std::vector<std::int64_t> epoch_order(std::int64_t documents, std::uint64_t seed, std::int64_t epoch, bool shuffle) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(documents));
  for (std::int64_t i = 0; i < documents; ++i) order[i] = i;
  if (!shuffle) return order;
  std::uint64_t state = seed ^ (0x5851f42d4c957f2dull * static_cast<std::uint64_t>(epoch + 1));
  // Fisher-Yates; the modulo bias of a 64-bit draw over document counts is negligible and, above all, fixed.
  for (std::int64_t i = documents - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(splitmix64(state) % static_cast<std::uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

std::int64_t piece_targets(const Piece& piece, std::int64_t document_length) {
  return std::max<std::int64_t>(0, std::min(piece.offset + piece.length, document_length - 1) - piece.offset);
}

void check_position(std::span<const std::int64_t> document_lengths, const PlanOptions& options,
                    const DataPosition& start) {
  const auto documents = static_cast<std::int64_t>(document_lengths.size());
  if (start.epoch < 0 || start.index < 0 || start.index > documents || start.offset < 0 ||
      (start.index < documents && start.offset > document_lengths[epoch_order(documents, options.seed, start.epoch,
                                                                               options.shuffle)[start.index]])) {
    throw InvalidArgument("position", "epoch " + std::to_string(start.epoch) + ", document " +
                                          std::to_string(start.index) + ", offset " + std::to_string(start.offset) +
                                          " is not inside the data");
  }
}

StepPlan plan_step(std::span<const std::int64_t> document_lengths, const PlanOptions& options,
                   const DataPosition& start) {
  check_plan_options(options);
  const auto documents = static_cast<std::int64_t>(document_lengths.size());
  if (std::none_of(document_lengths.begin(), document_lengths.end(), [](std::int64_t n) { return n > 0; })) {
    throw InvalidArgument("data", "holds no tokens (every document is empty)");
  }
  check_position(document_lengths, options, start);
  StepPlan plan;
  DataPosition at = start;
  std::vector<std::int64_t> order = epoch_order(documents, options.seed, at.epoch, options.shuffle);
  const std::int64_t rows = options.tokens_per_step / options.seq_len;
  plan.rows.resize(static_cast<std::size_t>(rows));
  for (std::vector<Piece>& row : plan.rows) {
    std::int64_t room = options.seq_len;
    while (room > 0) {
      if (at.index == documents) {
        at = {at.epoch + 1, 0, 0};
        order = epoch_order(documents, options.seed, at.epoch, options.shuffle);
      }
      const std::int64_t document = order[at.index];
      const std::int64_t left = document_lengths[document] - at.offset;
      if (left <= 0) {
        at.index += 1;
        at.offset = 0;
        continue;
      }
      const Piece piece{document, at.offset, std::min(left, room)};
      row.push_back(piece);
      plan.targets += piece_targets(piece, document_lengths[document]);
      room -= piece.length;
      at.offset += piece.length;
      if (at.offset == document_lengths[document]) {
        at.index += 1;
        at.offset = 0;
      }
    }
  }
  plan.end = at;
  return plan;
}

std::span<const std::vector<Piece>> rank_rows(const StepPlan& plan, int rank, int dp_size) {
  if (dp_size < 1 || rank < 0 || rank >= dp_size || plan.rows.size() % dp_size != 0) {
    throw InvalidArgument("rank", "rank " + std::to_string(rank) + " of " + std::to_string(dp_size) +
                                      " cannot take an equal share of " + std::to_string(plan.rows.size()) + " rows");
  }
  const std::size_t per_rank = plan.rows.size() / dp_size;
  return std::span<const std::vector<Piece>>(plan.rows).subspan(rank * per_rank, per_rank);
}

}  // namespace deltatrain::train
