// dplab consolidate: one full checkpoint from a sharded one.
//
//   dplab consolidate ckpt/ -o full.safetensors
//
// reads ckpt/index.json and every shard file it names (dp/sharded_checkpoint.h), checks them
// against each other, and writes every parameter whole under its name and every optimizer
// state tensor T as "optimizer.T" over the whole model: a checkpoint any safetensors reader
// opens, whatever the world size and the ZeRO stage that saved the shards.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>

#include "commands.h"
#include "dp/sharded_checkpoint.h"
#include "option_checks.h"

namespace dp::cli {
namespace {

struct ConsolidateArguments {
  std::string directory;
  std::string output;
};

}  // namespace

void add_consolidate_command(CLI::App& app) {
  auto args = std::make_shared<ConsolidateArguments>();
  CLI::App* consolidate_app = app.add_subcommand(
      "consolidate",
      "Write one full checkpoint (every parameter whole, the optimizer state flat) from a "
      "sharded checkpoint's directory");
  consolidate_app
      ->add_option("directory", args->directory,
                   "The sharded checkpoint: the directory of index.json and the shard files")
      ->required()
      ->check(non_empty_path());
  consolidate_app->add_option("-o,--output", args->output, "The safetensors file to write")
      ->required()
      ->check(non_empty_path());
  consolidate_app->callback([args] {
    // Errors are dp::Error, printed by main() as every command's are.
    dp::consolidate_checkpoint(args->directory, args->output);
    const dp::ShardedCheckpointPlan plan = dp::load_checkpoint_index(args->directory);
    fmt::print("consolidated {} shards ({} parameters; tensors {}) into {}\n", plan.layouts.size(),
               plan.parameters.size(), fmt::format("{}", fmt::join(plan.tensors, ", ")),
               args->output);
  });
}

}  // namespace dp::cli
