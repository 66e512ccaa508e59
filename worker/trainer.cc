#include "worker/trainer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace shardps::worker {

// Per-epoch accumulators.
struct Trainer::EpochStats {
  double loss_sum = 0.0;
  double grad_norm_sum = 0.0;  // clipping: the steps' global norms
  int64_t steps = 0;
  int64_t samples = 0;  // global
  absl::Duration compute, push, wait;
  // From the first push to the last reply (overlapping compute), and the
  // part of it after backward, which the step waited for.
  absl::Duration exchange, exposed;
  // Steps whose next batch's first layer was computed during the replies.
  int64_t ahead = 0;
  absl::Time start = absl::Now();
  double PerStepMs(absl::Duration d) const {
    return absl::ToDoubleMilliseconds(d) / std::max<int64_t>(1, steps);
  }
};

absl::StatusOr<v1::OptimizerSpec> MakeOptimizerSpec(const OptimizerFlags& f,
                                                    int64_t total_steps) {
  v1::OptimizerSpec spec;
  static const auto* kinds = new std::map<std::string, v1::OptimizerSpec::Kind>{
      {"sgd", v1::OptimizerSpec::KIND_SGD},
      {"adam", v1::OptimizerSpec::KIND_ADAM},
      {"adamw", v1::OptimizerSpec::KIND_ADAMW},
      {"adagrad", v1::OptimizerSpec::KIND_ADAGRAD}};
  auto kind = kinds->find(f.name);
  if (kind == kinds->end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer=", f.name, " is not one of: sgd, adam, adamw, adagrad"));
  }
  spec.set_kind(kind->second);
  spec.set_learning_rate(static_cast<float>(f.lr));
  if (kind->second == v1::OptimizerSpec::KIND_SGD) {
    spec.set_momentum(static_cast<float>(f.momentum));
    spec.set_nesterov(f.nesterov);
  }
  spec.set_weight_decay(static_cast<float>(f.weight_decay));
  v1::LrSchedule* schedule = spec.mutable_schedule();
  schedule->set_warmup_steps(f.warmup_steps);
  const std::vector<std::string> parts = absl::StrSplit(f.schedule, ':');
  if (f.schedule == "constant") {
    schedule->set_kind(v1::LrSchedule::KIND_CONSTANT);
  } else if (f.schedule == "cosine") {
    schedule->set_kind(v1::LrSchedule::KIND_COSINE);
    schedule->set_total_steps(std::max<int64_t>(1, total_steps));
  } else if (parts.size() == 3 && parts[0] == "step") {
    int64_t size = 0;
    float gamma = 0;
    if (!absl::SimpleAtoi(parts[1], &size) ||
        !absl::SimpleAtof(parts[2], &gamma)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lr_schedule=", f.schedule, ": want step:SIZE:GAMMA"));
    }
    schedule->set_kind(v1::LrSchedule::KIND_STEP);
    schedule->set_step_size(size);
    schedule->set_gamma(gamma);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--lr_schedule=", f.schedule,
                     " is not one of: constant, cosine, step:SIZE:GAMMA"));
  }
  return spec;
}

absl::StatusOr<int64_t> StepsPerEpoch(int64_t num_samples, int64_t batch_size,
                                      uint32_t num_workers) {
  if (batch_size < static_cast<int64_t>(num_workers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch_size=", batch_size, " is smaller than the ",
                     num_workers, " workers: each needs at least one sample"));
  }
  if (batch_size % num_workers != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--batch_size=", batch_size,
                                                   " is not divisible by the ",
                                                   num_workers, " workers"));
  }
  if (batch_size > num_samples) {
    return absl::InvalidArgumentError(absl::StrCat("--batch_size=", batch_size,
                                                   " exceeds the ", num_samples,
                                                   " training samples"));
  }
  return num_samples / batch_size;
}

v1::Layout ModelLayout(const ModelSpec& model, uint64_t seed,
                       uint64_t chunk_bytes, int64_t link_bits_per_second,
                       int wire_bytes_per_element) {
  v1::Layout layout;
  layout.set_chunk_bytes(chunk_bytes);
  for (const ParamSpec& p : model.Params(seed)) {
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name(p.name);
    for (int64_t d : p.shape) t->add_shape(d);
    if (p.init == ParamSpec::Init::kNormal) {
      t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
      t->mutable_init()->set_value(p.std);
      t->mutable_init()->set_seed(p.seed);
    }
  }
  ChooseChunkBytes(layout, link_bits_per_second, wire_bytes_per_element);
  return layout;
}

Trainer::Trainer(TrainerOptions options, ModelSpec model, Dataset train,
                 std::optional<Dataset> test, std::unique_ptr<Backend> backend,
                 std::unique_ptr<Client> client, v1::OptimizerSpec optimizer)
    : options_(std::move(options)),
      model_(std::move(model)),
      params_(model_.Params(options_.seed)),
      train_(std::move(train)),
      test_(std::move(test)),
      backend_(std::move(backend)),
      client_(std::move(client)),
      optimizer_(std::move(optimizer)) {}

namespace {

// Buffers of the trainer's own, made at first use, where the client has
// none (no shard on this machine).
Tensors OwnBuffers(const std::vector<ParamSpec>& params,
                   std::vector<std::vector<float>>* buffers) {
  if (buffers->empty()) {
    for (const ParamSpec& p : params) buffers->emplace_back(p.num_elements());
  }
  Tensors v;
  for (auto& b : *buffers) v.emplace_back(absl::MakeSpan(b));
  return v;
}

}  // namespace

Tensors Trainer::WeightViews() {
  Tensors v = client_->WeightBuffers();
  return v.empty() ? OwnBuffers(params_, &weights_) : v;
}

ConstTensors Trainer::Params() {
  const Tensors weights = WeightViews();
  return ConstTensors(weights.begin(), weights.end());
}

Tensors Trainer::GradientBuffers() {
  Tensors v = client_->GradientBuffers();
  return v.empty() ? OwnBuffers(params_, &grads_) : v;
}

std::string Trainer::NoAheadReason() const {
  if (backend_->first_layer_block() == 0) {
    return "the backend computes it in the step";
  }
  if (options_.clip_grad_norm > 0) {
    return "a clipped step's weights come after its second phase";
  }
  if (client_->replies_through_rings()) {
    return "replies through shared memory are taken at the step's end";
  }
  return "";
}

bool Trainer::ComputeAhead(absl::Span<const int64_t> next) {
  const int block = backend_->first_layer_block();
  if (block == 0 || next.empty()) return false;
  const Tensors weights = WeightViews();
  const int units = static_cast<int>(weights[1].size());
  const int64_t in = model_.num_features();
  train_.FillBatch(next, x_ahead_.data(), labels_ahead_.data());
  const absl::Span<const float> x = absl::MakeConstSpan(
      x_ahead_.data(), static_cast<int64_t>(next.size()) * in);
  // The bias, then the weight's rows, as their replies come.
  if (!client_->AwaitWeights(1, units)) return false;
  for (int u = 0; u < units; u += block) {
    const int end = std::min(u + block, units);
    if (!client_->AwaitWeights(0, end * in) ||
        !backend_->ForwardFirstLayer(x, u, end, weights[0], weights[1]).ok()) {
      return false;
    }
  }
  ahead_indices_.assign(next.begin(), next.end());
  return true;
}

absl::Status Trainer::Step(int64_t step, absl::Span<const int64_t> indices,
                           absl::Span<const int64_t> next, EpochStats* stats) {
  const absl::Time start = absl::Now();
  const int b = static_cast<int>(indices.size());
  // Computed ahead during the last step (for this step and batch; a
  // rollback or a failure in between leaves none).
  const bool ahead =
      ahead_step_ == step && absl::MakeConstSpan(ahead_indices_) == indices;
  ahead_step_ = -1;
  if (ahead) {
    std::swap(x_, x_ahead_);
    std::swap(labels_, labels_ahead_);
  } else {
    train_.FillBatch(indices, x_.data(), labels_.data());
  }
  // Computed ahead, the first layer's weights are not read again.
  SHARDPS_RETURN_IF_ERROR(
      backend_->SetParams(Params(), /*first_layer=*/!ahead));
  const Tensors grads = GradientBuffers();
  // scale = W / B: the servers average the W contributions, so the update
  // uses the mean gradient over the whole global batch (W: the workers
  // sharing this epoch's batches).
  const float scale = static_cast<float>(epoch_workers_) /
                      static_cast<float>(options_.batch_size);
  // Each layer's gradients go to the shards as backward produces them
  // (the last layer first; a large weight's in blocks of rows); their weights
  // come back into WeightViews() while backward runs, which is safe: the
  // backend computes on its own copy.
  const absl::Time opened = absl::Now();
  StepOptions step_options;
  if (options_.clip_grad_norm > 0) {
    step_options.second_phase = true;
    step_options.max_grad_norm = static_cast<float>(options_.clip_grad_norm);
  }
  SHARDPS_RETURN_IF_ERROR(
      client_->BeginStep(step, WeightViews(), step_options));
  std::optional<absl::Time> first_push;
  auto pushing_from_now = [&first_push] {
    if (!first_push.has_value()) first_push = absl::Now();
  };
  absl::StatusOr<double> loss = backend_->Gradients(
      absl::MakeConstSpan(x_.data(), int64_t{b} * model_.num_features()),
      absl::MakeConstSpan(labels_.data(), b), scale, grads,
      [&](int param) {
        pushing_from_now();
        return client_->PushTensor(param, grads[param]);
      },
      [&](int param, int64_t elements) {
        pushing_from_now();
        return client_->PushTensorPart(param, grads[param], elements);
      },
      ahead);
  if (!loss.ok()) {
    client_->AbortStep();
    return loss.status();
  }
  const absl::Time computed = absl::Now();
  const bool computed_ahead = !step_options.second_phase && ComputeAhead(next);
  SHARDPS_RETURN_IF_ERROR(client_->FinishStep());
  if (computed_ahead) {
    ahead_step_ = step + 1;
    ++stats->ahead;
  }
  const absl::Time done = absl::Now();
  const absl::Duration exposed = done - computed;
  stats->compute += computed - start;
  stats->exchange += done - first_push.value_or(computed);
  stats->exposed += exposed;
  // Of the exposed part: until every chunk was written, then replies.
  const absl::Duration pushing = std::max(
      absl::ZeroDuration(), client_->last_push_time() - (computed - opened));
  stats->push += std::min(pushing, exposed);
  stats->wait += exposed - std::min(pushing, exposed);
  stats->loss_sum += *loss;
  if (step_options.second_phase) {
    stats->grad_norm_sum += client_->last_grad_norm();
  }
  ++stats->steps;
  stats->samples += options_.batch_size;
  if (options_.metrics != nullptr) {
    const uint64_t bytes = 4 * model_.num_params();  // fp32 both ways
    options_.metrics->StepDone({step, b, *loss, computed - start,
                                std::min(pushing, exposed), exposed, bytes,
                                bytes, client_->retries()});
  }
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> Trainer::Evaluate() {
  SHARDPS_RETURN_IF_ERROR(backend_->SetParams(Params()));
  EvalResult total;
  const int64_t n = test_->num_samples();
  std::vector<int64_t> indices;
  for (int64_t begin = 0; begin < n; begin += eval_batch_) {
    const int64_t end = std::min(n, begin + eval_batch_);
    indices.clear();
    for (int64_t i = begin; i < end; ++i) indices.push_back(i);
    const int64_t b = end - begin;
    test_->FillBatch(indices, x_.data(), labels_.data());
    SHARDPS_ASSIGN_OR_RETURN(
        EvalResult r,
        backend_->Evaluate(
            absl::MakeConstSpan(x_.data(), b * model_.num_features()),
            absl::MakeConstSpan(labels_.data(), b)));
    total.mean_loss += r.mean_loss * b;
    total.correct += r.correct;
  }
  total.mean_loss /= std::max<int64_t>(1, n);
  return total;
}

absl::Status Trainer::WriteMetricsRow(int epoch, int64_t step,
                                      const EpochStats& s,
                                      absl::Duration epoch_time,
                                      const EvalResult* eval) {
  if (options_.metrics_csv.empty()) return absl::OkStatus();
  // A fresh run starts the file; a resumed one, or a worker that took over
  // the lead later, appends to it (writing the header if the file is still
  // empty).
  const bool truncate = !metrics_started_ && !resumed_ && epoch == 1;
  metrics_started_ = true;
  std::error_code ec;
  const bool empty =
      truncate || std::filesystem::file_size(options_.metrics_csv, ec) == 0 ||
      ec;
  std::ofstream out(options_.metrics_csv,
                    truncate ? std::ios::trunc : std::ios::app);
  if (empty) {
    out << "epoch,step,train_loss,test_loss,test_accuracy,samples_per_s,"
           "epoch_s,compute_share,push_share,wait_share,compute_ms,"
           "exchange_ms,exposed_ms\n";
  }
  const double total = absl::ToDoubleSeconds(s.compute + s.push + s.wait);
  const double n_test = test_.has_value() ? test_->num_samples() : 1;
  out << absl::StrFormat(
      "%d,%d,%.6f,%s,%s,%.1f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n", epoch, step,
      s.loss_sum / std::max<int64_t>(1, s.steps),
      eval ? absl::StrFormat("%.6f", eval->mean_loss) : "",
      eval ? absl::StrFormat("%.4f", eval->correct / n_test) : "",
      s.samples / absl::ToDoubleSeconds(epoch_time),
      absl::ToDoubleSeconds(epoch_time),
      absl::ToDoubleSeconds(s.compute) / total,
      absl::ToDoubleSeconds(s.push) / total,
      absl::ToDoubleSeconds(s.wait) / total, s.PerStepMs(s.compute),
      s.PerStepMs(s.exchange), s.PerStepMs(s.exposed));
  out.close();
  if (!out) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write metrics to ", options_.metrics_csv));
  }
  return absl::OkStatus();
}

absl::Status Trainer::WriteModel(int64_t step) {
  if (options_.model_out.empty()) return absl::OkStatus();
  const Tensors weights = WeightViews();
  std::vector<SafetensorsTensor> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    tensors.push_back({params_[i].name, params_[i].shape, weights[i].data()});
  }
  return WriteSafetensors(options_.model_out, tensors,
                          {{"format", "pt"},
                           {"model", model_.ToString()},
                           {"step", absl::StrCat(step)}});
}

std::vector<uint32_t> Trainer::EpochRanks() const {
  return RanksSharingTheBatch(client_.get(), options_.active_ranks,
                              options_.num_workers, options_.rank);
}

absl::Status Trainer::Prepare() {
  // Fewer workers may share a batch later: room for the whole batch.
  const int64_t max_batch = std::max<int64_t>(options_.batch_size, 1000);
  eval_batch_ = max_batch;
  SHARDPS_RETURN_IF_ERROR(backend_->Init(model_, static_cast<int>(max_batch)));
  x_.resize(max_batch * model_.num_features());
  labels_.resize(max_batch);
  x_ahead_.resize(x_.size());
  labels_ahead_.resize(labels_.size());
  return client_->Declare(
      ModelLayout(model_, options_.seed, options_.chunk_bytes,
                  options_.link_bits_per_second,
                  WireBytesPerElement(client_->compression())),
      optimizer_);
}

int Trainer::StartEpoch(int epoch, std::vector<uint32_t>* last_ranks) {
  const std::vector<uint32_t> ranks = EpochRanks();
  if (ranks != *last_ranks) {
    LogInfo("epoch %d: the global batch is sharded over %d worker(s), ranks %s",
            epoch, ranks.size(), absl::StrJoin(ranks, ","));
    *last_ranks = ranks;
  }
  epoch_workers_ = static_cast<uint32_t>(ranks.size());
  return static_cast<int>(
      std::lower_bound(ranks.begin(), ranks.end(), options_.rank) -
      ranks.begin());
}

absl::Status Trainer::EndEpoch(int epoch, int64_t step, bool last,
                               const EpochStats& stats, TrainResult* result) {
  TrainResult& r = *result;
  const absl::Duration epoch_time = absl::Now() - stats.start;
  r.epoch = epoch;
  r.step = step;
  r.train_loss = stats.loss_sum / std::max<int64_t>(1, stats.steps);
  const bool lead = options_.lead ? options_.lead() : options_.rank == 0;
  if (lead) {
    std::optional<EvalResult> eval;
    if (test_.has_value() && test_->num_samples() > 0 &&
        (last || epoch % options_.eval_every_epochs == 0)) {
      SHARDPS_ASSIGN_OR_RETURN(eval, Evaluate());
      r.test_accuracy =
          static_cast<double>(eval->correct) / test_->num_samples();
    }
    // The row first: whoever reads the epoch's line finds its row written
    // (a test kills the lead at that line and expects the row).
    SHARDPS_RETURN_IF_ERROR(WriteMetricsRow(epoch, step, stats, epoch_time,
                                            eval ? &*eval : nullptr));
    const double total =
        absl::ToDoubleSeconds(stats.compute + stats.push + stats.wait);
    LogInfo(
        "epoch %d/%d step %d train_loss %.4f test_accuracy %s samples/s "
        "%.0f compute %.0f%% push %.0f%% wait %.0f%% (per step: compute "
        "%.2f ms, exchange %.2f ms, %.2f ms of it not hidden)",
        epoch, options_.epochs, step, r.train_loss,
        eval ? absl::StrFormat("%.4f", r.test_accuracy) : "-",
        stats.samples / absl::ToDoubleSeconds(epoch_time),
        100 * absl::ToDoubleSeconds(stats.compute) / total,
        100 * absl::ToDoubleSeconds(stats.push) / total,
        100 * absl::ToDoubleSeconds(stats.wait) / total,
        stats.PerStepMs(stats.compute), stats.PerStepMs(stats.exchange),
        stats.PerStepMs(stats.exposed));
    // Where it cannot be, Run said so once.
    if (NoAheadReason().empty() || stats.ahead > 0) {
      LogInfo(
          "epoch %d: the next batch's first layer was computed while the "
          "replies came in %d of %d steps",
          epoch, stats.ahead, stats.steps);
    }
    if (options_.clip_grad_norm > 0) {
      LogInfo("epoch %d: mean global gradient norm %.4f (clipped to %g)", epoch,
              stats.grad_norm_sum / std::max<int64_t>(1, stats.steps),
              options_.clip_grad_norm);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainResult> Trainer::Run() {
  SHARDPS_ASSIGN_OR_RETURN(
      const int64_t steps_per_epoch,
      StepsPerEpoch(train_.num_samples(), options_.batch_size,
                    options_.num_workers));
  SHARDPS_RETURN_IF_ERROR(Prepare());
  const int64_t total_steps =
      options_.max_steps > 0
          ? std::min<int64_t>(options_.max_steps,
                              steps_per_epoch * options_.epochs)
          : steps_per_epoch * options_.epochs;
  Recovery recovery(
      options_.recovery, client_.get(), [this] { return WeightViews(); },
      steps_per_epoch, total_steps, options_.rollback,
      options_.rejoin_when_dropped);
  recovery.Start();
  int64_t step = client_->start_step();
  if (client_->must_join()) {
    SHARDPS_ASSIGN_OR_RETURN(step, recovery.JoinRunningJob());
  }
  SHARDPS_RETURN_IF_ERROR(client_->Pull(WeightViews()));
  LogInfo("%s", client_->DescribeTransport());
  if (const std::string why = NoAheadReason(); !why.empty()) {
    LogInfo(
        "each step computes its batch's first layer itself, not while the "
        "last step's replies come: %s",
        why);
  }
  LogInfo(
      "model %s (%d parameters) declared in %s; %d steps per epoch, %d "
      "epochs",
      model_.ToString(), model_.num_params(), client_->DescribeChunks(),
      steps_per_epoch, options_.epochs);
  TrainResult result;
  // Servers restored from a checkpoint are at its step: resume there, at
  // the same place in the same epoch's data order.
  resumed_ = step > 0;
  if (step > 0 && !client_->must_join()) {
    LogInfo("resuming at step %d (epoch %d)", step, step / steps_per_epoch + 1);
  }
  std::vector<uint32_t> last_ranks;
  for (uint32_t r = 0; r < options_.num_workers; ++r) last_ranks.push_back(r);
  const int64_t n = train_.num_samples();
  const int first_epoch = static_cast<int>(step / steps_per_epoch) + 1;
  for (int epoch = first_epoch; epoch <= options_.epochs; ++epoch) {
    const std::vector<int64_t> perm = EpochPermutation(n, options_.seed, epoch);
    const int position = StartEpoch(epoch, &last_ranks);
    EpochStats stats;
    int64_t rejoined_at = -1;
    bool stop = options_.max_steps > 0 && step >= options_.max_steps;
    for (int64_t s = step - (epoch - 1) * steps_per_epoch;
         s < steps_per_epoch && !stop; ++s) {
      const IndexRange slice =
          WorkerSlice(s * options_.batch_size, options_.batch_size, position,
                      static_cast<int>(epoch_workers_));
      if (options_.step_delay > absl::ZeroDuration()) {
        absl::SleepFor(options_.step_delay);
      }
      // The next step's batch, in this epoch (its first layer is computed
      // while this step's replies arrive).
      IndexRange next{0, 0};
      if (s + 1 < steps_per_epoch &&
          !(options_.max_steps > 0 && step + 1 >= options_.max_steps)) {
        next = WorkerSlice((s + 1) * options_.batch_size, options_.batch_size,
                           position, static_cast<int>(epoch_workers_));
      }
      const absl::Status pushed = Step(
          step, absl::MakeConstSpan(perm).subspan(slice.begin, slice.size()),
          absl::MakeConstSpan(perm).subspan(next.begin, next.size()), &stats);
      if (!pushed.ok()) {
        SHARDPS_ASSIGN_OR_RETURN(rejoined_at, recovery.Recover(pushed, step));
        break;
      }
      ++step;
      if (options_.on_step) options_.on_step(step, epoch);
      stop = options_.max_steps > 0 && step >= options_.max_steps;
    }
    if (rejoined_at >= 0) {  // continue where the job goes on
      step = rejoined_at;
      epoch = static_cast<int>(step / steps_per_epoch);
      result.step = step;
      if (step >= total_steps) break;
      continue;
    }
    const bool last = stop || epoch == options_.epochs;
    SHARDPS_RETURN_IF_ERROR(EndEpoch(epoch, step, last, stats, &result));
    if (stop) break;
  }
  if (options_.lead ? options_.lead() : options_.rank == 0) {
    SHARDPS_RETURN_IF_ERROR(WriteModel(step));
  }
  return result;
}

}  // namespace shardps::worker
