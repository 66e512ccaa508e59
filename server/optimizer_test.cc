#include "server/optimizer.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/lr_schedule.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {
namespace {

using Contributions = std::vector<std::vector<float>>;  // [rank][element]

constexpr float kSentinel = 12345.0f;

v1::OptimizerSpec ParseSpec(const std::string& text) {
  v1::OptimizerSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec))
      << text;
  return spec;
}

// The weights and slots of one chunk of n elements. Every array has one more
// element, a sentinel that Apply must leave alone.
struct Chunk {
  Chunk(const Optimizer& opt, std::vector<float> weights)
      : n(weights.size()), w(std::move(weights)) {
    w.push_back(kSentinel);
    slots.assign(opt.num_slots(), std::vector<float>(n + 1, kSentinel));
    opt.InitSlots(SlotPointers(), n);
  }
  std::vector<float*> SlotPointers() {
    std::vector<float*> pointers;
    for (std::vector<float>& slot : slots) pointers.push_back(slot.data());
    return pointers;
  }
  void Apply(const Optimizer& opt, int64_t update, const Contributions& c,
             const StepHyperparameters& step = {}) {
    std::vector<const float*> ranks;
    for (const std::vector<float>& rank : c) ranks.push_back(rank.data());
    opt.Apply(update, ranks, w.data(), SlotPointers(), n, step);
    EXPECT_EQ(w[n], kSentinel);
    for (const std::vector<float>& slot : slots) EXPECT_EQ(slot[n], kSentinel);
  }
  int64_t n;
  std::vector<float> w;
  std::vector<std::vector<float>> slots;
};

// Starts a one-element chunk at w = 1, applies updates 0, 1, 2 with the
// given per-rank gradients and checks w after each.
void ExpectTrajectory(const std::string& spec_text,
                      const std::vector<std::vector<float>>& grads_by_update,
                      const std::vector<double>& want) {
  SCOPED_TRACE(spec_text);
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(ParseSpec(spec_text));
  SHARDPS_ASSERT_OK(opt);
  Chunk chunk(**opt, {1.0f});
  for (size_t u = 0; u < want.size(); ++u) {
    Contributions c;
    for (float g : grads_by_update[u]) c.push_back({g});
    chunk.Apply(**opt, u, c);
    // Hand values are exact decimals; float32 rounding over three updates
    // stays well under 1e-6 relative.
    EXPECT_NEAR(chunk.w[0], want[u], 1e-6 * (1 + std::abs(want[u])))
        << "update " << u;
  }
}

TEST(OptimizerTest, SgdMatchesHandValues) {
  // Two ranks; mean g = 1, 2, -2. w -= 0.1 * g: 1 - 0.1 = 0.9,
  // 0.9 - 0.2 = 0.7, 0.7 + 0.2 = 0.9.
  ExpectTrajectory("kind: KIND_SGD learning_rate: 0.1",
                   {{0.5f, 1.5f}, {2, 2}, {-1, -3}}, {0.9, 0.7, 0.9});
}

TEST(OptimizerTest, SgdMomentumMatchesHandValues) {
  // g = 1, 2, -2; buf = 0.9 * buf + g: 1, 2.9, 0.61.
  // w -= 0.1 * buf: 0.9, 0.9 - 0.29 = 0.61, 0.61 - 0.061 = 0.549.
  ExpectTrajectory("kind: KIND_SGD learning_rate: 0.1 momentum: 0.9",
                   {{1}, {2}, {-2}}, {0.9, 0.61, 0.549});
}

TEST(OptimizerTest, SgdNesterovMatchesHandValues) {
  // buf = 1, 2.9, 0.61 as above; step g + 0.9 * buf = 1.9, 4.61, -1.451.
  // w: 1 - 0.19 = 0.81, 0.81 - 0.461 = 0.349, 0.349 + 0.1451 = 0.4941.
  ExpectTrajectory(
      "kind: KIND_SGD learning_rate: 0.1 momentum: 0.9 nesterov: true",
      {{1}, {2}, {-2}}, {0.81, 0.349, 0.4941});
}

TEST(OptimizerTest, SgdWeightDecayMatchesHandValues) {
  // g' = g + 0.5 * w: 1 + 0.5 = 1.5 -> w = 1 - 0.15 = 0.85;
  // 2 + 0.425 = 2.425 -> w = 0.85 - 0.2425 = 0.6075;
  // -2 + 0.30375 = -1.69625 -> w = 0.6075 + 0.169625 = 0.777125.
  ExpectTrajectory("kind: KIND_SGD learning_rate: 0.1 weight_decay: 0.5",
                   {{1}, {2}, {-2}}, {0.85, 0.6075, 0.777125});
}

TEST(OptimizerTest, AdamMatchesHandValues) {
  // Defaults b1 = 0.9, b2 = 0.999, eps = 1e-8; g = 1, 2, -2.
  // t=1: m = 0.1, v = 0.001; m^ = 1, v^ = 1; w = 1 - 0.1 * 1 / 1 = 0.9.
  // t=2: m = 0.09 + 0.2 = 0.29, v = 0.000999 + 0.004 = 0.004999;
  //      m^ = 0.29 / 0.19 = 1.5263158, v^ = 0.004999 / 0.001999 = 2.5007504,
  //      sqrt = 1.5813761; w = 0.9 - 0.1 * 0.9651820 = 0.8034818.
  // t=3: m = 0.261 - 0.2 = 0.061, v = 0.004994001 + 0.004 = 0.008994001;
  //      m^ = 0.061 / 0.271 = 0.2250923, v^ = 0.008994001 / 0.002997001
  //      = 3.0010003, sqrt = 1.7323396; w = 0.8034818 - 0.0129936
  //      = 0.7904883.
  ExpectTrajectory("kind: KIND_ADAM learning_rate: 0.1", {{1}, {2}, {-2}},
                   {0.9, 0.8034818, 0.7904883});
}

TEST(OptimizerTest, AdamWeightDecayMatchesHandValues) {
  // b1 = 0.5, b2 = 0.75, eps = 0.25, g' = g + 0.5 * w.
  // t=1: g' = 1.5, m = 0.75, v = 0.5625; m^ = 1.5, v^ = 2.25, sqrt = 1.5;
  //      w = 1 - 0.1 * 1.5 / 1.75 = 0.9142857.
  // t=2: g' = 2 + 0.4571429 = 2.4571429; m = 1.6035714, v = 1.9312628;
  //      m^ = m / 0.75 = 2.1380952, v^ = v / 0.4375 = 4.4143149,
  //      sqrt = 2.1010271; w = 0.9142857 - 0.1 * 2.1380952 / 2.3510271
  //      = 0.8233427.
  // t=3: g' = -2 + 0.4116713 = -1.5883287; m = 0.0076214,
  //      v = 2.0791440; m^ = m / 0.875 = 0.0087102,
  //      v^ = v / 0.578125 = 3.5963573, sqrt = 1.8964064;
  //      w = 0.8233427 - 0.1 * 0.0087102 / 2.1464064 = 0.8229369.
  ExpectTrajectory(
      "kind: KIND_ADAM learning_rate: 0.1 weight_decay: 0.5 beta1: 0.5 "
      "beta2: 0.75 epsilon: 0.25",
      {{1}, {2}, {-2}}, {0.9142857, 0.8233427, 0.8229369});
}

TEST(OptimizerTest, AdamWMatchesHandValues) {
  // As AdamMatchesHandValues, but w *= 1 - 0.1 * 0.5 = 0.95 first:
  // 0.95 - 0.1 = 0.85; 0.8075 - 0.0965182 = 0.7109818;
  // 0.6754327 - 0.0129936 = 0.6624392.
  ExpectTrajectory("kind: KIND_ADAMW learning_rate: 0.1 weight_decay: 0.5",
                   {{1}, {2}, {-2}}, {0.85, 0.7109818, 0.6624392});
}

TEST(OptimizerTest, AdagradMatchesHandValues) {
  // g = 3, 4, 12: sum = 9, 25, 169, sqrt = 3, 5, 13 (eps 1e-10 is far below
  // the tolerance). w: 1 - 0.1 * 3/3 = 0.9, 0.9 - 0.1 * 4/5 = 0.82,
  // 0.82 - 0.1 * 12/13 = 0.7276923.
  ExpectTrajectory("kind: KIND_ADAGRAD learning_rate: 0.1", {{3}, {4}, {12}},
                   {0.9, 0.82, 0.7276923});
  // initial_accumulator 7, g = 3, 4, 2: sum = 16, 32, 36;
  // w: 1 - 0.1 * 3/4 = 0.925, 0.925 - 0.1 * 4/5.6568542 = 0.8542893,
  // 0.8542893 - 0.1 * 2/6 = 0.8209560.
  ExpectTrajectory(
      "kind: KIND_ADAGRAD learning_rate: 0.1 initial_accumulator: 7",
      {{3}, {4}, {2}}, {0.925, 0.8542893, 0.8209560});
}

// A double-precision twin of Apply, written from the formulas rather than
// from the implementation.
struct Reference {
  Reference(const v1::OptimizerSpec& spec, const std::vector<float>& w0)
      : spec(spec),
        w(w0.begin(), w0.end()),
        buf(w0.size()),
        m(w0.size()),
        v(w0.size()),
        sum(w0.size(), spec.initial_accumulator()) {}

  void Step(int64_t update, const Contributions& c) {
    const double lr = spec.learning_rate() * LrFactor(spec.schedule(), update);
    const double wd = spec.weight_decay(), mu = spec.momentum();
    const double b1 = spec.beta1(), b2 = spec.beta2(), eps = spec.epsilon();
    const double t = update + 1;
    const bool adamw = spec.kind() == v1::OptimizerSpec::KIND_ADAMW;
    for (size_t i = 0; i < w.size(); ++i) {
      double g = 0;
      for (const std::vector<float>& rank : c) g += rank[i];
      g /= c.size();
      if (adamw) {
        w[i] *= 1 - lr * wd;
      } else {
        g += wd * w[i];
      }
      switch (spec.kind()) {
        case v1::OptimizerSpec::KIND_SGD:
          buf[i] = mu * buf[i] + g;
          if (mu > 0) g = spec.nesterov() ? g + mu * buf[i] : buf[i];
          w[i] -= lr * g;
          break;
        case v1::OptimizerSpec::KIND_ADAGRAD:
          sum[i] += g * g;
          w[i] -= lr * g / (std::sqrt(sum[i]) + eps);
          break;
        default:  // Adam, AdamW
          m[i] = b1 * m[i] + (1 - b1) * g;
          v[i] = b2 * v[i] + (1 - b2) * g * g;
          w[i] -= lr * (m[i] / (1 - std::pow(b1, t))) /
                  (std::sqrt(v[i] / (1 - std::pow(b2, t))) + eps);
      }
    }
  }

  v1::OptimizerSpec spec;
  std::vector<double> w, buf, m, v, sum;
};

TEST(OptimizerTest, MatchesDoubleReferenceOnRandomInput) {
  const char* const kSpecs[] = {
      "kind: KIND_SGD learning_rate: 0.05",
      "kind: KIND_SGD learning_rate: 0.05 momentum: 0.9",
      "kind: KIND_SGD learning_rate: 0.05 momentum: 0.9 nesterov: true",
      "kind: KIND_SGD learning_rate: 0.05 momentum: 0.5 weight_decay: 0.01",
      "kind: KIND_ADAM learning_rate: 0.01",
      "kind: KIND_ADAM learning_rate: 0.01 weight_decay: 0.1 beta1: 0.8 "
      "beta2: 0.99 epsilon: 1e-6",
      "kind: KIND_ADAMW learning_rate: 0.01 weight_decay: 0.1 "
      "schedule { kind: KIND_COSINE total_steps: 4 warmup_steps: 2 }",
      "kind: KIND_ADAGRAD learning_rate: 0.1 weight_decay: 0.01 "
      "initial_accumulator: 0.1",
  };
  constexpr int kRanks = 3;
  constexpr int kUpdates = 5;
  for (const char* spec_text : kSpecs) {
    for (int64_t n : {int64_t{1}, int64_t{2049}, int64_t{5000}}) {
      SCOPED_TRACE(absl::StrCat(spec_text, ", n=", n));
      absl::StatusOr<std::unique_ptr<Optimizer>> opt =
          Optimizer::Create(ParseSpec(spec_text));
      SHARDPS_ASSERT_OK(opt);
      std::mt19937 rng(17);
      std::uniform_real_distribution<float> uniform(-1, 1);
      std::normal_distribution<float> normal(0, 1);
      std::vector<float> w0(n);
      for (float& x : w0) x = uniform(rng);
      Chunk chunk(**opt, w0);
      Reference ref((*opt)->spec(), w0);
      for (int u = 0; u < kUpdates; ++u) {
        Contributions c(kRanks, std::vector<float>(n));
        for (std::vector<float>& rank : c) {
          for (float& x : rank) x = normal(rng);
        }
        chunk.Apply(**opt, u, c);
        ref.Step(u, c);
      }
      for (int64_t i = 0; i < n; ++i) {
        // float32 rounding (~6e-8 relative per operation) over five updates.
        ASSERT_NEAR(chunk.w[i], ref.w[i], 1e-6 * (1 + std::abs(ref.w[i])))
            << "element " << i;
      }
    }
  }
}

TEST(OptimizerTest, MeanIsSummedInRankOrderBitwise) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-20, 20);
  // Magnitudes spread over 2^-20..2^20, so that another summation order
  // would round differently.
  auto random_value = [&] { return std::ldexp(mantissa(rng), exponent(rng)); };
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(ParseSpec("kind: KIND_SGD learning_rate: 1"));
  SHARDPS_ASSERT_OK(opt);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    for (int64_t n : {1, 5, 2048, 2049, 5000}) {
      SCOPED_TRACE(absl::StrCat(ranks, " ranks, n=", n));
      Contributions c(ranks, std::vector<float>(n));
      std::vector<float> w0(n);
      for (float& x : w0) x = random_value();
      for (std::vector<float>& rank : c) {
        for (float& x : rank) x = random_value();
      }
      Chunk chunk(**opt, w0);
      chunk.Apply(**opt, /*update=*/0, c);
      for (int64_t i = 0; i < n; ++i) {
        float s = c[0][i];
        for (int r = 1; r < ranks; ++r) s += c[r][i];
        const float g = s / static_cast<float>(ranks);
        ASSERT_EQ(chunk.w[i], w0[i] - g) << "element " << i;
      }
    }
  }
}

TEST(OptimizerTest, ScheduleScalesLearningRate) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(ParseSpec("kind: KIND_SGD learning_rate: 0.1 "
                                  "schedule { kind: KIND_STEP step_size: 2 "
                                  "gamma: 0.5 }"));
  SHARDPS_ASSERT_OK(opt);
  const float want[] = {0.1f, 0.1f, 0.05f, 0.05f, 0.025f};
  for (int u = 0; u < 5; ++u) {
    EXPECT_FLOAT_EQ((*opt)->LearningRate(u), want[u]) << "update " << u;
  }
  // Update 4 runs at lr 0.025: w = 1 - 0.025 * 2 = 0.95.
  Chunk chunk(**opt, {1.0f});
  chunk.Apply(**opt, /*update=*/4, {{2.0f}});
  EXPECT_FLOAT_EQ(chunk.w[0], 0.95f);
}

TEST(OptimizerTest, SlotsMatchKind) {
  struct Case {
    const char* spec;
    int num_slots;
    float initial;
  };
  const Case kCases[] = {
      {"kind: KIND_SGD learning_rate: 1", 0, 0},
      {"kind: KIND_SGD learning_rate: 1 momentum: 0.5", 1, 0},
      {"kind: KIND_ADAM learning_rate: 1", 2, 0},
      {"kind: KIND_ADAMW learning_rate: 1", 2, 0},
      {"kind: KIND_ADAGRAD learning_rate: 1 initial_accumulator: 0.25", 1,
       0.25f},
  };
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.spec);
    absl::StatusOr<std::unique_ptr<Optimizer>> opt =
        Optimizer::Create(ParseSpec(c.spec));
    SHARDPS_ASSERT_OK(opt);
    ASSERT_EQ((*opt)->num_slots(), c.num_slots);
    Chunk chunk(**opt, std::vector<float>(3, 1.0f));  // slots start at 12345
    for (const std::vector<float>& slot : chunk.slots) {
      EXPECT_EQ(slot, (std::vector<float>{c.initial, c.initial, c.initial,
                                          kSentinel}));
    }
  }
}

TEST(OptimizerTest, FillsDefaults) {
  absl::StatusOr<std::unique_ptr<Optimizer>> adam =
      Optimizer::Create(ParseSpec("kind: KIND_ADAM learning_rate: 1"));
  SHARDPS_ASSERT_OK(adam);
  EXPECT_EQ((*adam)->spec().beta1(), 0.9f);
  EXPECT_EQ((*adam)->spec().beta2(), 0.999f);
  EXPECT_EQ((*adam)->spec().epsilon(), 1e-8f);
  absl::StatusOr<std::unique_ptr<Optimizer>> adagrad =
      Optimizer::Create(ParseSpec("kind: KIND_ADAGRAD learning_rate: 1"));
  SHARDPS_ASSERT_OK(adagrad);
  EXPECT_EQ((*adagrad)->spec().epsilon(), 1e-10f);
  absl::StatusOr<std::unique_ptr<Optimizer>> set = Optimizer::Create(
      ParseSpec("kind: KIND_ADAM learning_rate: 1 beta1: 0.5 beta2: 0.75 "
                "epsilon: 0.125"));
  SHARDPS_ASSERT_OK(set);
  EXPECT_EQ((*set)->spec().beta1(), 0.5f);
  EXPECT_EQ((*set)->spec().beta2(), 0.75f);
  EXPECT_EQ((*set)->spec().epsilon(), 0.125f);
}

TEST(OptimizerTest, RejectsInvalidSpecs) {
  struct Case {
    const char* spec;
    const char* field;  // named in the message
  };
  const Case kCases[] = {
      {"learning_rate: 0.1", "kind"},
      {"kind: KIND_SGD", "learning_rate"},
      {"kind: KIND_SGD learning_rate: -1", "learning_rate"},
      {"kind: KIND_SGD learning_rate: nan", "learning_rate"},
      {"kind: KIND_SGD learning_rate: inf", "learning_rate"},
      {"kind: KIND_SGD learning_rate: 1 momentum: -0.1", "momentum"},
      {"kind: KIND_SGD learning_rate: 1 momentum: 1", "momentum"},
      {"kind: KIND_SGD learning_rate: 1 momentum: nan", "momentum"},
      {"kind: KIND_SGD learning_rate: 1 nesterov: true", "nesterov"},
      {"kind: KIND_SGD learning_rate: 1 weight_decay: -0.01", "weight_decay"},
      {"kind: KIND_SGD learning_rate: 1 weight_decay: inf", "weight_decay"},
      {"kind: KIND_ADAM learning_rate: 1 beta1: -0.5", "beta1"},
      {"kind: KIND_ADAM learning_rate: 1 beta1: 1", "beta1"},
      {"kind: KIND_ADAMW learning_rate: 1 beta2: 1.5", "beta2"},
      {"kind: KIND_ADAM learning_rate: 1 beta2: nan", "beta2"},
      {"kind: KIND_ADAM learning_rate: 1 epsilon: -1e-8", "epsilon"},
      {"kind: KIND_ADAGRAD learning_rate: 1 epsilon: inf", "epsilon"},
      {"kind: KIND_ADAGRAD learning_rate: 1 initial_accumulator: -1",
       "initial_accumulator"},
      {"kind: KIND_SGD learning_rate: 1 schedule { warmup_steps: -1 }",
       "warmup_steps"},
      {"kind: KIND_SGD learning_rate: 1 schedule { kind: KIND_STEP }",
       "step_size"},
  };
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.spec);
    absl::StatusOr<std::unique_ptr<Optimizer>> opt =
        Optimizer::Create(ParseSpec(c.spec));
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument)
        << opt.status();
    EXPECT_TRUE(absl::StrContains(opt.status().message(), c.field))
        << opt.status();
  }
  v1::OptimizerSpec unknown = ParseSpec("learning_rate: 1");
  unknown.set_kind(static_cast<v1::OptimizerSpec::Kind>(9));
  EXPECT_EQ(Optimizer::Create(unknown).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A given learning rate replaces the scheduled one and nothing else: the
// result equals that of an optimizer declared with that rate and no
// schedule, at the same update (Adam's bias correction included).
TEST(OptimizerTest, GivenLearningRateReplacesTheScheduleOnly) {
  for (const char* kind : {"KIND_SGD momentum: 0.9", "KIND_ADAM",
                           "KIND_ADAMW weight_decay: 0.1", "KIND_ADAGRAD"}) {
    SCOPED_TRACE(kind);
    absl::StatusOr<std::unique_ptr<Optimizer>> scheduled =
        Optimizer::Create(ParseSpec(absl::StrCat(
            "kind: ", kind,
            " learning_rate: 0.5 schedule { kind: KIND_STEP step_size: 1 "
            "gamma: 0.5 }")));
    absl::StatusOr<std::unique_ptr<Optimizer>> plain = Optimizer::Create(
        ParseSpec(absl::StrCat("kind: ", kind, " learning_rate: 0.03")));
    SHARDPS_ASSERT_OK(scheduled);
    SHARDPS_ASSERT_OK(plain);
    Chunk given(**scheduled, {1.0f, -2.0f, 0.5f});
    Chunk want(**plain, {1.0f, -2.0f, 0.5f});
    for (int64_t u = 0; u < 4; ++u) {
      const Contributions c = {{0.1f * u, -0.3f, 2.0f},
                               {0.7f, 0.2f * u, -1.0f}};
      std::vector<const float*> ranks = {c[0].data(), c[1].data()};
      (*scheduled)
          ->Apply(u, ranks, given.w.data(), given.SlotPointers(), given.n,
                  StepHyperparameters{/*learning_rate=*/0.03f});
      want.Apply(**plain, u, c);
      EXPECT_EQ(given.w, want.w) << "update " << u;
      EXPECT_EQ(given.slots, want.slots) << "update " << u;
    }
  }
}

// A given momentum or beta replaces the declared one for its update alone
// (Adam's bias correction included): each update equals the one an
// optimizer declared with those values makes from the same weights and
// slots. At momentum 0 the update is plain SGD and the buffer stays.
TEST(OptimizerTest, GivenMomentumAndBetasEqualDeclaredOnes) {
  const std::optional<float> none;
  struct Case {
    std::string spec;
    std::vector<StepHyperparameters> steps;  // by update
  };
  const std::vector<Case> cases = {
      {"kind: KIND_SGD momentum: 0.9 weight_decay: 0.01",
       {{none, 0.95f}, {none, 0.5f}, {}, {none, 0.0f}, {0.2f, 0.7f}}},
      {"kind: KIND_SGD momentum: 0.9 nesterov: true",
       {{none, 0.85f}, {none, 0.0f}, {none, 0.6f}, {}}},
      {"kind: KIND_ADAM",
       {{none, none, 0.95f, 0.99f},
        {none, none, 0.85f},
        {},
        {none, none, 0.5f, 0.9f}}},
      {"kind: KIND_ADAMW weight_decay: 0.1",
       {{none, none, 0.8f}, {0.01f, none, 0.9f, 0.95f}, {none, none, 0.7f}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    const std::string base = c.spec + " learning_rate: 0.05";
    absl::StatusOr<std::unique_ptr<Optimizer>> given =
        Optimizer::Create(ParseSpec(base));
    SHARDPS_ASSERT_OK(given);
    Chunk chunk(**given, {1.0f, -2.0f, 0.5f});
    for (size_t u = 0; u < c.steps.size(); ++u) {
      const StepHyperparameters& step = c.steps[u];
      SHARDPS_ASSERT_OK((*given)->CheckStepHyperparameters(step));
      v1::OptimizerSpec spec = ParseSpec(base);
      if (step.learning_rate) spec.set_learning_rate(*step.learning_rate);
      if (step.momentum) spec.set_momentum(*step.momentum);
      if (step.momentum == 0.0f) spec.set_nesterov(false);
      if (step.beta1) spec.set_beta1(*step.beta1);
      if (step.beta2) spec.set_beta2(*step.beta2);
      absl::StatusOr<std::unique_ptr<Optimizer>> declared =
          Optimizer::Create(spec);
      SHARDPS_ASSERT_OK(declared);
      const Contributions g = {{0.1f * u, -0.3f, 2.0f}, {0.7f, 0.2f, -1.0f}};
      Chunk want = chunk;
      if ((*declared)->num_slots() == 0) {
        // Plain SGD: no slots to pass; the buffer must not change.
        std::vector<const float*> ranks = {g[0].data(), g[1].data()};
        (*declared)->Apply(u, ranks, want.w.data(), {}, want.n);
      } else {
        want.Apply(**declared, u, g);
      }
      chunk.Apply(**given, u, g, step);
      EXPECT_EQ(chunk.w, want.w) << "update " << u;
      EXPECT_EQ(chunk.slots, want.slots) << "update " << u;
    }
  }
}

TEST(OptimizerTest, StepHyperparametersAreCheckedAgainstTheKind) {
  const std::optional<float> none;
  struct Case {
    const char* spec;
    StepHyperparameters step;
    const char* want;  // empty: OK
  };
  const Case cases[] = {
      {"kind: KIND_SGD momentum: 0.9", {0.1f, 0.5f}, ""},
      {"kind: KIND_SGD momentum: 0.9", {none, 1.0f}, "momentum must be in"},
      {"kind: KIND_SGD", {none, 0.5f}, "declared with momentum 0"},
      {"kind: KIND_SGD", {none, 0.0f}, "declared with momentum 0"},
      {"kind: KIND_SGD momentum: 0.9", {none, none, 0.9f}, "beta1 is set"},
      {"kind: KIND_ADAM", {none, none, 0.0f, 0.5f}, ""},
      {"kind: KIND_ADAM", {none, 0.9f}, "KIND_ADAM, which has no momentum"},
      {"kind: KIND_ADAMW", {none, none, 0.9f, 1.0f}, "beta2 must be in"},
      {"kind: KIND_ADAGRAD", {none, none, none, 0.9f}, "beta2 is set"},
      {"kind: KIND_ADAGRAD", {-1.0f}, "learning rate must be"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    absl::StatusOr<std::unique_ptr<Optimizer>> opt =
        Optimizer::Create(ParseSpec(absl::StrCat(c.spec, " learning_rate: 1")));
    SHARDPS_ASSERT_OK(opt);
    const absl::Status s = (*opt)->CheckStepHyperparameters(c.step);
    if (*c.want == 0) {
      SHARDPS_EXPECT_OK(s);
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), c.want)) << s;
    }
  }
}

TEST(TensorOptimizersTest, TensorsWithoutTheirOwnShareTheDeclarations) {
  v1::DeclareRequest req;
  for (const char* name : {"a", "b", "c"}) {
    req.mutable_layout()->add_tensors()->set_name(name);
  }
  *req.mutable_optimizer() = ParseSpec("kind: KIND_SGD learning_rate: 0.1");
  *req.mutable_layout()->mutable_tensors(1)->mutable_optimizer() =
      ParseSpec("kind: KIND_ADAM learning_rate: 0.001");
  absl::StatusOr<TensorOptimizers> opts = TensorOptimizers::Create(req);
  SHARDPS_ASSERT_OK(opts);
  EXPECT_EQ(&opts->of(0), &opts->of(2));
  EXPECT_EQ(opts->of(0).spec().kind(), v1::OptimizerSpec::KIND_SGD);
  EXPECT_EQ(opts->of(1).spec().kind(), v1::OptimizerSpec::KIND_ADAM);
  EXPECT_EQ(opts->of(1).spec().beta1(), 0.9f);  // defaults filled
  // Moving keeps the optimizers where they are.
  const Optimizer* adam = &opts->of(1);
  TensorOptimizers moved = *std::move(opts);
  EXPECT_EQ(&moved.of(1), adam);

  v1::DeclareRequest bad_tensor = req;
  bad_tensor.mutable_layout()
      ->mutable_tensors(2)
      ->mutable_optimizer()
      ->set_kind(v1::OptimizerSpec::KIND_ADAGRAD);  // learning_rate 0
  absl::Status s = TensorOptimizers::Create(bad_tensor).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "tensor 2 (c) optimizer")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "learning_rate")) << s;

  // The declaration's is needed only by tensors without their own.
  v1::DeclareRequest no_declared = req;
  no_declared.clear_optimizer();
  s = TensorOptimizers::Create(no_declared).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "DeclareRequest.optimizer")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "tensor 0 (a)")) << s;
  for (int t : {0, 2}) {
    *no_declared.mutable_layout()->mutable_tensors(t)->mutable_optimizer() =
        req.optimizer();
  }
  SHARDPS_EXPECT_OK(TensorOptimizers::Create(no_declared));
}

}  // namespace
}  // namespace shardps::server
