# The single-rank build (TRAIN_GPT_MPI=OFF) kept from rotting where MPI is on: its CPU twin,
# train_gpt_cpu_nompi, trains the tiny preset for 3 steps without mpirun with train_gpt_cpu's losses
# (tests/single_rank/test_single_rank.py), and loads no MPI, NCCL or shared libstdc++
# (scripts/check_single_rank_libs.sh, which scripts/build_gpu_bundle.sh runs on the GPU programs);
# the planted case: train_gpt_cpu itself, which loads both, is refused naming them.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME single_rank_losses COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/single_rank/test_single_rank.py
           $<TARGET_FILE:train_gpt_cpu_nompi> $<TARGET_FILE:train_gpt_cpu>
           --preset tiny --max-steps 3 --val-every 0 --log-train-loss)
  set_tests_properties(single_rank_losses PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 900)
else()
  message(STATUS "python3 not found: single_rank_losses is not registered")
endif()
add_test(NAME single_rank_libs COMMAND ${REPO}/scripts/check_single_rank_libs.sh $<TARGET_FILE:train_gpt_cpu_nompi>)
add_test(NAME single_rank_libs_planted COMMAND ${REPO}/scripts/check_single_rank_libs.sh $<TARGET_FILE:train_gpt_cpu>)
# PASS_REGULAR_EXPRESSION alone decides: the check must fail, and for both reasons.
set_tests_properties(single_rank_libs_planted PROPERTIES
  PASS_REGULAR_EXPRESSION "train_gpt_cpu loads libmpi[^ ]* .*libstdc\\+\\+[^ ]* \\(a single-rank program")

# NCCL's one-rank stand-in (runtime/nccl_world1.cpp) against NCCL's one-rank results and error codes
# (tests/single_rank/nccl_world1_check.cu), on emu with that stand-in.
cpu_program(nccl_world1_check ${REPO}/tests/single_rank/nccl_world1_check.cu EMU ${EMU_WORLD1})
add_test(NAME nccl_world1_check COMMAND nccl_world1_check)

# scripts/build_gpu_bundle.sh refuses bad arguments, and a --out folder that is not a bundle (it
# deletes only a previous bundle's files), before building anything.
add_test(NAME gpu_bundle_bad_jobs COMMAND ${REPO}/scripts/build_gpu_bundle.sh --jobs 0)
set_tests_properties(gpu_bundle_bad_jobs PROPERTIES PASS_REGULAR_EXPRESSION "--jobs 0 is not a positive number")
add_test(NAME gpu_bundle_not_a_bundle COMMAND ${REPO}/scripts/build_gpu_bundle.sh --out ${REPO}/tests)
set_tests_properties(gpu_bundle_not_a_bundle PROPERTIES PASS_REGULAR_EXPRESSION "tests exists and is not a bundle")
