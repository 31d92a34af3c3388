#include "tiny_gpt.h"

#include <fmt/format.h>

#include "dp/model.h"
#include "dp/text_data.h"

namespace dp::grading {

std::string_view grader_text() {
  // Written for dplab's grader (no outside source): a parable of data-parallel training.
  static constexpr std::string_view kText =
      "Four readers shared one long table and one notebook. Each took a different stack of "
      "pages, read it, and wrote down how the notebook ought to change. Before anyone touched "
      "the notebook they compared their notes: every suggestion was added up, the sum was "
      "divided by four, and each reader made that same correction to a private copy. Because "
      "they all began from the same notebook and applied the same correction, the copies "
      "never drifted apart, and the work went nearly four times as fast as one reader alone.\n"
      "The trouble was the talking. Reading a page took a moment; agreeing on a correction "
      "meant passing slips of paper around the table, and one slow hand held up everybody. "
      "So they learned to pass the notes of the last chapter while the first chapters were "
      "still being read. By the time the final page was done, most of the slips had already "
      "gone round, and only a few were left to wait for.\n"
      "Small slips were a nuisance. Each one cost a full trip around the table however little "
      "it said, so the readers began to gather them into bundles: a bundle left as soon as it "
      "was full, and the last bundle left when the reading stopped. Too small a bundle, and "
      "the trips ate the afternoon; too large, and nothing moved until the very end.\n"
      "Later the notebook grew too heavy for one reader to hold. They tore it into four parts "
      "and each kept one, lending a part to the others only while it was needed and taking it "
      "back at once. The table was quiet, the copies agreed to the last digit, and the stack "
      "of unread pages shrank a little faster every day.\n"
      "A visitor asked why they did not simply read faster. The eldest laughed and said that "
      "reading was never the hard part: the hard part was agreeing, and agreeing well meant "
      "knowing exactly what to send, when to send it, and when to wait.\n";
  return kText;
}

std::shared_ptr<const Dataset> draw_tiny_gpt(Draws& draws, TrainOptions& options) {
  const std::int64_t layers = draws.integer("gpt layers", 1, 2);
  const std::int64_t dim = 2 * draws.integer("gpt dim / 2", 8, 16);
  const std::int64_t context = draws.integer("gpt context", 8, 16);
  options.model = fmt::format("gpt:layers={},dim={},heads=2,context={}", layers, dim, context);
  draws.overrule("gpt context", fmt::format("gpt context={} (model {} on the grader's text)",
                                            context, options.model));
  options.dataset = "the grader's text";
  auto data = std::make_shared<const Dataset>(
      make_text_dataset(grader_text(), context, "the grader's text"));
  options.vocab = data->num_classes;
  return data;
}

}  // namespace dp::grading
