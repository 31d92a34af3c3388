// Tests of the semantic part of the lab audit: clang's reading of small lab files.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dp/error.h"
#include "semantic_audit.h"

namespace dp::grader::audit {
namespace {

namespace fs = std::filesystem;

class SemanticAuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("dp_semantic_" +
             std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  /// "line:what" of every finding for `source` (a lab file of its own), sorted.
  std::vector<std::string> found(std::string_view source, const fs::path& cache = {},
                                 const std::vector<RefusedCall>& refused_calls = {}) {
    const fs::path file = root_ / "code.cpp";
    std::ofstream(file) << source;
    std::vector<std::string> result;
    for (const SourceFinding& finding :
         audit_semantics(file, {"-std=c++20", "-I" DP_TEST_DP_INCLUDE}, cache, refused_calls))
      result.push_back(std::to_string(finding.line) + ":" + finding.what);
    std::sort(result.begin(), result.end());
    return result;
  }

  fs::path root_;
};

using Found = std::vector<std::string>;

TEST_F(SemanticAuditTest, CastsThatReinterpretAreFoundHoweverTheyAreSpelt) {
  EXPECT_EQ(found("#include <cstddef>\n#include <type_traits>\n#include <vector>\n"
                  "struct S { int a; };\n"
                  "template <class To, class From> To as(From f) { return To(f); }\n"
                  "void f(S& s) {\n"
                  "  auto p = std::vector<unsigned char*>::value_type(&s);\n"
                  "  auto q = std::add_pointer_t<double>(&s.a);\n"
                  "  std::size_t n = std::size_t(&s);\n"
                  "  auto r = as<S*>(n);\n"
                  "  (void)p; (void)q; (void)r;\n"
                  "}\n"),
            // The template's cast is found in the template (line 5), for every instance.
            Found({"5:a cast that reinterprets memory", "7:a cast that reinterprets memory",
                   "8:a cast that reinterprets memory", "9:a cast that reinterprets memory"}));
}

TEST_F(SemanticAuditTest, MemoryPastWhatWasGivenIsFound) {
  EXPECT_EQ(found("#include <iterator>\n#include <span>\n#include <vector>\n"
                  "float f(std::vector<float>& v) {\n"
                  "  float* d = v.data();\n"
                  "  float a = d[100000] + *(d + 5);\n"
                  "  auto it = v.begin() + 1000;\n"
                  "  float b = *std::next(v.begin(), 50);\n"
                  "  std::span<float> s(v.data(), 100000);\n"
                  "  int raw[4] = {};\n"
                  "  (void)it;\n"
                  "  return a + b + s[0] + static_cast<float>(raw[1]);\n"
                  "}\n"),
            Found({"12:subscript of a pointer or a C array", "6:pointer arithmetic",
                   "6:subscript of a pointer or a C array", "7:iterator arithmetic",
                   "8:an iterator passed to a function", "8:std::next, std::prev or std::advance",
                   "9:a view built from a pointer and a length"}));
}

// What an adversarial trial of lab 7 built a memory read and write from, and a model of its
// own to fake the model's compute with: each way is found.
TEST_F(SemanticAuditTest, RangesOverOtherMemoryAndModelsOfTheLabsOwnAreFound) {
  EXPECT_EQ(
      found("#include <algorithm>\n#include <array>\n#include <cstring>\n"
            "#include <functional>\n#include <memory>\n#include <span>\n"
            "#include <vector>\n#include \"dp/layers/linear.h\"\n#include \"dp/model.h\"\n"
            "void f(std::vector<float>& a, std::vector<float>& b, dp::Model& model) {\n"
            "  std::span<float> wild(a.begin(), b.begin());\n"
            "  std::fill(a.begin(), a.end(), 0.0f);\n"
            "  std::array<float, 2> x{}, y{};\n"
            "  std::copy(x.begin(), y.end(), x.begin());\n"
            "  std::memcpy(&x, &y, 64);\n"
            "  std::size_t where = std::hash<float*>{}(&x[0]);\n"
            "  dp::Model other = dp::Model::mlp(\"4-4\", {});\n"
            "  auto layer = std::make_unique<dp::Linear>(\"pad\", 4, 4);\n"
            "  (void)wild; (void)where; (void)model;\n"
            "}\n"),
      Found({"11:an iterator passed to a function", "12:an iterator passed to a function",
             "14:an address passed to a library function", "15:a cast that reinterprets memory",
             "15:an address passed to a library function",
             "16:an address passed to a library function", "16:an address turned into a number",
             "17:a model or a layer of the lab's own", "18:a model or a layer of the lab's own"}));
}

TEST_F(SemanticAuditTest, ElementAddressesHandedToLibraryTypesAreFound) {
  // The lab 2 relabelling: a host span's address in a std::tuple, made a MutableBuffer on
  // the device by std::make_from_tuple inside a system header; and the same through an
  // optional and a container. A pointer to an object (a struct) is fine.
  EXPECT_EQ(
      found("#include <optional>\n#include <span>\n#include <tuple>\n#include <utility>\n"
            "#include <vector>\n#include \"dp/comm.h\"\nstruct S { int a; };\n"
            "void f(std::span<float> host, dp::Device device, std::vector<S*>& objects, S& s) {\n"
            "  auto buffer = std::make_from_tuple<dp::MutableBuffer>(std::tuple(\n"
            "      host.data(), host.size(), dp::DataType::kFloat32, device));\n"
            "  std::optional<dp::MutableBuffer> maybe(std::in_place, host.data(), host.size(),\n"
            "                                         dp::DataType::kFloat32, device);\n"
            "  std::vector<dp::MutableBuffer> many;\n"
            "  many.emplace_back(host.data(), host.size(), dp::DataType::kFloat32, device);\n"
            "  objects.push_back(&s);\n"
            "  std::pair<S*, int> pair(&s, 1);\n"
            "  (void)buffer; (void)maybe; (void)pair;\n"
            "}\n"),
      // The tuple, the optional and the container of buffers are also library templates told
      // to build a view from a pointer, and std::make_from_tuple is handed a tuple that holds
      // one.
      Found({"11:a view built from a pointer and a length",
             "11:an element address passed to a library type",
             "14:a view built from a pointer and a length",
             "14:an element address passed to a library type",
             "9:a view built from a pointer and a length",
             "9:an address passed to a library function",
             "9:an element address passed to a library type"}));
}

// Generic code is read with the types the compiler gave it: a pointer that reaches a generic
// lambda through std::apply over a tuple of object pointers, a function template's parameter
// or an alias is a pointer all the same (the rules matched the spelling of a pointer type, so
// each of these walked past its object unseen).
TEST_F(SemanticAuditTest, PointersInGenericCodeAreFoundWhateverTheirTypeIsCalled) {
  EXPECT_EQ(
      found("#include <cstddef>\n#include <span>\n#include <tuple>\n#include <vector>\n"
            "struct Word { std::size_t bits; };\n"
            "template <class P> P step(P p, long k) { return p + k; }\n"
            "using WordPointer = Word*;\n"
            "void f(std::vector<Word>& words, std::size_t far) {\n"
            "  std::apply([&](auto first) { (first + far)->bits = 1; },\n"
            "             std::tuple<Word*>(&words.front()));\n"
            "  auto all = [](auto first, std::size_t n) { return std::span<Word>(first, n); };\n"
            "  all(&words.front(), far)[0].bits = 2;\n"
            "  step(&words.front(), 3)->bits = 3;\n"
            "  WordPointer last = &words.back();\n"
            "  ++last;\n"
            "}\n"),
      Found({"11:a view built from a pointer and a length", "15:pointer arithmetic",
             "6:pointer arithmetic", "9:an address passed to a library function",
             "9:pointer arithmetic"}));
}

// Library templates do what the lab's types and arguments tell them: a view built from a
// pointer inside std::make_from_tuple, an optional's or a container's in-place construction,
// std::views::counted (a function object) or std::apply over a tuple that holds a pointer; a
// buffer's field named by a member pointer and handed to std::invoke.
TEST_F(SemanticAuditTest, ViewsAndFieldsReachedThroughLibraryTemplatesAreFound) {
  EXPECT_EQ(
      found(
          "#include <cstddef>\n#include <functional>\n#include <optional>\n"
          "#include <ranges>\n#include <span>\n#include <tuple>\n#include <utility>\n"
          "#include <vector>\n#include \"dp/comm.h\"\nstruct Word { std::size_t bits; };\n"
          "void f(Word& word, std::size_t n, dp::MutableBuffer& buffer) {\n"
          "  std::pair<Word*, std::size_t> where;\n"
          "  where.first = &word;\n"
          "  auto a = std::make_from_tuple<std::span<Word>>(where);\n"
          "  std::optional<std::span<Word>> b(std::in_place, &word, n);\n"
          "  std::vector<std::span<Word>> c;\n"
          "  c.emplace_back(&word, n);\n"
          "  auto d = std::views::counted(&word, n);\n"
          "  auto e = std::apply(std::views::counted, std::tuple<Word*, std::size_t>(&word, n));\n"
          "  std::invoke(&dp::MutableBuffer::count, buffer) = n;\n"
          "  (void)a; (void)b; (void)d; (void)e;\n"
          "}\n"),
      Found({"14:a view built from a pointer and a length",
             "14:an address passed to a library function",
             "15:a view built from a pointer and a length",
             "17:a view built from a pointer and a length",
             "18:an address passed to a library function",
             "19:an address passed to a library function",
             "20:a field of a communication buffer"}));
}

// A refused method called by a library template for the lab's file: std::ranges::data calls
// the view's data().
TEST_F(SemanticAuditTest, ARefusedCallALibraryTemplateMakesIsFound) {
  const std::vector<RefusedCall> refused = {{"dp::TensorView", "data", "a raw address"}};
  EXPECT_EQ(found("#include <ranges>\n#include \"dp/tensor.h\"\n"
                  "float f(dp::TensorView view) { return *std::ranges::data(view); }\n",
                  {}, refused),
            Found({"0:dp::TensorView::data() (called for this file by a library template)"}));
}

TEST_F(SemanticAuditTest, PlacementNewIsFound) {
  EXPECT_EQ(found("#include <new>\nstruct S { int a; };\n"
                  "void f(S& s) { new (&s) S{}; }\n"),
            Found({"3:a cast that reinterprets memory", "3:placement new"}));
}

TEST_F(SemanticAuditTest, ALabsRefusedCallsAreFoundThroughABaseOrADerivedClass) {
  // Lab 3's rule: the communicator's native collectives are refused, point-to-point is not.
  const std::vector<RefusedCall> refused = {
      {"dp::Communicator", "allreduce", "build it from isend and irecv"},
      {"dp::Communicator", "barrier", "wait for messages"}};
  const std::string source =
      "#include <memory>\n#include \"dp/comm.h\"\n"
      "void f(dp::Communicator& comm, dp::MutableBuffer data, dp::ConstBuffer in) {\n"
      "  comm.allreduce(data, dp::ReduceOp::kSum)->wait();\n"
      "  comm.isend(in, 0, 0)->wait();\n"
      "  dp::Communicator* pointer = &comm;\n"
      "  pointer->barrier();\n"
      "}\n";
  EXPECT_EQ(found(source, {}, refused),
            Found({"4:dp::Communicator::allreduce()", "7:dp::Communicator::barrier()"}));
  EXPECT_EQ(found(source), Found({}));  // other labs call them
}

TEST_F(SemanticAuditTest, AMalformedRefusedCallsFileNamesItsLine) {
  const fs::path file = root_ / "refused_calls";
  std::ofstream(file) << "# comment\n\ndp::Communicator::allreduce why\nallreduce\n";
  try {
    (void)load_refused_calls(file);
    FAIL() << "a line without a class was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("refused_calls:4: expected '<class>::<method> <why>'"),
              std::string::npos)
        << error.what();
  }
}

TEST_F(SemanticAuditTest, LabCodeAsTheLabsWriteItPasses) {
  EXPECT_EQ(found("#include <algorithm>\n#include <array>\n#include <map>\n#include <numeric>\n"
                  "#include <span>\n#include <string_view>\n#include <tuple>\n#include <utility>\n"
                  "#include <vector>\n#include \"dp/tensor.h\"\n"
                  "#include \"dp/tensor_ops.h\"\n"
                  "struct Base { virtual ~Base() = default; };\n"
                  "struct Derived : Base {};\n"
                  "float f(std::vector<float>& v, dp::Tensor& t, Derived& d) {\n"
                  "  std::array<float, 4> a{};\n"
                  "  std::span<float> s(v);\n"
                  "  std::ranges::sort(v);\n"
                  "  for (float& x : v) x += 1.0f;\n"
                  "  std::string_view name = \"fine\";\n"
                  "  Base& base = d;\n"
                  "  dp::fill(t.view(0, t.size()), 1.0f);\n"
                  "  (void)name; (void)base;\n"
                  "  const auto found = std::ranges::find(v, 2.0f);\n"
                  "  if (found != v.end()) *found = 3.0f;\n"
                  "  std::vector<Base*> bases;\n"
                  "  bases.push_back(&d);\n"
                  "  std::map<const Base*, int> index;\n"
                  "  index[&d] = 1;\n"
                  "  std::pair<Base*, int> pair(&d, 1);\n"
                  "  (void)std::apply([](auto... n) { return (n + ...); }, std::tuple(1, 2));\n"
                  "  std::vector<std::string_view> names;\n"
                  "  names.emplace_back(\"literal\");\n"
                  "  (void)pair;\n"
                  "  return a[1] + s.subspan(1)[0] + v[2] + *std::ranges::max_element(v);\n"
                  "}\n"),
            Found{});
}

TEST_F(SemanticAuditTest, AFileClangCannotReadIsAFinding) {
  EXPECT_EQ(found("int f() { return undeclared; }\n"), Found{"1:a file clang cannot read"});
}

TEST_F(SemanticAuditTest, FindingsAreCachedByWhatTheyDependOn) {
  const fs::path cache = root_ / "cache";
  const std::string source = "void f(int* p) { ++p; }\n";
  EXPECT_EQ(found(source, cache), Found{"1:pointer arithmetic"});
  const auto entries = [&] {
    return std::distance(fs::directory_iterator(cache), fs::directory_iterator{});
  };
  EXPECT_EQ(entries(), 1);
  EXPECT_EQ(found(source, cache), Found{"1:pointer arithmetic"});  // from the cache
  EXPECT_EQ(entries(), 1);
  EXPECT_EQ(found("void f(int* p) { (void)p; }\n", cache), Found{});  // another file
  EXPECT_EQ(entries(), 2);
}

}  // namespace
}  // namespace dp::grader::audit
