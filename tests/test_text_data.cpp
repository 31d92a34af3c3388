// Tests of text data for a GPT: the character tokenizer (its vocabulary rule, round trips,
// the checkpoint metadata), the windows of a text and their stride, the same global batches
// and rank slices as every data set, the default corpus, the trainer's GPT options, a GPT
// checkpoint read back, and sampling.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/text_data.h"
#include "dp/text_sampling.h"
#include "dp/tokenizer.h"
#include "dp/trainer.h"
#include "test_support.h"

namespace {

namespace fs = std::filesystem;

using dp::testing::test_directory;

fs::path write_file(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
  return path;
}

// Runs `action`, expecting a dp::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& action, std::initializer_list<std::string> parts) {
  try {
    action();
    ADD_FAILURE() << "expected a dp::Error, nothing was thrown";
  } catch (const dp::Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos)
          << "message: " << message << "\nshould contain: " << part;
  }
}

// A text of a few hundred bytes with a small vocabulary, for tiny GPTs.
std::string small_corpus() {
  std::string text;
  for (int i = 0; i < 40; ++i) text += i % 3 == 0 ? "the cat sat.\n%\n" : "a dog ran.\n";
  return text;
}

// --- the tokenizer -------------------------------------------------------------------------

TEST(CharTokenizer, VocabularyIsTheSortedDistinctBytesOfTheCorpus) {
  const dp::CharTokenizer tokenizer = dp::CharTokenizer::from_corpus("hello, world\n");
  EXPECT_EQ(tokenizer.vocabulary(), std::string("\n ,dehlorw"));
  EXPECT_EQ(tokenizer.size(), 10);
  EXPECT_EQ(tokenizer.encode("hello"), (std::vector<int>{5, 4, 6, 6, 7}));
  EXPECT_TRUE(tokenizer.contains('w'));
  EXPECT_FALSE(tokenizer.contains('x'));
  // Bytes, not characters: a UTF-8 letter is two tokens, and 0xff sorts last.
  const dp::CharTokenizer bytes = dp::CharTokenizer::from_corpus(
      "\xc3\xa9"
      "a\xff"
      "a");
  EXPECT_EQ(bytes.vocabulary(), std::string("a\xa9\xc3\xff"));
}

TEST(CharTokenizer, EncodeThenDecodeGivesEveryByteBack) {
  std::string every_byte;
  for (int value = 255; value >= 0; --value) every_byte.push_back(static_cast<char>(value));
  const dp::CharTokenizer tokenizer = dp::CharTokenizer::from_corpus(every_byte);
  ASSERT_EQ(tokenizer.size(), 256);
  const std::vector<int> ids = tokenizer.encode(every_byte);
  EXPECT_EQ(ids.front(), 255);
  EXPECT_EQ(ids.back(), 0);
  EXPECT_EQ(tokenizer.decode(ids), every_byte);
  const std::string text = small_corpus();
  const dp::CharTokenizer small = dp::CharTokenizer::from_corpus(text);
  EXPECT_EQ(small.decode(small.encode(text)), text);
}

TEST(CharTokenizer, BadInputIsAClearError) {
  expect_error([] { dp::CharTokenizer::from_corpus("", "the text file 'a.txt'"); },
               {"the text file 'a.txt' is empty", "expected text"});
  const dp::CharTokenizer tokenizer = dp::CharTokenizer::from_corpus("abc");
  expect_error([&] { tokenizer.encode("abxc", "the prompt"); },
               {"the prompt has the byte 'x' at position 2", "not in the vocabulary",
                "expected one of the 3 bytes \"abc\""});
  expect_error([&] { tokenizer.encode("a\n"); }, {"the byte '\\n' at position 1"});
  // The vocabulary as the message shows it: quotes and control bytes escaped.
  EXPECT_EQ(dp::CharTokenizer::from_corpus("a\"'\n\x01").describe(), "\"\\x01\\n\\\"'a\"");
  const std::vector<int> bad_ids = {0, 3};
  expect_error([&] { tokenizer.decode(bad_ids); },
               {"token 3 at position 1", "expected an id from 0 to 2"});
  expect_error([] { dp::CharTokenizer::from_vocabulary("acb"); },
               {"distinct bytes in increasing order", "byte 2 ('b') follows 1 ('c')"});
  expect_error([] { dp::CharTokenizer::from_vocabulary("aa"); }, {"byte 1 ('a') follows 0"});
  expect_error([] { dp::CharTokenizer::from_vocabulary(""); }, {"empty"});
}

TEST(CharTokenizer, MetadataRoundTripKeepsEveryByte) {
  const dp::CharTokenizer tokenizer =
      dp::CharTokenizer::from_corpus(std::string("\0\n\"\\%\xff", 6));
  std::map<std::string, std::string> metadata = {{"model", "gpt"}};
  tokenizer.add_to_metadata(metadata);
  EXPECT_EQ(metadata.at("tokenizer"), "char");
  EXPECT_EQ(metadata.at("tokenizer.vocabulary"), "000a22255cff");
  EXPECT_EQ(dp::CharTokenizer::from_metadata(metadata, "run.safetensors"), tokenizer);
}

TEST(CharTokenizer, DamagedMetadataIsAClearError) {
  const auto with = [](std::string kind, std::string hex) {
    std::map<std::string, std::string> metadata = {{"tokenizer", std::move(kind)}};
    if (!hex.empty()) metadata["tokenizer.vocabulary"] = std::move(hex);
    return metadata;
  };
  expect_error([] { dp::CharTokenizer::from_metadata({}, "x.st"); },
               {"'x.st' records no tokenizer", "\"tokenizer\""});
  expect_error([&] { dp::CharTokenizer::from_metadata(with("bpe", "61"), "x.st"); },
               {"records the tokenizer \"bpe\"", "expected \"char\""});
  expect_error([&] { dp::CharTokenizer::from_metadata(with("char", ""), "x.st"); },
               {"without its \"tokenizer.vocabulary\" entry"});
  expect_error([&] { dp::CharTokenizer::from_metadata(with("char", "616"), "x.st"); },
               {"has 3 characters", "positive even number"});
  expect_error([&] { dp::CharTokenizer::from_metadata(with("char", "61zz"), "x.st"); },
               {"holds \"zz\" at character 2", "two lowercase hex digits"});
  expect_error([&] { dp::CharTokenizer::from_metadata(with("char", "6261"), "x.st"); },
               {"is damaged", "byte 1 ('a') follows 0 ('b')"});
}

// --- windows ---------------------------------------------------------------------------------

TEST(TextDataset, WindowsOfContextPlusOneTokensAtStrideContext) {
  // 11 tokens, context 4: windows [0, 4], [4, 8]; tokens 9 and 10 are left out.
  const dp::Dataset data = dp::make_text_dataset("hello world", 4, "greeting");
  const dp::CharTokenizer& tokenizer = *data.tokenizer;
  EXPECT_EQ(tokenizer.vocabulary(), " dehlorw");
  EXPECT_EQ(data.num_classes, 8);
  EXPECT_EQ(data.labels_per_sample, 4);
  ASSERT_EQ(data.size(), 2u);
  ASSERT_EQ(data.features.shape(), (std::vector<std::int64_t>{2, 4}));
  const auto text_of_row = [&](std::size_t row) {
    std::vector<int> ids;
    for (std::size_t t = 0; t < 4; ++t)
      ids.push_back(static_cast<int>(data.features.data()[row * 4 + t]));
    return tokenizer.decode(ids);
  };
  EXPECT_EQ(text_of_row(0), "hell");
  EXPECT_EQ(text_of_row(1), "o wo");
  EXPECT_EQ(tokenizer.decode(data.labels), "ello wor");
  EXPECT_EQ(dp::text_window_count(11, 4), 2u);
  EXPECT_EQ(dp::text_window_count(9, 4), 2u);  // [0, 4] and [4, 8]: one token shared
  EXPECT_EQ(dp::text_window_count(8, 4), 1u);
  EXPECT_EQ(dp::text_window_count(4, 4), 0u);
  EXPECT_EQ(dp::text_window_count(0, 4), 0u);
}

TEST(TextDataset, EveryTokenButTheFirstIsPredictedOncePerEpoch) {
  const std::string text = small_corpus();
  constexpr std::int64_t kContext = 16;
  const dp::Dataset data = dp::make_text_dataset(text, kContext, "small");
  const std::vector<int> ids = data.tokenizer->encode(text);
  const std::size_t windows = (text.size() - 1) / kContext;
  ASSERT_EQ(data.size(), windows);
  for (std::size_t w = 0; w < windows; ++w)
    for (std::size_t t = 0; t < kContext; ++t) {
      ASSERT_EQ(data.features.data()[w * kContext + t], static_cast<float>(ids[w * kContext + t]));
      ASSERT_EQ(data.labels[w * kContext + t], ids[w * kContext + t + 1]);
    }
  // A batch carries the context's labels of each window, window after window.
  const std::vector<std::size_t> rows = {3, 0};
  const dp::Batch batch = dp::gather_batch(data, rows);
  ASSERT_EQ(batch.inputs.shape(), (std::vector<std::int64_t>{2, kContext}));
  ASSERT_EQ(batch.labels.size(), 2u * kContext);
  EXPECT_EQ(batch.labels.front(), ids[3 * kContext + 1]);
  EXPECT_EQ(batch.labels.back(), ids[kContext]);
  // The evaluation split keeps windows whole.
  const dp::DatasetSplit split = dp::split_for_evaluation(data, 0.25);
  EXPECT_EQ(split.train.size() + split.eval.size(), windows);
  EXPECT_EQ(split.eval.labels.size(), split.eval.size() * kContext);
  EXPECT_EQ(split.eval.tokenizer, data.tokenizer);
}

TEST(TextDataset, RanksShareEachGlobalBatchAsForEveryDataSet) {
  // The trainer's batches: each epoch a permutation of the windows, rank r taking rows
  // [r B/N, (r+1) B/N) of every global batch. Over an epoch the ranks' slices visit every
  // window of the full batches once, with no overlap between ranks.
  const dp::Dataset data = dp::make_text_dataset(small_corpus(), 8, "small");
  constexpr std::int64_t kBatch = 8;
  constexpr int kRanks = 2;
  dp::GlobalBatches batches(data.size(), kBatch, /*seed=*/4);
  for (std::size_t epoch = 0; epoch < 2; ++epoch) {
    std::set<std::size_t> seen;
    for (std::size_t b = 0; b < batches.batches_per_epoch(); ++b) {
      const int step = static_cast<int>(epoch * batches.batches_per_epoch() + b);
      const std::vector<std::size_t> global(batches.of_step(step).begin(),
                                            batches.of_step(step).end());
      std::vector<std::size_t> joined;
      for (int rank = 0; rank < kRanks; ++rank) {
        const auto slice = std::span<const std::size_t>(global).subspan(
            static_cast<std::size_t>(rank) * kBatch / kRanks, kBatch / kRanks);
        joined.insert(joined.end(), slice.begin(), slice.end());
        const dp::Batch part = dp::gather_batch(data, slice);
        EXPECT_EQ(part.labels.size(), static_cast<std::size_t>(kBatch / kRanks * 8));
      }
      EXPECT_EQ(joined, global);
      seen.insert(global.begin(), global.end());
    }
    EXPECT_EQ(seen.size(), batches.batches_per_epoch() * kBatch) << "epoch " << epoch;
  }
  // Another epoch, another order.
  EXPECT_NE(dp::global_batch_indices(data.size(), kBatch, 0, 4),
            dp::global_batch_indices(data.size(), kBatch,
                                     static_cast<int>(batches.batches_per_epoch()), 4));
}

TEST(TextDataset, BadInputIsAClearError) {
  expect_error([] { dp::make_text_dataset("abc", 3, "short"); },
               {"the text 'short' has 3 tokens (bytes), fewer than one window of context + 1 = 4",
                "a GPT with a context below 3"});
  expect_error([] { dp::make_text_dataset("abcdef", 0, "any"); },
               {"expected a context of at least 1 token, got 0"});
  const fs::path dir = test_directory();
  const fs::path empty = write_file(dir / "empty.txt", "");
  expect_error([&] { dp::load_text(empty, 4); }, {"empty.txt' is empty"});
  expect_error([&] { dp::load_text(dir / "missing.txt", 4); },
               {"cannot open text file", "missing.txt"});
  expect_error([&] { dp::load_text(dir, 4); }, {"it is a directory"});
  const fs::path file = write_file(dir / "ok.txt", "0123456789");
  expect_error([&] { dp::load_dataset("text:" + file.string(), 0); },
               {"cut into windows of a GPT's context", "got 0", "--model gpt"});
  expect_error([] { dp::load_dataset("text:", 0, 4); }, {"no path after 'text:'"});
  const dp::Dataset data = dp::load_dataset("text:" + file.string(), 0, 3);
  EXPECT_EQ(data.name, "text:" + file.string());
  EXPECT_EQ(data.size(), 3u);
  EXPECT_EQ(dp::dataset_files("text:" + file.string()), std::vector<fs::path>{file});
  EXPECT_TRUE(dp::is_text_dataset_spec("fortunes"));
  EXPECT_TRUE(dp::is_text_dataset_spec("text:a"));
  EXPECT_FALSE(dp::is_text_dataset_spec("digits"));
}

// --- the default corpus --------------------------------------------------------------------

TEST(Fortunes, IsTheFortuneFilesJoinedInOrder) {
  const fs::path dir = test_directory();
  std::string expected;
  for (const std::string_view name : dp::fortune_file_names()) {
    const std::string text = std::string(name) + " says hi\n%\n";
    write_file(dir / name, text);
    expected += text;
  }
  write_file(dir / "fortunes.dat", "an index, not text");
  write_file(dir / "bofh-excuses", "another package's file, not in the corpus");
  EXPECT_EQ(dp::read_fortunes(dir), expected);
  const dp::Dataset data = dp::load_fortunes(8, dir);
  EXPECT_EQ(data.name, "fortunes");
  EXPECT_EQ(data.size(), (expected.size() - 1) / 8);
  fs::remove(dir / "riddles");
  expect_error(
      [&] { dp::read_fortunes(dir); },
      {"riddles', which does not exist", "apt-get install fortunes-min", "tools/install-deps"});
  EXPECT_EQ(dp::fortune_file_names().size(), 43u);
}

TEST(Fortunes, TheInstalledCorpusLoads) {
  // tools/install-deps installs Debian's fortunes: 43 files, 2.5 MB of text.
  const std::string corpus = dp::read_fortunes();
  EXPECT_GT(corpus.size(), 2'000'000u);
  const dp::CharTokenizer tokenizer = dp::CharTokenizer::from_corpus(corpus);
  EXPECT_TRUE(tokenizer.contains('%'));
  EXPECT_LT(tokenizer.size(), 256);
  EXPECT_EQ(dp::dataset_files("fortunes").size(), 43u);
}

// --- training a GPT on text ------------------------------------------------------------------

dp::TrainOptions tiny_gpt_options(const fs::path& corpus_file) {
  dp::TrainOptions options;
  options.model = "gpt:layers=1,dim=16,heads=2,context=8";
  options.dataset = "text:" + corpus_file.string();
  options.global_batch = 8;
  options.steps = 40;
  options.optimizer = "adamw";
  options.lr = 1e-2f;
  options.log_every = 40;
  options.seed = 3;
  return options;
}

TEST(TextTraining, GptAndTextGoTogether) {
  dp::TrainOptions gpt_on_digits;
  gpt_on_digits.model = "gpt:context=8";
  gpt_on_digits.dataset = "digits";
  expect_error([&] { dp::check_train_options(gpt_on_digits); },
               {"model gpt:context=8 is a GPT, which trains on text, but the data set 'digits' "
                "is not",
                "--dataset text:FILE"});
  dp::TrainOptions mlp_on_text;
  mlp_on_text.dataset = "fortunes";
  expect_error([&] { dp::check_train_options(mlp_on_text); },
               {"the data set 'fortunes' is text", "the model 64-256-256-10 is an MLP",
                "expected --model gpt"});
  dp::TrainOptions gpt_with_layer_norm;
  gpt_with_layer_norm.model = "gpt";
  gpt_with_layer_norm.dataset = "fortunes";
  gpt_with_layer_norm.layer_norm = true;
  expect_error([&] { dp::check_train_options(gpt_with_layer_norm); }, {"--layer-norm"});
  // Windows cut for another context do not fit.
  dp::TrainOptions options = gpt_with_layer_norm;
  options.layer_norm = false;
  options.model = "gpt:context=16";
  const dp::Dataset data = dp::make_text_dataset(small_corpus(), 8, "small");
  expect_error([&] { dp::check_data_fits_model(options, data); },
               {"not windows of 16 tokens", "8 features and 8 labels per sample"});
  options.model = "gpt:context=8";
  options.vocab = 3;
  expect_error(
      [&] { dp::check_data_fits_model(options, data); },
      {"a vocabulary of 3 tokens", "the data set 'small' has " + std::to_string(data.num_classes)});
  options.vocab = 0;
  expect_error([&] { dp::make_model(options); }, {"vocabulary comes from its data"});
}

TEST(TextTraining, TinyGptLearnsAndRanksMatchTheirEmulation) {
  const fs::path dir = test_directory();
  const fs::path file = write_file(dir / "corpus.txt", small_corpus());
  const dp::TrainOptions options = tiny_gpt_options(file);
  const dp::Dataset data = dp::load_dataset(options.dataset, options.seed, 8);
  dp::TrainOptions first = options;
  first.steps = 1;
  const float first_loss = dp::train_single_process(first, data).reports.back().loss;
  EXPECT_NEAR(first_loss, std::log(static_cast<float>(data.num_classes)), 0.5f);
  const dp::TrainResult single = dp::train_emulating_data_parallel(options, data, 2);
  EXPECT_LT(single.reports.back().loss, 0.6f * first_loss);
  std::vector<float> parameters[2];
  dp::launch({.world_size = 2}, [&](dp::Communicator& comm) {
    dp::TrainResult result = dp::train_data_parallel(options, data, comm);
    parameters[comm.rank()] = result.model.flat_parameters();
  });
  EXPECT_EQ(parameters[0], single.model.flat_parameters());
  EXPECT_EQ(parameters[1], parameters[0]);
}

// Activation checkpointing changes the memory and the compute, never the run.
TEST(TextTraining, ActivationCheckpointingTrainsTheSameRunOnLessMemory) {
  const fs::path dir = test_directory();
  const fs::path file = write_file(dir / "corpus.txt", small_corpus());
  const dp::TrainOptions options = tiny_gpt_options(file);
  const dp::Dataset data = dp::load_dataset(options.dataset, options.seed, 8);
  dp::TrainOptions checkpointed = options;
  checkpointed.activation_checkpointing = true;
  checkpointed.steps = 5;
  dp::TrainOptions plain = checkpointed;
  plain.activation_checkpointing = false;
  const dp::TrainResult single = dp::train_emulating_data_parallel(plain, data, 2);
  std::vector<float> parameters[2];
  dp::launch({.world_size = 2}, [&](dp::Communicator& comm) {
    parameters[comm.rank()] =
        dp::train_data_parallel(checkpointed, data, comm).model.flat_parameters();
  });
  EXPECT_EQ(parameters[0], single.model.flat_parameters());
  EXPECT_EQ(parameters[1], parameters[0]);

  // One block saves nothing (its state is recomputed whole, and the input copy comes on top):
  // the saving grows with the depth.
  dp::TrainOptions deep = checkpointed;
  deep.model = "gpt:layers=4,dim=16,heads=2,context=8";
  const dp::ActivationCheckpointingEffect effect =
      dp::measure_activation_checkpointing(deep, data, 4);
  EXPECT_LT(effect.activations_with, effect.activations_without / 2);
  EXPECT_GT(effect.flops_with, effect.flops_without);
  EXPECT_LT(effect.flops_with, 1.5 * effect.flops_without) << "one forward of each block more";

  dp::TrainOptions mlp;
  mlp.activation_checkpointing = true;
  expect_error([&] { dp::check_train_options(mlp); },
               {"activation checkpointing recomputes a GPT's transformer blocks",
                "the model 64-256-256-10 is an MLP"});
  expect_error([&] { dp::measure_activation_checkpointing(checkpointed, data, 0); },
               {"on 0 samples", "expected 1 to"});
}

TEST(TextTraining, CheckpointRecordsTheVocabularyAndSamplesFromIt) {
  const fs::path dir = test_directory();
  const fs::path file = write_file(dir / "corpus.txt", small_corpus());
  dp::TrainOptions options = tiny_gpt_options(file);
  const dp::Dataset data = dp::load_dataset(options.dataset, options.seed, 8);
  const dp::TrainResult result = dp::train_single_process(options, data);
  options.vocab = data.num_classes;
  const fs::path checkpoint = dir / "gpt.safetensors";
  dp::save_training_checkpoint(checkpoint, options, result.model, *result.optimizer, options.steps,
                               data.size(), {.tokenizer = data.tokenizer});
  const dp::Checkpoint contents = dp::load_safetensors(checkpoint);
  EXPECT_EQ(contents.metadata.at("vocab"), std::to_string(data.num_classes));
  EXPECT_EQ(dp::CharTokenizer::from_metadata(contents.metadata, checkpoint.string()),
            *data.tokenizer);
  // Resumable with the data's vocabulary, not with another.
  EXPECT_EQ(dp::load_training_checkpoint(checkpoint, options, data.size()).step, options.steps);
  dp::TrainOptions other = options;
  other.vocab = data.num_classes + 1;
  expect_error([&] { dp::load_training_checkpoint(checkpoint, other, data.size()); },
               {"it was saved with vocab = " + std::to_string(data.num_classes)});

  dp::TrainedGpt gpt = dp::load_trained_gpt(checkpoint);
  EXPECT_EQ(gpt.tokenizer, *data.tokenizer);
  EXPECT_EQ(gpt.model.flat_parameters(), result.model.flat_parameters());
  const dp::SampleOptions sampling{.length = 40, .temperature = 0.8f, .seed = 5};
  const std::string text = dp::sample_text(gpt.model, gpt.tokenizer, "the ", sampling);
  ASSERT_EQ(text.size(), 44u);
  EXPECT_EQ(text.substr(0, 4), "the ");
  EXPECT_EQ(dp::sample_text(gpt.model, gpt.tokenizer, "the ", sampling), text);  // same seed
  std::set<std::string> texts;
  for (std::uint64_t seed = 0; seed < 4; ++seed)
    texts.insert(dp::sample_text(gpt.model, gpt.tokenizer, "", {.length = 40, .seed = seed}));
  EXPECT_GT(texts.size(), 1u) << "every seed gave the same text";
  // Greedy decoding, and a prompt longer than the context (only the last 8 bytes are read).
  const std::string greedy = dp::sample_text(gpt.model, gpt.tokenizer, "a dog ran.\na dog ",
                                             {.length = 3, .temperature = 0});
  EXPECT_EQ(greedy.size(), 20u);
  expect_error([&] { dp::sample_text(gpt.model, gpt.tokenizer, "the cow", sampling); },
               {"the prompt has the byte 'w' at position 6"});
  expect_error([&] { dp::sample_text(gpt.model, gpt.tokenizer, "", {.temperature = -1}); },
               {"temperature must be a finite number >= 0"});
  // A checkpoint without a tokenizer is not a GPT's to sample from.
  dp::save_training_checkpoint(dir / "bare.safetensors", options, result.model, *result.optimizer,
                               options.steps, data.size(), {});
  expect_error([&] { dp::load_trained_gpt(dir / "bare.safetensors"); }, {"records no tokenizer"});
}

}  // namespace
