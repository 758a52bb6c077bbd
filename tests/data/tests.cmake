# Data area: shard reader, loaders, bigram hash, dump_batches, dataset scripts.
# The data code is host-only C++20, so these programs build with the host compiler alone (no emu,
# no CUDA): they never wait on, or break with, the kernel build.

# Own warning flags (as strict as the CPU build's), so this file does not depend on what the main
# CMakeLists calls its flag lists.
set(DATA_WARNINGS -Wall -Wextra -Werror)

function(data_host_program name src)
  add_executable(${name} ${src})
  target_include_directories(${name} PRIVATE ${REPO})
  target_compile_options(${name} PRIVATE ${DATA_WARNINGS})
  target_link_libraries(${name} PRIVATE Threads::Threads)
  add_dependencies(cpu_all ${name})
endfunction()

data_host_program(dump_batches ${REPO}/data/dump_batches.cpp)
data_host_program(bench_data_loader ${REPO}/tests/data/bench_data_loader.cpp)
foreach(t test_data_shard test_data_bigram test_data_loader test_data_cli test_data_checkpoint test_data_prefix_table)
  data_host_program(${t} ${REPO}/tests/data/${t}.cpp)
endforeach()

set(DATA_TEST_ENV "REPO=${REPO};SHARED_DATA=${SHARED_DATA}")
add_test(NAME test_data_shard COMMAND test_data_shard)
add_test(NAME test_data_bigram COMMAND test_data_bigram)
add_test(NAME test_data_loader COMMAND test_data_loader)
add_test(NAME test_data_cli COMMAND test_data_cli $<TARGET_FILE:dump_batches>)
add_test(NAME test_data_checkpoint COMMAND test_data_checkpoint)
add_test(NAME test_data_prefix_table COMMAND test_data_prefix_table)
# One record-size micro-batch must take far less host time than a 34 ms training step.
add_test(NAME bench_data_loader COMMAND bench_data_loader --max-ms 5)
set_tests_properties(test_data_shard test_data_bigram test_data_loader test_data_cli test_data_checkpoint test_data_prefix_table
                     bench_data_loader
                     PROPERTIES ENVIRONMENT "${DATA_TEST_ENV}" TIMEOUT 120)

# The Python side: the independent reference against the stored fixtures, and the dataset
# scripts' offline tests. Not registered where no python3 is installed (the C++ tests still compare
# against the stored fixtures).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  foreach(t test_data_reference test_cached_fineweb test_prepare_tinyshakespeare)
    add_test(NAME ${t} COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/data/${t}.py)
    # No __pycache__ in the source tree from importing the scripts under test.
    set_tests_properties(${t} PROPERTIES ENVIRONMENT "${DATA_TEST_ENV};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 120)
  endforeach()
  # The checkpoint reader script against files the C++ writer makes (the test program's
  # --write-sample and --list modes) and files made byte by byte.
  add_test(NAME test_read_checkpoint
           COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/data/test_read_checkpoint.py $<TARGET_FILE:test_data_checkpoint>)
  set_tests_properties(test_read_checkpoint PROPERTIES ENVIRONMENT "${DATA_TEST_ENV};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 120)
else()
  message(STATUS "python3 not found: the data area's Python tests are not registered")
endif()
