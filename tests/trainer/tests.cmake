# The trainer end to end on the tiny preset under emu: logs, tying, 1/2/8-rank equivalence,
# resume, failures (tests/trainer/test_trainer.py). Needs python3 with numpy.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_trainer.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 3000)
else()
  message(STATUS "python3 not found: the trainer's end-to-end test is not registered")
endif()
