# cmake -DREPO=DIR -DWORK=DIR -P labels_planted.cmake
# tests/labels.cmake in a scratch project of three stand-in tests (no languages, so each configure
# takes a fraction of a second): named tests configure and land in their tiers; a planted test that no
# rule names stops the configure, naming it.
cmake_minimum_required(VERSION 3.24)
if(NOT REPO OR NOT WORK)
  message(FATAL_ERROR "usage: cmake -DREPO=DIR -DWORK=DIR -P labels_planted.cmake")
endif()

# scratch_project(DIR PLANTED): a project registering test_norm, schedule_bits and, if PLANTED is
# not "-", a test of that name, then including tests/labels.cmake.
function(scratch_project dir planted)
  set(tests "add_test(NAME test_norm COMMAND true)\nadd_test(NAME schedule_bits COMMAND true)\n")
  if(NOT planted STREQUAL "-")
    string(APPEND tests "add_test(NAME ${planted} COMMAND true)\n")
  endif()
  file(REMOVE_RECURSE ${dir})
  file(WRITE ${dir}/src/CMakeLists.txt "cmake_minimum_required(VERSION 3.24)\nproject(labels_planted NONE)\n"
       "enable_testing()\nset(REPO ${REPO})\n${tests}include(${REPO}/tests/labels.cmake)\n")
endfunction()

# configure(DIR OUT_RC OUT_TEXT)
function(configure dir rc text)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${dir}/src -B ${dir}/build RESULT_VARIABLE r
                  OUTPUT_VARIABLE o ERROR_VARIABLE e)
  set(${rc} ${r} PARENT_SCOPE)
  set(${text} "${o}${e}" PARENT_SCOPE)
endfunction()

set(failed 0)
scratch_project(${WORK}/named -)
configure(${WORK}/named rc text)
execute_process(COMMAND ${CMAKE_CTEST_COMMAND} -N -L fast WORKING_DIRECTORY ${WORK}/named/build OUTPUT_VARIABLE fast)
execute_process(COMMAND ${CMAKE_CTEST_COMMAND} -N -L trainer WORKING_DIRECTORY ${WORK}/named/build OUTPUT_VARIABLE trainer)
if(rc EQUAL 0 AND fast MATCHES "test_norm" AND NOT fast MATCHES "schedule_bits" AND trainer MATCHES "schedule_bits")
  message("ok   named tests configure, test_norm in the fast tier and schedule_bits in the trainer tier")
else()
  message("FAIL named tests: configure rc ${rc}\n${text}\nfast tier:\n${fast}\ntrainer tier:\n${trainer}")
  set(failed 1)
endif()

scratch_project(${WORK}/planted planted_unlabelled_test)
configure(${WORK}/planted rc text)
if(NOT rc EQUAL 0 AND text MATCHES "planted_unlabelled_test have no tier label")
  message("ok   a test no rule names stops the configure, naming it")
else()
  message("FAIL the planted unlabelled test: configure rc ${rc}\n${text}")
  set(failed 1)
endif()
if(failed)
  message(FATAL_ERROR "tests/labels.cmake failed its planted test")
endif()
