# The trainer end to end on the tiny preset under emu: logs, tying, 1/2/8-rank equivalence,
# resume, failures (tests/trainer/test_trainer.py). Needs python3 with numpy. It and the twins' tests below run
# their 1-rank runs on one emu worker (EMU_WORKERS=1; by hand, 2): ctest -j 2 keeps the other core busy.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_trainer.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1;EMU_WORKERS=1" TIMEOUT 3000)
else()
  message(STATUS "python3 not found: the trainer's end-to-end test is not registered")
endif()

# The tiny-r80 preset end to end (tests/trainer/test_trainer_r80.py): 1 rank against the reference's golden
# run, 8 ranks and 2 under emu's strict modes against 1 rank.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer_r80 COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_trainer_r80.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer_r80 PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1;EMU_WORKERS=1" TIMEOUT 1500)
endif()

# The tiny-r84 preset end to end (tests/trainer/test_trainer_r84.py): 1 rank's losses falling, the sign table in the
# checkpoint, a bitwise resume from an odd step, 8 ranks under emu's strict modes against 1 rank, the record's memory
# plan; record 89's FP8 down-projection on it (tiny-r84-fp8down: the scales' warm-up reset). FULL=1 (by hand) adds
# the golden runs of record 88's prefix loss and 89's FP8 down on it (tiny-r84-prefix, tiny-r84-fp8down), 2 ranks each.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer_r84 COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_trainer_r84.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer_r84 PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1;EMU_WORKERS=1" TIMEOUT 1800)
endif()

# Records 86 and 89 end to end (tests/trainer/test_trainer_r86.py), two tests that run side by side: tiny-r86 against
# its golden run on 1 rank (PART=r86); tiny-r89 against its golden run, resumed inside the FP8 bootstrap bitwise, 2
# and 8 strict ranks against 1 (PART=r89: record 86's paths on several ranks too); each record's memory plan.
if(Python3_Interpreter_FOUND)
  foreach(part r86 r89)
    add_test(NAME test_trainer_${part} COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_trainer_r86.py
             $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
    set_tests_properties(test_trainer_${part} PROPERTIES
                         ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1;EMU_WORKERS=1;PART=${part}" TIMEOUT 1800)
  endforeach()
endif()

# Bad inputs and faults (tests/trainer/test_failures.py): flags, startup checks, a full log disk,
# checkpoint manifests and mixed or damaged rank files, non-finite state, signals; issue 28's outputs
# that could be lost, overwritten, skipped or invalidated (flags per mode, EMU_* ranges, checkpoint
# directory ownership, resume checks, how a log ends). Mounts a small tmpfs when it runs as root,
# else uses the CPU build's TRAIN_GPT_LOG_LIMIT.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_trainer_failures COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_failures.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(test_trainer_failures PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 1200)
endif()

# Checkpoints keep their on-disk layout (tests/trainer/test_checkpoint_layout.py's fixture, the tensor list
# of a save at an odd and an even step as main at d302bc7 saved them): test_trainer checks its 1-rank
# run's saves at steps 1 and 2 against it, which list the same as that script's own 2-step run (no
# test of its own, which trained that run for this alone: ~20 s; repin.py still makes the fixture with it).

# The step profiler in the trainer (issue 17). plan_step_dry_vs_real: --plan-step's dry run records
# the same operations as the real steps it stands for (tests/trainer/plan_step_dry_vs_real.cu), on 1
# rank and on 8 (collectives, the sparse exchange).
trainer_test(plan_step_dry_vs_real ${REPO}/tests/trainer/plan_step_dry_vs_real.cu CPU_ONLY)
add_test(NAME plan_step_dry_vs_real_np1 COMMAND plan_step_dry_vs_real)
add_test(NAME plan_step_dry_vs_real_np8 COMMAND ${MPIRUN} -np 8 -x EMU_WORKERS=1 $<TARGET_FILE:plan_step_dry_vs_real>)
set_tests_properties(plan_step_dry_vs_real_np1 plan_step_dry_vs_real_np8 PROPERTIES ENVIRONMENT "REPO=${REPO}" TIMEOUT 900)
# The command line (tests/trainer/test_plan_step.py): --plan-step's JSON, trace and stages on 1, 2 and
# 8 ranks (the record preset on 8 in under 2 minutes), --profile-steps' tables against the recording.
if(Python3_Interpreter_FOUND)
  add_test(NAME plan_step_cli COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_plan_step.py plan
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  add_test(NAME profile_steps_cli COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_plan_step.py profile
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(plan_step_cli profile_steps_cli PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1"
                       TIMEOUT 600)
endif()
# The schedule's bits pinned (tests/trainer/test_schedule_bits.py): every checkpoint tensor and
# training loss of the short tiny schedule equal to the fixture made before the step was rescheduled
# (issue 18). test_trainer checks its own runs against the fixture: 1 and 2 ranks in emu's default
# mode, 8 ranks (with the warm-up) under deferred random-order streams, so no CTest test of its own
# trains the schedule again (the script stays for --make, --full and the repin test's cheap round).
if(Python3_Interpreter_FOUND)
  # The re-pin path (scripts/repin.py, `make repin`) on a planted change, in a scratch copy of the
  # fixtures (tests/trainer/test_repin.py).
  add_test(NAME repin_planted COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/trainer/test_repin.py
           $<TARGET_FILE:train_gpt_cpu> ${MPIRUN})
  set_tests_properties(repin_planted PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 900)
endif()
# Record 84's FP8 up-projection through real tiny-r84 steps (tests/trainer/fp8_refresh.cu): each step's training
# forward multiplies by the quantization of the c_fc it reads, although NorMuon moved it after the step before.
# Planted: the optimizer's mark that c_fc changed lost after each step, which must fail at step 1.
trainer_test(fp8_refresh ${REPO}/tests/trainer/fp8_refresh.cu CPU_ONLY)
add_test(NAME fp8_refresh COMMAND ${MPIRUN} -np 1 $<TARGET_FILE:fp8_refresh>)
add_test(NAME fp8_refresh_planted COMMAND ${MPIRUN} -np 1 $<TARGET_FILE:fp8_refresh> plant)
set_tests_properties(fp8_refresh fp8_refresh_planted PROPERTIES ENVIRONMENT "REPO=${REPO}" TIMEOUT 600)
set_tests_properties(fp8_refresh_planted PROPERTIES
                     PASS_REGULAR_EXPRESSION "FAIL.*step 1: the FP8 copies of c_fc are its quantization")
# The next forward's waits for the gathers (tests/trainer/gathers_race.cu): real tiny steps through
# an Adam step tied and untied under deferred streams, where the race detector stops any read of a
# parameter not ordered after its gather; every rank's parameters equal afterwards. Planted: the
# forward's event for one gathered group swapped for a complete one, which must die of the race.
trainer_test(gathers_race ${REPO}/tests/trainer/gathers_race.cu CPU_ONLY)
foreach(np 2 8)
  add_test(NAME gathers_race_np${np} COMMAND ${MPIRUN} -np ${np} -x EMU_WORKERS=1 $<TARGET_FILE:gathers_race>)
endforeach()
set_tests_properties(gathers_race_np2 gathers_race_np8 PROPERTIES TIMEOUT 900
                     ENVIRONMENT "REPO=${REPO};EMU_STREAMS=deferred:5;EMU_RANDOM_ORDER=5")
# (A missing wait is caught where no later-gathered group's wait comes before the read: the MLP bank
# is gathered before the attention bank, whose wait at layer 0 covers it.)
# Each: the test's name, the group (its kParamTable label) and table, the range the race names.
foreach(planted "bigram;bigram_embed;bigram_embed" "lm_head;lm_head;lm_head" "attn;attn;attn"
        "value_3;value_embed 3;param.value_embed.3." "embed;embed;embed")
  list(GET planted 0 label)
  list(GET planted 1 group)
  list(GET planted 2 name)
  string(REPLACE " " ";" args "${group}")
  add_test(NAME gathers_race_planted_${label} COMMAND ${MPIRUN} -np 2 -x EMU_WORKERS=1 $<TARGET_FILE:gathers_race> plant ${args})
  set_tests_properties(gathers_race_planted_${label} PROPERTIES TIMEOUT 900 PASS_REGULAR_EXPRESSION "race on '${name}'"
                       ENVIRONMENT "REPO=${REPO};EMU_STREAMS=deferred:5;EMU_RANDOM_ORDER=5")
endforeach()
