# emu's own suite again with one worker and shuffled thread order: correct kernels must not care.
add_test(NAME test_exec_random_order_1_worker COMMAND test_exec)
set_tests_properties(test_exec_random_order_1_worker PROPERTIES ENVIRONMENT "EMU_RANDOM_ORDER=12345;EMU_WORKERS=1")
# Emulated kernel throughput (reported, not a test).
cpu_program(bench_emu ${REPO}/tests/emu/bench_emu.cu)
# Poison in random mode too (test_poison alone runs itself under EMU_POISON=1).
add_test(NAME test_poison_random_order COMMAND test_poison)
set_tests_properties(test_poison_random_order PROPERTIES ENVIRONMENT "EMU_RANDOM_ORDER=4242")
