// object_inspection.cpp: objdump's output, parsed.
#include "object_inspection.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <regex>
#include <string>

#include "dp/error.h"
#include "symbol_rules.h"

extern char** environ;  // NOLINT(readability-redundant-declaration): POSIX declares it nowhere

namespace dp::grader::audit {
namespace {

/// The lines of `text`, without their newlines.
std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    lines.push_back(text.substr(0, newline));
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
  }
  return lines;
}

/// "member.o:     file format elf64-x86-64" -> "member.o"; "" for any other line.
std::string object_of_header(std::string_view line) {
  const std::size_t format = line.find(":     file format ");
  return format == std::string_view::npos ? "" : std::string(line.substr(0, format));
}

using Match = std::match_results<std::string_view::const_iterator>;

/// Calls `on_line(object, match)` for each line of objdump's `text` that matches `format`,
/// with the object file (archive member) the line belongs to.
template <typename OnLine>
void for_each_matching_line(std::string_view text, const std::regex& format, OnLine on_line) {
  std::string object;
  for (std::string_view line : lines_of(text)) {
    if (std::string header = object_of_header(line); !header.empty()) {
      object = std::move(header);
      continue;
    }
    Match match;
    if (std::regex_match(line.begin(), line.end(), match, format)) on_line(object, match);
  }
}

}  // namespace

CapturedRun run_collecting(const std::vector<std::string>& argv) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0)
    throw Error(fmt::format("cannot make a pipe for {}: {}", argv.front(), std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  std::vector<char*> arguments;
  for (const std::string& argument : argv) arguments.push_back(const_cast<char*>(argument.c_str()));
  arguments.push_back(nullptr);
  pid_t pid = -1;
  const int spawned =
      posix_spawnp(&pid, argv.front().c_str(), &actions, nullptr, arguments.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawned != 0) {
    close(pipe_fds[0]);
    throw Error(fmt::format(
        "the lab audit needs {} (binutils), which could not be started: {} (tools/install-deps "
        "installs it)",
        argv.front(), std::strerror(spawned)));
  }
  std::string output;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = read(pipe_fds[0], buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    output.append(buffer, static_cast<std::size_t>(got));
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), std::move(output)};
}

std::string run_capturing(const std::vector<std::string>& argv) {
  CapturedRun run = run_collecting(argv);
  if (run.exit_status != 0)
    throw Error(fmt::format("{} failed (status {}): {}", fmt::join(argv, " "), run.exit_status,
                            run.output.substr(0, 2000)));
  return std::move(run.output);
}

std::vector<ObjectSymbol> parse_symbol_table(std::string_view text) {
  // "<value> <7 flags> <section>\t<size> <name>", e.g.
  // "0000000000000000  w    F .text._ZN2dp5ErrorD2Ev\t0000000000000022 _ZN2dp5ErrorD2Ev"
  static const std::regex line_format(R"(^([0-9a-fA-F]+) (.{7}) (\S+)\t([0-9a-fA-F]+) (.*)$)");
  std::vector<ObjectSymbol> symbols;
  for_each_matching_line(text, line_format, [&](const std::string& object, const Match& match) {
    const std::string flags = match[2].str();
    if (flags[5] == 'd' || flags[6] == 'f') return;  // section and file-name symbols
    ObjectSymbol symbol;
    symbol.object = object;
    symbol.section = match[3].str();
    symbol.size = std::stoull(match[4].str(), nullptr, 16);
    std::string name = match[5].str();
    for (std::string_view visibility : {".hidden ", ".protected ", ".internal "})
      if (name.starts_with(visibility)) name.erase(0, visibility.size());
    symbol.name = name;
    symbol.demangled = demangle(name);
    symbol.undefined = symbol.section == "*UND*";
    if (flags[1] == 'w')
      symbol.binding = Binding::kWeak;
    else if (flags[0] == 'l')
      symbol.binding = Binding::kLocal;
    else if (flags[0] == 'u')
      symbol.binding = Binding::kUnique;
    else
      symbol.binding = Binding::kGlobal;  // 'g', '!', or ' ' for an undefined one
    symbols.push_back(std::move(symbol));
  });
  return symbols;
}

bool ObjectSection::writable() const {
  // Exactly the compilers' relocated read-only sections: the linker turns those read-only
  // once relocated; a section merely named like them (".data.rel.ro_x") stays writable.
  if (name == ".data.rel.ro" || name.starts_with(".data.rel.ro.")) return false;
  return flags.find("ALLOC") != std::string::npos && flags.find("READONLY") == std::string::npos &&
         flags.find("CODE") == std::string::npos;
}

std::vector<ObjectSection> parse_section_headers(std::string_view text) {
  // "  3 .bss          00000008  0000000000000000  0000000000000000  00000050  2**3"
  // "                  ALLOC" (its flags, on the next line)
  static const std::regex line_format(R"(^\s*[0-9]+ (\S+)\s+([0-9a-fA-F]+)\s.*$)");
  static const std::regex flags_format(R"(^\s+([A-Z_]+(, [A-Z_]+)*)\s*$)");
  std::vector<ObjectSection> sections;
  std::string object;
  for (std::string_view line : lines_of(text)) {
    if (std::string header = object_of_header(line); !header.empty()) {
      object = std::move(header);
      continue;
    }
    Match match;
    if (std::regex_match(line.begin(), line.end(), match, line_format)) {
      sections.push_back({object, match[1].str(), std::stoull(match[2].str(), nullptr, 16), ""});
    } else if (!sections.empty() && sections.back().flags.empty() &&
               std::regex_match(line.begin(), line.end(), match, flags_format)) {
      sections.back().flags = match[1].str();
    }
  }
  return sections;
}

std::vector<KernelEntry> find_kernel_entries(std::string_view text) {
  // "0000000000000040 <_ZN2dp4lab11fEv>:" opens a function; "      4:\tsyscall" is an
  // instruction (objdump -d --no-show-raw-insn).
  static const std::regex function_header(R"(^[0-9a-fA-F]+ <(.*)>:$)");
  std::vector<KernelEntry> entries;
  std::string object, function;
  for (std::string_view line : lines_of(text)) {
    if (std::string header = object_of_header(line); !header.empty()) {
      object = std::move(header);
      continue;
    }
    std::match_results<std::string_view::const_iterator> match;
    if (std::regex_match(line.begin(), line.end(), match, function_header)) {
      function = demangle(match[1].str());
      continue;
    }
    const std::size_t tab = line.find('\t');
    if (tab == std::string_view::npos || line.substr(0, tab).find(':') == std::string_view::npos)
      continue;
    std::string_view instruction = line.substr(tab + 1);
    while (!instruction.empty() && instruction.back() == ' ') instruction.remove_suffix(1);
    const bool kernel_entry =
        instruction.starts_with("syscall") || instruction.starts_with("sysenter") ||
        instruction.starts_with("svc") ||  // arm64
        (instruction.starts_with("int ") && instruction.find("$0x80") != std::string_view::npos);
    if (kernel_entry) entries.push_back({object, function, std::string(instruction)});
  }
  return entries;
}

ObjectInventory inspect_objects(const std::filesystem::path& file) {
  if (!std::filesystem::is_regular_file(file))
    throw Error(
        fmt::format("the lab's compiled code {} does not exist (build it: cmake --build "
                    "<build dir>)",
                    file.string()));
  ObjectInventory inventory;
  inventory.symbols = parse_symbol_table(run_capturing({"objdump", "-t", file.string()}));
  inventory.sections = parse_section_headers(run_capturing({"objdump", "-h", file.string()}));
  inventory.kernel_entries =
      find_kernel_entries(run_capturing({"objdump", "-d", "--no-show-raw-insn", file.string()}));
  for (const ObjectSection& section : inventory.sections)
    if (inventory.objects.empty() || inventory.objects.back() != section.object)
      inventory.objects.push_back(section.object);
  return inventory;
}

}  // namespace dp::grader::audit
