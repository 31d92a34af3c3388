// misuse_check.cpp: see misuse_check.h.
#include "misuse_check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <limits>

#include "dp/error.h"

namespace dp::grading {

void expect_dp_error(Verdict& verdict, std::string_view what, const std::function<void()>& call,
                     std::string_view returned) {
  try {
    call();
    verdict.fail(fmt::format("{}: the {} returned; expected dp::Error", what, returned));
  } catch (const NotImplemented&) {
    throw;
  } catch (const Error&) {
  }
}

void expect_factory_called_once(Verdict& verdict, const std::vector<std::size_t>& asked,
                                std::size_t shard, const Optimizer* made, const Optimizer& inner) {
  if (asked != std::vector<std::size_t>{shard})
    verdict.fail(
        fmt::format("the factory was called with [{}]; expected once, with the shard's S = {}",
                    fmt::join(asked, ", "), shard));
  else if (&inner != made)
    verdict.fail("inner() is not the optimizer the factory made");
}

void expect_one_inner_step(Verdict& verdict, const Optimizer& inner,
                           const std::function<void()>& step) {
  const std::int64_t steps_before = inner.step_count();
  step();
  if (verdict.passed() && inner.step_count() != steps_before + 1)
    verdict.fail(fmt::format(
        "one step() began {} steps of the inner optimizer; expected 1 (begin_step once)",
        inner.step_count() - steps_before));
}

void expect_constructor_refuses_misuse(Verdict& verdict, const ConstructorMisuse& misuse,
                                       const ConstructZero& construct) {
  const ShardedTraining& training = misuse.training;
  const auto expect_error = [&](const std::string& what, const std::function<void()>& call) {
    expect_dp_error(verdict, what, call, misuse.returned);
  };
  const InnerOptimizerFactory& factory = misuse.factory;
  {
    Model model = training.model();
    const std::string& name = misuse.frozen == FrozenParameter::kFirst
                                  ? model.parameters().front()->name
                                  : model.parameters().back()->name;
    model.freeze(name);
    expect_error(fmt::format("a frozen parameter ({})", name),
                 [&] { construct(model, factory, 0.0f); });
  }
  Model& model = misuse.model;
  expect_error("max_norm -1", [&] { construct(model, factory, -1.0f); });
  expect_error("max_norm NaN",
               [&] { construct(model, factory, std::numeric_limits<float>::quiet_NaN()); });
  expect_error("max_norm infinity",
               [&] { construct(model, factory, std::numeric_limits<float>::infinity()); });
  expect_error("an empty factory", [&] { construct(model, InnerOptimizerFactory{}, 0.0f); });
  expect_error("a factory that returns nullptr", [&] {
    construct(
        model, [](std::size_t) { return std::unique_ptr<Optimizer>{}; }, 0.0f);
  });
  expect_error(fmt::format("a factory whose optimizer keeps state for S + 1 = {} elements",
                           misuse.shard + 1),
               [&] {
                 construct(
                     model,
                     [](std::size_t s) {
                       return std::make_unique<Sgd>(s + 1, SgdOptions{}, check_device());
                     },
                     0.0f);
               });
  // The inner optimizer's state on another device than the model's: every update would mix
  // the devices.
  expect_inner_optimizer_elsewhere_refused(
      verdict, model.device(),
      [&](const InnerOptimizerFactory& make) { construct(model, make, 0.0f); });
}

}  // namespace dp::grading
