# Strict mode: the kernel tests, the model tests and a short 2-rank tiny training run again under
# emu's checking switches, with two fixed seeds: EMU_RANDOM_ORDER (threads and blocks in shuffled
# order), EMU_STREAMS=deferred (streams run when needed, in a seeded order, under the race
# detector) and EMU_POISON=1 (allocations filled with NaNs). A correct program passes in every mode;
# the training run must match the default mode's bit for bit (tests/strict/strict_training.py).
set(STRICT_SEEDS 11 23)
# The longest (5-50 s a run on 2 cores) under the first seed only, for CI's 30 minutes: their kernels also run under
# the trainer tests' strict seeds (test_trainer_r84's 8 ranks: 29; test_trainer_r89's 2 and 8: 31).
set(STRICT_FIRST_SEED_ONLY test_model test_mlp test_residual test_head test_attention test_attention_aux test_optim)
file(GLOB STRICT_SOURCES CONFIGURE_DEPENDS ${REPO}/tests/kernels/test_*.cu ${REPO}/tests/model/test_*.cu)
foreach(src ${STRICT_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  set(seeds ${STRICT_SEEDS})
  if(name IN_LIST STRICT_FIRST_SEED_ONLY)
    list(GET STRICT_SEEDS 0 seeds)
  endif()
  foreach(seed ${seeds})
    if(name MATCHES "^test_mpi_")
      set(test ${name}_np2_strict_${seed})
      add_test(NAME ${test} COMMAND ${MPIRUN} -np 2 -x EMU_WORKERS=1 $<TARGET_FILE:${name}>)
    else()
      set(test ${name}_strict_${seed})
      add_test(NAME ${test} COMMAND ${name})
    endif()
    set_tests_properties(${test} PROPERTIES TIMEOUT 900 ENVIRONMENT
      "SHARED_DATA=${SHARED_DATA};REPO=${REPO};EMU_RANDOM_ORDER=${seed};EMU_STREAMS=deferred:${seed};EMU_POISON=1")
  endforeach()
endforeach()

find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  list(GET STRICT_SEEDS 0 STRICT_SEED_LIST)  # one seed, for CI's budget (the 8-rank trainer runs take two more)
  add_test(NAME train_gpt_cpu_np2_strict COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/strict/strict_training.py
           $<TARGET_FILE:train_gpt_cpu> ${STRICT_SEED_LIST} ${MPIRUN})
  set_tests_properties(train_gpt_cpu_np2_strict PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 1800)
endif()
