# The assembled model through the trainer program (the C++ tests, test_*.cu, are registered by
# CMakeLists.txt): the memory plan's optimizer-state summary, and the README's example of adding a
# parameter built into a trainer. Need python3 (the edit and the checks are Python).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(NOT Python3_Interpreter_FOUND)
  message(STATUS "python3 not found: memory_plan_state and param_toy_edit are not registered")
  return()
endif()
set(MODEL_TEST_ENV "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1")

# --print-memory's optimizer-state summary against the optimizer arena's entries, both presets.
add_test(NAME memory_plan_state
         COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/model/test_memory_plan_state.py $<TARGET_FILE:train_gpt_cpu>)
set_tests_properties(memory_plan_state PROPERTIES ENVIRONMENT "${MODEL_TEST_ENV}" TIMEOUT 120)

# toy_trainer(NAME): train_gpt_cpu built from a copy of train_gpt.cu with the README's worked
# example of adding a parameter applied by param_toy_edit.py, with
# train_gpt_cpu's own compile options and definitions (less -g), linked with the built emu, and a source bundle
# of the edited file for its log. Not part of `make cpu`: test_param_toy_edit.py builds the one it needs.
get_target_property(TRAINER_OPTIONS train_gpt_cpu COMPILE_OPTIONS)
get_target_property(TRAINER_DEFINITIONS train_gpt_cpu COMPILE_DEFINITIONS)
function(toy_trainer name)
  set(dir ${CMAKE_CURRENT_BINARY_DIR}/param_toy/${name})
  file(MAKE_DIRECTORY ${dir})
  foreach(sub runtime profiler kernels data emu)  # its includes (and theirs, by ../), and the bundle's other sources
    file(CREATE_LINK ${REPO}/${sub} ${dir}/${sub} SYMBOLIC)
  endforeach()
  add_custom_command(OUTPUT ${dir}/train_gpt.cu
    COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/model/param_toy_edit.py ${REPO}/README.md ${REPO}/train_gpt.cu
            ${dir}/train_gpt.cu
    DEPENDS ${REPO}/README.md ${REPO}/train_gpt.cu ${REPO}/tests/model/param_toy_edit.py
    COMMENT "Applying README.md's parameter example to a copy of train_gpt.cu (${name})")
  add_custom_command(OUTPUT ${dir}/source_bundle.cpp
    COMMAND ${CMAKE_COMMAND} -DREPO=${dir} -DOUTPUT=${dir}/source_bundle.cpp -DFILES=${EMBEDDED_LIST}
            -P ${REPO}/cmake/embed_sources.cmake
    DEPENDS ${dir}/train_gpt.cu ${EMBEDDED_PATHS} ${REPO}/cmake/embed_sources.cmake)
  add_library(${name}_sources STATIC EXCLUDE_FROM_ALL ${dir}/source_bundle.cpp)
  file(CONFIGURE OUTPUT ${dir}/${name}.cpp CONTENT "#include \"${dir}/train_gpt.cu\"\n")
  # the edited file as a source that is not compiled itself: its rule runs before the wrapper's compile
  set_source_files_properties(${dir}/train_gpt.cu PROPERTIES HEADER_FILE_ONLY ON)
  add_executable(${name} EXCLUDE_FROM_ALL ${dir}/${name}.cpp ${dir}/train_gpt.cu)
  target_compile_options(${name} PRIVATE ${TRAINER_OPTIONS} -g0)  # no debug information to make and link
  target_compile_definitions(${name} PRIVATE ${TRAINER_DEFINITIONS})
  target_link_libraries(${name} PRIVATE emu ${name}_sources)
  set_source_files_properties(${dir}/${name}.cpp PROPERTIES OBJECT_DEPENDS ${dir}/train_gpt.cu)
endfunction()
toy_trainer(train_gpt_toy_cpu)

# The README's example through the real program: the toy trainer starts (the table check passes), lists
# the parameter and its Adam state in --print-memory, trains 2 steps on 2 ranks under deferred streams
# with the unedited trainer's checkpoint tensors bit for bit after its first Adam step, its own equal to
# the first bigram table's.
add_test(NAME param_toy_edit
         COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/model/test_param_toy_edit.py ${CMAKE_COMMAND} ${CMAKE_BINARY_DIR}
                 $<TARGET_FILE:train_gpt_cpu> $<TARGET_FILE:train_gpt_toy_cpu> ${MPIRUN})
set_tests_properties(param_toy_edit PROPERTIES ENVIRONMENT "${MODEL_TEST_ENV}" TIMEOUT 900)
