// symbol_rules.h: which functions, variables and classes lab code may use, as an ordered
// list of rules read from text files (grader/audit/base.rules, and a lab's own
// grader/<lab>/audit.rules before it).
//
// A rule is one line: `allow PATTERN`, or `refuse PATTERN WHY`, where PATTERN is a
// demangled C++ name (or a C name) in which `*` matches any run of characters, quoted when
// it has spaces ("operator new"), and WHY says
// why the name is refused and what to use instead; it is what the student reads. The first
// rule that matches a name decides, and a name that no rule matches is refused: the list
// allows, it does not forbid. Lines starting with '#' are comments; a line starting with
// whitespace continues the WHY of the rule above it.
//
// Names are matched by what they name, not by how the compiler spells them:
// `qualified_name` strips a template function's return type and its parameter list
// ("void std::vector<float>::push_back(float const&)" is std::vector<float>::push_back),
// and the prefix of the symbols that belong to a class ("typeinfo for dp::Error",
// "vtable for dp::Error" name dp::Error). So `refuse dp::grading::*` refuses the grader's
// functions, its classes' virtual tables and their type information, which `dynamic_cast`
// and `typeid` would need.
//
// Example:
//
//   SymbolRules rules = SymbolRules::parse(
//       "refuse dp::grading::* the grader's internals are not for lab code\n"
//       "allow  dp::*\n", "example.rules");
//   rules.decide("dp::Tensor::~Tensor()");                 // allowed
//   rules.decide("typeinfo for dp::grading::Recorder");    // refused, with the reason above
//   rules.decide("fopen");                                 // refused: matches no rule
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader::audit {

/// One rule of a rules file.
struct SymbolRule {
  bool allow = false;   ///< allow or refuse
  std::string pattern;  ///< a qualified name; '*' matches any run of characters
  std::string reason;   ///< for a refusal: why, and what to use instead
  std::string origin;   ///< "file:line" of the rule, for messages
};

/// What the rules say about one name.
struct SymbolDecision {
  bool allowed = false;  ///< the name may be used
  std::string reason;    ///< why not (for a refusal); "" when allowed
  std::string origin;    ///< the rule that decided, "file:line", or "" when none matched
};

/// An ordered list of rules; the first that matches decides.
class SymbolRules {
 public:
  /// Reads rules from `text`; `origin` names it in messages ("base.rules"). Throws
  /// `dp::Error`, naming the line, for a line that is not a rule, a comment or a
  /// continuation.
  static SymbolRules parse(std::string_view text, std::string_view origin);
  /// Reads the rules of each file in turn (earlier files decide first). Throws `dp::Error`
  /// when a file cannot be read or is malformed.
  static SymbolRules load(const std::vector<std::filesystem::path>& files);

  /// Puts `rule` before every rule so far.
  void prepend(SymbolRule rule);
  /// Puts the rules of `later` after every rule so far.
  void append(const SymbolRules& later);

  /// What the first rule that matches `name` (a demangled symbol, see `qualified_name`)
  /// says; a refusal with the default reason when none matches.
  SymbolDecision decide(std::string_view name) const;

  /// The rules, in the order they decide.
  const std::vector<SymbolRule>& rules() const { return rules_; }

 private:
  std::vector<SymbolRule> rules_;
};

/// True when `text` matches `pattern`, in which '*' matches any run of characters (also an
/// empty one) and every other character itself.
bool glob_match(std::string_view pattern, std::string_view text);

/// What a demangled symbol names, as the rules match it: "typeinfo for X", "vtable for X",
/// "guard variable for X" and the other special symbols name X; a function names its
/// qualified name without return type and parameters ("void dp::f<int>(int)" -> "dp::f<int>",
/// "dp::Model::forward(dp::Tensor const&)" -> "dp::Model::forward",
/// "operator new(unsigned long)" -> "operator new"); a variable or a C name, itself.
std::string qualified_name(std::string_view demangled);

/// The demangled form of a linker symbol ("_ZN2dp5ErrorD2Ev" -> "dp::Error::~Error()"); a
/// name that is not a mangled C++ name comes back unchanged.
std::string demangle(std::string_view symbol);

}  // namespace dp::grader::audit
