// source_scan.cpp: a small C++ tokeniser and the constructs the audit refuses.
//
// The scan runs in two passes: `lex` turns the text into tokens as the compiler's first
// phases do (lines joined at a backslash-newline, comments replaced by a space, literals
// kept whole, digraphs spelt as what they stand for, preprocessing directives marked), and
// `Rules` walks the tokens with the context each rule needs (what comes before a
// parenthesis, what a static_cast converts to, which namespace a definition opens).
#include "source_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <utility>

namespace dp::grader::audit {
namespace {

// --- Pass 1: tokens ------------------------------------------------------------------------

enum class TokenKind {
  kIdentifier,  // also keywords
  kNumber,
  kString,  // text: the literal's contents
  kCharacter,
  kHeaderName,  // the <...> or "..." of an #include; text: with its delimiters
  kPunctuator,  // digraphs spelt as what they stand for ("<:" is "[")
  kBackslash,   // a '\' outside a literal: a universal character name
};

struct Token {
  TokenKind kind;
  std::string text;
  int line = 0;
  bool directive_start = false;  // the '#' that opens a preprocessing directive
  bool in_directive = false;     // a token of a directive's line
};

/// The text after translation phase 2 (backslash-newlines removed), with the source line of
/// every character, so that findings name the line the student wrote.
struct SplicedText {
  std::string text;
  std::vector<int> line;  ///< line[i]: the 1-based source line of text[i]
};

SplicedText splice(std::string_view source) {
  SplicedText spliced;
  int line = 1;
  for (std::size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\\') {
      std::size_t next = i + 1;
      if (next < source.size() && source[next] == '\r') ++next;
      if (next < source.size() && source[next] == '\n') {
        ++line;
        i = next;
        continue;
      }
    }
    spliced.text.push_back(source[i]);
    spliced.line.push_back(line);
    if (source[i] == '\n') ++line;
  }
  return spliced;
}

bool identifier_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}

bool identifier_char(char c) {
  return identifier_start(c) || (c >= '0' && c <= '9');
}

/// The punctuators the rules look at, longest first; any other character is a punctuator of
/// its own. Digraphs map to what they stand for.
/// "[" "[" opens an attribute whatever lies between them (blanks, comments), so brackets
/// stay single tokens and the rules look at pairs.
constexpr std::array<std::pair<std::string_view, std::string_view>, 12> kPunctuators = {{
    {"%:%:", "##"},
    {"##", "##"},
    {"::", "::"},
    {"->", "->"},
    {"&&", "&&"},
    {"%:", "#"},
    {"<:", "["},
    {":>", "]"},
    {"<%", "{"},
    {"%>", "}"},
    {"<<", "<<"},
    {">>", ">>"},
}};

std::vector<Token> lex(std::string_view source) {
  const SplicedText spliced = splice(source);
  const std::string& text = spliced.text;
  std::vector<Token> tokens;
  bool line_start = true;  // only whitespace and comments since the last newline
  bool in_directive = false;
  bool expect_header = false;  // after "# include": a header name comes next
  std::size_t i = 0;
  auto line_at = [&](std::size_t at) {
    return at < spliced.line.size() ? spliced.line[at]
                                    : (spliced.line.empty() ? 1 : spliced.line.back());
  };
  auto push = [&](TokenKind kind, std::string token_text, std::size_t at) {
    tokens.push_back({kind, std::move(token_text), line_at(at), false, in_directive});
  };
  while (i < text.size()) {
    const char c = text[i];
    const std::string_view rest = std::string_view(text).substr(i);
    if (c == '\n') {
      line_start = true;
      in_directive = false;
      expect_header = false;
      ++i;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
      ++i;
      continue;
    }
    if (rest.starts_with("//")) {  // a comment is a space (translation phase 3)
      const std::size_t newline = text.find('\n', i);
      i = newline == std::string::npos ? text.size() : newline;
      continue;
    }
    if (rest.starts_with("/*")) {
      const std::size_t end = text.find("*/", i + 2);
      i = end == std::string::npos ? text.size() : end + 2;
      continue;
    }
    if (line_start && (c == '#' || rest.starts_with("%:")) && !rest.starts_with("%:%:")) {
      in_directive = true;
      push(TokenKind::kPunctuator, "#", i);
      tokens.back().directive_start = true;
      tokens.back().in_directive = true;
      i += c == '#' ? 1 : 2;
      line_start = false;
      // The directive's name follows, maybe after blanks and comments; an include's header
      // name after it is lexed as one token.
      expect_header = true;
      continue;
    }
    line_start = false;
    if (expect_header && identifier_start(c)) {
      std::size_t end = i;
      while (end < text.size() && identifier_char(text[end])) ++end;
      const std::string name = text.substr(i, end - i);
      push(TokenKind::kIdentifier, name, i);
      i = end;
      expect_header =
          name == "include" || name == "include_next" || name == "import" || name == "embed";
      if (expect_header) {
        // Skip blanks and comments to the header name.
        while (i < text.size()) {
          if (text[i] == ' ' || text[i] == '\t') {
            ++i;
          } else if (std::string_view(text).substr(i).starts_with("/*")) {
            const std::size_t end_comment = text.find("*/", i + 2);
            i = end_comment == std::string::npos ? text.size() : end_comment + 2;
          } else {
            break;
          }
        }
        if (i < text.size() && (text[i] == '<' || text[i] == '"')) {
          const char close = text[i] == '<' ? '>' : '"';
          const std::size_t end_name = text.find(close, i + 1);
          const std::size_t newline = text.find('\n', i);
          if (end_name != std::string::npos && end_name < newline) {
            push(TokenKind::kHeaderName, text.substr(i, end_name - i + 1), i);
            i = end_name + 1;
          }
        }
      }
      expect_header = false;
      continue;
    }
    expect_header = false;
    if (c == '\\') {
      push(TokenKind::kBackslash, "\\", i);
      ++i;
      continue;
    }
    if ((c >= '0' && c <= '9') ||
        (c == '.' && i + 1 < text.size() && text[i + 1] >= '0' && text[i + 1] <= '9')) {
      // A pp-number: digits, letters, '.', digit separators and exponent signs.
      const std::size_t start = i++;
      while (i < text.size()) {
        const char d = text[i];
        if ((d == '+' || d == '-') &&
            std::string_view("eEpP").find(text[i - 1]) != std::string::npos)
          ++i;
        else if (identifier_char(d) || d == '.' ||
                 (d == '\'' && i + 1 < text.size() && identifier_char(text[i + 1])))
          ++i;
        else
          break;
      }
      push(TokenKind::kNumber, text.substr(start, i - start), start);
      continue;
    }
    if (identifier_start(c)) {
      const std::size_t start = i;
      while (i < text.size() && identifier_char(text[i])) ++i;
      const std::string name = text.substr(start, i - start);
      static const std::array<std::string_view, 9> kPrefixes = {"L",  "u",  "U",  "u8", "R",
                                                                "LR", "uR", "UR", "u8R"};
      const bool prefix = std::find(kPrefixes.begin(), kPrefixes.end(), name) != kPrefixes.end();
      if (prefix && i < text.size() && name.back() == 'R' && text[i] == '"') {
        // R"delimiter( ... )delimiter"
        const std::size_t open = text.find('(', i);
        if (open == std::string::npos) {
          i = text.size();
          continue;
        }
        const std::string end = fmt::format("){}\"", text.substr(i + 1, open - i - 1));
        const std::size_t close = text.find(end, open);
        const std::size_t stop = close == std::string::npos ? text.size() : close;
        push(TokenKind::kString, text.substr(open + 1, stop - open - 1), start);
        i = close == std::string::npos ? text.size() : close + end.size();
        continue;
      }
      if (prefix && i < text.size() && (text[i] == '"' || text[i] == '\''))
        continue;  // literal next
      push(TokenKind::kIdentifier, name, start);
      continue;
    }
    if (c == '"' || c == '\'') {
      const std::size_t start = i;
      std::string contents;
      for (++i; i < text.size() && text[i] != c && text[i] != '\n'; ++i) {
        if (text[i] == '\\' && i + 1 < text.size()) contents.push_back(text[i++]);
        contents.push_back(text[i]);
      }
      if (i < text.size() && text[i] == c) ++i;
      push(c == '"' ? TokenKind::kString : TokenKind::kCharacter, std::move(contents), start);
      continue;
    }
    // "<::" not followed by ':' or '>' is '<' and '::' (C++11), not the digraph "<:".
    if (rest.starts_with("<::") && !rest.starts_with("<:::") && !rest.starts_with("<::>")) {
      push(TokenKind::kPunctuator, "<", i);
      ++i;
      continue;
    }
    bool matched = false;
    for (const auto& [spelling, meaning] : kPunctuators) {
      if (rest.starts_with(spelling)) {
        push(TokenKind::kPunctuator, std::string(meaning), i);
        i += spelling.size();
        matched = true;
        break;
      }
    }
    if (!matched) {
      push(TokenKind::kPunctuator, std::string(1, c), i);
      ++i;
    }
  }
  return tokens;
}

// --- Pass 2: the rules ---------------------------------------------------------------------

/// Identifiers the audit refuses, and why.
const std::map<std::string, std::string, std::less<>>& refused_identifiers() {
  static const std::string kReinterprets =
      "reinterprets memory, which can reach any object of the process, the grader's included: "
      "convert numbers with static_cast, and handle buffers through the dp:: API's views and "
      "the standard containers";
  static const std::string kRawMemory =
      "copies or compares raw bytes of any object, the grader's included: use std::copy, "
      "std::fill or dp::copy on elements";
  static const std::map<std::string, std::string, std::less<>> refused = {
      {"asm",
       "inline assembly: the audit judges your code by what it compiles to, which assembly "
       "can hide; write C++"},
      {"reinterpret_cast", kReinterprets},
      {"bit_cast", kReinterprets},
      {"as_bytes", kReinterprets},
      {"as_writable_bytes", kReinterprets},
      {"launder", kReinterprets},
      {"start_lifetime_as", kReinterprets},
      {"uintptr_t", kReinterprets},
      {"intptr_t", kReinterprets},
      {"const_cast", "writes what was given to you read-only: take what you need writable"},
      {"dynamic_cast",
       "asks what type an object the check gave you really is (a recorder, a timer): lab code "
       "uses the interfaces it is given"},
      {"typeid",
       "asks what type an object the check gave you really is: lab code uses the interfaces it "
       "is given"},
      {"decltype",
       "a type named after an expression can cast anything to anything (decltype(p)(x)): name "
       "types, or use auto"},
      {"union",
       "overlays two types on the same memory (a way to reinterpret it): use separate members "
       "or std::variant"},
      {"thread_local",
       "a variable per thread outlives the call: ranks are threads of one process, so keep "
       "state in your class's members"},
      {"extern",
       "declares something defined outside your code (a C library function, another file's "
       "variable): use what your contract's headers declare"},
      {"memcpy", kRawMemory},
      {"memmove", kRawMemory},
      {"memset", kRawMemory},
      {"memcmp", kRawMemory},
      {"stdout",
       "the C library's streams are the process's, not lab code's: print with fmt::print or "
       "std::printf"},
      {"stderr",
       "the C library's streams are the process's, not lab code's: print with fmt::print or "
       "std::printf"},
      {"stdin", "lab code reads no input: the check gives it everything it needs"},
      {"FILE",
       "the C library's streams are the process's, not lab code's: print with fmt::print or "
       "std::printf"},
  };
  return refused;
}

/// The standard attributes; any other ([[gnu::constructor]], [[gnu::section(...)]]) changes
/// how the compiler builds the code in ways the audit does not follow.
bool standard_attribute(std::string_view name) {
  static constexpr std::array<std::string_view, 9> kStandard = {
      "nodiscard",  "maybe_unused",      "fallthrough",       "likely", "unlikely", "noreturn",
      "deprecated", "no_unique_address", "carries_dependency"};
  return std::find(kStandard.begin(), kStandard.end(), name) != kStandard.end();
}

/// What a string literal may not contain: paths into the process's own state and the
/// names of the grader's variables.
constexpr std::array<std::pair<std::string_view, std::string_view>, 5> kRefusedInLiterals = {{
    {"/proc", "a path into /proc, where a process reads its own memory, files and environment"},
    {"/dev/", "a path into /dev"},
    {"/sys/", "a path into /sys"},
    {"DPLAB", "the name of one of the grader's environment variables"},
    {"GRADE", "the name of one of the grader's environment variables"},
}};

/// Keywords after which a parenthesis opens an expression, not a call or a declarator.
bool expression_keyword(std::string_view word) {
  static constexpr std::array<std::string_view, 8> kKeywords = {
      "return", "case", "throw", "co_return", "co_yield", "else", "do", "co_await"};
  return std::find(kKeywords.begin(), kKeywords.end(), word) != kKeywords.end();
}

class Rules {
 public:
  Rules(std::string_view file, std::vector<Token> tokens, const IncludePolicy& policy)
      : file_(file), tokens_(std::move(tokens)), policy_(policy) {
    const std::string header = policy_.contract_header;  // "lab7.h" -> "lab7"
    lab_namespace_ = header.substr(0, header.find('.'));
  }

  std::vector<SourceFinding> run() {
    for (i_ = 0; i_ < tokens_.size(); ++i_) {
      const Token& token = tokens_[i_];
      if (token.directive_start) {
        directive();
        continue;
      }
      switch (token.kind) {
        case TokenKind::kBackslash:
          find(token, "\\u",
               "a universal character name outside a literal can spell any name; write names "
               "in plain letters");
          break;
        case TokenKind::kString: literal(token); break;
        case TokenKind::kIdentifier: identifier(); break;
        case TokenKind::kPunctuator: punctuator(); break;
        default: break;
      }
    }
    return std::move(findings_);
  }

 private:
  void find(const Token& at, std::string what, std::string why) {
    findings_.push_back({std::string(file_), at.line, std::move(what), std::move(why)});
  }

  const Token* next(std::size_t offset = 1) const {
    return i_ + offset < tokens_.size() ? &tokens_[i_ + offset] : nullptr;
  }
  const Token* previous() const { return i_ > 0 ? &tokens_[i_ - 1] : nullptr; }
  static bool is(const Token* token, std::string_view text) {
    return token != nullptr && token->text == text && token->kind != TokenKind::kString &&
           token->kind != TokenKind::kCharacter;
  }

  void directive() {
    const Token& hash = tokens_[i_];
    const Token* name = next();
    if (name == nullptr || !name->in_directive || name->kind != TokenKind::kIdentifier) return;
    ++i_;
    if (name->text == "include" || name->text == "include_next" || name->text == "import" ||
        name->text == "embed") {
      include(hash, name->text);
    } else if (name->text == "pragma") {
      find(hash, "#pragma",
           "a pragma changes how the compiler builds your code; there is no need for one in a "
           "lab");
    } else if (name->text == "define" || name->text == "undef") {
      find(hash, "#" + name->text,
           "a macro can rename anything the audit reads (#define private public, a keyword); "
           "write the code itself");
    }
  }

  void include(const Token& hash, const std::string& directive) {
    const Token* header = next();
    if (directive != "include" || header == nullptr || header->kind != TokenKind::kHeaderName) {
      find(hash, "#" + directive,
           "include headers by name, #include <vector> or #include \"dp/tensor.h\"");
      return;
    }
    ++i_;
    const bool quoted = header->text.front() == '"';
    const std::string name = header->text.substr(1, header->text.size() - 2);
    const bool allowed =
        quoted ? (name == policy_.contract_header || policy_.dp_headers.contains(name))
               : (allowed_standard_headers().contains(name) || name == "fmt/format.h" ||
                  name == "fmt/core.h" || name == "fmt/ranges.h");
    if (!quoted && name == "iostream")
      find(hash, "#include <iostream>",
           "<iostream> gives your file a static initialiser (code that runs before main(), which "
           "lab code may not have): print with fmt::print (<fmt/format.h>) or std::printf");
    else if (!allowed)
      find(hash, "#include " + header->text,
           fmt::format("lab code may include the standard C++ headers (but not those that start "
                       "threads, open files or handle signals), \"{}\", the runtime's \"dp/...\" "
                       "headers and <fmt/format.h>",
                       policy_.contract_header));
  }

  void literal(const Token& token) {
    for (const auto& [word, what] : kRefusedInLiterals)
      if (token.text.find(word) != std::string::npos)
        find(token, fmt::format("\"...{}...\"", word),
             fmt::format("{}: lab code reads no files and no environment, the check gives it "
                         "everything it needs",
                         what));
  }

  void identifier() {
    const Token& token = tokens_[i_];
    const std::string& name = token.text;
    if (const auto refused = refused_identifiers().find(name);
        refused != refused_identifiers().end()) {
      find(token, name, refused->second);
    } else if (name.starts_with("__builtin") || name == "__attribute__" || name == "__asm__" ||
               name == "__asm") {
      find(token, name,
           "a compiler extension: it reaches what the language does not offer; write standard "
           "C++");
    } else if (name.front() == '_' && !std::all_of(name.begin() + 1, name.end(),
                                                   [](char c) { return c >= '0' && c <= '9'; })) {
      find(token, name,
           "names that begin with an underscore are reserved for the compiler and the standard "
           "library: they are how code reaches the library's internals; name things plainly");
    } else if (name == "static_cast") {
      static_cast_target();
    } else if (name == "template") {
      explicit_instantiation();
    } else if (name == "void") {
      void_pointer();
    } else if (name == "namespace") {
      namespace_definition();
    } else if (name == "using" || name == "typedef") {
      pointer_alias();
    }
  }

  /// The tokens of a template argument list that starts at `open` ('<'), and the index just
  /// past its closing '>' (or the end).
  std::pair<std::vector<const Token*>, std::size_t> angle_list(std::size_t open) const {
    std::vector<const Token*> inside;
    int depth = 0;
    for (std::size_t j = open; j < tokens_.size(); ++j) {
      const std::string& text = tokens_[j].text;
      if (tokens_[j].kind == TokenKind::kPunctuator) {
        if (text == "<" || text == "(") ++depth;
        if (text == ">" || text == ")") --depth;
        if (text == ">>") depth -= 2;
      }
      if (j > open) inside.push_back(&tokens_[j]);
      if (depth <= 0 && j > open) return {inside, j + 1};
    }
    return {inside, tokens_.size()};
  }

  static bool pointer_or_reference(const std::vector<const Token*>& type) {
    return std::any_of(type.begin(), type.end(), [](const Token* token) {
      return token->kind == TokenKind::kPunctuator &&
             (token->text == "*" || token->text == "&" || token->text == "&&");
    });
  }

  void static_cast_target() {
    if (!is(next(), "<")) return;
    const auto [type, end] = angle_list(i_ + 1);
    (void)end;
    if (pointer_or_reference(type))
      find(tokens_[i_], "static_cast to a pointer or reference",
           "converts a pointer to another type (through void*, or down to a class the object "
           "is not): lab code converts numbers only, and uses objects as the types it is given");
  }

  void explicit_instantiation() {
    const Token* before = previous();
    if (is(before, ".") || is(before, "->") || is(before, "::")) return;  // x.template f<T>()
    if (is(next(), "<")) return;
    find(tokens_[i_], "explicit template instantiation",
         "an explicit instantiation ignores access control (it is how code reaches private "
         "members): write templates, let them be instantiated where they are used");
  }

  void void_pointer() {
    std::size_t j = i_ + 1;
    while (j < tokens_.size() && (tokens_[j].text == "const" || tokens_[j].text == "volatile")) ++j;
    if (j < tokens_.size() && tokens_[j].kind == TokenKind::kPunctuator && tokens_[j].text == "*")
      find(tokens_[i_], "void*",
           "a pointer to memory of no type converts to a pointer to anything: handle memory "
           "through the dp:: API's views and the standard containers");
  }

  /// `namespace a::b {` must be the lab's own namespace or inside it, or anonymous: a class
  /// defined in another namespace could stand in for one of the runtime's or the grader's
  /// (a friend they name, a layout mirror).
  void namespace_definition() {
    if (is(previous(), "using")) return;  // using namespace std;
    std::string path;
    std::size_t j = i_ + 1;
    if (j < tokens_.size() && tokens_[j].text == "inline") ++j;
    while (j < tokens_.size() &&
           (tokens_[j].kind == TokenKind::kIdentifier || tokens_[j].text == "::")) {
      path += tokens_[j].text;
      ++j;
    }
    if (j < tokens_.size() && tokens_[j].text == "=") return;  // an alias: namespace fs = ...
    const std::string enclosing = namespaces_.empty() ? "" : namespaces_.back();
    const std::string full = enclosing.empty() ? path
                             : path.empty()    ? enclosing
                                               : enclosing + "::" + path;
    const std::string own = "dp::" + lab_namespace_;
    const bool allowed = path.empty() || full == own || full.starts_with(own + "::") ||
                         (full == "dp" && is_nested_lab_namespace(j));
    if (!allowed)
      find(tokens_[i_], fmt::format("namespace {}", full),
           fmt::format("define your code in namespace {} (or an anonymous namespace): a class "
                       "defined elsewhere could stand in for one of the runtime's or the "
                       "grader's",
                       own));
    // Track the nesting for `namespace dp { namespace lab1 {`.
    if (j < tokens_.size() && tokens_[j].text == "{") pending_namespace_ = full;
  }

  /// True when "namespace dp {" is followed by "namespace lab<N>".
  bool is_nested_lab_namespace(std::size_t brace) const {
    return brace + 2 < tokens_.size() && tokens_[brace].text == "{" &&
           tokens_[brace + 1].text == "namespace" && tokens_[brace + 2].text == lab_namespace_;
  }

  void pointer_alias() {
    // using Name = ...; or typedef ... Name;
    const bool is_using = tokens_[i_].text == "using";
    if (is_using &&
        !(next() != nullptr && next()->kind == TokenKind::kIdentifier && is(next(2), "=")))
      return;  // a using-declaration or directive
    std::vector<const Token*> type;
    for (std::size_t j = i_ + 1; j < tokens_.size() && tokens_[j].text != ";"; ++j)
      type.push_back(&tokens_[j]);
    if (pointer_or_reference(type))
      find(tokens_[i_], is_using ? "alias of a pointer or reference type" : "typedef of a pointer",
           "a name for a pointer type makes a cast of it reinterpret memory (Alias(x)): write "
           "the type where you use it");
  }

  void punctuator() {
    const Token& token = tokens_[i_];
    if (token.text == "##") {
      find(token, "##",
           "token pasting can build names that the audit refuses, out of parts it does not; "
           "write names whole");
    } else if (token.text == "[" && is(next(), "[")) {
      attributes();
    } else if (token.text == "(") {
      c_style_cast();
    } else if (token.text == "{") {
      namespaces_.push_back(pending_namespace_.empty()
                                ? (namespaces_.empty() ? "" : namespaces_.back())
                                : pending_namespace_);
      pending_namespace_.clear();
    } else if (token.text == "}") {
      if (!namespaces_.empty()) namespaces_.pop_back();
    }
  }

  /// Every attribute of an attribute list ("[" "[" ... "]" "]") must be a standard one.
  void attributes() {
    const Token& open = tokens_[i_];
    int depth = 0;
    bool expect_name = true;
    for (i_ += 2; i_ < tokens_.size(); ++i_) {
      const Token& token = tokens_[i_];
      if (token.kind == TokenKind::kPunctuator) {
        if (token.text == "]" && depth == 0 && is(next(), "]")) {
          ++i_;
          return;
        }
        if (token.text == "(" || token.text == "[") ++depth;
        if (token.text == ")" || token.text == "]") --depth;
        if (token.text == "," && depth == 0) expect_name = true;
        continue;
      }
      if (!expect_name || depth != 0) continue;
      expect_name = false;
      if (token.text == "using") {
        find(open, "[[using ...]]",
             "only the standard attributes ([[nodiscard]], ...) are allowed");
        continue;
      }
      std::string name = token.text;
      if (is(next(), "::")) name += "::";
      if (!standard_attribute(name))
        find(open, fmt::format("[[{}...]]", name),
             "only the standard attributes ([[nodiscard]], [[maybe_unused]], ...) are allowed: "
             "others (a constructor, a section) change how the compiler builds your code");
    }
  }

  /// "(T*) x", "(const T&) y": a C-style cast to a pointer or reference type, which can
  /// reinterpret anything. Told from a call or a declaration by what comes before the
  /// parenthesis (a name or a closing bracket: a call, a declarator, sizeof) and after it
  /// (an operand).
  void c_style_cast() {
    const Token* before = previous();
    if (before != nullptr && !before->in_directive) {
      const bool blocks = before->kind == TokenKind::kIdentifier
                              ? !expression_keyword(before->text)
                              : (before->kind != TokenKind::kPunctuator || before->text == ")" ||
                                 before->text == "]" || before->text == ">");
      if (blocks) return;
    }
    std::vector<const Token*> inside;
    std::size_t j = i_ + 1;
    for (; j < tokens_.size() && tokens_[j].text != ")"; ++j) {
      const Token& token = tokens_[j];
      const bool type_token =
          token.kind == TokenKind::kIdentifier ||
          (token.kind == TokenKind::kPunctuator &&
           (token.text == "::" || token.text == "*" || token.text == "&" || token.text == "&&" ||
            token.text == "<" || token.text == ">" || token.text == ","));
      if (!type_token) return;  // an expression, not a type
      inside.push_back(&token);
    }
    if (inside.empty() || j + 1 >= tokens_.size()) return;
    const std::string& last = inside.back()->text;
    if (last != "*" && last != "&" && last != "&&") return;
    const Token& after = tokens_[j + 1];
    const bool operand = after.kind != TokenKind::kPunctuator || after.text == "(" ||
                         after.text == "&" || after.text == "*" || after.text == "::" ||
                         after.text == "-" || after.text == "!" || after.text == "~";
    if (operand)
      find(tokens_[i_], "C-style cast to a pointer or reference",
           "a C-style cast to a pointer type reinterprets memory, which can reach any object "
           "of the process: handle buffers through the dp:: API's views and the containers");
  }

  std::string_view file_;
  std::vector<Token> tokens_;
  const IncludePolicy& policy_;
  std::string lab_namespace_;
  std::vector<std::string> namespaces_;  // the namespace each open brace is in
  std::string pending_namespace_;        // the namespace the next '{' opens
  std::size_t i_ = 0;
  std::vector<SourceFinding> findings_;
};

}  // namespace

const std::set<std::string>& allowed_standard_headers() {
  // C++20's headers (and the C library's in their <cname> form), less <iostream> (before
  // GCC 13 it gives every file that includes it a static initialiser), <thread>, <future>,
  // <stop_token>, <mutex>, <shared_mutex>, <condition_variable>, <semaphore>, <latch>,
  // <barrier> (threads and what synchronises them: the ranks already are threads),
  // <fstream>, <filesystem>, <syncstream> (files),
  // <csignal>, <csetjmp> (signals, jumps out of the grader's frames) and <ctime> (the wall
  // clock).
  // clang-format off
  static const std::set<std::string> headers = {
      "algorithm", "any", "array", "atomic", "bit", "bitset", "cassert", "cctype", "cerrno",
      "cfenv", "cfloat", "charconv", "chrono", "cinttypes", "climits", "clocale", "cmath",
      "compare", "complex", "concepts", "cstdarg", "cstddef", "cstdint", "cstdio", "cstdlib",
      "cstring", "cuchar", "cwchar", "cwctype", "deque", "exception", "execution", "expected",
      "format", "forward_list", "functional", "initializer_list", "iomanip", "ios", "iosfwd",
      "istream", "iterator", "limits", "list", "locale", "map", "memory", "memory_resource",
      "new", "numbers", "numeric", "optional", "ostream", "queue", "random", "ranges", "ratio",
      "regex", "scoped_allocator", "set", "source_location", "span", "sstream", "stack",
      "stdexcept", "streambuf", "string", "string_view", "system_error", "tuple", "type_traits",
      "typeindex", "typeinfo", "unordered_map", "unordered_set", "utility", "valarray",
      "variant", "vector", "version"};
  // clang-format on
  return headers;
}

std::vector<SourceFinding> scan_lab_source(std::string_view file, std::string_view text,
                                           const IncludePolicy& policy) {
  return Rules(file, lex(text), policy).run();
}

}  // namespace dp::grader::audit
