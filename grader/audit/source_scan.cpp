// source_scan.cpp: a small C++ tokeniser and the constructs the audit refuses.
#include "source_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <utility>

namespace dp::grader::audit {
namespace {

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

/// Identifiers the audit refuses, and why.
const std::map<std::string, std::string, std::less<>>& refused_identifiers() {
  static const std::map<std::string, std::string, std::less<>> refused = {
      {"asm",
       "inline assembly: the audit judges your code by what it compiles to, which assembly "
       "can hide; write C++"},
      {"reinterpret_cast",
       "reinterprets memory as another type, which can reach any object of the process, the "
       "grader's included: use static_cast, and the dp:: API's views for buffers"},
      {"bit_cast", "reinterprets memory as another type: use static_cast for numbers"},
      {"union",
       "overlays two types on the same memory (a way to reinterpret it): use separate members "
       "or std::variant"},
      {"thread_local",
       "a variable per thread outlives the call: ranks are threads of one process, so keep "
       "state in your class's members"},
      {"extern",
       "declares something defined outside your code (a C library function, another file's "
       "variable): use what your contract's headers declare"},
      {"uintptr_t",
       "turns pointers into integers and back: handle memory through the dp:: API's tensors "
       "and views and the standard containers"},
      {"intptr_t",
       "turns pointers into integers and back: handle memory through the dp:: API's tensors "
       "and views and the standard containers"},
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
constexpr std::array<std::pair<std::string_view, std::string_view>, 4> kRefusedInLiterals = {{
    {"/proc", "a path into /proc, where a process reads its own memory, files and environment"},
    {"/dev/", "a path into /dev"},
    {"/sys/", "a path into /sys"},
    {"DPLAB_", "the name of one of the grader's environment variables"},
}};

class Scanner {
 public:
  Scanner(std::string_view file, std::string_view source, const IncludePolicy& policy)
      : file_(file), spliced_(splice(source)), policy_(policy) {}

  std::vector<SourceFinding> scan() {
    const std::string& text = spliced_.text;
    bool line_start = true;  // only whitespace since the last newline
    for (i_ = 0; i_ < text.size();) {
      const char c = text[i_];
      if (c == '\n') {
        line_start = true;
        ++i_;
        continue;
      }
      if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
        ++i_;
        continue;
      }
      if (starts("//")) {
        skip_to_newline();
        continue;
      }
      if (starts("/*")) {
        const std::size_t end = text.find("*/", i_ + 2);
        i_ = end == std::string::npos ? text.size() : end + 2;
        continue;
      }
      const bool directive_start = line_start && (c == '#' || starts("%:"));
      line_start = false;
      if (directive_start) {
        directive();
        continue;
      }
      if (starts("##") || starts("%:%:")) {
        find(i_, "##",
             "token pasting can build names that the audit refuses, out of parts it "
             "does not; write names whole");
        i_ += 2;
        continue;
      }
      if (starts("[[") || starts("<:<:")) {
        attribute();
        continue;
      }
      if (c == '\\') {
        find(i_, "\\u",
             "a universal character name outside a literal can spell any name; "
             "write names in plain letters");
        ++i_;
        continue;
      }
      if (c >= '0' && c <= '9') {
        number();
        continue;
      }
      if (c == '.' && i_ + 1 < text.size() && text[i_ + 1] >= '0' && text[i_ + 1] <= '9') {
        number();
        continue;
      }
      if (identifier_start(c)) {
        identifier_or_literal();
        continue;
      }
      if (c == '"' || c == '\'') {
        literal(c);
        continue;
      }
      ++i_;
    }
    return std::move(findings_);
  }

 private:
  bool starts(std::string_view word) const {
    return std::string_view(spliced_.text).substr(i_).starts_with(word);
  }

  void skip_to_newline() {
    const std::size_t newline = spliced_.text.find('\n', i_);
    i_ = newline == std::string::npos ? spliced_.text.size() : newline;
  }

  void find(std::size_t at, std::string what, std::string why) {
    const int line = at < spliced_.line.size() ? spliced_.line[at]
                                               : (spliced_.line.empty() ? 1 : spliced_.line.back());
    findings_.push_back({std::string(file_), line, std::move(what), std::move(why)});
  }

  std::string read_identifier() {
    const std::size_t start = i_;
    while (i_ < spliced_.text.size() && identifier_char(spliced_.text[i_])) ++i_;
    return spliced_.text.substr(start, i_ - start);
  }

  void skip_blanks() {
    while (i_ < spliced_.text.size() && (spliced_.text[i_] == ' ' || spliced_.text[i_] == '\t'))
      ++i_;
  }

  void directive() {
    const std::size_t at = i_;
    i_ += spliced_.text[i_] == '#' ? 1 : 2;
    skip_blanks();
    const std::string name = read_identifier();
    if (name == "include" || name == "include_next" || name == "import" || name == "embed") {
      include(at, name);
      skip_to_newline();
    } else if (name == "pragma") {
      find(at, "#pragma",
           "a pragma changes how the compiler builds your code; there is no need "
           "for one in a lab");
      skip_to_newline();
    }
    // Other directives (#define, #if, ...): the rest of the line is scanned as code.
  }

  void include(std::size_t at, const std::string& directive) {
    skip_blanks();
    const std::string& text = spliced_.text;
    const char open = i_ < text.size() ? text[i_] : '\0';
    const char close = open == '<' ? '>' : '"';
    const std::size_t end =
        (open == '<' || open == '"') ? text.find(close, i_ + 1) : std::string::npos;
    if (directive != "include" || end == std::string::npos || text.find('\n', i_) < end) {
      find(at, "#" + directive,
           "include headers by name, #include <vector> or #include \"dp/tensor.h\"");
      return;
    }
    const std::string header = text.substr(i_ + 1, end - i_ - 1);
    const bool allowed =
        open == '"' ? (header == policy_.contract_header || policy_.dp_headers.contains(header))
                    : (allowed_standard_headers().contains(header) || header == "fmt/format.h" ||
                       header == "fmt/core.h" || header == "fmt/ranges.h");
    if (header == "iostream" && open == '<')
      find(at, "#include <iostream>",
           "<iostream> gives your file a static initialiser (code that runs before main(), which "
           "lab code may not have): print with fmt::print (<fmt/format.h>) or std::printf");
    else if (!allowed)
      find(at, fmt::format("#include {}{}{}", open, header, close),
           fmt::format("lab code may include the standard C++ headers (but not those that "
                       "start threads, open files or handle signals), \"{}\", the runtime's "
                       "\"dp/...\" headers and <fmt/format.h>",
                       policy_.contract_header));
  }

  void attribute() {
    const std::size_t at = i_;
    i_ += spliced_.text[i_] == '[' ? 2 : 4;  // "[[" or its digraph "<:<:"
    skip_blanks();
    std::string name = read_identifier();
    if (name == "using") {  // [[using gnu: ...]]
      find(at, "[[using ...]]", "only the standard attributes ([[nodiscard]], ...) are allowed");
      return;
    }
    skip_blanks();
    if (starts("::")) name += "::";
    if (!standard_attribute(name))
      find(at, fmt::format("[[{}...]]", name),
           "only the standard attributes ([[nodiscard]], [[maybe_unused]], ...) are allowed: "
           "others (a constructor, a section) change how the compiler builds your code");
  }

  void number() {
    // A pp-number: digits, letters, '.', digit separators and exponent signs.
    const std::string& text = spliced_.text;
    ++i_;
    while (i_ < text.size()) {
      const char c = text[i_];
      if ((c == '+' || c == '-') && std::string("eEpP").find(text[i_ - 1]) != std::string::npos) {
        ++i_;
      } else if (identifier_char(c) || c == '.' ||
                 (c == '\'' && i_ + 1 < text.size() && identifier_char(text[i_ + 1]))) {
        ++i_;
      } else {
        break;
      }
    }
  }

  void identifier_or_literal() {
    const std::size_t at = i_;
    const std::string name = read_identifier();
    const std::string& text = spliced_.text;
    if (i_ < text.size() && (text[i_] == '"' || text[i_] == '\'')) {
      static const std::set<std::string> kPrefixes = {"L",  "u",  "U",  "u8", "R",
                                                      "LR", "uR", "UR", "u8R"};
      if (kPrefixes.contains(name)) {
        if (name.back() == 'R' && text[i_] == '"')
          raw_literal(at);
        else
          literal(text[i_]);
        return;
      }
    }
    if (const auto refused = refused_identifiers().find(name);
        refused != refused_identifiers().end()) {
      find(at, name, refused->second);
    } else if (name.starts_with("__builtin") || name == "__attribute__" || name == "__asm__" ||
               name == "__asm") {
      find(at, name,
           "a compiler extension: it reaches what the language does not offer; write "
           "standard C++");
    } else if (name.front() == '_' && !std::all_of(name.begin() + 1, name.end(),
                                                   [](char c) { return c >= '0' && c <= '9'; })) {
      find(at, name,
           "names that begin with an underscore are reserved for the compiler and the standard "
           "library: they are how code reaches the library's internals; name things plainly");
    }
  }

  void literal(char quote) {
    const std::size_t at = i_;
    const std::string& text = spliced_.text;
    std::string contents;
    for (++i_; i_ < text.size() && text[i_] != quote && text[i_] != '\n'; ++i_) {
      if (text[i_] == '\\' && i_ + 1 < text.size()) contents.push_back(text[i_++]);
      contents.push_back(text[i_]);
    }
    if (i_ < text.size() && text[i_] == quote) ++i_;
    check_literal(at, contents);
  }

  void raw_literal(std::size_t at) {
    // R"delimiter( ... )delimiter"
    const std::string& text = spliced_.text;
    const std::size_t open = text.find('(', i_);
    if (open == std::string::npos) {
      i_ = text.size();
      return;
    }
    const std::string end = fmt::format("){}\"", text.substr(i_ + 1, open - i_ - 1));
    const std::size_t close = text.find(end, open);
    const std::size_t stop = close == std::string::npos ? text.size() : close;
    check_literal(at, text.substr(open + 1, stop - open - 1));
    i_ = close == std::string::npos ? text.size() : close + end.size();
  }

  void check_literal(std::size_t at, const std::string& contents) {
    for (const auto& [word, what] : kRefusedInLiterals)
      if (contents.find(word) != std::string::npos)
        find(at, fmt::format("\"...{}...\"", word),
             fmt::format("{}: lab code reads no files and no environment, the check gives it "
                         "everything it needs",
                         what));
  }

  std::string_view file_;
  SplicedText spliced_;
  const IncludePolicy& policy_;
  std::size_t i_ = 0;
  std::vector<SourceFinding> findings_;
};

}  // namespace

const std::set<std::string>& allowed_standard_headers() {
  // C++20's headers (and the C library's in their <cname> form), less <iostream> (before
  // GCC 13 it gives every file that includes it a static initialiser), <thread>, <future>,
  // <stop_token>, <mutex>, <shared_mutex>, <condition_variable>, <semaphore>, <latch>,
  // <barrier> (threads and what synchronises them: the ranks already are threads),
  // <fstream>, <filesystem>, <syncstream> (files), <csignal>, <csetjmp> (signals, jumps out
  // of the grader's frames) and <ctime> (the wall clock).
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
  return Scanner(file, text, policy).scan();
}

}  // namespace dp::grader::audit
