// lab_audit.cpp: the folder, the contract, the sources and the objects of a lab, judged.
#include "lab_audit.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>

#include "dp/error.h"
#include "object_inspection.h"
#include "semantic_audit.h"
#include "source_scan.h"
#include "symbol_rules.h"

namespace dp::grader::audit {
namespace {

namespace fs = std::filesystem;

/// The one compiler-made symbol in a writable section that holds no state of the lab's: the
/// personality routine's address (exception handling).
bool harmless_writable(const ObjectSymbol& symbol) {
  return symbol.name == "DW.ref.__gxx_personality_v0";
}

/// For the slot a catch clause makes, "DW.ref._ZTI..." (the address of the caught class's
/// typeinfo, which the unwinder reads; `catch (const dp::Error&)` makes
/// "DW.ref._ZTIN2dp5ErrorE"), the typeinfo's mangled name; else nothing. The slot holds no
/// state of the lab's and C++ cannot spell its name (the source scan refuses asm labels), so
/// it is judged as the class it names.
std::optional<std::string> caught_typeinfo(const ObjectSymbol& symbol) {
  constexpr std::string_view kSlot = "DW.ref.";
  if (!symbol.name.starts_with(std::string(kSlot) + "_ZTI") || symbol.size > sizeof(void*))
    return std::nullopt;
  return symbol.name.substr(kSlot.size());
}

/// Sections whose contents run before main() or after it.
bool initialiser_section(std::string_view name) {
  for (std::string_view prefix :
       {".init_array", ".preinit_array", ".fini_array", ".ctors", ".dtors", ".init", ".fini"})
    if (name == prefix || name.starts_with(std::string(prefix) + ".")) return true;
  return false;
}

/// "zero3.cpp.o" -> "zero3.cpp": the source a student knows.
std::string source_of(std::string_view object) {
  std::string name(object);
  if (name.ends_with(".o")) name.resize(name.size() - 2);
  return name;
}

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}", file.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

class Auditor {
 public:
  Auditor(const LabCode& code, const fs::path& grader_lab_dir, const fs::path& audit_dir,
          const AuditOptions& options)
      : code_(code),
        options_(options),
        grader_lab_dir_(grader_lab_dir),
        audit_dir_(audit_dir),
        contract_header_(fmt::format("lab{}.h", code.lab)),
        lab_namespace_(fmt::format("dp::lab{}::", code.lab)) {}

  AuditReport run() {
    check_folder();
    check_contract();
    check_sources();
    check_objects();
    return std::move(report_);
  }

 private:
  void find(std::string where, std::string what, std::string why) {
    report_.findings.push_back({std::move(where), std::move(what), std::move(why)});
  }

  void check_folder() {
    for (const fs::directory_entry& entry : fs::directory_iterator(code_.code_dir)) {
      const std::string name = entry.path().filename().string();
      const bool expected = entry.is_directory()
                                ? name == "figures"
                                : (name == contract_header_ || name == "README.md" ||
                                   (entry.is_regular_file() && name.ends_with(".cpp")));
      if (!expected)
        find(code_.code_dir.filename().string(), name,
             "a lab's folder holds its README.md, figures/, the contract header and your .cpp "
             "files only (another header there could stand in for one the checks are compiled "
             "against): move helpers into your .cpp files");
    }
  }

  void check_contract() {
    const fs::path digest_file = grader_lab_dir_ / "contract.sha256";
    std::istringstream digest_text(read_file(digest_file));
    std::string expected, name;
    digest_text >> expected >> name;
    if (expected.size() != 64 || name != contract_header_)
      throw Error(
          fmt::format("malformed {}: expected '<64 hex digits>  {}' (tools/make-skeletons "
                      "writes it), got '{}'",
                      digest_file.string(), contract_header_, digest_text.str()));
    const fs::path header = code_.code_dir / contract_header_;
    if (!fs::is_regular_file(header)) {
      find(code_.code_dir.filename().string(), contract_header_,
           "the contract header is missing: restore it from your release (the checks are "
           "compiled against it)");
      return;
    }
    if (sha256_of_file(header) != expected)
      find(contract_header_, "changed",
           "the contract header differs from the course's: the checks are compiled against it, "
           "so it must stay as it was given; restore it (your code goes in the .cpp files)");
  }

  void check_sources() {
    IncludePolicy policy;
    policy.contract_header = contract_header_;
    if (fs::is_directory(code_.dp_headers))
      for (const fs::directory_entry& entry : fs::recursive_directory_iterator(code_.dp_headers))
        if (entry.is_regular_file() && entry.path().extension() == ".h")
          policy.dp_headers.insert("dp/" +
                                   fs::relative(entry.path(), code_.dp_headers).generic_string());
    std::vector<fs::path> sources;
    for (const fs::directory_entry& entry : fs::directory_iterator(code_.code_dir))
      if (entry.is_regular_file() && entry.path().extension() == ".cpp")
        sources.push_back(entry.path());
    std::sort(sources.begin(), sources.end());
    const std::vector<std::string> compile_args = {"-std=c++20",
                                                   "-I" + code_.dp_headers.parent_path().string(),
                                                   "-I" + code_.code_dir.string()};
    // Member functions no lab may call (grader/audit/base.refused_calls), and those this lab
    // may not (grader/<lab>/refused_calls), if it has any.
    std::vector<RefusedCall> refused_calls = load_refused_calls(audit_dir_ / "base.refused_calls");
    // A lab whose lesson needs one of them lists it in grader/<lab>/allowed_calls (lab 0
    // times messages on the clock): the same form, the why saying what the lab needs it for.
    const fs::path lab_allowed_calls = grader_lab_dir_ / "allowed_calls";
    if (fs::exists(lab_allowed_calls))
      for (const RefusedCall& allowed : load_refused_calls(lab_allowed_calls))
        std::erase_if(refused_calls, [&](const RefusedCall& call) {
          return call.class_name == allowed.class_name && call.method == allowed.method;
        });
    // A lab's own entry for a call the base file refuses too replaces it: its why says what
    // the call would give away in that lab (lab 0's trace holds the network it measures).
    const fs::path lab_refused_calls = grader_lab_dir_ / "refused_calls";
    if (fs::exists(lab_refused_calls)) {
      std::vector<RefusedCall> lab_calls = load_refused_calls(lab_refused_calls);
      for (const RefusedCall& lab_call : lab_calls)
        std::erase_if(refused_calls, [&](const RefusedCall& call) {
          return call.class_name == lab_call.class_name && call.method == lab_call.method;
        });
      refused_calls.insert(refused_calls.end(), lab_calls.begin(), lab_calls.end());
    }
    for (const fs::path& source : sources) {
      std::vector<SourceFinding> findings =
          scan_lab_source(source.filename().string(), read_file(source), policy);
      // What the spelling refuses already needs no compiler to read it.
      if (findings.empty() && options_.read_semantics)
        findings = audit_semantics(source, compile_args, options_.cache_dir, refused_calls);
      for (SourceFinding& finding : findings)
        find(finding.line > 0 ? fmt::format("{}:{}", finding.file, finding.line) : finding.file,
             std::move(finding.what), std::move(finding.why));
    }
  }

  void check_objects() {
    std::vector<fs::path> rule_files;
    if (fs::exists(grader_lab_dir_ / "audit.rules"))
      rule_files.push_back(grader_lab_dir_ / "audit.rules");
    rule_files.push_back(audit_dir_ / "base.rules");
    SymbolRules rules = SymbolRules::load(rule_files);
    // The lab's own namespace: what one of its files defines, another may use.
    rules.prepend({true, lab_namespace_ + "*", "", "the lab's own namespace"});

    const ObjectInventory inventory = inspect_objects(code_.objects);
    // Writable static storage, judged by the sections' flags (a section of any name the
    // program can write: .data, .bss, thread-local data, a section of one's own) and common
    // symbols; not the initialisers, which are refused for what they run.
    std::set<std::pair<std::string, std::string>> writable;  // (object, section)
    for (const ObjectSection& section : inventory.sections)
      if (section.writable() && !initialiser_section(section.name))
        writable.insert({section.object, section.name});
    const auto in_writable_storage = [&](const ObjectSymbol& symbol) {
      return symbol.section == "*COM*" || writable.contains({symbol.object, symbol.section});
    };
    std::set<std::string> reported;  // each refused name once, however many objects use it
    auto refuse_once = [&](const std::string& object, const std::string& what,
                           const std::string& why) {
      if (reported.insert(what).second) find(source_of(object), what, why);
    };

    for (const ObjectSymbol& symbol : inventory.symbols) {
      if (const std::optional<std::string> typeinfo = caught_typeinfo(symbol)) {
        // A typed catch: admitted when the lab may use the class (the lab 5 trial's
        // `catch (const dp::Error&)` was refused as a global variable).
        const std::string what = demangle(*typeinfo);
        const SymbolDecision decision = rules.decide(what);
        if (!decision.allowed) refuse_once(symbol.object, what, decision.reason);
        continue;
      }
      if (in_writable_storage(symbol) && !harmless_writable(symbol)) {
        refuse_once(symbol.object, symbol.demangled,
                    "a global or static variable: its state outlives the call and is shared by "
                    "every rank (ranks are threads of one process): keep state in your "
                    "class's members");
        continue;
      }
      if (!symbol.external() || harmless_writable(symbol)) continue;
      const std::string entity = qualified_name(symbol.demangled);
      if (symbol.undefined) {
        const SymbolDecision decision = rules.decide(symbol.demangled);
        if (!decision.allowed) refuse_once(symbol.object, symbol.demangled, decision.reason);
        continue;
      }
      if (entity.starts_with(lab_namespace_)) continue;
      if (symbol.binding == Binding::kGlobal) {
        refuse_once(symbol.object, symbol.demangled,
                    fmt::format("defined outside the lab's namespace: define your functions and "
                                "classes in namespace {} (or in an anonymous namespace)",
                                lab_namespace_.substr(0, lab_namespace_.size() - 2)));
        continue;
      }
      // A weak definition: an inline function or a template the lab's code instantiated.
      // The check program's own copy comes first on the link line, so the lab's is used only
      // by the lab; it must still be something the lab may use.
      const SymbolDecision decision = rules.decide(symbol.demangled);
      if (!decision.allowed) refuse_once(symbol.object, symbol.demangled, decision.reason);
    }

    for (const ObjectSection& section : inventory.sections) {
      if (section.size == 0) continue;
      const auto in_section = [&](const ObjectSymbol& symbol) {
        return symbol.object == section.object && symbol.section == section.name;
      };
      if (writable.contains({section.object, section.name}) &&
          std::none_of(inventory.symbols.begin(), inventory.symbols.end(), in_section))
        refuse_once(section.object, fmt::format("{} bytes of {}", section.size, section.name),
                    "writable static data: state that outlives the call and is shared by every "
                    "rank: keep state in your class's members");
      if (initialiser_section(section.name))
        refuse_once(section.object, fmt::format("a static initialiser ({})", section.name),
                    "code that runs before main() or after it, outside every check: a static "
                    "object with a constructor (one that takes no storage too), <iostream>, or "
                    "a constructor attribute; create objects in your functions");
    }

    for (const KernelEntry& entry : inventory.kernel_entries)
      refuse_once(entry.object, fmt::format("'{}' in {}", entry.instruction, entry.function),
                  "an instruction that calls the kernel directly, past every rule of the audit");
  }

  const LabCode& code_;
  AuditOptions options_;
  fs::path grader_lab_dir_;
  fs::path audit_dir_;
  std::string contract_header_;
  std::string lab_namespace_;
  AuditReport report_;
};

}  // namespace

LabCode LabCode::load(const std::filesystem::path& manifest) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(read_file(manifest));
  } catch (const nlohmann::json::exception& error) {
    throw Error(fmt::format("malformed lab manifest {}: {}", manifest.string(), error.what()));
  }
  LabCode code;
  try {
    code.lab = json.at("lab").get<int>();
    code.code_dir = json.at("code_dir").get<std::string>();
    code.objects = json.at("objects").get<std::string>();
    code.dp_headers = json.at("dp_headers").get<std::string>();
  } catch (const nlohmann::json::exception& error) {
    throw Error(
        fmt::format("malformed lab manifest {}: expected the fields lab (a number), "
                    "code_dir, objects and dp_headers (paths): {}",
                    manifest.string(), error.what()));
  }
  if (!fs::is_directory(code.code_dir))
    throw Error(fmt::format("the lab manifest {} names the folder {}, which does not exist",
                            manifest.string(), code.code_dir.string()));
  return code;
}

std::filesystem::path LabCode::manifest_of(const std::filesystem::path& program) {
  return program.string() + ".lab.json";
}

std::string AuditReport::summary(std::size_t max_lines) const {
  if (passed()) return "";
  // One line per file and reason, in the order found: "cheat.cpp:8, 9: #include <a>,
  // #include <b>: why", so that six GoogleTest functions make one line, not six.
  struct Line {
    std::string file;
    std::vector<std::string> lines;  // the source lines, where the findings have them
    std::vector<std::string> what;
    std::string why;
  };
  std::vector<Line> lines;
  for (const AuditFinding& finding : findings) {
    const std::size_t colon = finding.where.find(':');
    const std::string file = finding.where.substr(0, colon);
    auto it = std::find_if(lines.begin(), lines.end(), [&](const Line& line) {
      return line.file == file && line.why == finding.why;
    });
    if (it == lines.end()) it = lines.insert(lines.end(), Line{file, {}, {}, finding.why});
    if (colon != std::string::npos) it->lines.push_back(finding.where.substr(colon + 1));
    it->what.push_back(finding.what);
  }
  std::string text = fmt::format(
      "the lab audit refused your code, so none of it ran: lab code may use only what the "
      "handout's \"What your code may use\" lists ({} finding{}):",
      findings.size(), findings.size() == 1 ? "" : "s");
  for (std::size_t i = 0; i < lines.size() && i < max_lines; ++i) {
    const Line& line = lines[i];
    text += fmt::format("\n  {}{}{}: {}: {}", line.file, line.lines.empty() ? "" : ":",
                        fmt::join(line.lines, ", "), fmt::join(line.what, ", "), line.why);
  }
  if (lines.size() > max_lines)
    text += fmt::format("\n  ... and {} more", lines.size() - max_lines);
  return text;
}

AuditReport audit_lab_code(const LabCode& code, const std::filesystem::path& grader_lab_dir,
                           const std::filesystem::path& audit_dir, const AuditOptions& options) {
  return Auditor(code, grader_lab_dir, audit_dir, options).run();
}

std::string sha256_of_file(const std::filesystem::path& file) {
  if (!fs::is_regular_file(file))
    throw Error(fmt::format("cannot read {} to take its SHA-256", file.string()));
  const std::string output = run_capturing({"sha256sum", "--", file.string()});
  const std::string digest = output.substr(0, output.find(' '));
  if (digest.size() != 64)
    throw Error(fmt::format("sha256sum {} printed '{}'", file.string(), output));
  return digest;
}

}  // namespace dp::grader::audit
