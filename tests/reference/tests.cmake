# The PyTorch reference's own tests (tests/reference/test_torch_reference.py): hand-computed and
# float64 checks of its model, optimizer and schedule. Without torch installed it says so and passes:
# the reference only matters when regenerating the golden fixture.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_torch_reference COMMAND ${Python3_EXECUTABLE} ${REPO}/tests/reference/test_torch_reference.py)
  set_tests_properties(test_torch_reference PROPERTIES ENVIRONMENT "REPO=${REPO};PYTHONDONTWRITEBYTECODE=1" TIMEOUT 600)
endif()
