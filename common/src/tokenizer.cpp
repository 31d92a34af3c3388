// The character-level tokenizer: a sorted set of bytes, stored in checkpoints as hex.
#include "dp/tokenizer.h"

#include <algorithm>
#include <utility>

#include "dp/error.h"

namespace dp {

std::string describe_byte(char byte) {
  const auto value = static_cast<unsigned char>(byte);
  switch (byte) {
    case '\n': return "'\\n'";
    case '\t': return "'\\t'";
    case '\r': return "'\\r'";
    case '\'': return "'\\''";
    case '\\': return "'\\\\'";
    default: break;
  }
  if (value < 0x20 || value >= 0x7f) return fmt::format("'\\x{:02x}'", value);
  return fmt::format("'{}'", byte);
}

CharTokenizer::CharTokenizer(std::string vocabulary) : vocabulary_(std::move(vocabulary)) {
  id_of_byte_.fill(-1);
  for (std::size_t i = 0; i < vocabulary_.size(); ++i)
    id_of_byte_[static_cast<unsigned char>(vocabulary_[i])] = static_cast<int>(i);
}

CharTokenizer CharTokenizer::from_corpus(std::string_view corpus, std::string_view what) {
  if (corpus.empty())
    throw Error(fmt::format(
        "{} is empty: expected text to build a vocabulary from (at least one byte)", what));
  std::array<bool, 256> seen{};
  for (const char byte : corpus) seen[static_cast<unsigned char>(byte)] = true;
  std::string vocabulary;
  for (std::size_t value = 0; value < seen.size(); ++value)
    if (seen[value]) vocabulary.push_back(static_cast<char>(value));
  return CharTokenizer(std::move(vocabulary));
}

CharTokenizer CharTokenizer::from_vocabulary(std::string_view vocabulary) {
  if (vocabulary.empty())
    throw Error("a character vocabulary is empty: expected at least one byte");
  for (std::size_t i = 1; i < vocabulary.size(); ++i) {
    const auto before = static_cast<unsigned char>(vocabulary[i - 1]);
    const auto here = static_cast<unsigned char>(vocabulary[i]);
    if (here <= before)
      throw Error(fmt::format(
          "a character vocabulary must list distinct bytes in increasing order, but byte {} "
          "({}) follows {} ({})",
          i, describe_byte(vocabulary[i]), i - 1, describe_byte(vocabulary[i - 1])));
  }
  return CharTokenizer(std::string(vocabulary));
}

namespace {

int hex_digit(char digit) {
  if (digit >= '0' && digit <= '9') return digit - '0';
  if (digit >= 'a' && digit <= 'f') return digit - 'a' + 10;
  return -1;
}

}  // namespace

CharTokenizer CharTokenizer::from_metadata(const std::map<std::string, std::string>& metadata,
                                           std::string_view file) {
  const auto kind = metadata.find(kMetadataKey);
  if (kind == metadata.end())
    throw Error(fmt::format(
        "'{}' records no tokenizer (its metadata has no \"{}\" entry): expected a checkpoint "
        "of a GPT trained by `dplab train --model gpt... --dataset text:FILE`",
        file, kMetadataKey));
  if (kind->second != kMetadataKind)
    throw Error(fmt::format("'{}' records the tokenizer \"{}\": expected \"{}\"", file,
                            kind->second, kMetadataKind));
  const auto hex = metadata.find(kMetadataVocabularyKey);
  if (hex == metadata.end())
    throw Error(fmt::format("'{}' records a \"{}\" tokenizer without its \"{}\" entry", file,
                            kMetadataKind, kMetadataVocabularyKey));
  const std::string& text = hex->second;
  if (text.empty() || text.size() % 2 != 0)
    throw Error(fmt::format(
        "'{}': the metadata \"{}\" has {} characters: expected a positive even number (two "
        "hex digits per byte)",
        file, kMetadataVocabularyKey, text.size()));
  std::string vocabulary;
  for (std::size_t i = 0; i < text.size(); i += 2) {
    const int high = hex_digit(text[i]);
    const int low = hex_digit(text[i + 1]);
    if (high < 0 || low < 0)
      throw Error(fmt::format(
          "'{}': the metadata \"{}\" holds \"{}\" at character {}: expected two lowercase hex "
          "digits per byte",
          file, kMetadataVocabularyKey, text.substr(i, 2), i));
    vocabulary.push_back(static_cast<char>(high * 16 + low));
  }
  try {
    return from_vocabulary(vocabulary);
  } catch (const Error& error) {
    throw Error(fmt::format("'{}': the metadata \"{}\" is damaged: {}", file,
                            kMetadataVocabularyKey, error.what()));
  }
}

void CharTokenizer::add_to_metadata(std::map<std::string, std::string>& metadata) const {
  std::string hex;
  hex.reserve(2 * vocabulary_.size());
  for (const char byte : vocabulary_)
    hex += fmt::format("{:02x}", static_cast<unsigned char>(byte));
  metadata[kMetadataKey] = kMetadataKind;
  metadata[kMetadataVocabularyKey] = std::move(hex);
}

std::vector<int> CharTokenizer::encode(std::string_view text, std::string_view what) const {
  std::vector<int> ids;
  ids.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const int id = id_of_byte_[static_cast<unsigned char>(text[i])];
    if (id < 0)
      throw Error(fmt::format(
          "{} has the byte {} at position {}, which is not in the vocabulary: expected one of "
          "the {} bytes {}",
          what, describe_byte(text[i]), i, vocabulary_.size(), describe()));
    ids.push_back(id);
  }
  return ids;
}

std::string CharTokenizer::decode(std::span<const int> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= static_cast<int>(vocabulary_.size()))
      throw Error(fmt::format(
          "token {} at position {} is not in the vocabulary: expected an id from 0 to {}", ids[i],
          i, static_cast<int>(vocabulary_.size()) - 1));
    text.push_back(vocabulary_[static_cast<std::size_t>(ids[i])]);
  }
  return text;
}

std::string CharTokenizer::describe() const {
  std::string text = "\"";
  for (const char byte : vocabulary_) {
    if (byte == '"') {
      text += "\\\"";  // the closing quote would be ambiguous
      continue;
    }
    const std::string shown = describe_byte(byte);
    text += byte == '\'' ? "'" : shown.substr(1, shown.size() - 2);  // without the quotes
  }
  return text + "\"";
}

}  // namespace dp
