// object_inspection.h: what a lab's compiled code contains, read with binutils' objdump:
// the symbols each object uses and defines, its sections, and the instructions no C++ code
// of a lab compiles to.
//
// The audit judges the objects rather than the sources alone because the objects are what
// runs: a macro, a template or an `extern "C"` declaration can hide from a reading of the
// sources what the compiler made of them, but not from the object's symbol table.
//
// Example:
//
//   ObjectInventory inventory = inspect_objects("build/default/grader/libgrade_lab1_code.a");
//   for (const ObjectSymbol& symbol : inventory.symbols)
//     if (symbol.undefined) fmt::print("{} uses {}\n", symbol.object, symbol.demangled);
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader::audit {

/// How a symbol is bound (objdump's first flag column).
enum class Binding { kLocal, kGlobal, kWeak, kUnique };

/// One entry of an object's symbol table (sections and file names left out).
struct ObjectSymbol {
  std::string object;                 ///< the object file (archive member) it belongs to
  std::string name;                   ///< as the linker sees it (mangled)
  std::string demangled;              ///< as C++ spells it
  std::string section;                ///< where it is defined; "*UND*" when it is only used
  Binding binding = Binding::kLocal;  ///< local, global, weak or unique
  std::size_t size = 0;               ///< bytes, for data
  bool undefined = false;             ///< used here, defined elsewhere

  /// True for a symbol other objects can link to (global, weak or unique).
  bool external() const { return binding != Binding::kLocal; }
};

/// One section of an object.
struct ObjectSection {
  std::string object;    ///< the object file it belongs to
  std::string name;      ///< e.g. ".text", ".bss", ".init_array"
  std::size_t size = 0;  ///< bytes
  std::string flags;     ///< objdump's flags, e.g. "CONTENTS, ALLOC, LOAD, DATA"

  /// True for memory the program can write while it runs: allocated, neither read-only nor
  /// code (relocated read-only data, .data.rel.ro, becomes read-only once relocated).
  bool writable() const;
};

/// An instruction that enters the kernel directly (syscall, sysenter, int $0x80; svc on arm64).
struct KernelEntry {
  std::string object;       ///< the object file
  std::string function;     ///< the function it is in (demangled)
  std::string instruction;  ///< as objdump prints it
};

/// Everything the audit reads from a lab's objects.
struct ObjectInventory {
  std::vector<std::string> objects;         ///< the object files, in archive order
  std::vector<ObjectSymbol> symbols;        ///< every named symbol of every object
  std::vector<ObjectSection> sections;      ///< every section of every object
  std::vector<KernelEntry> kernel_entries;  ///< direct system calls, expected none
};

/// Runs objdump on `file` (an object or a static library of objects) and parses what it
/// prints. Throws `dp::Error` when objdump is missing or fails (naming the file and what
/// objdump said).
ObjectInventory inspect_objects(const std::filesystem::path& file);

/// What a program printed (stdout and stderr together) and its exit status.
struct CapturedRun {
  int exit_status = 0;  ///< its exit status (128 + the signal when a signal ended it)
  std::string output;   ///< stdout and stderr together
};

/// Runs `argv` (found on PATH) and returns what it printed and how it exited. Throws
/// `dp::Error` when it cannot be started.
CapturedRun run_collecting(const std::vector<std::string>& argv);

/// Runs `argv` (found on PATH) and returns what it printed on stdout and stderr together.
/// Throws `dp::Error` when it cannot be started or exits with a failure, with its output.
std::string run_capturing(const std::vector<std::string>& argv);

/// Parses `objdump -t` output. Exposed for the tests.
std::vector<ObjectSymbol> parse_symbol_table(std::string_view text);
/// Parses `objdump -h` output. Exposed for the tests.
std::vector<ObjectSection> parse_section_headers(std::string_view text);
/// Finds the kernel entries in `objdump -d` output. Exposed for the tests.
std::vector<KernelEntry> find_kernel_entries(std::string_view text);

}  // namespace dp::grader::audit
