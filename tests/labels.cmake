# The suite's tiers and order, included after every test is registered. Each test gets one tier label
# from the first rule its name matches (a test that already carries a tier label keeps it):
#   fast       single-process unit tests of kernels, emu and host code (`make check`)
#   mpi        the same kind of unit tests on 2 and 8 ranks under mpirun
#   strict     tests run again under emu's checking switches (tests/strict/)
#   trainer    the trainer end to end: training runs, pinned bits, checkpoints, the profiler's runs
#   scripts    the record, A/B and GPU-check scripts
#   gpu-build  the GPU build's binaries (SASS and resource checks)
#   setup      the README's setup on a fresh clone
# A registered test that no rule names stops the configure with its name, so a new test is placed
# in a tier when it is added, not found slow in `make check` later.
set(TEST_TIERS fast mpi strict trainer scripts gpu-build setup)

# The compiled unit-test programs (tests/<area>/test_*.cu and .cpp, one process each, their test named
# for the program) are fast by construction: a slow one belongs in tests/trainer/ or tests/strict/.
file(GLOB UNIT_TEST_SOURCES CONFIGURE_DEPENDS ${REPO}/tests/*/test_*.cu ${REPO}/tests/*/test_*.cpp)
set(UNIT_TEST_PROGRAMS)
foreach(src ${UNIT_TEST_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  list(APPEND UNIT_TEST_PROGRAMS ${name})
endforeach()
list(JOIN UNIT_TEST_PROGRAMS "|" UNIT_TEST_ALTERNATIVES)

# Ordered (first match wins): "TIER REGEX".
set(TIER_RULES
  "setup ^setup_"
  "gpu-build ^(gpu_res_usage|gpu_hopper_sass.*|gpu_attention_sass|launch_log_fresh|test_check_res_usage)$"
  "scripts ^(test_scripts|test_make_prefix_table|test_ab|run_ab_cpu|gpu_check_.*|gpu_bundle_.*)$"
  "strict _strict(_[0-9]+)?$"
  "trainer ^(test_trainer|test_trainer_r80|test_trainer_r84|test_trainer_r86|test_trainer_r89|test_trainer_failures|schedule_bits|repin_.*|plan_step_.*|profile_steps_cli|gathers_race.*|fp8_refresh.*|param_toy_edit|single_rank_losses)$"
  "mpi _np([2-9]|[1-9][0-9]+)(_|$)"
  "fast ^(${UNIT_TEST_ALTERNATIVES})$"
  "fast ^(train_gpt_cpu_np1|train_gpt_print_memory|train_gpt_bad_flag|emu_profile|memory_plan_state|nccl_world1_check)$"
  "fast ^(test_exec_random_order_1_worker|test_exec_deferred_streams|test_poison_random_order|emu_launch_bounds_scan.*)$"
  "fast ^(step_model|profile_steps_measure|check_recorded_calls|kernel_bench_smoke|single_rank_libs|single_rank_libs_planted)$"
  "fast ^(test_data_reference|test_cached_fineweb|test_prepare_tinyshakespeare|test_read_checkpoint|bench_data_loader)$"
  "fast ^(test_torch_reference|tier_labels_planted|headers_compile_alone.*)$"
)

# What a fresh clone's CTest has no timings for yet: the longest tests (seconds, as the fresh-clone
# CI run of f661ed4 measured them on 2 cores under ctest -j 2, those changed since as estimated)
# start first, so that none of them is left to run alone at the end (repin_planted, not listed
# once, ran its 214 s last with one core idle).
set(TEST_COSTS
  "test_trainer_r89 440" "test_trainer 320" "test_trainer_r84 250" "test_trainer_r86 235" "test_trainer_failures 160"
  "test_trainer_r80 115" "param_toy_edit 110" "run_ab_cpu 100" "repin_planted 100" "gpu_check_dry-run 60"
  "train_gpt_cpu_np2_strict 55" "test_gpt_reference 40" "headers_compile_alone 35" "test_model_strict_11 55" "test_mlp_strict_11 32"
  "test_scripts 32" "test_model 35" "test_mlp 30" "plan_step_dry_vs_real_np8 30"
  "gathers_race_np8 28")

# tier_of(OUT NAME): NAME's tier by the rules, or "" where none matches.
function(tier_of out name)
  foreach(rule ${TIER_RULES})
    string(FIND "${rule}" " " space)
    string(SUBSTRING "${rule}" 0 ${space} tier)
    math(EXPR start "${space} + 1")
    string(SUBSTRING "${rule}" ${start} -1 regex)
    if(name MATCHES "${regex}")
      set(${out} ${tier} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

get_property(registered_tests DIRECTORY PROPERTY TESTS)
set(unlabelled)
foreach(test ${registered_tests})
  get_property(labels TEST ${test} PROPERTY LABELS)
  set(has_tier OFF)
  foreach(label ${labels})
    if(label IN_LIST TEST_TIERS)
      set(has_tier ON)
    endif()
  endforeach()
  if(has_tier)
    continue()
  endif()
  tier_of(tier ${test})
  if(tier)
    set_property(TEST ${test} APPEND PROPERTY LABELS ${tier})
  else()
    list(APPEND unlabelled ${test})
  endif()
endforeach()
if(unlabelled)
  list(JOIN unlabelled ", " names)
  list(JOIN TEST_TIERS ", " tiers)
  message(FATAL_ERROR "tests/labels.cmake: test(s) ${names} have no tier label: add a rule for each to TIER_RULES "
                      "(tiers: ${tiers}), or give it one with set_tests_properties(NAME PROPERTIES LABELS TIER)")
endif()

foreach(entry ${TEST_COSTS})
  string(REPLACE " " ";" entry "${entry}")
  list(GET entry 0 test)
  list(GET entry 1 seconds)
  if(TEST ${test})
    set_tests_properties(${test} PROPERTIES COST ${seconds})
  endif()
endforeach()
