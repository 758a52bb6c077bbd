# emu's own suite again with one worker and shuffled thread order: correct kernels must not care.
add_test(NAME test_exec_random_order_1_worker COMMAND test_exec)
set_tests_properties(test_exec_random_order_1_worker PROPERTIES ENVIRONMENT "EMU_RANDOM_ORDER=12345;EMU_WORKERS=1")
# Emulated kernel throughput (reported, not a test).
cpu_program(bench_emu ${REPO}/tests/emu/bench_emu.cu)
# Poison in random mode too (test_poison alone runs itself under EMU_POISON=1).
add_test(NAME test_poison_random_order COMMAND test_poison)
set_tests_properties(test_poison_random_order PROPERTIES ENVIRONMENT "EMU_RANDOM_ORDER=4242")
# The launch-bounds scan on planted sources: a bound of constants is evaluated (256), a comment is not a
# kernel, and a bound it cannot evaluate stops with the kernel's name.
add_test(NAME emu_launch_bounds_scan COMMAND sh -c "${CMAKE_COMMAND} -DOUTPUT=$1 -DSOURCES=$2 -P $3 && cat $1" sh
         ${CMAKE_CURRENT_BINARY_DIR}/planted_launch_bounds.cpp ${REPO}/tests/emu/fixtures/launch_bounds_good.cuh
         ${REPO}/emu/launch_bounds.cmake)
set_tests_properties(emu_launch_bounds_scan PROPERTIES
  PASS_REGULAR_EXPRESSION "kLaunchBounds\\[\\] = {\n    {\"planted_kernel\", 256},\n};\nconst size_t kLaunchBoundCount = 1;")
add_test(NAME emu_launch_bounds_scan_unresolved COMMAND ${CMAKE_COMMAND} -DOUTPUT=${CMAKE_CURRENT_BINARY_DIR}/planted_bad.cpp
         -DSOURCES=${REPO}/tests/emu/fixtures/launch_bounds_bad.cuh -P ${REPO}/emu/launch_bounds.cmake)
set_tests_properties(emu_launch_bounds_scan_unresolved PROPERTIES
  PASS_REGULAR_EXPRESSION "launch bounds of unresolved_kernel: 'kNowhere' is not a")
# emu's suite and the NCCL shim's again with deferred streams (work runs when needed, in a seeded
# order, under the race detector): the results and the error reports must not change.
add_test(NAME test_exec_deferred_streams COMMAND test_exec)
set_tests_properties(test_exec_deferred_streams PROPERTIES ENVIRONMENT "EMU_STREAMS=deferred:3")
add_test(NAME test_mpi_nccl_np2_deferred_streams COMMAND ${MPIRUN} -np 2 -x EMU_WORKERS=1 $<TARGET_FILE:test_mpi_nccl>)
set_tests_properties(test_mpi_nccl_np2_deferred_streams PROPERTIES ENVIRONMENT "EMU_STREAMS=deferred:3" TIMEOUT 600)
