#include "server/receive_budget.h"

#include <algorithm>
#include <utility>

namespace shardps::server {

bool ReceiveBudget::Allows(const Ticket& t) const {
  if (limit_ == 0 || in_use_ == 0 || in_use_ + t.bytes <= limit_) return true;
  if (!t.rank.has_value()) return true;  // cannot tell: a first read
  if (folds_.empty()) return false;
  const Fold& least = folds_.begin()->first;
  return *t.rank == least.second &&
         (!t.next_step.has_value() || *t.next_step <= least.first);
}

bool ReceiveBudget::TryRead(std::optional<uint32_t> rank, int64_t bytes,
                            std::function<void()> wake,
                            std::optional<int64_t> next_step) {
  if (limit_ == 0) return true;
  absl::MutexLock lock(&mu_);
  Ticket t{rank, next_step, bytes, nullptr};
  if (Allows(t)) {
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return true;
  }
  t.wake = std::move(wake);
  parked_.push_back(std::move(t));
  ++waited_;
  return false;
}

void ReceiveBudget::Admit() {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (!Allows(*it)) {
      ++it;
      continue;
    }
    in_use_ += it->bytes;
    peak_ = std::max(peak_, in_use_);
    admitted_.push_back(std::move(it->wake));
    it = parked_.erase(it);
  }
}

void ReceiveBudget::Take(int64_t bytes) {
  if (limit_ == 0) return;
  absl::MutexLock lock(&mu_);
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
}

void ReceiveBudget::Free(int64_t bytes) {
  if (limit_ == 0) return;
  {
    absl::MutexLock lock(&mu_);
    in_use_ -= bytes;
    if (!parked_.empty()) Admit();
  }
  RunAdmitted();
}

void ReceiveBudget::MoveFold(std::optional<Fold> from, std::optional<Fold> to) {
  if (from == to) return;
  absl::MutexLock lock(&mu_);
  const auto least = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return folds_.empty() ? std::nullopt
                          : std::optional<Fold>(folds_.begin()->first);
  };
  const std::optional<Fold> before = least();
  if (from.has_value()) {
    auto it = folds_.find(*from);
    if (it != folds_.end() && --it->second == 0) folds_.erase(it);
  }
  if (to.has_value()) ++folds_[*to];
  if (least() != before && !parked_.empty()) Admit();
}

void ReceiveBudget::RunAdmitted() {
  std::vector<std::function<void()>> woken;
  {
    absl::MutexLock lock(&mu_);
    if (admitted_.empty()) return;
    woken.swap(admitted_);
  }
  for (std::function<void()>& w : woken) w();
}

ReceiveBudget::Usage ReceiveBudget::usage() const {
  absl::MutexLock lock(&mu_);
  return Usage{in_use_, peak_, waited_};
}

}  // namespace shardps::server
