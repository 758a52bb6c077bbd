# Every header of runtime/ and profiler/ compiles alone (tests/headers/compile_alone.cmake): the
# trainer includes them all at its top, in any order, and a reader never has to know what must come
# first. headers_compile_alone_planted: a twin of runtime/step_losses.h without its kernels/common.cuh
# include must fail the same check. Needs no MPI: CMakeLists.txt includes this file before the
# MPI-only tests.
include_guard(GLOBAL)
file(GLOB STANDALONE_HEADERS CONFIGURE_DEPENDS RELATIVE ${REPO} ${REPO}/runtime/*.h ${REPO}/runtime/*.cuh
     ${REPO}/profiler/*.h ${REPO}/profiler/*.cuh)
set(alone_flags ${CPU_FLAGS} -std=gnu++20)
foreach(dir ${CUDA_HEADER_DIRS})
  list(APPEND alone_flags -I${dir})
endforeach()
string(REPLACE ";" "|" alone_flags "${alone_flags}")
string(REPLACE ";" "|" alone_headers "${STANDALONE_HEADERS}")
set(alone_args -DCOMPILER=${CMAKE_CXX_COMPILER} -DFLAGS=${alone_flags} -DREPO=${REPO})
add_test(NAME headers_compile_alone COMMAND ${CMAKE_COMMAND} ${alone_args} -DWORK=${CMAKE_CURRENT_BINARY_DIR}/headers_alone
         -DHEADERS=${alone_headers} -P ${REPO}/tests/headers/compile_alone.cmake)
add_test(NAME headers_compile_alone_planted COMMAND ${CMAKE_COMMAND} ${alone_args}
         -DWORK=${CMAKE_CURRENT_BINARY_DIR}/headers_alone_planted -DHEADERS=unused -DPLANT=runtime/step_losses.h
         "-DDROP=#include \"../kernels/common.cuh\"" -P ${REPO}/tests/headers/compile_alone.cmake)
set_tests_properties(headers_compile_alone headers_compile_alone_planted PROPERTIES TIMEOUT 600)
set_tests_properties(headers_compile_alone_planted PROPERTIES
  PASS_REGULAR_EXPRESSION "planted/runtime/step_losses.h does not compile alone: [^\n]*error")
