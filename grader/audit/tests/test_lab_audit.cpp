// Tests of the lab audit on real objects: a small lab folder is compiled with the project's
// own compiler and audited against the project's rules, as `dplab grade` audits a lab.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "dp/error.h"
#include "lab_audit.h"
#include "object_inspection.h"

#ifndef DP_TEST_CXX
#error "DP_TEST_CXX must name the C++ compiler (grader/audit/tests/CMakeLists.txt sets it)"
#endif

namespace dp::grader::audit {
namespace {

namespace fs = std::filesystem;

constexpr const char* kContract =
    "// lab1.h: a small contract for the audit's tests.\n"
    "#pragma once\n"
    "#include \"dp/tensor.h\"\n"
    "namespace dp::lab1 {\n"
    "/// The sum of `values`.\n"
    "float total(const dp::Tensor& values);\n"
    "}  // namespace dp::lab1\n";

void write(const fs::path& file, std::string_view text) {
  std::ofstream out(file, std::ios::binary);
  out << text;
}

/// A lab folder with `source` as its code, compiled into a static library, and a grader
/// folder whose contract digest is that of kContract.
class LabAuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("dp_audit_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "lab1_test");
    fs::create_directories(root_ / "grader_lab1");
    write(root_ / "lab1_test" / "lab1.h", kContract);
    write(root_ / "lab1_test" / "README.md", "# Lab 1\n");
    write(root_ / "grader_lab1" / "contract.sha256",
          sha256_of_file(root_ / "lab1_test" / "lab1.h") + "  lab1.h\n");
  }
  void TearDown() override { fs::remove_all(root_); }

  /// Compiles `source` as the lab's total.cpp and audits the lab.
  AuditReport audit(std::string_view source) {
    write(root_ / "lab1_test" / "total.cpp", source);
    const fs::path object = root_ / "total.cpp.o";
    const fs::path archive = root_ / "liblab1.a";
    run_capturing({DP_TEST_CXX, "-std=c++20", "-O2", "-c", "-I" DP_TEST_DP_INCLUDE,
                   "-I" + (root_ / "lab1_test").string(),
                   (root_ / "lab1_test" / "total.cpp").string(), "-o", object.string()});
    fs::remove(archive);
    run_capturing({"ar", "rcs", archive.string(), object.string()});
    LabCode code;
    code.lab = 1;
    code.code_dir = root_ / "lab1_test";
    code.objects = archive;
    code.dp_headers = DP_TEST_DP_INCLUDE "/dp";
    return audit_lab_code(code, root_ / "grader_lab1", DP_TEST_AUDIT_DIR);
  }

  fs::path root_;
};

/// True when some finding's what or why contains `text`.
bool mentions(const AuditReport& report, std::string_view text) {
  for (const AuditFinding& finding : report.findings)
    if (finding.what.find(text) != std::string::npos || finding.why.find(text) != std::string::npos)
      return true;
  return false;
}

constexpr const char* kHonest =
    "#include \"lab1.h\"\n"
    "#include <fmt/format.h>\n"
    "#include <cstdio>\n"
    "#include <vector>\n"
    "#include \"dp/tensor_ops.h\"\n"
    "namespace dp::lab1 {\n"
    "namespace { float twice(float x) { return 2 * x; } }\n"
    "float total(const dp::Tensor& values) {\n"
    "  dp::Tensor copy({static_cast<std::int64_t>(values.size())}, dp::MemoryCategory::kOther, "
    "values.device());\n"
    "  dp::copy(values.view(0, values.size()), copy.view(0, copy.size()));\n"
    "  std::vector<double> parts = {dp::dot(copy.view(0, copy.size()), copy.view(0, "
    "copy.size()))};\n"
    "  if (parts.empty()) throw dp::Error(fmt::format(\"no parts of {}\", values.size()));\n"
    "  std::printf(\"total\\n\");\n"
    "  fmt::print(\"{} parts\\n\", parts.size());\n"
    "  double sum = 0.0;\n"
    "  for (const double part : parts) sum += part;\n"
    "  return twice(static_cast<float>(sum));\n"
    "}\n"
    "}  // namespace dp::lab1\n";

TEST_F(LabAuditTest, HonestLabCodePasses) {
  const AuditReport report = audit(kHonest);
  EXPECT_TRUE(report.passed()) << report.summary();
}

TEST_F(LabAuditTest, RefusesTheEnvironmentTheProcessAndMalloc) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <cstdlib>\n"
      "namespace dp::lab1 {\n"
      "void* scratch(std::size_t bytes) { return std::malloc(bytes); }\n"
      "float total(const dp::Tensor& values) {\n"
      "  if (std::getenv(\"HOME\") != nullptr) std::exit(0);\n"
      "  return static_cast<float>(values.size());\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "getenv")) << report.summary();
  EXPECT_TRUE(mentions(report, "exit")) << report.summary();
  EXPECT_TRUE(mentions(report, "malloc")) << report.summary();
  EXPECT_TRUE(mentions(report, "not counted")) << report.summary();
}

TEST_F(LabAuditTest, RefusesAStaticInitialiserThatTakesNoStorage) {
  // An empty constant object needs no storage, so only the initialiser shows it.
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <cstdio>\n"
      "namespace dp::lab1 {\n"
      "namespace { struct Early { Early() { std::printf(\"before main\\n\"); } };\n"
      "const Early early; }\n"
      "float total(const dp::Tensor& values) { return static_cast<float>(values.size()); }\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "a static initialiser (.init_array)")) << report.summary();
}

TEST_F(LabAuditTest, RefusesIostreamForItsStaticInitialiser) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <iostream>\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) { std::cout << 1; return 0.0f * values.size(); }\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "fmt::print")) << report.summary();
  EXPECT_TRUE(mentions(report, "a static initialiser (.init_array)")) << report.summary();
}

TEST_F(LabAuditTest, RefusesStaticStateAndStaticInitialisers) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <vector>\n"
      "namespace dp::lab1 {\n"
      "namespace { std::vector<float> shared_between_ranks(100); }\n"
      "float total(const dp::Tensor& values) {\n"
      "  static int calls = 0;\n"
      "  return static_cast<float>(values.size() + ++calls + shared_between_ranks.size());\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "static initialiser")) << report.summary();
  EXPECT_TRUE(mentions(report, "shared_between_ranks")) << report.summary();
  EXPECT_TRUE(mentions(report, "calls")) << report.summary();
}

// A typed catch makes the compiler keep the address of the class's typeinfo in a writable
// slot ("DW.ref._ZTIN2dp5ErrorE"), which the audit once refused as a global variable (the lab
// 5 trial: 0 points for `catch (const dp::Error&)` while the README allows exceptions).
TEST_F(LabAuditTest, AdmitsACatchOfAClassTheLabMayUse) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <stdexcept>\n"
      "#include \"dp/error.h\"\n"
      "#include \"dp/tensor_ops.h\"\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) {\n"
      "  try {\n"
      "    return static_cast<float>(dp::dot(values.view(0, values.size()), "
      "values.view(0, values.size())));\n"
      "  } catch (const dp::Error& error) {\n"
      "    throw std::runtime_error(error.what());\n"
      "  } catch (const std::exception&) {\n"
      "    return 0.0f;\n"
      "  }\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_TRUE(report.passed()) << report.summary();
}

// A catch of a class the rules refuse stays refused, and names the class.
TEST_F(LabAuditTest, RefusesACatchOfAClassTheLabMayNotUse) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include \"dp/memory.h\"\n"
      "#include \"dp/tensor_ops.h\"\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) {\n"
      "  try {\n"
      "    return static_cast<float>(dp::dot(values.view(0, values.size()), "
      "values.view(0, values.size())));\n"
      "  } catch (const dp::detail::UncountedHeapAllocations&) {\n"
      "    return 1.0f;\n"
      "  }\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "typeinfo for dp::detail::UncountedHeapAllocations"))
      << report.summary();
  EXPECT_FALSE(mentions(report, "global or static variable")) << report.summary();
}

TEST_F(LabAuditTest, RefusesTheGradersCodeEvenDeclaredByHand) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "namespace dp::grading { void note_measured(int); }\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) {\n"
      "  dp::grading::note_measured(1);\n"
      "  return static_cast<float>(values.size());\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "dp::grading::note_measured")) << report.summary();
}

TEST_F(LabAuditTest, RefusesDefinitionsOutsideTheLabsNamespace) {
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "#include <new>\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) { return static_cast<float>(values.size()); }\n"
      "}  // namespace dp::lab1\n"
      "namespace dp { float helper() { return 1; } }\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "dp::helper()")) << report.summary();
  EXPECT_TRUE(mentions(report, "namespace dp::lab1")) << report.summary();
}

TEST_F(LabAuditTest, RefusesADirectSystemCall) {
  // Written with the sanctioned ways out of the language that the source scan refuses, so
  // that the object check is seen to refuse the instruction as well.
  const AuditReport report = audit(
      "#include \"lab1.h\"\n"
      "namespace dp::lab1 {\n"
      "float total(const dp::Tensor& values) {\n"
      "  long result = 39;\n"
      "  asm volatile(\"syscall\" : \"+a\"(result) : : \"rcx\", \"r11\", \"memory\");\n"
      "  return static_cast<float>(values.size() + result);\n"
      "}\n"
      "}  // namespace dp::lab1\n");
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "'syscall' in dp::lab1::total")) << report.summary();
  EXPECT_TRUE(mentions(report, "inline assembly")) << report.summary();
}

TEST_F(LabAuditTest, RefusesAChangedContractAndExtraFiles) {
  write(root_ / "lab1_test" / "lab1.h",
        std::string(kContract) + "#define EXPECT_EQ(a, b) (void)0\n");
  // Any file: one named as a header (`vector`) would stand in for it when the checks and the
  // lab's files are compiled, this test's included.
  write(root_ / "lab1_test" / "notes.txt", "my notes\n");
  const AuditReport report = audit(kHonest);
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "contract header differs")) << report.summary();
  EXPECT_TRUE(mentions(report, "holds its README.md")) << report.summary();
  EXPECT_EQ(report.findings.size(), 2u) << report.summary();
}

/// Lab code that reads the clock's time, and with `with_trace` its trace too.
std::string reads_the_clock(bool with_trace) {
  return std::string(
             "#include \"lab1.h\"\n"
             "#include \"dp/clock.h\"\n"
             "#include \"dp/comm.h\"\n"
             "namespace dp::lab1 {\n"
             "float total(const dp::Tensor& values) { return static_cast<float>(values.size()); }\n"
             "double seconds(dp::Communicator& comm) {\n"
             "  return comm.clock().now()") +
         (with_trace ? " + static_cast<double>(comm.clock().trace().events.size())" : "") +
         ";\n}\n}  // namespace dp::lab1\n";
}

TEST_F(LabAuditTest, AllowedCallsLetOneLabReadTheClockButNotItsTrace) {
  // Refused by grader/audit/base.refused_calls...
  AuditReport report = audit(reads_the_clock(false));
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "dp::Clock::now")) << report.summary();
  // ...unless the lab's allowed_calls lists it (lab 0 times its messages); the rest of the
  // clock stays refused.
  write(root_ / "grader_lab1" / "allowed_calls",
        "# the lab measures time\ndp::Clock::now the lab times its messages\n");
  report = audit(reads_the_clock(false));
  EXPECT_TRUE(report.passed()) << report.summary();
  report = audit(reads_the_clock(true));
  EXPECT_FALSE(report.passed());
  EXPECT_TRUE(mentions(report, "dp::Clock::trace")) << report.summary();
  EXPECT_FALSE(mentions(report, "dp::Clock::now")) << report.summary();
}

TEST(LabCode, ManifestErrorsNameTheFileAndTheField) {
  const fs::path manifest = fs::temp_directory_path() / "dp_audit_manifest_test.lab.json";
  write(manifest, "{\"lab\": 1, \"code_dir\": \"/\"}");
  try {
    LabCode::load(manifest);
    ADD_FAILURE() << "a manifest without objects loaded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("malformed lab manifest"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("objects"), std::string::npos);
  }
  fs::remove(manifest);
}

}  // namespace
}  // namespace dp::grader::audit
