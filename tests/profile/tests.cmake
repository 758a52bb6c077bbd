# The step profiler: the cost model, the launchers' records, the trainer's measurements.

# ---- the step model (profiler/cost_model.h, replay.h, reports.h, upstream_schedule.h) ----
# Host-only C++17 (what the header promises), built with the host compiler alone: no emu, no CUDA.
# The test hands the JSON it writes to Python's json module through check_step_model_json.py.
add_executable(test_step_model ${REPO}/tests/profile/test_step_model.cpp)
target_include_directories(test_step_model PRIVATE ${REPO})
set_target_properties(test_step_model PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF)
target_compile_options(test_step_model PRIVATE -Wall -Wextra -Werror)
add_dependencies(cpu_all test_step_model)
if(Python3_Interpreter_FOUND)
  add_test(NAME step_model COMMAND test_step_model ${Python3_EXECUTABLE} ${REPO}/tests/profile/check_step_model_json.py)
else()
  add_test(NAME step_model COMMAND test_step_model)  # says the JSON checks are skipped
endif()
set_tests_properties(step_model PROPERTIES TIMEOUT 120 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
# ---- end of the cost model ----

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

# ---- the trainer's side: --profile-steps' arithmetic (profiler/step_measure.h) on hand-made times ----
add_executable(test_step_measure ${REPO}/tests/profile/test_step_measure.cpp)
target_include_directories(test_step_measure PRIVATE ${REPO})
set_target_properties(test_step_measure PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF)
target_compile_options(test_step_measure PRIVATE -Wall -Wextra -Werror)
add_dependencies(cpu_all test_step_measure)
add_test(NAME profile_steps_measure COMMAND test_step_measure)
