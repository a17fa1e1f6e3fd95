// Batch planning: which tokens each rank trains on at a step. Pure functions of the document lengths, the
// options and a data position, so a step is the same whatever the rank count, and a run resumes from the
// position stored in its checkpoint.
//
// The global batch of a step is tokens_per_step consecutive tokens of the data stream, laid out as rows of
// seq_len tokens. The stream is the documents in each epoch's order (a seeded permutation, or file order),
// each read from start to end, epoch after epoch. A row is filled with pieces of documents: a piece ends at
// its document's end or the row's end, and a document cut by a row's end continues at the start of the
// next row. Each piece is one sequence of the packed batch, so no sequence crosses a document boundary.
// Rows go to ranks in contiguous blocks of rows / dp_size: sequences never depend on the rank count, so
// 1, 2 or 4 ranks see the same sequences and the same global tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace deltatrain::train {

// Where the next step starts: epoch, index into that epoch's document order, token offset in the document.
struct DataPosition {
  std::int64_t epoch = 0;
  std::int64_t index = 0;
  std::int64_t offset = 0;
  bool operator==(const DataPosition&) const = default;
};

struct PlanOptions {
  std::int64_t tokens_per_step = 0;  // a multiple of seq_len * dp_size
  std::int64_t seq_len = 0;
  int dp_size = 1;
  bool shuffle = true;    // a fresh permutation of the documents each epoch; false: file order
  std::uint64_t seed = 0;  // of the permutations
};

// InvalidArgument naming the option (tokens-per-step, seq-len, ranks) when the step cannot be split.
void check_plan_options(const PlanOptions& options);

// The order of `documents` documents in `epoch`: a permutation drawn from (seed, epoch) with a generator
// defined here (not the standard library's unspecified shuffle), so it is the same on every platform.
std::vector<std::int64_t> epoch_order(std::int64_t documents, std::uint64_t seed, std::int64_t epoch, bool shuffle);

struct Piece {
  std::int64_t document = 0;  // index into the document table
  std::int64_t offset = 0;    // first token in the document
  std::int64_t length = 0;
};

struct StepPlan {
  std::vector<std::vector<Piece>> rows;  // tokens_per_step / seq_len rows of seq_len tokens each
  // Tokens that have a next-token target: every planned token but the last of its document. The last
  // token of a piece that a row cut predicts the document's next token.
  std::int64_t targets = 0;
  DataPosition end;  // where the next step starts
};

// InvalidArgument naming `position` when `start` is not inside the documents (a saved position that does not
// fit them).
void check_position(std::span<const std::int64_t> document_lengths, const PlanOptions& options,
                    const DataPosition& start);

// The global plan of one step from `start`. InvalidArgument when every document is empty or the options
// are invalid.
StepPlan plan_step(std::span<const std::int64_t> document_lengths, const PlanOptions& options,
                   const DataPosition& start);

// Rank `rank`'s rows: [rank * n, (rank + 1) * n) with n = rows / dp_size.
std::span<const std::vector<Piece>> rank_rows(const StepPlan& plan, int rank, int dp_size);

// Targets of a piece's tokens with the document's length: the next token's index in the document, or -1.
std::int64_t piece_targets(const Piece& piece, std::int64_t document_length);

}  // namespace deltatrain::train
