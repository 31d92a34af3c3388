// misuse_check.h: what the contract checks of the sharded labs (5, 6 and 7) share: a call
// that must throw dp::Error, and the arguments every ZeRO optimizer's constructor must
// refuse. Each lab adds the misuse particular to it (a second backward, a released value).
//
// Example (one rank of lab 6's contract check):
//
//   grading::expect_constructor_refuses_misuse(
//       verdict,
//       {.training = training, .model = model, .factory = factory_for(options), .shard = shard,
//        .frozen = grading::FrozenParameter::kLast, .returned = "call"},
//       [&](Model& model, const grading::InnerOptimizerFactory& factory, float max_norm) {
//         ZeroTwoOptimizer zero(model, comm, factory, cap, max_norm);
//       });
//   grading::expect_dp_error(verdict, "step() without a backward", [&] { (void)zero.step(); });
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/model.h"
#include "dp/optimizer.h"
#include "grading.h"
#include "sharded.h"

namespace dp::grading {

/// Runs `call`, which must throw dp::Error. When it returns, fails `verdict` with "<what>:
/// the <returned> returned; expected dp::Error". A NotImplemented (the skeleton) and any
/// exception that is not a dp::Error pass through.
void expect_dp_error(Verdict& verdict, std::string_view what, const std::function<void()>& call,
                     std::string_view returned = "call");

/// The factory a ZeRO optimizer's constructor takes (each lab's OptimizerFactory).
using InnerOptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t)>;

/// Constructs (and destroys) the lab's ZeRO optimizer over `model` with `factory` and
/// `max_norm`, the lab's other arguments (communicator, bucket cap) bound by the caller.
using ConstructZero =
    std::function<void(Model& model, const InnerOptimizerFactory& factory, float max_norm)>;

/// Which parameter the check freezes: the labs grew their checks apart, and each keeps its
/// own (any frozen parameter must be refused).
enum class FrozenParameter { kFirst, kLast };

/// What expect_constructor_refuses_misuse needs of the lab.
struct ConstructorMisuse {
  const ShardedTraining& training;  ///< the drawn set-up: a model of it is frozen
  Model& model;                     ///< the caller's model of it, for every other case
  InnerOptimizerFactory factory;    ///< the lab's factory for the set-up on this world
  std::size_t shard = 0;            ///< S, the contract's shard in elements on this world
  FrozenParameter frozen = FrozenParameter::kLast;  ///< which parameter is frozen
  std::string_view returned = "call";  ///< "constructor" or "call", in the failure message
};

/// The constructor's refusals every sharded lab promises: a frozen parameter, a max_norm of
/// -1, NaN or infinity, an empty factory, a factory that returns nullptr, one whose
/// optimizer keeps state for S + 1 elements, and an inner optimizer on another device than
/// the model's (expect_inner_optimizer_elsewhere_refused). Each must throw dp::Error;
/// `verdict` fails for each that returns. The frozen case runs on a fresh model of
/// `misuse.training`, the others on `misuse.model`.
void expect_constructor_refuses_misuse(Verdict& verdict, const ConstructorMisuse& misuse,
                                       const ConstructZero& construct);

/// Fails `verdict` unless `asked` (the sizes the factory was called with) is `shard` alone, S,
/// and `inner` (the lab's inner()) is `made`, the optimizer the factory returned. What
/// FactoryCalls::expect_called_once checks.
void expect_factory_called_once(Verdict& verdict, const std::vector<std::size_t>& asked,
                                std::size_t shard, const Optimizer* made, const Optimizer& inner);

/// The calls a ZeRO optimizer's constructor makes to its factory, watched for the check every
/// sharded lab makes of them: the factory called once, with S, and inner() the optimizer it
/// made. `Made` is what the watched factory returns (grading::UpdateRecorder, say, to read
/// its updates after a step).
template <typename Made = Optimizer>
class FactoryCalls {
 public:
  /// Watches `make`, the factory the lab's optimizer would be given.
  explicit FactoryCalls(std::function<std::unique_ptr<Made>(std::size_t)> make)
      : make_(std::move(make)) {}

  /// The factory to construct the lab's optimizer with: records each size it is asked for and
  /// the optimizer it makes. It refers to this object, which must outlive the construction.
  InnerOptimizerFactory factory() {
    return [this](std::size_t elements) -> std::unique_ptr<Optimizer> {
      asked_.push_back(elements);
      std::unique_ptr<Made> optimizer = make_(elements);
      made_ = optimizer.get();
      return optimizer;
    };
  }

  /// The optimizer the factory made last; nullptr before its first call.
  Made* made() const { return made_; }

  /// Fails `verdict` unless the factory was called once, with `shard` (S), and `inner` (the
  /// lab's inner()) is the optimizer it made.
  void expect_called_once(Verdict& verdict, std::size_t shard, const Optimizer& inner) const {
    expect_factory_called_once(verdict, asked_, shard, made_, inner);
  }

 private:
  std::function<std::unique_ptr<Made>(std::size_t)> make_;
  std::vector<std::size_t> asked_;
  Made* made_ = nullptr;
};

/// Runs `step` (the lab's step(), after a forward and backward) and fails `verdict` unless it
/// began exactly one step of `inner`, the lab's inner optimizer (begin_step once).
void expect_one_inner_step(Verdict& verdict, const Optimizer& inner,
                           const std::function<void()>& step);

}  // namespace dp::grading
