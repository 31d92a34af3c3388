// Tests of the audit's reading of a lab's sources.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "source_scan.h"

namespace dp::grader::audit {
namespace {

IncludePolicy lab1_policy() {
  return {"lab1.h", {"dp/tensor.h", "dp/comm.h"}};
}

/// "line:what" of every finding, sorted, for compact expectations.
std::vector<std::string> found(std::string_view text) {
  std::vector<std::string> result;
  for (const SourceFinding& finding : scan_lab_source("x.cpp", text, lab1_policy()))
    result.push_back(std::to_string(finding.line) + ":" + finding.what);
  std::sort(result.begin(), result.end());
  return result;
}

using Found = std::vector<std::string>;

TEST(SourceScan, CleanLabCodePasses) {
  EXPECT_EQ(found("// sampler.cpp: lab 1's sampler.\n"
                  "#include \"lab1.h\"\n"
                  "#include <fmt/format.h>\n"
                  "#include <vector>\n"
                  "#include \"dp/tensor.h\"\n"
                  "namespace dp::lab1 {\n"
                  "[[nodiscard]] int f(int x) { return static_cast<int>(1'000 * x + 0x1F) % _1; }\n"
                  "const char* kText = R\"(a \"quoted\" asm word)\";\n"
                  "char quote = '\\'';  // union, reinterpret_cast in a comment\n"
                  "/* #pragma once, __builtin_trap() */\n"
                  "}\n"),
            Found{});
}

TEST(SourceScan, FindsTheWaysOutOfTheLanguage) {
  EXPECT_EQ(found("int a = reinterpret_cast<long>(&a);\n"), Found{"1:reinterpret_cast"});
  EXPECT_EQ(found("void f() { asm(\"syscall\"); }\n"), Found{"1:asm"});
  EXPECT_EQ(found("void f() { __asm__ volatile(\"nop\"); }\n"), Found{"1:__asm__"});
  EXPECT_EQ(found("__attribute__((constructor)) void f() {}\n"), Found{"1:__attribute__"});
  EXPECT_EQ(found("[[gnu::constructor]] void f() {}\n"), Found{"1:[[gnu::...]]"});
  EXPECT_EQ(found("<:<:gnu::constructor:>:> void f() {}\n"), Found{"1:[[gnu::...]]"});
  EXPECT_EQ(found("union U { float f; int i; };\n"), Found{"1:union"});
  EXPECT_EQ(found("thread_local int n;\n"), Found{"1:thread_local"});
  EXPECT_EQ(found("extern \"C\" int write(int, const void*, unsigned long);\n"),
            Found({"1:extern", "1:void*"}));
  EXPECT_EQ(found("std::uintptr_t p = 0;\n"), Found{"1:uintptr_t"});
  EXPECT_EQ(found("auto s = __gnu_cxx::x;\n"), Found{"1:__gnu_cxx"});
  EXPECT_EQ(found("int _fileno = 3;\n"), Found{"1:_fileno"});
  EXPECT_EQ(found("int x = __builtin_frame_address(0);\n"), Found{"1:__builtin_frame_address"});
}

TEST(SourceScan, FindsTheWaysToReinterpretMemory) {
  EXPECT_EQ(found("auto p = static_cast<char*>(static_cast<void*>(&x));\n"),
            Found({"1:static_cast to a pointer or reference",
                   "1:static_cast to a pointer or reference", "1:void*"}));
  EXPECT_EQ(found("auto& r = static_cast<Mirror&>(comm);\n"),
            Found{"1:static_cast to a pointer or reference"});
  EXPECT_EQ(found("float y = static_cast<float>(x) * static_cast<std::size_t>(n);\n"), Found{});
  EXPECT_EQ(
      found("auto p = (char*)&x;\nf((const int&) y);\nreturn (T*) q;\n"),
      Found({"1:C-style cast to a pointer or reference", "2:C-style cast to a pointer or reference",
             "3:C-style cast to a pointer or reference"}));
  EXPECT_EQ(found("void f(int*);\nauto n = sizeof(int*);\nstd::function<void(int*)> g;\n"
                  "auto h = [](float* p) { return (*p) * (a * b); };\n(void)x;\n"),
            Found{});
  EXPECT_EQ(found("auto n = typeid(comm).name();\nauto* r = dynamic_cast<R*>(&comm);\n"),
            Found({"1:typeid", "2:dynamic_cast"}));
  EXPECT_EQ(found("decltype(p) q = decltype(p)(x);\n"), Found({"1:decltype", "1:decltype"}));
  EXPECT_EQ(found("auto b = std::as_writable_bytes(std::span(&t, 1));\n"),
            Found{"1:as_writable_bytes"});
  EXPECT_EQ(found("std::memcpy(&a, &b, 8);\n"), Found{"1:memcpy"});
  EXPECT_EQ(found("using Bytes = unsigned char*;\ntypedef float& Ref;\nusing std::vector;\n"
                  "using namespace std;\nusing Count = std::size_t;\n"),
            Found({"1:alias of a pointer or reference type", "2:typedef of a pointer"}));
  EXPECT_EQ(found("template struct Rob<Tag, &dp::MemoryTracker::current_>;\n"
                  "x.template get<int>();\ntemplate <typename T> T f();\n"),
            Found{"1:explicit template instantiation"});
  EXPECT_EQ(found("std::fputs(\"x\", stderr);\nFILE* f = stdout;\n"),
            Found({"1:stderr", "2:FILE", "2:stdout"}));
}

TEST(SourceScan, CodeLivesInTheLabsNamespace) {
  EXPECT_EQ(found("namespace dp::lab1 {\nnamespace {\nint f();\n}\nnamespace detail {}\n}\n"
                  "namespace {\n}\nnamespace dp {\nnamespace lab1 {\n}\n}\n"
                  "namespace fs = std::filesystem;\n"),
            Found{});
  EXPECT_EQ(found("namespace dp {\nclass MemoryTrackerTest {};\n}\n"), Found{"1:namespace dp"});
  EXPECT_EQ(found("namespace dp::grading {\n}\nnamespace std {\n}\n"),
            Found({"1:namespace dp::grading", "3:namespace std"}));
  EXPECT_EQ(found("namespace {\nnamespace dp {\n}\n}\n"), Found{"2:namespace dp"});
}

TEST(SourceScan, FindsPreprocessorTricks) {
  EXPECT_EQ(found("#define CAT(a, b) a##b\n"), Found({"1:##", "1:#define"}));
  EXPECT_EQ(found("#pragma GCC optimize(\"O0\")\n"), Found{"1:#pragma"});
  EXPECT_EQ(found("%:pragma once\n"), Found{"1:#pragma"});
  EXPECT_EQ(found("_Pragma(\"x\")\n"), Found{"1:_Pragma"});
  // Phase 2 joins the lines before the tokens are read, so a split word is found whole.
  EXPECT_EQ(found("int a;\nauto b = reinterpret_\\\ncast<long>(&a);\n"),
            Found{"2:reinterpret_cast"});
  EXPECT_EQ(found("int \\u0061sm;\n"), Found{"1:\\u"});
  // A comment is a space: it neither hides a directive nor splits one.
  EXPECT_EQ(found("#/**/include <unistd.h>\n"), Found{"1:#include <unistd.h>"});
  EXPECT_EQ(found("# /* x */ pragma once\n"), Found{"1:#pragma"});
  EXPECT_EQ(found("#define private public\n#undef private\n"), Found({"1:#define", "2:#undef"}));
  EXPECT_EQ(found("[[maybe_unused, gnu::section(\"shared\")]] int x;\n"), Found{"1:[[gnu::...]]"});
  EXPECT_EQ(found("[[nodiscard, maybe_unused]] int f();\n"), Found{});
  // "[" "[" is an attribute whatever lies between the brackets.
  EXPECT_EQ(found("[ [gnu::section(\".data.rel.ro_lab\")] ] int x;\n"), Found{"1:[[gnu::...]]"});
  EXPECT_EQ(found("[/* */[gnu::used]] int y;\n"), Found{"1:[[gnu::...]]"});
  EXPECT_EQ(found("int z = a[b[c]];\n"), Found{});
}

TEST(SourceScan, IncludesOnlyTheStandardLibraryTheRuntimeTheContractAndFmt) {
  EXPECT_EQ(found("#include <unistd.h>\n"), Found{"1:#include <unistd.h>"});
  EXPECT_EQ(found("#include <thread>\n#include <fstream>\n"),
            Found({"1:#include <thread>", "2:#include <fstream>"}));
  EXPECT_EQ(found("#include \"grading.h\"\n"), Found{"1:#include \"grading.h\""});
  EXPECT_EQ(found("#include \"../../grader/support/grading.h\"\n"),
            Found{"1:#include \"../../grader/support/grading.h\""});
  EXPECT_EQ(found("#include <gtest/gtest.h>\n"), Found{"1:#include <gtest/gtest.h>"});
  EXPECT_EQ(found("#include \"lab2.h\"\n"), Found{"1:#include \"lab2.h\""});
  EXPECT_EQ(found("#define HEADER <unistd.h>\n#include HEADER\n"),
            Found({"1:#define", "2:#include"}));
  EXPECT_EQ(found("#include_next <vector>\n"), Found{"1:#include_next"});
  EXPECT_EQ(found("#include <cmath>\n#include \"dp/comm.h\"\n#include <fmt/format.h>\n"), Found{});
}

TEST(SourceScan, FindsPathsIntoTheProcessAndTheGradersVariables) {
  EXPECT_EQ(found("const char* p = \"/proc/self/maps\";\n"), Found{"1:\".../proc...\""});
  EXPECT_EQ(found("auto v = u8\"DPLAB_GRADE_SEED\";\n"),
            Found({"1:\"...DPLAB...\"", "1:\"...GRADE...\""}));
  EXPECT_EQ(found("auto v = R\"x(/dev/null)x\";\n"), Found{"1:\".../dev/...\""});
}

}  // namespace
}  // namespace dp::grader::audit
