// Tests of the parsing of objdump's output (the whole path, objdump included, is in
// test_lab_audit.cpp).
#include <gtest/gtest.h>

#include "object_inspection.h"

namespace dp::grader::audit {
namespace {

TEST(ObjectInspection, ParsesTheSymbolTableOfAnArchive) {
  const std::vector<ObjectSymbol> symbols = parse_symbol_table(
      "In archive libx.a:\n"
      "\n"
      "a.cpp.o:     file format elf64-x86-64\n"
      "\n"
      "SYMBOL TABLE:\n"
      "0000000000000000 l    df *ABS*\t0000000000000000 a.cpp\n"
      "0000000000000000 l    d  .text\t0000000000000000 .text\n"
      "0000000000000000 l     O .bss\t0000000000000004 _ZZN2dp4lab11fEvE5calls\n"
      "0000000000000000  w    F .text._ZN2dp5ErrorD2Ev\t0000000000000022 _ZN2dp5ErrorD2Ev\n"
      "0000000000000000  w    O .data.rel.local.DW.ref.__gxx_personality_v0\t0000000000000008 "
      ".hidden DW.ref.__gxx_personality_v0\n"
      "0000000000000000         *UND*\t0000000000000000 getenv\n"
      "\n"
      "b.cpp.o:     file format elf64-x86-64\n"
      "\n"
      "SYMBOL TABLE:\n"
      "0000000000000010 g     F .text\t0000000000000030 _ZN2dp4lab11fEv\n"
      "0000000000000000 u     O .bss._ZN2dp4lab15cacheE\t0000000000000008 _ZN2dp4lab15cacheE\n");
  ASSERT_EQ(symbols.size(), 6u);
  EXPECT_EQ(symbols[0].object, "a.cpp.o");
  EXPECT_EQ(symbols[0].demangled, "dp::lab1::f()::calls");
  EXPECT_EQ(symbols[0].section, ".bss");
  EXPECT_EQ(symbols[0].size, 4u);
  EXPECT_EQ(symbols[0].binding, Binding::kLocal);
  EXPECT_EQ(symbols[1].demangled, "dp::Error::~Error()");
  EXPECT_EQ(symbols[1].binding, Binding::kWeak);
  EXPECT_EQ(symbols[2].name, "DW.ref.__gxx_personality_v0");
  EXPECT_TRUE(symbols[3].undefined);
  EXPECT_EQ(symbols[3].name, "getenv");
  EXPECT_TRUE(symbols[3].external());
  EXPECT_EQ(symbols[4].object, "b.cpp.o");
  EXPECT_EQ(symbols[4].binding, Binding::kGlobal);
  EXPECT_EQ(symbols[5].binding, Binding::kUnique);
}

TEST(ObjectInspection, ParsesSectionHeaders) {
  const std::vector<ObjectSection> sections = parse_section_headers(
      "a.cpp.o:     file format elf64-x86-64\n"
      "\n"
      "Sections:\n"
      "Idx Name          Size      VMA               LMA               File off  Algn\n"
      "  0 .text         00000040  0000000000000000  0000000000000000  00000040  2**4\n"
      "                  CONTENTS, ALLOC, LOAD, READONLY, CODE\n"
      "  1 .bss          00000001  0000000000000000  0000000000000000  00000080  2**0\n"
      "                  ALLOC\n"
      " 12 .data.rel.local.DW.ref.__gxx_personality_v0 00000008  0000000000000000  "
      "0000000000000000  00000100  2**3\n"
      "                  CONTENTS, ALLOC, LOAD, DATA\n");
  ASSERT_EQ(sections.size(), 3u);
  EXPECT_EQ(sections[0].name, ".text");
  EXPECT_EQ(sections[0].size, 0x40u);
  EXPECT_EQ(sections[0].flags, "CONTENTS, ALLOC, LOAD, READONLY, CODE");
  EXPECT_FALSE(sections[0].writable());
  EXPECT_EQ(sections[1].name, ".bss");
  EXPECT_EQ(sections[1].object, "a.cpp.o");
  EXPECT_TRUE(sections[1].writable());
  EXPECT_EQ(sections[2].name, ".data.rel.local.DW.ref.__gxx_personality_v0");
  EXPECT_TRUE(sections[2].writable());
  // Of any name: a section of one's own is writable by its flags.
  EXPECT_TRUE((ObjectSection{"a.o", "lab7_shared", 4, "CONTENTS, ALLOC, LOAD, DATA"}).writable());
  EXPECT_FALSE((ObjectSection{"a.o", ".data.rel.ro", 8, "CONTENTS, ALLOC, LOAD, DATA"}).writable());
  EXPECT_FALSE(
      (ObjectSection{"a.o", ".data.rel.ro.local", 8, "CONTENTS, ALLOC, LOAD, DATA"}).writable());
  EXPECT_TRUE(
      (ObjectSection{"a.o", ".data.rel.ro_lab7", 4, "CONTENTS, ALLOC, LOAD, DATA"}).writable());
}

TEST(ObjectInspection, FindsInstructionsThatEnterTheKernel) {
  const std::vector<KernelEntry> entries = find_kernel_entries(
      "a.cpp.o:     file format elf64-x86-64\n"
      "\n"
      "Disassembly of section .text:\n"
      "\n"
      "0000000000000000 <_ZN2dp4lab11fEv>:\n"
      "   0:\tmov    $0x27,%eax\n"
      "   5:\tsyscall \n"
      "   7:\tint    $0x80\n"
      "   9:\tint3   \n"
      "   a:\tret    \n"
      "\n"
      "0000000000000010 <_ZN2dp4lab11gEv>:\n"
      "  10:\tsysenter \n");
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].function, "dp::lab1::f()");
  EXPECT_EQ(entries[0].instruction, "syscall");
  EXPECT_EQ(entries[1].instruction, "int    $0x80");
  EXPECT_EQ(entries[2].function, "dp::lab1::g()");
}

}  // namespace
}  // namespace dp::grader::audit
