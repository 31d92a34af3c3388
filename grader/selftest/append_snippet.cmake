# append_snippet.cmake: appends the file SNIPPET to the file TARGET, which it makes when it
# does not exist (a planted cheat added to a copy of a lab's solution; see
# grader/CMakeLists.txt).
#
#   cmake -DTARGET=copy/zero3.cpp -DSNIPPET=cheat.snippet -P append_snippet.cmake
foreach(variable TARGET SNIPPET)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "append_snippet.cmake: -D${variable}=... is required")
  endif()
endforeach()
file(READ ${SNIPPET} snippet)
file(APPEND ${TARGET} "\n${snippet}")
