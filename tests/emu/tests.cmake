# emu's own suite again with one worker and shuffled thread order: correct kernels must not care.
add_test(NAME test_exec_random_order_1_worker COMMAND test_exec)
set_tests_properties(test_exec_random_order_1_worker PROPERTIES ENVIRONMENT "EMU_RANDOM_ORDER=12345;EMU_WORKERS=1")
# Emulated kernel throughput (reported, not a test).
cpu_program(bench_emu ${REPO}/tests/emu/bench_emu.cu)
# emu's suite and the NCCL shim's again with deferred streams (work runs when needed, in a seeded
# order, under the race detector): the results and the error reports must not change.
add_test(NAME test_exec_deferred_streams COMMAND test_exec)
set_tests_properties(test_exec_deferred_streams PROPERTIES ENVIRONMENT "EMU_STREAMS=deferred:3")
add_test(NAME test_mpi_nccl_np2_deferred_streams COMMAND ${MPIRUN} -np 2 -x EMU_WORKERS=1 $<TARGET_FILE:test_mpi_nccl>)
set_tests_properties(test_mpi_nccl_np2_deferred_streams PROPERTIES ENVIRONMENT "EMU_STREAMS=deferred:3" TIMEOUT 600)
