// Tests of the audit's rules: names as the rules see them, matching, and the rules files.
#include <gtest/gtest.h>

#include <string>

#include "dp/error.h"
#include "symbol_rules.h"

namespace dp::grader::audit {
namespace {

TEST(GlobMatch, StarMatchesAnyRunAndOtherCharactersThemselves) {
  EXPECT_TRUE(glob_match("dp::*", "dp::Tensor::~Tensor"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("std::chrono::*::now", "std::chrono::_V2::steady_clock::now"));
  EXPECT_TRUE(glob_match("sqrt*", "sqrtf"));
  EXPECT_FALSE(glob_match("dp::*", "dpx::f"));
  EXPECT_FALSE(glob_match("std::thread*", "std::vector<std::thread>::push_back"));
  EXPECT_FALSE(glob_match("malloc", "malloc_usable_size"));
  EXPECT_TRUE(glob_match("a*b*c", "axxbyyc"));
  EXPECT_FALSE(glob_match("a*b*c", "axxbyy"));
}

TEST(QualifiedName, DropsReturnTypesAndParameters) {
  EXPECT_EQ(qualified_name("dp::Model::forward(dp::Tensor const&)"), "dp::Model::forward");
  EXPECT_EQ(qualified_name("void std::vector<float, std::allocator<float> >::_M_realloc_insert"
                           "<float const&>(__gnu_cxx::__normal_iterator<float*, "
                           "std::vector<float, std::allocator<float> > >, float const&)"),
            "std::vector<float, std::allocator<float> >::_M_realloc_insert<float const&>");
  EXPECT_EQ(qualified_name("memcpy"), "memcpy");
  EXPECT_EQ(qualified_name("std::__ioinit"), "std::__ioinit");
  EXPECT_EQ(qualified_name("dp::Tensor const& dp::f<int>(int) const"), "dp::f<int>");
}

TEST(QualifiedName, KeepsOperatorsWhole) {
  EXPECT_EQ(qualified_name("operator new(unsigned long)"), "operator new");
  EXPECT_EQ(qualified_name("operator delete[](void*, unsigned long)"), "operator delete[]");
  EXPECT_EQ(qualified_name("dp::Tensor::operator=(dp::Tensor&&)"), "dp::Tensor::operator=");
  EXPECT_EQ(qualified_name("dp::lab4::Hook::operator()(dp::Parameter&) const"),
            "dp::lab4::Hook::operator()");
  EXPECT_EQ(qualified_name("std::basic_ostream<char, std::char_traits<char> >& std::operator<< "
                           "<std::char_traits<char> >(std::basic_ostream<char, "
                           "std::char_traits<char> >&, char const*)"),
            "std::operator<< <std::char_traits<char> >");
}

TEST(QualifiedName, LambdasAndLocalClassesBelongToTheirFunction) {
  EXPECT_EQ(
      qualified_name("dp::lab4::X::X(dp::Model&, dp::Communicator&)::{lambda(dp::Parameter&)"
                     "#1}::operator()(dp::Parameter&) const"),
      "dp::lab4::X::X(dp::Model&, dp::Communicator&)::{lambda(dp::Parameter&)#1}::operator()");
  EXPECT_EQ(qualified_name("(anonymous namespace)::helper(int)"), "(anonymous namespace)::helper");
}

TEST(QualifiedName, SpecialSymbolsNameWhatTheyBelongTo) {
  EXPECT_EQ(qualified_name("typeinfo for dp::grading::RecordingCommunicator"),
            "dp::grading::RecordingCommunicator");
  EXPECT_EQ(qualified_name("vtable for dp::Error"), "dp::Error");
  EXPECT_EQ(qualified_name("typeinfo name for dp::Error"), "dp::Error");
  EXPECT_EQ(qualified_name("guard variable for dp::lab1::f()::cache"), "dp::lab1::f()::cache");
  EXPECT_EQ(qualified_name("non-virtual thunk to dp::lab3::X::wait()"), "dp::lab3::X::wait");
}

TEST(Demangle, TurnsLinkerNamesIntoCppNames) {
  EXPECT_EQ(demangle("_ZN2dp5ErrorD2Ev"), "dp::Error::~Error()");
  EXPECT_EQ(demangle("memcpy"), "memcpy");
  EXPECT_EQ(demangle("_ZTIN2dp5ErrorE"), "typeinfo for dp::Error");
}

TEST(SymbolRules, FirstMatchDecidesAndNothingMatchedIsRefused) {
  const SymbolRules rules = SymbolRules::parse(
      "# a comment\n"
      "refuse dp::grading::* the grader's internals\n"
      "   are not for lab code\n"
      "allow  dp::*\n"
      "allow  \"operator new(unsigned long)\"\n",
      "test.rules");
  EXPECT_TRUE(rules.decide("dp::Tensor::~Tensor()").allowed);
  const SymbolDecision grader = rules.decide("typeinfo for dp::grading::RecordingCommunicator");
  EXPECT_FALSE(grader.allowed);
  EXPECT_EQ(grader.reason, "the grader's internals are not for lab code");
  EXPECT_EQ(grader.origin, "test.rules:2");
  EXPECT_TRUE(rules.decide("operator new(unsigned long)").allowed);
  EXPECT_FALSE(rules.decide("operator new(unsigned long, std::align_val_t)").allowed);
  const SymbolDecision unknown = rules.decide("fopen");
  EXPECT_FALSE(unknown.allowed);
  EXPECT_NE(unknown.reason.find("not on the list"), std::string::npos) << unknown.reason;
  EXPECT_EQ(unknown.origin, "");
}

TEST(SymbolRules, PrependedRulesDecideFirst) {
  SymbolRules rules = SymbolRules::parse("refuse dp::lab* another lab's code\nallow dp::*\n", "b");
  EXPECT_FALSE(rules.decide("dp::lab3::ring_allreduce(int)").allowed);
  rules.prepend({true, "dp::lab3::*", "", "own"});
  EXPECT_TRUE(rules.decide("dp::lab3::ring_allreduce(int)").allowed);
  EXPECT_FALSE(rules.decide("dp::lab4::assign_buckets()").allowed);
}

TEST(SymbolRules, MalformedLinesAreErrorsThatNameTheLine) {
  auto error_of = [](std::string_view text) {
    try {
      SymbolRules::parse(text, "x.rules");
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("permit dp::*\n").find("x.rules:1: expected 'allow PATTERN'"),
            std::string::npos);
  EXPECT_NE(error_of("allow dp::* because\n").find("x.rules:1: an allow rule takes no reason"),
            std::string::npos);
  EXPECT_NE(error_of("\n\nrefuse malloc\n").find("x.rules:3: a refuse rule must say why"),
            std::string::npos);
  EXPECT_NE(error_of("  continuation first\n").find("x.rules:1: an indented line"),
            std::string::npos);
}

}  // namespace
}  // namespace dp::grader::audit
