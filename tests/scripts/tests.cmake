# The record scripts (scripts/run_record.sh, run_many.sh, stats.py, plot_logs.py): offline tests with
# synthetic logs and stub mpirun/nvidia-smi/make. Not registered where no python3 is installed.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_scripts COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_scripts.py)
  # No __pycache__ in the source tree from importing the scripts under test.
  set_tests_properties(test_scripts PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 300)
else()
  message(STATUS "python3 not found: the record scripts' tests are not registered")
endif()

# The GPU check and the side-by-side race without a GPU (issue 26, tests/scripts/test_gpu_check.py):
# scripts/gpu_check.sh's plan and help; its --dry-run on the CPU build, every part, then a calibration
# from that report through --plan-step; planted failures (a hung part, a failing and a hung kernel test,
# losses off, a non-Hopper GPU) reported by name with the other parts still run; side_by_side.sh's dry
# run, extraction and argument checks. The build folder holds train_gpt_cpu and the kernel tests' CPU twins.
if(Python3_Interpreter_FOUND)
  set(GPU_CHECK_DRY_OUT ${CMAKE_BINARY_DIR}/gpu_check_dry_run)
  foreach(what plan dry-run planted side)
    set(extra)
    if(what STREQUAL "dry-run" OR what STREQUAL "side")
      set(extra ${GPU_CHECK_DRY_OUT})
    endif()
    add_test(NAME gpu_check_${what} COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_gpu_check.py ${what}
             $<TARGET_FILE_DIR:train_gpt_cpu> ${extra})
    set_tests_properties(gpu_check_${what} PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 600)
  endforeach()
  # the side test reads the dry run's logs.txt (ours, --ours-log) rather than running the trainer again
  set_tests_properties(gpu_check_dry-run PROPERTIES FIXTURES_SETUP gpu_check_dry_run)
  set_tests_properties(gpu_check_side PROPERTIES FIXTURES_REQUIRED gpu_check_dry_run)
endif()

# The A/B comparison (scripts/run_ab.sh, stats.py --ab/--paired, source_hash.py). test_ab, offline:
# paired statistics against scipy (in the project's .venv: without it the test fails), A/B folder
# checks and statistics.md on synthetic logs, run_ab.sh's plan, flags and Ctrl-C with stand-in builds.
# run_ab_cpu, end to end with the real CPU trainer: a temporary clone with a second commit, HEAD~1
# reusing this build folder (built from the same tree) and HEAD built in its own worktree (most of
# its time: the trainer alone, linked with this build folder's emu, EMU_FROM_BUILD), a one-step tiny
# schedule, then the logs, the manifest and statistics.md.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_ab COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_ab.py)
  add_test(NAME run_ab_cpu COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_run_ab_cpu.py ${CMAKE_BINARY_DIR})
  set_tests_properties(test_ab run_ab_cpu PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 1500)
endif()

# The GPU bundle's fallback build without the nlohmann-json package (tests/scripts/test_bundle_json.py):
# a configure given the headers as a bundle carries them takes them, the checkpoint format compiles
# against them alone, build_gpu_bundle.sh refuses a folder without them, gpu_check.sh's rebuild passes them.
if(Python3_Interpreter_FOUND)
  add_test(NAME gpu_bundle_json_headers COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_bundle_json.py ${CMAKE_BINARY_DIR})
  set_tests_properties(gpu_bundle_json_headers PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 300)
endif()

# scripts/make_prefix_table.py (tests/scripts/test_make_prefix_table.py): rebuilt from the shared GPT-2
# vocabulary it equals the committed data/gpt2_prefix_table.bin byte for byte; a vocabulary with one
# token removed is refused with a sha256 error and no output.
if(Python3_Interpreter_FOUND)
  add_test(NAME test_make_prefix_table COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/scripts/test_make_prefix_table.py)
  set_tests_properties(test_make_prefix_table PROPERTIES ENVIRONMENT "REPO=${REPO};SHARED_DATA=${SHARED_DATA};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 120)
endif()
