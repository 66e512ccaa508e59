#include "coordinator/collectives.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/collective_reduce.h"

namespace shardps::coordinator {
namespace {

// The live holder of `rank` in `view`, or nullptr.
const v1::WorkerSlot* LiveSlot(const v1::ClusterView& view, uint32_t rank) {
  if (rank >= static_cast<uint32_t>(view.workers_size())) return nullptr;
  const v1::WorkerSlot& slot = view.workers(static_cast<int>(rank));
  return slot.alive() ? &slot : nullptr;
}

std::string Named(uint64_t sequence, const v1::CollectiveRequest& call) {
  return absl::StrCat("collective ", sequence, " (", DescribeCollective(call),
                      ")");
}

}  // namespace

std::string Collectives::Ranks(const Open& open, bool called) {
  std::vector<uint32_t> ranks;
  for (const auto& [rank, caller] : open.callers) {
    if (caller.called == called) ranks.push_back(rank);
  }
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ",
                      absl::StrJoin(ranks, ", "));
}

absl::Status Collectives::CheckCaller(const v1::CollectiveRequest& request,
                                      const v1::ClusterView& view) const {
  if (shut_down_) {
    return absl::UnavailableError("the coordinator is shutting down");
  }
  const v1::WorkerSlot* slot = LiveSlot(view, request.rank());
  if (slot == nullptr || slot->incarnation() != request.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", request.rank(), " (incarnation ", request.incarnation(),
        ") is not a live worker of the job: collectives are for the job's "
        "members"));
  }
  for (const auto& [sequence, status] : finished_) {
    if (sequence != request.sequence()) continue;
    if (status.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("collective ", sequence,
                       " already completed without rank ", request.rank(),
                       ": it joined the job after the collective opened, "
                       "or called it twice"));
    }
    return absl::Status(
        status.code(), absl::StrCat(status.message(), " (rank ", request.rank(),
                                    " called it too late)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Collectives::Open*> Collectives::OpenFor(
    const v1::CollectiveRequest& request, const v1::ClusterView& view) {
  Open open;
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.alive()) open.callers[w.rank()].incarnation = w.incarnation();
  }
  open.src_rank = open.callers.begin()->first;  // -1: the lowest
  if (request.op() == v1::COLLECTIVE_OP_BROADCAST && request.src() >= 0) {
    open.src_rank = static_cast<uint32_t>(request.src());
    if (open.callers.count(open.src_rank) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(DescribeCollective(request), ": rank ", open.src_rank,
                       " is not a live worker of the job"));
    }
  }
  if (open_.size() >= kMaxOpen) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kMaxOpen, " collectives are open already (the oldest is ",
        open_.begin()->first, "): ranks call them in different orders"));
  }
  open.first = request;
  open.first.clear_values();
  return &(open_[request.sequence()] = std::move(open));
}

void Collectives::Call(const v1::CollectiveRequest& request,
                       const v1::ClusterView& view, absl::Time now,
                       CollectiveAnswer answer) {
  Answers answers;
  std::optional<Open> done;
  {
    absl::MutexLock lock(&mu_);
    // Departures the notifier already saw count even when the caller read
    // its view before them.
    const v1::ClusterView& newest =
        view_.generation() > view.generation() ? view_ : view;
    absl::Status status = CheckCaller(request, newest);
    Open* open = nullptr;
    auto it = open_.find(request.sequence());
    if (status.ok() && it != open_.end()) {
      open = &it->second;
      auto caller = open->callers.find(request.rank());
      if (caller == open->callers.end()) {
        status = absl::FailedPreconditionError(absl::StrCat(
            Named(request.sequence(), open->first), " is over ",
            Ranks(*open, true), " and ", Ranks(*open, false), "; rank ",
            request.rank(), " joined the job after it opened"));
      } else if (caller->second.called) {
        status = absl::AlreadyExistsError(
            absl::StrCat("rank ", request.rank(), " already called ",
                         Named(request.sequence(), open->first)));
      } else {
        status = MatchCollective(open->first, request);
      }
    }
    if (status.ok() && open == nullptr) {
      // Validated against the participants before anything is kept.
      absl::StatusOr<Open*> opened = OpenFor(request, newest);
      if (opened.ok()) {
        status = ValidateCollective(request, (*opened)->src_rank);
        if (status.ok()) {
          open = *opened;
        } else {
          open_.erase(request.sequence());
        }
      } else {
        status = opened.status();
      }
    } else if (status.ok()) {
      status = ValidateCollective(request, open->src_rank);
    }
    if (!status.ok()) {
      answers.emplace_back(std::move(answer), status);
    } else {
      Caller& caller = open->callers[request.rank()];
      caller.called = true;
      caller.values = request.values();
      caller.answer = std::move(answer);
      open->deadline = std::min(open->deadline,
                                now + absl::Milliseconds(request.timeout_ms()));
      const bool complete =
          std::all_of(open->callers.begin(), open->callers.end(),
                      [](const auto& c) { return c.second.called; });
      if (complete) {
        done = std::move(open_.extract(request.sequence()).mapped());
        Remember(request.sequence(), absl::OkStatus());
      }
    }
  }
  // Reduced outside the lock: up to a MiB per participant.
  if (done.has_value()) answers = Complete(*std::move(done));
  for (auto& [reply, result] : answers) reply(std::move(result));
}

Collectives::Answers Collectives::Complete(Open open) {
  v1::CollectiveResponse response;
  std::vector<const std::string*> values;
  for (const auto& [rank, caller] : open.callers) {
    response.add_ranks(rank);
    values.push_back(&caller.values);
  }
  switch (open.first.op()) {
    case v1::COLLECTIVE_OP_BARRIER:
      break;
    case v1::COLLECTIVE_OP_BROADCAST:
      response.set_values(open.callers.at(open.src_rank).values);
      break;
    default:
      response.set_values(
          ReduceInRankOrder(open.first.op(), open.first.dtype(), values));
  }
  Answers answers;
  for (auto& [rank, caller] : open.callers) {
    answers.emplace_back(std::move(caller.answer), response);
  }
  return answers;
}

void Collectives::DropDeparted(const v1::ClusterView& view) {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    if (view.generation() > view_.generation()) view_ = view;
    std::vector<std::pair<uint64_t, absl::Status>> failed;
    for (const auto& [sequence, open] : open_) {
      for (const auto& [rank, caller] : open.callers) {
        const v1::WorkerSlot* slot = LiveSlot(view, rank);
        if (caller.called ||
            (slot != nullptr && slot->incarnation() == caller.incarnation)) {
          continue;
        }
        failed.emplace_back(sequence, absl::AbortedError(absl::StrCat(
                                          Named(sequence, open.first),
                                          " cannot complete: rank ", rank,
                                          " left the job before calling it (",
                                          Ranks(open, true), " called it)")));
        break;
      }
    }
    for (const auto& [sequence, status] : failed) {
      FailLocked(sequence, status, &answers);
    }
  }
  for (auto& [reply, result] : answers) reply(std::move(result));
}

void Collectives::ExpireWaits(absl::Time now) {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<uint64_t, absl::Status>> failed;
    for (const auto& [sequence, open] : open_) {
      if (open.deadline > now) continue;
      failed.emplace_back(
          sequence,
          absl::DeadlineExceededError(absl::StrCat(
              Named(sequence, open.first), " timed out: ", Ranks(open, false),
              " did not call it (", Ranks(open, true), " did)")));
    }
    for (const auto& [sequence, status] : failed) {
      FailLocked(sequence, status, &answers);
    }
  }
  for (auto& [reply, result] : answers) reply(std::move(result));
}

void Collectives::Shutdown() {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    std::vector<uint64_t> sequences;
    for (const auto& [sequence, open] : open_) sequences.push_back(sequence);
    for (uint64_t sequence : sequences) {
      FailLocked(sequence,
                 absl::UnavailableError("the coordinator is shutting down"),
                 &answers);
    }
  }
  for (auto& [reply, result] : answers) reply(std::move(result));
}

void Collectives::FailLocked(uint64_t sequence, const absl::Status& status,
                             Answers* answers) {
  auto node = open_.extract(sequence);
  for (auto& [rank, caller] : node.mapped().callers) {
    if (caller.called) answers->emplace_back(std::move(caller.answer), status);
  }
  Remember(sequence, status);
}

void Collectives::Remember(uint64_t sequence, absl::Status status) {
  finished_.emplace_back(sequence, std::move(status));
  while (finished_.size() > kRemembered) finished_.pop_front();
}

size_t Collectives::open() const {
  absl::MutexLock lock(&mu_);
  return open_.size();
}

}  // namespace shardps::coordinator
