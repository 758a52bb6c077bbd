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

# Bad inputs and faults (tests/trainer/test_failures.py): flags, startup checks, a full log disk,
# checkpoint manifests and mixed or damaged rank files, non-finite state, signals. Mounts a small
# tmpfs when it runs as root, else uses the CPU build's TRAIN_GPT_LOG_LIMIT.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer_failures COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_failures.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer_failures PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 1200)
endif()

# Checkpoints keep their on-disk layout (tests/trainer/test_checkpoint_layout.py): the tensor list of
# a save at an odd and an even step against the fixture listed from main at d302bc7's save.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_checkpoint_layout COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_checkpoint_layout.py
           $<TARGET_FILE:train_gpt_cpu>)
  set_tests_properties(test_checkpoint_layout PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 600)
endif()
