// semantic_audit.h: the part of the lab audit that reads a lab's source as the compiler
// understands it (with clang-query, on clang's syntax tree, template instances included), for
// what no spelling gives away: a functional cast through a type that happens to be a pointer
// (`std::vector<char*>::value_type(x)`, `To(x)` in a template) reinterprets memory as
// `reinterpret_cast` does; pointer and iterator arithmetic, and views built from a pointer and
// a length, reach memory past what the lab was given. With memory reinterpreted or reached out
// of bounds, lab code could read or change any object of the check program, the checker's
// included; so the audit refuses, wherever they appear in the lab's own files:
//
//   * casts that reinterpret (integer to pointer and back, a pointer to a pointer of an
//     unrelated type or to void, a reference to one, a base class down to a derived one);
//   * placement new;
//   * arithmetic on pointers and on iterators, `std::next`, `std::prev`, `std::advance`, and
//     the subscript of a pointer or a C array (std::vector, std::array and std::span have a
//     checked one, and the lab's code is built with _GLIBCXX_ASSERTIONS);
//   * a std::span, a dp::TensorView, a communication buffer or a std::string_view built from
//     a pointer and a length (take views from tensors and containers).
//
// Generic code is judged as the compiler resolved it, since a template does what the lab's
// types and arguments tell it: the rules match the type an expression has, not how it is
// spelt (a pointer that reaches a generic lambda through std::apply, a template parameter or
// an alias is a pointer); a library template told to build a view from a pointer
// (std::make_from_tuple<std::span<T>>, an optional's or a container's in-place construction)
// builds a view from a pointer; a tuple, pair or array holding a pointer, handed to a
// library function or function object (std::apply, std::views::counted), hands it an
// address; a member pointer to a buffer's field is the field; and a refused member function
// that a library template calls for the lab's file (std::ranges::data calls data()) is
// refused as if the lab's file called it (reported without a line: clang does not print
// which line of the lab's file instantiated the template).
//
// Reading a file takes clang a few seconds, so results are kept in a cache keyed by
// everything they depend on (the file, the contract header, the runtime's headers, the
// rules), beside the check programs.
//
// Example:
//
//   std::vector<SourceFinding> findings = audit_semantics(
//       "labs/lab7_zero3/zero3.cpp", {"-std=c++20", "-Icommon/include", "-Ilabs/lab7_zero3"},
//       "build/default/bin/lab-audit-cache");
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "source_scan.h"

namespace dp::grader::audit {

/// A member function one lab's code may not call, on its class or any class derived from it:
/// a line `<class>::<method> <why>` of the lab's `refused_calls` file (lab 3 builds its
/// collectives from messages, so the communicator's native ones are refused there). A virtual
/// call has no symbol of its own in the object, so only the compiler's reading finds it.
struct RefusedCall {
  std::string class_name;  ///< fully qualified, e.g. "dp::Communicator"
  std::string method;      ///< e.g. "allreduce"
  std::string why;         ///< what to do instead, for the finding
};

/// The refused calls of a `refused_calls` file: one `<class>::<method> <why>` a line, `#`
/// comments and blank lines ignored. Throws `dp::Error` naming the line that is malformed.
std::vector<RefusedCall> load_refused_calls(const std::filesystem::path& file);

/// What the compiler's reading of `source` refuses, compiled with `compile_args` (the
/// include directories and the standard, as the lab's build gives them), `refused_calls`
/// included. Results are cached under `cache_dir` when it is not empty (and writable).
/// Throws `dp::Error` when clang-query is missing; a file clang cannot read is a finding that
/// says why.
std::vector<SourceFinding> audit_semantics(const std::filesystem::path& source,
                                           const std::vector<std::string>& compile_args,
                                           const std::filesystem::path& cache_dir,
                                           const std::vector<RefusedCall>& refused_calls = {});

/// The version of the semantic rules: part of every cache key, so that a change of the rules
/// reads every file again.
inline constexpr int kSemanticRulesVersion = 4;

}  // namespace dp::grader::audit
