// symbol_rules.cpp: reading rules files and matching demangled names against them.
#include "symbol_rules.h"

#include <cxxabi.h>
#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "dp/error.h"

namespace dp::grader::audit {
namespace {

/// What a refusal says when no rule matched the name.
constexpr std::string_view kNotListed =
    "it is not on the list of what lab code may use (grader/audit/base.rules): the public "
    "dp:: API of your contract, the C++ standard library's containers, algorithms, numerics, "
    "strings and exceptions, and fmt's formatting";

/// The prefixes of the symbols that belong to something else: "typeinfo for X" names X.
constexpr std::array<std::string_view, 14> kSpecialPrefixes = {"typeinfo name for ",
                                                               "typeinfo for ",
                                                               "vtable for ",
                                                               "VTT for ",
                                                               "construction vtable for ",
                                                               "guard variable for ",
                                                               "TLS init function for ",
                                                               "TLS wrapper function for ",
                                                               "non-virtual thunk to ",
                                                               "virtual thunk to ",
                                                               "covariant return thunk to ",
                                                               "transaction clone for ",
                                                               "hidden alias for ",
                                                               "reference temporary "};

bool is_identifier_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r'))
    text.remove_suffix(1);
  return text;
}

/// The index just past the ')' that closes the '(' at `open`, or npos.
std::size_t after_closing_paren(std::string_view text, std::size_t open) {
  int depth = 0;
  for (std::size_t i = open; i < text.size(); ++i) {
    if (text[i] == '(') ++depth;
    if (text[i] == ')' && --depth == 0) return i + 1;
  }
  return std::string_view::npos;
}

/// Skips the operator's own characters after the word "operator" at `i` (which points just
/// past it): "()", "[]", "<<=", " new[]", " delete", a conversion " std::vector<int>".
std::size_t skip_operator(std::string_view text, std::size_t i) {
  if (text.substr(i, 2) == "()") return i + 2;
  if (i < text.size() && text[i] == ' ') {
    // A named operator (new, delete, a conversion, a literal operator ""): up to the '('
    // of its parameters, keeping template arguments of a conversion's type whole.
    int depth = 0;
    for (++i; i < text.size(); ++i) {
      if (text[i] == '<') ++depth;
      if (text[i] == '>') --depth;
      if (text[i] == '(' && depth == 0) return i;
    }
    return i;
  }
  constexpr std::string_view kOperatorChars = "<>=!+-*/%^&|~,[]";
  while (i < text.size() && kOperatorChars.find(text[i]) != std::string_view::npos) ++i;
  return i;
}

}  // namespace

bool glob_match(std::string_view pattern, std::string_view text) {
  std::size_t p = 0, t = 0;
  std::size_t star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::string qualified_name(std::string_view demangled) {
  for (std::string_view prefix : kSpecialPrefixes) {
    if (!demangled.starts_with(prefix)) continue;
    std::string_view rest = demangled.substr(prefix.size());
    if (prefix == "reference temporary ") {  // "reference temporary #0 for X"
      const std::size_t for_word = rest.find(" for ");
      rest = for_word == std::string_view::npos ? rest : rest.substr(for_word + 5);
    }
    if (prefix == "construction vtable for ") {  // "construction vtable for X-in-Y": Y's
      const std::size_t in = rest.find("-in-");
      if (in != std::string_view::npos) rest = rest.substr(in + 4);
    }
    return qualified_name(rest);
  }

  constexpr std::string_view kAnonymous = "(anonymous namespace)";
  std::size_t name_start = 0;
  std::size_t end = demangled.size();
  int depth = 0;  // inside <...>, {...} and [...] of template arguments and lambdas
  for (std::size_t i = 0; i < demangled.size();) {
    if (demangled.substr(i).starts_with(kAnonymous)) {
      i += kAnonymous.size();
      continue;
    }
    if (demangled.substr(i).starts_with("operator") &&
        (i == 0 || !is_identifier_char(demangled[i - 1])) &&
        (i + 8 == demangled.size() || !is_identifier_char(demangled[i + 8]))) {
      i = skip_operator(demangled, i + 8);
      continue;
    }
    const char c = demangled[i];
    if (c == '<' || c == '{' || c == '[') ++depth;
    if (c == '>' || c == '}' || c == ']') --depth;
    // What came before a space is a return type; "operator<< <T>" is one name.
    if (c == ' ' && depth == 0 && demangled.substr(i + 1, 1) != "<") name_start = i + 1;
    if (c == '(' && depth == 0) {
      // The parameters of a function, unless the name goes on after them: a lambda or a
      // local class of a function, "f(int) const::{lambda()#1}".
      std::size_t next = after_closing_paren(demangled, i);
      if (next == std::string_view::npos) {
        end = i;
        break;
      }
      for (std::string_view qualifier : {" const", " volatile", " &&", " &"})
        if (demangled.substr(next).starts_with(qualifier)) next += qualifier.size();
      if (demangled.substr(next).starts_with("::")) {
        i = next;
        continue;
      }
      end = i;
      break;
    }
    ++i;
  }
  if (name_start > end) name_start = 0;
  return std::string(trim(demangled.substr(name_start, end - name_start)));
}

std::string demangle(std::string_view symbol) {
  const std::string mangled(symbol);
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> text(
      abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), std::free);
  if (status != 0 || text == nullptr) return mangled;
  return text.get();
}

SymbolRules SymbolRules::parse(std::string_view text, std::string_view origin) {
  SymbolRules rules;
  int line_number = 0;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    ++line_number;
    if (trim(line).empty() || trim(line).front() == '#') continue;
    const std::string where = fmt::format("{}:{}", origin, line_number);
    if (line.front() == ' ' || line.front() == '\t') {
      if (rules.rules_.empty() || rules.rules_.back().allow)
        throw Error(fmt::format(
            "{}: an indented line continues the reason of a refuse rule, but none comes before "
            "it: '{}'",
            where, trim(line)));
      rules.rules_.back().reason += fmt::format(" {}", trim(line));
      continue;
    }
    // "VERB PATTERN [WHY]", where a pattern with spaces is quoted: "operator new".
    const std::size_t verb_end = line.find_first_of(" \t");
    const std::string verb(line.substr(0, verb_end));
    std::string_view rest = trim(verb_end == std::string_view::npos ? "" : line.substr(verb_end));
    std::string pattern;
    if (rest.starts_with('"')) {
      const std::size_t close = rest.find('"', 1);
      if (close == std::string_view::npos)
        throw Error(fmt::format("{}: a quoted pattern has no closing '\"': '{}'", where, rest));
      pattern = rest.substr(1, close - 1);
      rest.remove_prefix(close + 1);
    } else {
      const std::size_t pattern_end = rest.find_first_of(" \t");
      pattern = rest.substr(0, pattern_end);
      rest.remove_prefix(pattern_end == std::string_view::npos ? rest.size() : pattern_end);
    }
    SymbolRule rule{verb == "allow", pattern, std::string(trim(rest)), where};
    if ((verb != "allow" && verb != "refuse") || pattern.empty())
      throw Error(fmt::format(
          "{}: expected 'allow PATTERN' or 'refuse PATTERN WHY' (or a '#' comment), got '{}'",
          where, trim(line)));
    if (rule.allow && !rule.reason.empty())
      throw Error(fmt::format("{}: an allow rule takes no reason, got '{}'", where, rule.reason));
    if (!rule.allow && rule.reason.empty())
      throw Error(
          fmt::format("{}: a refuse rule must say why, and what to use instead: 'refuse {} WHY'",
                      where, pattern));
    rules.rules_.push_back(std::move(rule));
  }
  return rules;
}

SymbolRules SymbolRules::load(const std::vector<std::filesystem::path>& files) {
  SymbolRules rules;
  for (const std::filesystem::path& file : files) {
    std::ifstream in(file);
    if (!in) throw Error(fmt::format("cannot read the lab audit's rules file {}", file.string()));
    std::ostringstream text;
    text << in.rdbuf();
    rules.append(parse(text.str(), file.filename().string()));
  }
  return rules;
}

void SymbolRules::prepend(SymbolRule rule) {
  rules_.insert(rules_.begin(), std::move(rule));
}

void SymbolRules::append(const SymbolRules& later) {
  rules_.insert(rules_.end(), later.rules_.begin(), later.rules_.end());
}

SymbolDecision SymbolRules::decide(std::string_view name) const {
  const std::string entity = qualified_name(name);
  for (const SymbolRule& rule : rules_) {
    // A pattern with parentheses ("operator new(unsigned long)") is about the whole
    // signature; any other is about what the symbol names.
    const bool whole = rule.pattern.find('(') != std::string::npos;
    if (glob_match(rule.pattern, whole ? std::string(name) : entity))
      return {rule.allow, rule.allow ? "" : rule.reason, rule.origin};
  }
  return {false, std::string(kNotListed), ""};
}

}  // namespace dp::grader::audit
