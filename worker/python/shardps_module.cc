// _shardps: the Python binding of a worker's Session (worker/session.h) and
// of the data order shardps-worker uses. It takes float32 buffers (numpy
// arrays, or anything with the buffer protocol), never torch tensors, so
// one build serves every torch version. Network waits release the GIL;
// heartbeats and the cluster watch run on C++ threads. A failed call raises
// the shardps.Error subclass of its status code (shardps/_errors.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/chunking.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/security.h"
#include "common/transport.h"
#include "worker/python/binding_util.h"
#include "worker/session.h"

namespace py = pybind11;

namespace shardps::python {
namespace {

absl::StatusOr<v1::OptimizerSpec> OptimizerFromDict(const py::dict& d,
                                                    const std::string& what) {
  static const auto* kinds = new std::map<std::string, v1::OptimizerSpec::Kind>{
      {"sgd", v1::OptimizerSpec::KIND_SGD},
      {"adam", v1::OptimizerSpec::KIND_ADAM},
      {"adamw", v1::OptimizerSpec::KIND_ADAMW},
      {"adagrad", v1::OptimizerSpec::KIND_ADAGRAD}};
  v1::OptimizerSpec spec;
  for (const auto& [key, value] : d) {
    const std::string k = py::str(key);
    if (k == "kind") {
      const std::string name = py::str(value);
      auto kind = kinds->find(name);
      if (kind == kinds->end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": optimizer kind '", name,
                         "' is not one of sgd, adam, adamw, adagrad"));
      }
      spec.set_kind(kind->second);
    } else if (k == "lr") {
      spec.set_learning_rate(value.cast<float>());
    } else if (k == "momentum") {
      spec.set_momentum(value.cast<float>());
    } else if (k == "nesterov") {
      spec.set_nesterov(value.cast<bool>());
    } else if (k == "weight_decay") {
      spec.set_weight_decay(value.cast<float>());
    } else if (k == "beta1") {
      spec.set_beta1(value.cast<float>());
    } else if (k == "beta2") {
      spec.set_beta2(value.cast<float>());
    } else if (k == "eps") {
      spec.set_epsilon(value.cast<float>());
    } else if (k == "initial_accumulator") {
      spec.set_initial_accumulator(value.cast<float>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unknown optimizer setting '", k, "'"));
    }
  }
  return spec;
}

SecurityOptions LoadSecurity(const std::string& cert, const std::string& key,
                             const std::string& ca,
                             const std::string& token_file,
                             const std::string& server_name) {
  SecurityFiles files;
  files.tls_cert = cert;
  files.tls_key = key;
  files.tls_ca = ca;
  files.auth_token_file = token_file;
  files.tls_server_name = server_name;
  return Check(LoadSecurityOptions(files));
}

// The Python Session: a worker::Session and the Python objects whose
// memory it reads and writes (the weight buffers for the session's life, a
// step's gradients until the step ends).
class PySession {
 public:
  PySession(std::unique_ptr<worker::Session> session,
            int64_t link_bits_per_second)
      : session_(std::move(session)),
        link_bits_per_second_(link_bits_per_second) {}
  ~PySession() {
    py::gil_scoped_release release;
    session_.reset();
  }

  worker::Session& s() { return *session_; }

  void Declare(const py::list& tensors, const py::dict& optimizer,
               int64_t chunk_bytes, const py::list& initial,
               const py::list& weights) {
    v1::Layout layout;
    layout.set_chunk_bytes(chunk_bytes);
    for (const py::handle& item : tensors) {
      const py::dict t = item.cast<py::dict>();
      v1::TensorSpec* spec = layout.add_tensors();
      spec->set_name(t["name"].cast<std::string>());
      for (int64_t d : t["shape"].cast<std::vector<int64_t>>()) {
        spec->add_shape(d);
      }
      spec->mutable_init()->set_kind(v1::InitSpec::KIND_PROVIDED);
      if (t.contains("optimizer")) {
        *spec->mutable_optimizer() =
            Check(OptimizerFromDict(t["optimizer"].cast<py::dict>(),
                                    absl::StrCat("tensor ", spec->name())));
      }
    }
    if (chunk_bytes < 0) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("chunk_bytes ", chunk_bytes, " is negative")));
    }
    // 0: from the model's size, the links' rate and the wire encodings.
    ChooseChunkBytes(layout, link_bits_per_second_,
                     WireBytesPerElement(s().client().compression()));
    const v1::OptimizerSpec spec =
        Check(OptimizerFromDict(optimizer, "the optimizer"));
    if (static_cast<int>(weights.size()) != layout.tensors_size() ||
        (!initial.empty() &&
         static_cast<int>(initial.size()) != layout.tensors_size())) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("the model has ", layout.tensors_size(),
                       " tensors; got ", weights.size(), " weight buffers and ",
                       initial.size(), " initial values")));
    }
    ConstTensors initial_spans;
    Tensors weight_spans;
    for (int i = 0; i < layout.tensors_size(); ++i) {
      const std::string& name = layout.tensors(i).name();
      weight_spans.push_back(
          Check(FloatSpan(weights[i].cast<py::buffer>(), true,
                          absl::StrCat(name, " (weights)"))));
      if (!initial.empty()) {
        initial_spans.push_back(
            Check(FloatSpan(initial[i].cast<py::buffer>(), false,
                            absl::StrCat(name, " (initial values)"))));
      }
    }
    weights_ = weights;
    initial_ = initial;
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = session_->Declare(layout, spec, initial_spans, weight_spans);
    }
    Check(status);
  }

  void BeginStep(bool second_phase, std::optional<float> loss_scale,
                 std::optional<float> max_grad_norm) {
    StepOptions options;
    options.second_phase = second_phase;
    options.loss_scale = loss_scale;
    options.max_grad_norm = max_grad_norm;
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = session_->BeginStep(options);
    }
    Check(status);
    gradients_ = py::list();
  }

  // momentum, beta1, beta2: None keeps the declared value.
  void Push(int tensor, const py::object& gradient, float learning_rate,
            const std::string& name, std::optional<float> momentum,
            std::optional<float> beta1, std::optional<float> beta2) {
    const StepHyperparameters h = {learning_rate, momentum, beta1, beta2};
    absl::Status status;
    if (gradient.is_none()) {
      py::gil_scoped_release release;
      status = session_->PushNoGradient(tensor, h);
    } else {
      const absl::Span<float> span =
          Check(FloatSpan(gradient.cast<py::buffer>(), false,
                          absl::StrCat(name, " (gradient)")));
      gradients_.append(gradient);  // read until the step ends
      // Unlocked: starting the write may run gRPC's transport work (the
      // socket write) on this thread, and backward's other threads need
      // the GIL meanwhile.
      py::gil_scoped_release release;
      status = session_->PushTensor(tensor, span, h);
    }
    Check(status);
  }

  bool FinishStep() {
    absl::StatusOr<bool> done;
    {
      py::gil_scoped_release release;
      done = session_->FinishStep();
    }
    gradients_ = py::list();
    return Check(std::move(done));
  }

  void AbortStep() {
    {
      py::gil_scoped_release release;
      session_->AbortStep();
    }
    gradients_ = py::list();
  }

 private:
  std::unique_ptr<worker::Session> session_;
  const int64_t link_bits_per_second_;  // 0: not known
  py::list weights_;                    // written by the session
  py::list initial_;    // read by Declare only; kept for symmetry
  py::list gradients_;  // of the open step
};

// The op and dtype names of shardps.torch's collectives.
absl::StatusOr<v1::CollectiveOp> CollectiveOpNamed(const std::string& name) {
  static const auto* ops = new std::map<std::string, v1::CollectiveOp>{
      {"sum", v1::COLLECTIVE_OP_SUM},
      {"mean", v1::COLLECTIVE_OP_MEAN},
      {"max", v1::COLLECTIVE_OP_MAX},
      {"min", v1::COLLECTIVE_OP_MIN},
      {"broadcast", v1::COLLECTIVE_OP_BROADCAST},
      {"barrier", v1::COLLECTIVE_OP_BARRIER}};
  auto it = ops->find(name);
  if (it == ops->end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "collective op '", name,
        "' is not one of sum, mean, max, min, broadcast, barrier"));
  }
  return it->second;
}

absl::StatusOr<v1::CollectiveDtype> CollectiveDtypeNamed(
    const std::string& name) {
  if (name.empty()) return v1::COLLECTIVE_DTYPE_UNSPECIFIED;
  if (name == "float32") return v1::COLLECTIVE_DTYPE_FLOAT32;
  if (name == "float64") return v1::COLLECTIVE_DTYPE_FLOAT64;
  if (name == "int64") return v1::COLLECTIVE_DTYPE_INT64;
  return absl::InvalidArgumentError(absl::StrCat(
      "collective dtype '", name, "' is not float32, float64 or int64"));
}

}  // namespace

void DefineModule(py::module_& m) {
  m.doc() =
      "shardps worker binding: a Session joins a job, declares a model and "
      "pushes steps tensor by tensor (see shardps.torch for the PyTorch "
      "layer).";
  // As in the daemons (common/daemon_flags.cc): no lock-graph bookkeeping.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  py::class_<PySession>(m, "Session")
      .def(
          py::init(
              [](const std::string& coordinator,
                 const std::vector<std::string>& servers, int rank,
                 std::optional<uint32_t> num_workers, const std::string& job_id,
                 const std::string& tls_cert, const std::string& tls_key,
                 const std::string& tls_ca, const std::string& auth_token_file,
                 const std::string& tls_server_name, double connect_timeout_s,
                 double rpc_timeout_s, int streams_per_shard,
                 bool shared_memory, const std::string& compression,
                 bool error_feedback, int64_t topk_warmup_steps,
                 int64_t compression_min_elements,
                 const std::string& weight_encoding, bool speculative_weights,
                 const std::string& link_rate) {
                const int64_t link_bits_per_second =
                    link_rate.empty()
                        ? 0
                        : Check(ParseLinkRate(link_rate, "link_rate"));
                worker::SessionOptions o;
                o.coordinator = coordinator;
                o.servers = servers;
                o.rank = rank;
                o.num_workers = num_workers;
                o.job_id = job_id;
                o.security = LoadSecurity(tls_cert, tls_key, tls_ca,
                                          auth_token_file, tls_server_name);
                o.connect_timeout = absl::Seconds(connect_timeout_s);
                o.rpc_timeout = absl::Seconds(rpc_timeout_s);
                o.recovery.rollback_timeout =
                    std::max(o.recovery.rollback_timeout, o.connect_timeout);
                o.streams_per_shard = streams_per_shard;
                if (link_bits_per_second > 0) {
                  o.receive_buffer_bytes =
                      ReceiveBufferBytesForLink(link_bits_per_second);
                }
                o.shared_memory = shared_memory;
                o.speculative_weights = speculative_weights;
                o.compression.gradients = Check(ParseGradientCompression(
                    compression, &o.compression.topk_ratio));
                o.compression.error_feedback = error_feedback;
                o.compression.topk_warmup_steps = topk_warmup_steps;
                o.compression.min_elements = compression_min_elements;
                o.compression.weights = Check(ParseWeightEncoding(
                    weight_encoding, &o.compression.weights_topk_ratio));
                absl::StatusOr<std::unique_ptr<worker::Session>> session;
                {
                  py::gil_scoped_release release;
                  session = worker::Session::Start(std::move(o));
                }
                return std::make_unique<PySession>(Check(std::move(session)),
                                                   link_bits_per_second);
              }),
          py::arg("coordinator") = "",
          py::arg("servers") = std::vector<std::string>{}, py::arg("rank") = -1,
          py::arg("num_workers") = py::none(), py::arg("job_id") = "default",
          py::arg("tls_cert") = "", py::arg("tls_key") = "",
          py::arg("tls_ca") = "", py::arg("auth_token_file") = "",
          py::arg("tls_server_name") = "", py::arg("connect_timeout_s") = 120.0,
          py::arg("rpc_timeout_s") = 300.0, py::arg("streams_per_shard") = 2,
          py::arg("shared_memory") = true, py::arg("compression") = "none",
          py::arg("error_feedback") = true, py::arg("topk_warmup_steps") = 0,
          py::arg("compression_min_elements") = 0,
          py::arg("weight_encoding") = "fp32",
          py::arg("speculative_weights") = true, py::arg("link_rate") = "",
          "Joins the job (coordinator) or connects to `servers` (static) and "
          "waits until the job can take this worker. `compression` is the "
          "gradients' encoding on the wire (none, bf16, fp16, int8, "
          "topk:RATIO), with `error_feedback` for the lossy ones; "
          "`weight_encoding` the weights' (fp32, bf16 or topk:RATIO).")
      .def_property_readonly("rank", [](PySession& p) { return p.s().rank(); })
      .def_property_readonly("num_workers",
                             [](PySession& p) { return p.s().num_workers(); })
      .def_property_readonly("servers",
                             [](PySession& p) { return p.s().servers(); })
      .def_property_readonly("coordinated",
                             [](PySession& p) { return p.s().coordinated(); })
      .def_property_readonly(
          "is_lead", [](PySession& p) { return p.s().IsLead(); },
          "This worker does rank 0's duties: the lowest rank in the job.")
      .def_property_readonly(
          "step", [](PySession& p) { return p.s().step(); },
          "The step pushed next.")
      .def_property_readonly("step_open",
                             [](PySession& p) { return p.s().step_open(); })
      .def("declare", &PySession::Declare, py::arg("tensors"),
           py::arg("optimizer"), py::arg("chunk_bytes"), py::arg("initial"),
           py::arg("weights"),
           "Declares the model: tensors are dicts (name, shape, optimizer); "
           "rank 0's `initial` float32 buffers are the initial values; "
           "`weights` (writable float32 buffers) receive the job's weights "
           "now and after every step.")
      .def(
          "start_epochs",
          [](PySession& p, int64_t steps_per_epoch) {
            return Check(
                Unlocked([&] { return p.s().StartEpochs(steps_per_epoch); }));
          },
          py::arg("steps_per_epoch"),
          "Sets the steps of an epoch; a worker new to a running job joins "
          "at the next epoch start here. Returns the step to go on from.")
      .def(
          "active_ranks",
          [](PySession& p) {
            return Unlocked([&] { return p.s().ActiveRanks(); });
          },
          "The ranks sharing the global batch now, ascending.")
      .def(
          "gradient_buffers",
          [](py::object self) {
            // Views of the client's region: the session (their base) keeps
            // it mapped while it is current and until the next renewal.
            py::list out;
            for (absl::Span<float> t :
                 self.cast<PySession&>().s().client().GradientBuffers()) {
              out.append(
                  py::array_t<float>({static_cast<py::ssize_t>(t.size())},
                                     {sizeof(float)}, t.data(), self));
            }
            return out;
          },
          "After declare: one writable float32 array per tensor in the "
          "client's gradient region, which the shards on this machine read "
          "without a copy (an empty list when no shard takes shared memory). "
          "Valid until buffer_regions changes twice (or another layout is "
          "declared): take them again when it changes.")
      .def_property_readonly(
          "buffer_regions",
          [](PySession& p) { return p.s().client().buffer_regions(); },
          "Gradient and weight regions made so far: a new value means new "
          "gradient_buffers (after a step that failed on a stream).")
      .def("begin_step", &PySession::BeginStep, py::arg("second_phase") = false,
           py::arg("loss_scale") = py::none(),
           py::arg("max_grad_norm") = py::none(),
           "Opens the next step; second_phase makes it a two-phase step "
           "(global-norm clipping to max_grad_norm, loss scaling).")
      .def(
          "grad_norm",
          [](PySession& p) {
            absl::StatusOr<std::optional<double>> norm =
                Unlocked([&] { return p.s().GradNorm(); });
            return Check(std::move(norm));
          },
          "Two-phase steps, after every push: the global norm of the step's "
          "averaged gradient (None when the job went back: finish_step then "
          "returns False).")
      .def(
          "set_wire",
          [](PySession& p, const std::string& compression,
             const std::string& weight_encoding) {
            Compression c = p.s().client().compression();
            c.gradients =
                Check(ParseGradientCompression(compression, &c.topk_ratio));
            c.weights = Check(
                ParseWeightEncoding(weight_encoding, &c.weights_topk_ratio));
            Check(p.s().client().SetCompression(c));
          },
          py::arg("compression"), py::arg("weight_encoding"),
          "Before declare: how gradients and weights cross the wire (as "
          "init's compression and weight_encoding).")
      .def(
          "pull_fp32",
          [](PySession& p, const py::list& arrays) {
            Tensors spans;
            for (size_t i = 0; i < arrays.size(); ++i) {
              spans.push_back(Check(
                  FloatSpan(arrays[i].cast<py::buffer>(), true, "weights")));
            }
            Check(Unlocked([&] { return p.s().client().Pull(spans, true); }));
          },
          py::arg("arrays"),
          "The servers' weights, exactly (fp32 whatever the wire's weight "
          "encoding), into float32 arrays, one per tensor; no step open.")
      .def(
          "read_optimizer_state",
          [](PySession& p) {
            const int64_t step = p.s().step();
            std::vector<TensorOptimizerState> states = Check(Unlocked(
                [&] { return p.s().client().ReadOptimizerState(step); }));
            py::list out;
            for (TensorOptimizerState& t : states) {
              py::list slots;
              for (std::vector<float>& slot : t.slots) {
                py::array_t<float> a(static_cast<py::ssize_t>(slot.size()));
                std::copy(slot.begin(), slot.end(), a.mutable_data());
                slots.append(a);
              }
              out.append(py::make_tuple(t.optimizer_steps, slots));
            }
            return out;
          },
          "Between steps: every tensor's optimizer state on the servers, as "
          "(optimizer steps, [slot arrays]) in layout order (slots: SGD's "
          "momentum buffer, Adam's exp_avg and exp_avg_sq, Adagrad's sum).")
      .def(
          "write_optimizer_state",
          [](PySession& p, const py::list& states) {
            std::vector<std::optional<TensorOptimizerState>> in;
            for (size_t i = 0; i < states.size(); ++i) {
              if (states[i].is_none()) {
                in.emplace_back();
                continue;
              }
              const auto entry = states[i].cast<py::tuple>();
              TensorOptimizerState t;
              t.optimizer_steps = entry[0].cast<int64_t>();
              for (const py::handle slot : entry[1].cast<py::list>()) {
                const absl::Span<float> values = Check(FloatSpan(
                    slot.cast<py::buffer>(), false, "an optimizer slot"));
                t.slots.emplace_back(values.begin(), values.end());
              }
              in.push_back(std::move(t));
            }
            const int64_t step = p.s().step();
            Check(Unlocked(
                [&] { return p.s().client().WriteOptimizerState(step, in); }));
          },
          py::arg("states"),
          "Between steps: replaces the optimizer state of every tensor "
          "whose entry is not None, as read_optimizer_state returns it.")
      .def_property_readonly(
          "wire",
          [](PySession& p) {
            const Compression& c = p.s().client().compression();
            return py::make_tuple(v1::Encoding_Name(c.gradients),
                                  v1::Encoding_Name(c.weights));
          },
          "(gradient encoding, weight encoding) names, e.g. ENCODING_FP32.")
      .def(
          "set_max_grad_norm",
          [](PySession& p, float max_norm) {
            Check(p.s().client().SetMaxGradNorm(max_norm));
          },
          py::arg("max_norm"))
      .def_property_readonly(
          "last_grad_norm",
          [](PySession& p) { return p.s().client().last_grad_norm(); })
      .def_property_readonly(
          "last_step_skipped",
          [](PySession& p) { return p.s().client().last_step_skipped(); })
      .def("push", &PySession::Push, py::arg("tensor"), py::arg("gradient"),
           py::arg("learning_rate"), py::arg("name"),
           py::arg("momentum") = py::none(), py::arg("beta1") = py::none(),
           py::arg("beta2") = py::none(),
           "Pushes one tensor's gradient (None: no gradient this step) with "
           "the step's hyperparameters (None: the declared value).")
      .def("finish_step", &PySession::FinishStep,
           "Waits for the step's replies: True when the step is done, False "
           "when the job went back (or on) to `step`.")
      .def("abort_step", &PySession::AbortStep)
      .def(
          "collective",
          [](PySession& p, const std::string& op, const std::string& dtype,
             const std::vector<int64_t>& shape, const py::bytes& values,
             int32_t src, double timeout_s) {
            const v1::CollectiveOp o = Check(CollectiveOpNamed(op));
            const v1::CollectiveDtype d = Check(CollectiveDtypeNamed(dtype));
            std::string in = values;
            absl::StatusOr<std::string> out = Unlocked([&] {
              return p.s().Collective(o, d, shape, std::move(in), src,
                                      absl::Seconds(timeout_s));
            });
            return py::bytes(Check(std::move(out)));
          },
          py::arg("op"), py::arg("dtype"), py::arg("shape"), py::arg("values"),
          py::arg("src"), py::arg("timeout_s"),
          "One collective over the job's live workers (rpc Collective): "
          "`values` are this rank's raw little-endian values (empty for a "
          "barrier and a broadcast off src); returns the result's bytes.")
      .def(
          "set_progress",
          [](PySession& p, int64_t step, int64_t epoch) {
            p.s().SetProgress(step, epoch);
          },
          py::arg("step"), py::arg("epoch"))
      .def(
          "finish",
          [](PySession& p) { Check(Unlocked([&] { return p.s().Finish(); })); },
          "Tells the coordinator this rank completed its training.")
      .def(
          "leave",
          [](PySession& p) { Check(Unlocked([&] { return p.s().Leave(); })); },
          "Leaves the job (the other workers stop waiting for this one).");

  DefineFunctions(m);
}

}  // namespace shardps::python

PYBIND11_MODULE(_shardps, m) { shardps::python::DefineModule(m); }
