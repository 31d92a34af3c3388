# check_grades.cmake: runs `dplab grade` once per grading seed and asserts what each
# results.json says.
#
#   cmake -DDPLAB=bin/dplab-reference "-DARGS=--lab|1|--variant|bug_x" -DMODE=lost
#         -DEXPECT=grader/selftest/lab1_replicated/x.expect -DLAB=1 -DOUT=out.json
#         "-DSEEDS=1|2|3" -P check_grades.cmake
#
# Every seed must pass: the grader draws world sizes, sizes and steps from it, so a
# reference that passes only some draws, or a planted bug that escapes some, fails here
# and names the seed that shows it (repeat with `dplab grade --seed S`).
#
# MODE full: exit code 0 and every check at full marks.
# MODE zero: every graded check scored 0, and the check program neither crashed nor hung
#            (the skeleton must fail by its checks, not by dying).
# MODE lost: each test named in EXPECT (one per line, '#' comments, and the optional lines
#            "needs-ranks: K" and "device: emulated" that the CMake list reads) lost
#            points; the variant's check program must exist and start. Only those checks
#            run (`dplab grade --check`): the others cannot show what the bug must lose,
#            and skipping them is most of the selftests' time.
# MODE refused: a planted cheat: every graded check scored 0 because the lab audit refused
#            the lab's code (nothing of it ran), and the output names each thing the
#            EXPECT file's "cheat: TEXT" lines give.
cmake_minimum_required(VERSION 3.25)

foreach(variable DPLAB ARGS MODE LAB OUT)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "check_grades.cmake: -D${variable}=... is required")
  endif()
endforeach()
string(REPLACE "|" ";" arguments "${ARGS}")
if(NOT DEFINED SEEDS OR SEEDS STREQUAL "")
  set(SEEDS 1)
endif()
string(REPLACE "|" ";" seeds "${SEEDS}")

# MODE lost: the checks EXPECT lists, as `--check NAME` arguments for `dplab grade`.
set(expected_checks "")
if(MODE STREQUAL "lost" AND DEFINED EXPECT AND EXISTS "${EXPECT}")
  file(STRINGS ${EXPECT} expect_lines)
  foreach(line IN LISTS expect_lines)
    string(REGEX REPLACE "#.*" "" line "${line}")
    string(STRIP "${line}" line)
    if(NOT line STREQUAL "" AND NOT line MATCHES "^(needs-ranks|device):")
      list(APPEND expected_checks "${line}")
      list(APPEND arguments --check "${line}")
    endif()
  endforeach()
endif()

# Fails the run for grading seed ${seed}, showing that seed's score table first; the
# arguments are joined into one message.
macro(fail_seed)
  string(CONCAT failure_text ${ARGV})
  message("${table}${errors}")
  message(FATAL_ERROR "grading seed ${seed}: ${failure_text}")
endmacro()

# expect_every_check_zero(what): every graded check of ${results} scored 0, and dplab grade
# exited with a failure; `what` names the code graded ("the untouched skeleton").
macro(expect_every_check_zero what)
  math(EXPR last "${test_count} - 1")
  foreach(i RANGE ${last})
    string(JSON name GET "${results}" tests ${i} name)
    string(JSON score GET "${results}" tests ${i} score)
    if(NOT score EQUAL 0)
      fail_seed("${what} earned ${score} points on '${name}': a check that passes without the "
                "lab's work checks nothing")
    endif()
  endforeach()
  if(exit_code EQUAL 0)
    fail_seed("dplab grade exited 0 for ${what}, which scored 0")
  endif()
endmacro()

# check_one_seed(seed): one `dplab grade --seed seed` and the assertions of MODE.
function(check_one_seed seed)
  set(OUT ${OUT}.seed${seed}.json)
  file(REMOVE ${OUT})
  execute_process(COMMAND ${DPLAB} grade ${arguments} --seed ${seed} --json ${OUT}
                  RESULT_VARIABLE exit_code OUTPUT_VARIABLE table ERROR_VARIABLE errors)
  if(NOT EXISTS ${OUT})
    fail_seed("dplab grade wrote no ${OUT} (exit code ${exit_code})")
  endif()
  file(READ ${OUT} results)

  string(JSON output GET "${results}" output)
  if(NOT output MATCHES "^grading seed ${seed} \\(repeat this run with --seed ${seed}\\)\n")
    fail_seed("results.json's output does not open with the grading seed:\n${output}")
  endif()
  string(JSON test_count LENGTH "${results}" tests)
  if(test_count EQUAL 0)
    fail_seed("results.json lists no graded check")
  endif()

  # Problems of the check program as a whole (see RunResult::summary in grader/driver).
  set(program_problems "check program crashed" "timed out after" "before reporting every result"
      "not found \\(build it" "cannot start" "the lab audit could not be done")

  if(MODE STREQUAL "full")
    string(JSON score GET "${results}" score)
    string(JSON max_score GET "${results}" max_score)
    if(NOT exit_code EQUAL 0 OR NOT score EQUAL max_score)
      fail_seed("expected full marks: scored ${score}/${max_score}, exit code ${exit_code}")
    endif()
  elseif(MODE STREQUAL "zero")
    foreach(problem IN LISTS program_problems)
      if(output MATCHES "${problem}")
        fail_seed("the skeleton's check program failed as a whole (${problem}): it must "
                            "fail check by check, not crash or hang")
      endif()
    endforeach()
    expect_every_check_zero("the untouched skeleton")
  elseif(MODE STREQUAL "lost")
    # A variant that was never built fails its audit before it runs, and its zero would
    # read as points lost: that is no evidence that the checks catch the bug.
    foreach(problem "not found \\(build it" "cannot start" "the lab audit could not be done")
      if(output MATCHES "${problem}")
        fail_seed("the planted bug's check program did not run (${problem})")
      endif()
    endforeach()
    if(NOT DEFINED EXPECT OR NOT EXISTS "${EXPECT}")
      fail_seed("MODE lost needs -DEXPECT=<file.expect>")
    endif()
    set(expected_count 0)
    foreach(line IN LISTS expected_checks)
      math(EXPR expected_count "${expected_count} + 1")
      set(found FALSE)
      math(EXPR last "${test_count} - 1")
      foreach(i RANGE ${last})
        string(JSON name GET "${results}" tests ${i} name)
        if(name STREQUAL "lab ${LAB}: ${line}")
          set(found TRUE)
          string(JSON score GET "${results}" tests ${i} score)
          string(JSON max_score GET "${results}" tests ${i} max_score)
          if(NOT score LESS max_score)
            fail_seed("planted bug not caught: '${line}' scored ${score}/${max_score} "
                                "(${EXPECT} says it must lose points)")
          endif()
        endif()
      endforeach()
      if(NOT found)
        fail_seed("${EXPECT} lists '${line}', which is not a graded check of lab ${LAB}")
      endif()
    endforeach()
    if(expected_count EQUAL 0)
      fail_seed("${EXPECT} lists no check: a planted bug must be caught by something")
    endif()
    if(exit_code EQUAL 0)
      fail_seed("dplab grade exited 0 although checks lost points")
    endif()
  elseif(MODE STREQUAL "refused")
    if(NOT DEFINED EXPECT OR NOT EXISTS "${EXPECT}")
      fail_seed("MODE refused needs -DEXPECT=<file.expect>")
    endif()
    if(NOT output MATCHES "the lab audit refused")
      fail_seed("the planted cheat was not refused by the lab audit: its code ran")
    endif()
    file(STRINGS ${EXPECT} cheat_lines REGEX "^cheat:")
    if(NOT cheat_lines)
      fail_seed("${EXPECT} has no 'cheat: TEXT' line naming what the audit must refuse")
    endif()
    foreach(line IN LISTS cheat_lines)
      string(REGEX REPLACE "^cheat: *" "" named "${line}")
      string(FIND "${output}" "${named}" at)
      if(at EQUAL -1)
        fail_seed("the audit's report does not name '${named}' (${EXPECT} says it must)")
      endif()
    endforeach()
    expect_every_check_zero("the planted cheat")
  else()
    fail_seed("unknown MODE '${MODE}': expected full, zero, lost or refused")
  endif()
endfunction()

foreach(seed IN LISTS seeds)
  check_one_seed(${seed})
endforeach()
message(STATUS "check_grades: ${MODE} OK for grading seeds ${seeds}")
