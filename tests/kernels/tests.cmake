# The kernel tests' benchmark mode (`test_X --bench`, tests/bench_util.h): three of them time their
# launchers once at the tiny preset's shapes; each launcher must get a line with a positive time and
# its recorded Work, and bad flags must fail naming the flag (tests/kernels/bench_smoke.py).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME kernel_bench_smoke COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/kernels/bench_smoke.py
           $<TARGET_FILE:test_norm> $<TARGET_FILE:test_residual> $<TARGET_FILE:test_mlp>)
  set_tests_properties(kernel_bench_smoke PROPERTIES ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1" TIMEOUT 300)
endif()
# The GPU build's TMA + wgmma GEMM of test_hopper (the correct variants, A from shared memory and from
# registers) and the MLP's wgmma kernels: HGMMA (QGMMA for FP8) and UTMALDG in their SASS, no local memory
# (tests/kernels/check_hopper_sass.py).
if(BUILD_GPU AND Python3_Interpreter_FOUND)
  add_test(NAME gpu_hopper_sass COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/kernels/check_hopper_sass.py
           $<TARGET_FILE:test_hopper_gpu> _Z14gemm_tma_wgmmaILb0EL7Planted0E _Z14gemm_tma_wgmmaILb1EL7Planted0E)
  set_tests_properties(gpu_hopper_sass PROPERTIES ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1" SKIP_RETURN_CODE 77)
  # the MLP's Hopper kernels (kernels/mlp.cuh, forward and backward epilogues, and the FP8 up-projection's
  # e4m3 forward: QGMMA) in test_mlp's binary; record 87's post-only epilogues (2, 3), record 89's
  # e4m3-post epilogue (4) and its pre-keeping form on record 84 (5)
  add_test(NAME gpu_hopper_sass_mlp COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/kernels/check_hopper_sass.py
           $<TARGET_FILE:test_mlp_gpu> _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue0E13__nv_bfloat16
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue1E13__nv_bfloat16
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue0E13__nv_fp8_e4m3
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue2E13__nv_bfloat16
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue3E13__nv_bfloat16
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue2E13__nv_fp8_e4m3
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue4E13__nv_fp8_e4m3
           _Z31linear_relu_square_wgmma_kernelIL10FcEpilogue5E13__nv_fp8_e4m3)
  set_tests_properties(gpu_hopper_sass_mlp PROPERTIES ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1" SKIP_RETURN_CODE 77)
  # the checker itself: a single-wgmma kernel loads no TMA box, so it must be refused
  add_test(NAME gpu_hopper_sass_planted COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/kernels/check_hopper_sass.py
           $<TARGET_FILE:test_hopper_gpu> _Z9one_wgmmaILi64ELb0E)
  set_tests_properties(gpu_hopper_sass_planted PROPERTIES ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1" SKIP_RETURN_CODE 77
                       WILL_FAIL TRUE)
  # attention on wgmma + TMA (kernels/attention_wgmma.cuh): forward, dq and dk/dv, D = 64 and 128
  add_test(NAME gpu_attention_sass COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/kernels/check_hopper_sass.py
           $<TARGET_FILE:test_attention_gpu> _Z30attention_forward_wgmma_kernelILi64E
           _Z30attention_forward_wgmma_kernelILi128E _Z34attention_backward_dq_wgmma_kernelILi64E
           _Z34attention_backward_dq_wgmma_kernelILi128E _Z36attention_backward_dkdv_wgmma_kernelILi64E
           _Z36attention_backward_dkdv_wgmma_kernelILi128E)
  set_tests_properties(gpu_attention_sass PROPERTIES ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1" SKIP_RETURN_CODE 77)
endif()
