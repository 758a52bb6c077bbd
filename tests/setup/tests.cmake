# The README's setup on a fresh clone with a bare Python (tests/setup/fresh_clone.sh), its quick part:
# scripts/install_deps.sh into the clone, configure, one small test, the .venv's imports and CMake's
# use of it. `fresh_clone.sh full` (make test and make run in the clone) would double CI's time and
# runs by hand; so does `fresh_clone.sh no-toolkit`, which needs a mount namespace.
add_test(NAME setup_fresh_clone COMMAND bash ${REPO}/tests/setup/fresh_clone.sh quick)
set_tests_properties(setup_fresh_clone PROPERTIES TIMEOUT 900)
