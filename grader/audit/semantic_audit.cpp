// semantic_audit.cpp: clang-query's matchers over a lab's source, and their cache.
#include "semantic_audit.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string_view>

#include "dp/error.h"
#include "lab_audit.h"
#include "object_inspection.h"

namespace dp::grader::audit {
namespace {

namespace fs = std::filesystem;

/// One rule: a clang-query matcher, bound to `id`, and what the finding says.
struct Matcher {
  const char* id;
  const char* matcher;  // a clang AST matcher expression, without ".bind(...)"
  const char* what;
  const char* why;
};

/// String literals `parts` joined at compile time into one, '\0'-terminated: the table of
/// rules below is constexpr, and rules that share a piece of matcher text are joined from it.
template <std::size_t... Sizes>
consteval std::array<char, (Sizes + ...) - sizeof...(Sizes) + 1> joined_literals(
    const char (&... parts)[Sizes]) {
  std::array<char, (Sizes + ...) - sizeof...(Sizes) + 1> text{};
  std::size_t end = 0;
  for (const std::string_view part : {std::string_view(parts, Sizes - 1)...})
    for (const char c : part) text[end++] = c;
  return text;  // its last element stays '\0'
}

// A type that carries an address a library template can go past: a pointer to anything but
// characters, or a std::tuple, std::pair or std::array that holds one (as a template argument,
// or in a field of one of its bases, where std::tuple keeps its elements). The rules on
// pointers see only the lab's own file; handed to a library function or constructor, such a
// value is moved, or made a view of any length, in a system header, where they do not look
// (std::apply and std::make_from_tuple unpack a tuple into whatever they call or build, so a
// tuple that holds a pointer hands it on as surely as the bare pointer). From there the lab's
// code reads or writes any memory of the grading process, the grader's results and memory
// accounts too. Character pointers stay allowed: a string literal handed to the library (a
// message, a format) is one.
constexpr char kNonCharPointerOrAHolderOfOne[] = R"(hasUnqualifiedDesugaredType(anyOf(
            pointerType(unless(pointee(isAnyCharacter()))),
            recordType(hasDeclaration(cxxRecordDecl(
                hasAnyName("::std::tuple", "::std::pair", "::std::array"), anyOf(
                classTemplateSpecializationDecl(hasAnyTemplateArgument(refersToType(
                    hasCanonicalType(pointerType(unless(pointee(isAnyCharacter()))))))),
                isDerivedFrom(cxxRecordDecl(has(fieldDecl(hasType(hasCanonicalType(
                    pointerType(unless(pointee(isAnyCharacter())))))))))))))))";

// The matchers of the rules view_from_pointer and pointer_to_library (see the table below),
// each of which looks for an argument of kNonCharPointerOrAHolderOfOne's type in two places.
constexpr auto kViewFromPointerMatcher = joined_literals(
    R"(expr(isExpansionInMainFile(), anyOf(
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(ofClass(hasAnyName("::std::span",
            "::dp::TensorView", "::dp::ConstTensorView", "::dp::ConstBuffer",
            "::dp::MutableBuffer")))), hasAnyArgument(hasType(hasCanonicalType(pointerType())))),
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(ofClass(hasName(
            "::std::basic_string_view")))), argumentCountIs(2),
            hasArgument(0, hasType(hasCanonicalType(pointerType())))),
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(isExpansionInSystemHeader(),
            ofClass(classTemplateSpecializationDecl(hasAnyTemplateArgument(refersToType(
                hasUnqualifiedDesugaredType(recordType(hasDeclaration(cxxRecordDecl(
                hasAnyName("::std::span", "::std::basic_string_view",
                "::std::ranges::subrange", "::dp::TensorView", "::dp::ConstTensorView",
                "::dp::ConstBuffer", "::dp::MutableBuffer"))))))))))),
            hasAnyArgument(hasType()",
    kNonCharPointerOrAHolderOfOne,
    R"()))),
        callExpr(callee(functionDecl(isExpansionInSystemHeader(), anyOf(
            hasAnyTemplateArgument(refersToType(hasUnqualifiedDesugaredType(recordType(
                hasDeclaration(cxxRecordDecl(hasAnyName("::std::span", "::std::basic_string_view",
                "::std::ranges::subrange", "::dp::TensorView", "::dp::ConstTensorView",
                "::dp::ConstBuffer", "::dp::MutableBuffer"))))))),
            cxxMethodDecl(ofClass(classTemplateSpecializationDecl(hasAnyTemplateArgument(
                refersToType(hasUnqualifiedDesugaredType(recordType(hasDeclaration(cxxRecordDecl(
                hasAnyName("::std::span", "::std::basic_string_view",
                "::std::ranges::subrange", "::dp::TensorView", "::dp::ConstTensorView",
                "::dp::ConstBuffer", "::dp::MutableBuffer"))))))))))))),
            hasAnyArgument(hasType()",
    kNonCharPointerOrAHolderOfOne, R"()))))))");

constexpr auto kPointerToLibraryMatcher = joined_literals(
    R"m(expr(isExpansionInMainFile(), anyOf(
        callExpr(unless(cxxOperatorCallExpr()), callee(functionDecl(isExpansionInSystemHeader(),
            unless(cxxMethodDecl()), unless(hasAnyName("::std::move", "::std::forward",
            "::std::exchange", "::std::swap", "::std::addressof", "::std::min", "::std::max",
            "::std::make_pair", "::std::make_tuple", "::std::tie", "::std::get")))),
            hasAnyArgument(hasType()m",
    kNonCharPointerOrAHolderOfOne,
    R"m()))),
        cxxOperatorCallExpr(hasOverloadedOperatorName("()"),
            callee(cxxMethodDecl(isExpansionInSystemHeader())),
            hasAnyArgument(hasType()m",
    kNonCharPointerOrAHolderOfOne,
    R"m()))),
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(isExpansionInSystemHeader())),
            argumentCountIs(2),
            hasArgument(0, hasType(hasUnqualifiedDesugaredType(pointerType(
                unless(pointee(isAnyCharacter())))))),
            hasArgument(1, hasType(hasUnqualifiedDesugaredType(pointerType(
                unless(pointee(isAnyCharacter()))))))),
        cxxMemberCallExpr(callee(cxxMethodDecl(isExpansionInSystemHeader())),
            hasArgument(0, hasType(hasUnqualifiedDesugaredType(pointerType(
                unless(pointee(isAnyCharacter())))))),
            hasArgument(1, hasType(hasUnqualifiedDesugaredType(pointerType(
                unless(pointee(isAnyCharacter()))))))))))m");

// Every matcher looks at the lab's own file only (isExpansionInMainFile), template instances
// included (traversal AsIs). Types are matched as the compiler resolved them
// (hasCanonicalType, hasUnqualifiedDesugaredType), never as spelt: in an instance of a
// generic lambda or a function template a pointer's type is the template parameter it was
// deduced for, and through an alias it is the alias's name, and `hasType(pointerType())`
// saw neither (std::apply over a tuple of object pointers into a generic lambda moved the
// pointer past its object unseen, the gap open since stop 39).
constexpr std::array<Matcher, 16> kMatchers = {{
    {"reinterpreting_cast",
     R"(castExpr(isExpansionInMainFile(), anyOf(hasCastKind("CK_IntegralToPointer"),
        hasCastKind("CK_PointerToIntegral"), hasCastKind("CK_BitCast"),
        hasCastKind("CK_LValueBitCast"), hasCastKind("CK_LValueToRValueBitCast"),
        hasCastKind("CK_ReinterpretMemberPointer"), hasCastKind("CK_BaseToDerived"),
        hasCastKind("CK_BaseToDerivedMemberPointer"))))",
     "a cast that reinterprets memory",
     "it converts an integer to a pointer or back, a pointer to a pointer of another type (or "
     "to void), or an object down to a class it may not be, however it is spelt (a functional "
     "cast through an alias or a template parameter too): lab code converts numbers only, and "
     "uses objects as the types it is given"},
    {"placement_new", R"(cxxNewExpr(isExpansionInMainFile(), hasAnyPlacementArg(anything())))",
     "placement new",
     "it builds an object in memory the code did not allocate: create objects as variables or "
     "in containers"},
    {"pointer_arithmetic",
     R"(binaryOperator(isExpansionInMainFile(), hasAnyOperatorName("+", "-", "+=", "-="),
        hasEitherOperand(hasType(hasCanonicalType(pointerType())))))",
     "pointer arithmetic",
     "a pointer moved past what it points to reaches any memory of the process: index a "
     "std::vector, std::array or std::span (checked), or take a view of a tensor"},
    {"pointer_step",
     R"(unaryOperator(isExpansionInMainFile(), hasAnyOperatorName("++", "--"),
        hasUnaryOperand(hasType(hasCanonicalType(pointerType())))))",
     "pointer arithmetic",
     "a pointer moved past what it points to reaches any memory of the process: index a "
     "std::vector, std::array or std::span (checked), or take a view of a tensor"},
    {"builtin_subscript", R"(arraySubscriptExpr(isExpansionInMainFile()))",
     "subscript of a pointer or a C array",
     "it is not checked against the array's end: use std::vector, std::array or std::span, "
     "whose operator[] is"},
    {"iterator_arithmetic",
     R"(cxxOperatorCallExpr(isExpansionInMainFile(),
        hasAnyOverloadedOperatorName("+", "-", "+=", "-=", "[]"),
        hasArgument(0, hasType(hasUnqualifiedDesugaredType(recordType(hasDeclaration(
            cxxRecordDecl(matchesName("iterator")))))))))",
     "iterator arithmetic",
     "an iterator moved past its container's end is not checked: index the container, or take "
     "a std::span and its subspan (checked)"},
    {"iterator_step",
     R"(callExpr(isExpansionInMainFile(), callee(functionDecl(hasAnyName(
        "::std::next", "::std::prev", "::std::advance", "::std::ranges::next",
        "::std::ranges::prev", "::std::ranges::advance")))))",
     "std::next, std::prev or std::advance",
     "an iterator moved past its container's end is not checked: index the container, or take "
     "a std::span and its subspan (checked)"},
    // A view from a pointer and a length, written in the lab's file or built by a library
    // template the lab's file tells to build one: a class or function template of the
    // library whose template argument is a view type, given a pointer or a tuple-like that
    // holds one (std::make_from_tuple<std::span<T>>(pair), std::optional<std::span<T>>(
    // std::in_place, p, n), a container of spans' emplace_back(p, n)).
    {"view_from_pointer", kViewFromPointerMatcher.data(),
     "a view built from a pointer and a length",
     "it reaches as far as the length says, past what the pointer points to: take views from "
     "tensors (view, slice) and from containers"},
    // Iterators of two containers make a range over whatever memory lies between them, and
    // an output iterator runs past its container's end: neither is checked. Loops (range-for,
    // which makes its own iterators) and whole-range algorithms need no iterator argument.
    {"iterator_argument",
     R"(expr(isExpansionInMainFile(), anyOf(
        callExpr(unless(cxxOperatorCallExpr()), hasAnyArgument(hasType(
            hasUnqualifiedDesugaredType(recordType(hasDeclaration(cxxRecordDecl(
                matchesName("iterator"), unless(matchesName("insert_iterator"))))))))),
        cxxConstructExpr(unless(hasType(hasUnqualifiedDesugaredType(recordType(hasDeclaration(
            cxxRecordDecl(matchesName("iterator"))))))), hasAnyArgument(hasType(
            hasUnqualifiedDesugaredType(recordType(hasDeclaration(cxxRecordDecl(
                matchesName("iterator"), unless(matchesName("insert_iterator"))))))))))))",
     "an iterator passed to a function",
     "iterators of two containers make a range over the memory between them, and an output "
     "iterator runs past its container's end, unchecked: pass whole containers to the "
     "std::ranges algorithms (std::ranges::fill(v, x), std::ranges::sort(v)), or loop with "
     "range-for or an index"},
    // The same through raw pointers (std::array's iterators are pointers): a library
    // function given addresses reads or writes as far as it is told. A library function
    // object (std::views::counted) is a library function; a std::tuple, std::pair or
    // std::array that holds a pointer hands the pointer on as surely as the pointer itself
    // (std::apply and std::make_from_tuple unpack it into whatever they call or build).
    {"pointer_to_library", kPointerToLibraryMatcher.data(),
     "an address passed to a library function",
     "a library function given addresses (std::memcpy, std::copy, a range of pointers) reads "
     "or writes as far as it is told, unchecked: use containers, their checked operator[], "
     "and the std::ranges algorithms on whole containers"},
    // An element address (float*, std::byte*, void*) handed to a library constructor or
    // member function: std::tuple, std::optional's in_place, a container's emplace, whose
    // code in a system header then builds a view or buffer from it, out of
    // view_from_pointer's sight (std::make_from_tuple<dp::MutableBuffer> relabelled a host
    // span as device memory so; a span from a pointer is view_from_pointer's finding).
    // Pointers to objects (a Parameter*, a Layer*) and to characters stay allowed.
    {"element_address_to_library",
     R"(expr(isExpansionInMainFile(), anyOf(
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(isExpansionInSystemHeader(),
                             unless(ofClass(hasAnyName("::std::span", "::std::basic_string_view"))))),
            hasAnyArgument(hasType(pointsTo(qualType(anyOf(hasCanonicalType(builtinType()),
                hasCanonicalType(enumType(hasDeclaration(enumDecl(hasName("::std::byte")))))),
                unless(isAnyCharacter())))))),
        cxxMemberCallExpr(callee(cxxMethodDecl(isExpansionInSystemHeader())),
            hasAnyArgument(hasType(pointsTo(qualType(anyOf(hasCanonicalType(builtinType()),
                hasCanonicalType(enumType(hasDeclaration(enumDecl(hasName("::std::byte")))))),
                unless(isAnyCharacter())))))))))",
     "an element address passed to a library type",
     "a library type given the address of tensor or container elements (a std::tuple, an "
     "optional or a container built from it) can turn it into a view or buffer of any length "
     "and any device: take views from tensors (view, slice) and from containers"},
    {"address_as_number",
     R"(expr(isExpansionInMainFile(), anyOf(
        cxxOperatorCallExpr(callee(cxxMethodDecl(ofClass(classTemplateSpecializationDecl(
            hasName("::std::hash"),
            hasTemplateArgument(0, refersToType(hasCanonicalType(pointerType())))))))),
        cxxOperatorCallExpr(hasOverloadedOperatorName("<<"), hasArgument(1, hasType(
            hasUnqualifiedDesugaredType(pointerType(unless(pointee(isAnyCharacter()))))))),
        callExpr(callee(functionDecl(hasName("::fmt::ptr")))))))",
     "an address turned into a number",
     "an address as a number (hashed, formatted or streamed) tells where objects are, which "
     "lab code has no use for: compare objects, or pointers with ==, instead"},
    // A function as a value: called through a pointer, it escapes every rule that looks at
    // what a call names (the lab 3 trial called dp::gemm so).
    {"function_as_value",
     R"(expr(isExpansionInMainFile(), anyOf(
        implicitCastExpr(hasCastKind("CK_FunctionToPointerDecay"),
            unless(hasParent(callExpr()))),
        unaryOperator(hasOperatorName("&"), hasUnaryOperand(declRefExpr(to(functionDecl())))))))",
     "a function taken as a value",
     "a function called through a pointer escapes what the audit reads of calls: call functions "
     "by name, and pass behaviour as a lambda"},
    // The communicator's buffers are views the runtime builds from tensors; a field changed
    // afterwards (a larger count) makes a call read or write past the tensor.
    // A member pointer to a field (&dp::MutableBuffer::count, handed to std::invoke or used
    // with .*) is the field too.
    {"buffer_field",
     R"(expr(isExpansionInMainFile(), anyOf(
        memberExpr(member(fieldDecl(hasParent(cxxRecordDecl(
            hasAnyName("::dp::ConstBuffer", "::dp::MutableBuffer")))))),
        declRefExpr(to(fieldDecl(hasParent(cxxRecordDecl(
            hasAnyName("::dp::ConstBuffer", "::dp::MutableBuffer")))))))))",
     "a field of a communication buffer",
     "a buffer's address or count, read or changed, reaches memory past its tensor: hand the "
     "communicator tensor views (view, slice), which it turns into buffers itself"},
    // A model or a layer of the lab's own would compute where the checks measure the model's
    // work (a speed check counting layer compute), or hold a replica the memory checks would
    // not see as the model's.
    {"builds_a_model",
     R"(stmt(isExpansionInMainFile(), anyOf(
        cxxConstructExpr(hasDeclaration(cxxConstructorDecl(ofClass(cxxRecordDecl(
            isSameOrDerivedFrom(cxxRecordDecl(hasAnyName("::dp::Model", "::dp::Layer")))))))),
        callExpr(callee(cxxMethodDecl(isStaticStorageClass(), ofClass(hasName("::dp::Model"))))),
        callExpr(callee(functionDecl(hasAnyName("::std::make_unique", "::std::make_shared"),
            hasTemplateArgument(0, refersToType(hasDeclaration(cxxRecordDecl(isSameOrDerivedFrom(
                cxxRecordDecl(hasAnyName("::dp::Model", "::dp::Layer")))))))))))))",
     "a model or a layer of the lab's own",
     "lab code trains the model it is given: a model, layer or copy of its own would compute "
     "or hold parameters where the checks measure the model's (use the model's own layers "
     "and parameters through the references the contract hands you)"},
    {"holds_a_model",
     R"(declaratorDecl(isExpansionInMainFile(), hasType(hasUnqualifiedDesugaredType(recordType(
        hasDeclaration(classTemplateSpecializationDecl(hasAnyTemplateArgument(refersToType(
            hasDeclaration(cxxRecordDecl(isSameOrDerivedFrom(cxxRecordDecl(hasAnyName(
                "::dp::Model", "::dp::Layer"))))))))))))))",
     "a model or a layer of the lab's own",
     "lab code trains the model it is given: a model, layer or copy of its own would compute "
     "or hold parameters where the checks measure the model's (use the model's own layers "
     "and parameters through the references the contract hands you)"},
}};

/// The clang-query program: clang-query, or the versioned name Debian installs.
std::string clang_query() {
  for (const char* name : {"clang-query", "clang-query-14", "clang-query-15", "clang-query-16"}) {
    const char* path = std::getenv("PATH");
    std::istringstream directories(path == nullptr ? "/usr/bin" : path);
    std::string directory;
    while (std::getline(directories, directory, ':'))
      if (!directory.empty() && access((fs::path(directory) / name).c_str(), X_OK) == 0)
        return name;
  }
  throw Error(
      "the lab audit needs clang-query (Debian's clang-tools-14), which is not installed: "
      "tools/install-deps installs it");
}

/// The bytes of `file`, or "" when it cannot be read: unlike lab_audit.cpp's reader this one
/// does not throw, since a source clang cannot read becomes clang's own finding.
std::string contents_or_empty(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Everything the findings depend on: the rules, the arguments, the file, and every header
/// in the include directories, by its path inside the directory and its contents. Not by
/// the directory's own path: a planted cheat is a copy of the solution elsewhere, and its
/// untouched files then share the solution's findings instead of being read again.
std::string cache_key_material(const fs::path& source, const std::vector<std::string>& args,
                               const std::vector<RefusedCall>& refused_calls) {
  std::string material = fmt::format("semantic rules {}\n", kSemanticRulesVersion);
  for (const Matcher& matcher : kMatchers) material += fmt::format("{}\n", matcher.matcher);
  for (const RefusedCall& call : refused_calls)
    material += fmt::format("refused {}::{} {}\n", call.class_name, call.method, call.why);
  for (const std::string& argument : args) {
    const fs::path directory = argument.starts_with("-I") ? argument.substr(2) : "";
    if (directory.empty() || !fs::is_directory(directory)) {
      material += argument + "\n";
      continue;
    }
    material += "-I\n";
    std::set<fs::path> headers;  // sorted, so that the key does not depend on the walk
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(directory))
      if (entry.is_regular_file() && entry.path().extension() == ".h")
        headers.insert(entry.path().lexically_relative(directory));
    for (const fs::path& header : headers) {
      const std::string contents = contents_or_empty(directory / header);
      material += fmt::format("{} {}\n{}\n", header.string(), contents.size(), contents);
    }
  }
  material += "--\n" + contents_or_empty(source);
  return material;
}

std::string serialise(const std::vector<SourceFinding>& findings) {
  std::string text;
  for (const SourceFinding& finding : findings)
    text += fmt::format("{}\t{}\t{}\n", finding.line, finding.what, finding.why);
  return text;
}

std::vector<SourceFinding> deserialise(std::string_view file, const std::string& text) {
  std::vector<SourceFinding> findings;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const std::size_t first = line.find('\t');
    const std::size_t second = line.find('\t', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    findings.push_back({std::string(file), std::atoi(line.substr(0, first).c_str()),
                        line.substr(first + 1, second - first - 1), line.substr(second + 1)});
  }
  return findings;
}

std::vector<SourceFinding> run_matchers(const fs::path& source,
                                        const std::vector<std::string>& compile_args,
                                        const std::vector<RefusedCall>& refused_calls) {
  std::vector<std::string> argv = {clang_query(), "-c", "set traversal AsIs", "-c",
                                   "set output diag"};
  for (const Matcher& matcher : kMatchers) {
    // One line per command: the matchers above are written over several.
    std::string expression;
    for (const char c : std::string_view(matcher.matcher)) {
      const bool blank = c == ' ' || c == '\n';
      if (!blank || (!expression.empty() && expression.back() != ' '))
        expression += blank ? ' ' : c;
    }
    argv.push_back("-c");
    argv.push_back(fmt::format("match {}.bind(\"{}\")", expression, matcher.id));
  }
  // Each refused call binds as "refused_call_<i>": in the lab's file, and in the library
  // templates it instantiates, which call what the lab's types give them to call (a
  // std::ranges::data(view) calls view.data(), a std::invoke what it is handed). Only the
  // lab's file can have made a library template call a method of the runtime's classes.
  for (std::size_t i = 0; i < refused_calls.size(); ++i) {
    argv.push_back("-c");
    argv.push_back(fmt::format(
        "match cxxMemberCallExpr(anyOf(isExpansionInMainFile(), isExpansionInSystemHeader()), "
        "callee(cxxMethodDecl(hasName(\"{}\"), ofClass(isSameOrDerivedFrom(\"::{}\")))))"
        ".bind(\"refused_call_{}\")",
        refused_calls[i].method, refused_calls[i].class_name, i));
  }
  argv.push_back(source.string());
  argv.push_back("--");
  argv.insert(argv.end(), compile_args.begin(), compile_args.end());
  argv.push_back("-w");  // the lab's build reports warnings; here only the tree matters
  const CapturedRun run = run_collecting(argv);

  // "<file>:<line>:<column>: note: "<id>" binds here" for every match; "<file>:...: error:
  // ..." where clang cannot read the file.
  static const std::regex binding(R"re(^(.*):([0-9]+):[0-9]+: note: "([a-z_0-9]+)" binds here$)re");
  static const std::regex error(R"re(^(.*):([0-9]+):[0-9]+: (fatal )?error: (.*)$)re");
  const std::string file = source.filename().string();
  std::vector<SourceFinding> findings;
  std::set<std::pair<int, std::string>> seen;  // a template instance repeats its matches
  std::istringstream lines(run.output);
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch match;
    if (std::regex_match(line, match, binding)) {
      const std::string id = match[3].str();
      const int at = std::stoi(match[2].str());
      if (id.starts_with("refused_call_")) {
        const std::size_t i = std::stoul(id.substr(std::string_view("refused_call_").size()));
        if (i >= refused_calls.size()) continue;
        const RefusedCall& call = refused_calls[i];
        std::string what = fmt::format("{}::{}()", call.class_name, call.method);
        // In a library header: the call is the lab's all the same, through a template whose
        // line in the lab's file clang does not print; the finding names the file.
        const bool in_the_labs_file = match[1].str() == source.string();
        if (!in_the_labs_file) what += " (called for this file by a library template)";
        const int finding_line = in_the_labs_file ? at : 0;
        if (seen.insert({finding_line, what}).second)
          findings.push_back({file, finding_line, what, call.why});
        continue;
      }
      const auto rule = std::find_if(kMatchers.begin(), kMatchers.end(),
                                     [&](const Matcher& m) { return id == m.id; });
      if (rule == kMatchers.end() || !seen.insert({at, rule->what}).second) continue;
      findings.push_back({file, at, rule->what, rule->why});
    } else if (std::regex_match(line, match, error) && findings.empty()) {
      findings.push_back({file, std::stoi(match[2].str()), "a file clang cannot read",
                          fmt::format("the audit reads your code with clang, which says: {} "
                                      "(write standard C++20 that both compilers accept)",
                                      match[4].str())});
      break;
    }
  }
  if (findings.empty() && run.exit_status != 0)
    findings.push_back({file, 0, "a file clang cannot read",
                        fmt::format("clang-query exited with status {}: {}", run.exit_status,
                                    run.output.substr(0, 400))});
  std::sort(findings.begin(), findings.end(),
            [](const SourceFinding& a, const SourceFinding& b) { return a.line < b.line; });
  return findings;
}

}  // namespace

std::vector<RefusedCall> load_refused_calls(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw Error(fmt::format("cannot read the refused calls {}", file.string()));
  static const std::regex line_form(
      R"re(^([A-Za-z_][A-Za-z_0-9:]*)::([A-Za-z_][A-Za-z_0-9]*)\s+(\S.*)$)re");
  std::vector<RefusedCall> calls;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty() || line.starts_with("#")) continue;
    std::smatch match;
    if (!std::regex_match(line, match, line_form))
      throw Error(fmt::format(
          "{}:{}: expected '<class>::<method> <why>' (e.g. 'dp::Communicator::allreduce lab 3 "
          "builds it from messages'), got '{}'",
          file.string(), number, line));
    calls.push_back({match[1].str(), match[2].str(), match[3].str()});
  }
  return calls;
}

std::vector<SourceFinding> audit_semantics(const std::filesystem::path& source,
                                           const std::vector<std::string>& compile_args,
                                           const std::filesystem::path& cache_dir,
                                           const std::vector<RefusedCall>& refused_calls) {
  if (cache_dir.empty()) return run_matchers(source, compile_args, refused_calls);
  std::error_code error;
  fs::create_directories(cache_dir, error);
  // The key: the SHA-256 of what the findings depend on, written to a scratch file first.
  const fs::path scratch = cache_dir / fmt::format("key.{}", getpid());
  {
    std::ofstream out(scratch, std::ios::binary);
    out << cache_key_material(source, compile_args, refused_calls);
    if (!out)
      return run_matchers(source, compile_args, refused_calls);  // a read-only build tree: no cache
  }
  const std::string key = sha256_of_file(scratch);
  fs::remove(scratch, error);
  const fs::path cached = cache_dir / (key + ".findings");
  if (fs::is_regular_file(cached))
    return deserialise(source.filename().string(), contents_or_empty(cached));
  std::vector<SourceFinding> findings = run_matchers(source, compile_args, refused_calls);
  // Written whole or not at all, as a concurrent grade may read it.
  const fs::path partial = cache_dir / fmt::format("{}.{}.partial", key, getpid());
  {
    std::ofstream out(partial, std::ios::binary);
    out << serialise(findings);
  }
  fs::rename(partial, cached, error);
  if (error) fs::remove(partial, error);
  return findings;
}

}  // namespace dp::grader::audit
