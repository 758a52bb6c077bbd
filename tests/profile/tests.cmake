# The step profiler. (test_work_counts.cu and test_mpi_work_comms.cu, the launchers' records, are
# registered by the top-level glob like every tests/*/test_*.cu.)

# The launchers' side: every launch passes a Work, every recorded call goes through a helper
# (check_recorded_calls.py on the sources, and on copies with planted violations).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME check_recorded_calls COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/profile/test_check_recorded_calls.py)
  set_tests_properties(check_recorded_calls PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 120)
else()
  message(STATUS "python3 not found: check_recorded_calls is not registered")
endif()
