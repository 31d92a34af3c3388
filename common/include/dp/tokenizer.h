// tokenizer.h: the character-level tokenizer of dplab's GPT (one token per byte).
//
// A language model reads integers, not text. `CharTokenizer` maps each byte of a text to
// a token id and back. Its vocabulary rule: the vocabulary is the sorted set of distinct
// bytes of the corpus it was built from, and byte b is token i when b is the i-th smallest
// of them. Bytes, not Unicode characters: every file is a valid corpus, a byte never
// splits in two, and a UTF-8 character simply spans several tokens. The rule makes the
// vocabulary a function of the corpus alone, so every rank builds the same one without
// communication, and it is small (the Debian fortunes, 2.6 MB, have under 100).
//
// A trained model is useless without its vocabulary, so a checkpoint stores it in its
// metadata (`add_to_metadata`, `from_metadata`): `dplab sample` decodes with it.
//
// Example:
//
//   dp::CharTokenizer tokenizer = dp::CharTokenizer::from_corpus("hello");  // "ehlo"
//   std::vector<int> ids = tokenizer.encode("hole");                         // {1, 3, 2, 0}
//   std::string text = tokenizer.decode(ids);                                // "hole"
//   std::map<std::string, std::string> metadata;
//   tokenizer.add_to_metadata(metadata);  // "tokenizer": "char", "tokenizer.vocabulary": hex
//   dp::CharTokenizer again = dp::CharTokenizer::from_metadata(metadata, "run.safetensors");
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dp {

/// Maps bytes to token ids 0..size()-1 and back; the vocabulary is a sorted set of bytes.
class CharTokenizer {
 public:
  /// The metadata key naming the tokenizer; its value is `kMetadataKind`.
  static constexpr const char* kMetadataKey = "tokenizer";
  /// The value of `kMetadataKey` for this tokenizer.
  static constexpr const char* kMetadataKind = "char";
  /// The metadata key of the vocabulary: its bytes in order, two lowercase hex digits each
  /// (hex, so that any byte, a newline or an invalid UTF-8 one, survives JSON and a terminal).
  static constexpr const char* kMetadataVocabularyKey = "tokenizer.vocabulary";

  /// The tokenizer of `corpus`: its vocabulary is the sorted set of the corpus's distinct
  /// bytes. Throws `dp::Error` on an empty corpus (`what` names it in the message, e.g.
  /// "the text file 'a.txt'").
  static CharTokenizer from_corpus(std::string_view corpus, std::string_view what = "the corpus");

  /// The tokenizer whose vocabulary is `vocabulary`, byte i being token i. Throws
  /// `dp::Error` unless it is non-empty and strictly increasing (sorted, no repeats), the
  /// form `from_corpus` gives, naming the first byte out of order.
  static CharTokenizer from_vocabulary(std::string_view vocabulary);

  /// The tokenizer a checkpoint's metadata records (`add_to_metadata`). Throws `dp::Error`
  /// naming `file` when the metadata has no tokenizer, names another kind, or holds a
  /// vocabulary that is not pairs of hex digits of strictly increasing bytes.
  static CharTokenizer from_metadata(const std::map<std::string, std::string>& metadata,
                                     std::string_view file);

  /// Records this tokenizer in `metadata` under `kMetadataKey` and `kMetadataVocabularyKey`.
  void add_to_metadata(std::map<std::string, std::string>& metadata) const;

  /// The number of tokens.
  std::int64_t size() const { return static_cast<std::int64_t>(vocabulary_.size()); }
  /// The vocabulary: byte i is token i, in increasing order.
  const std::string& vocabulary() const { return vocabulary_; }
  /// True when `byte` has a token.
  bool contains(char byte) const { return id_of_byte_[static_cast<unsigned char>(byte)] >= 0; }

  /// The token ids of `text`, one per byte. Throws `dp::Error` at the first byte without a
  /// token, naming the byte, its position in `text` (`what` names the text) and the
  /// vocabulary.
  std::vector<int> encode(std::string_view text, std::string_view what = "the text") const;
  /// The text of `ids`, one byte per id. Throws `dp::Error` at the first id outside
  /// [0, size()), naming it and its position.
  std::string decode(std::span<const int> ids) const;

  /// The vocabulary as printable text for messages: "\n", "\t", "\xNN" for bytes a
  /// terminal would not show, quoted.
  std::string describe() const;

  /// True when the two vocabularies are equal.
  friend bool operator==(const CharTokenizer& a, const CharTokenizer& b) {
    return a.vocabulary_ == b.vocabulary_;
  }

 private:
  explicit CharTokenizer(std::string vocabulary);

  std::string vocabulary_;
  std::array<int, 256> id_of_byte_{};  // -1 for a byte without a token
};

/// `byte` as a message shows it: 'a', '\n', '\t' or '\xNN' (quoted).
std::string describe_byte(char byte);

}  // namespace dp
