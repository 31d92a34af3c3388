// lab_audit.h: the lab audit. Lab code runs inside the check program, in the same process
// as the checks, so nothing the checker measures or reports may be reachable from it. Before
// any check runs, `dplab grade` audits the lab's sources and compiled objects, and a lab
// that fails the audit scores 0 without any of its code having run. The audit refuses:
//
//   * in the lab's folder, any file but the contract header (unchanged: its SHA-256 is
//     grader/<lab>/contract.sha256), the .cpp files, README.md and figures/: another header
//     there could replace one the checks are compiled against;
//   * in the sources, as written (source_scan.h) and as the compiler reads them
//     (semantic_audit.h: casts that reinterpret memory however they are spelt, pointer and
//     iterator arithmetic, views from a pointer and a length): includes other than the
//     standard headers (less those
//     that start threads, open files, handle signals or add a static initialiser), the
//     runtime's "dp/..." headers, the contract and fmt; inline assembly, compiler attributes,
//     reinterpret_cast and other ways to reinterpret memory, names reserved for the
//     implementation, token pasting, pragmas, and paths into /proc;
//   * in the objects (object_inspection.h): every function or variable they use that the
//     rules (symbol_rules.h: grader/audit/base.rules after grader/<lab>/audit.rules) do not
//     allow, which leaves lab code the public dp:: API its contract needs, the standard
//     library's containers, algorithms, numerics, strings and exceptions, and fmt: no
//     files, processes, threads, signals, malloc, environment or clock, nothing of the grader
//     or of GoogleTest; definitions outside the lab's namespace (a replaced operator new, a
//     grader function defined again); writable static storage and static initialisers
//     (code that would run before main, state shared by the ranks); and instructions that
//     enter the kernel directly.
//
// Example (what the grade driver does for each lab):
//
//   const LabCode code = LabCode::load("build/default/bin/grade_lab7.lab.json");
//   const AuditReport report = audit_lab_code(code, "grader/lab7_zero3", "grader/audit");
//   if (!report.passed()) fmt::print("{}\n", report.summary());
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

namespace dp::grader::audit {

/// Where a check program's lab code is: what the build writes next to each check program
/// as `<program>.lab.json`.
struct LabCode {
  int lab = 0;                       ///< the lab's number
  std::filesystem::path code_dir;    ///< the folder of its sources and contract header
  std::filesystem::path objects;     ///< the static library of its compiled sources
  std::filesystem::path dp_headers;  ///< the runtime's public headers (common/include/dp)

  /// Reads a `<program>.lab.json`. Throws `dp::Error` naming the file and the field when it
  /// is missing or malformed.
  static LabCode load(const std::filesystem::path& manifest);
  /// The manifest of check program `program`: `<program>.lab.json` beside it.
  static std::filesystem::path manifest_of(const std::filesystem::path& program);
};

/// One thing the audit refuses.
struct AuditFinding {
  std::string where;  ///< "zero3.cpp:12", "zero3.cpp" or the folder
  std::string what;   ///< the construct, symbol or file
  std::string why;    ///< why it is refused, and what to use instead
};

/// The audit's verdict on one lab's code.
struct AuditReport {
  std::vector<AuditFinding> findings;  ///< empty when the code may run

  /// True when nothing was refused.
  bool passed() const { return findings.empty(); }
  /// What the score table says: a sentence, then the findings, one line per file and reason
  /// ("zero3.cpp:12, 14: reinterpret_cast, union: why"), at most `max_lines` of them, and
  /// how many more there are.
  std::string summary(std::size_t max_lines = 24) const;
};

/// How thoroughly to audit.
struct AuditOptions {
  /// Read the sources as the compiler understands them too (semantic_audit.h). Off only for
  /// the planted bugs of the reference's selftests, which the course staff wrote: each is the
  /// reference with one change, and reading every one with clang would cost CI minutes.
  bool read_semantics = true;
  /// Where the semantic audit keeps what it found, by file and rules ("": no cache).
  std::filesystem::path cache_dir;
};

/// Audits `code` against the rules in `audit_dir` (base.rules) and `grader_lab_dir` (the
/// lab's audit.rules, if any, and its contract.sha256). Throws `dp::Error` when the audit
/// cannot be done (objdump or clang-query missing, a malformed rules file, no contract
/// digest): then the lab cannot be graded, which the driver reports as such.
AuditReport audit_lab_code(const LabCode& code, const std::filesystem::path& grader_lab_dir,
                           const std::filesystem::path& audit_dir,
                           const AuditOptions& options = {});

/// The SHA-256 of `file`'s bytes, 64 lower-case hex digits (computed with coreutils'
/// sha256sum). Throws `dp::Error` when the file cannot be read.
std::string sha256_of_file(const std::filesystem::path& file);

}  // namespace dp::grader::audit
