# Front door. The real build is CMake in build/; this file names the everyday commands.
#   make        the GPU trainer, train_gpt (nvcc, sm_90a)
#   make cpu    the CPU build: train_gpt_cpu and the test programs, against emu/
#   make test   both builds, then every test through CTest (README "Tests": the tiers and their times)
#   make check  the CPU build, then the fast tier (`ctest -L fast`: unit tests, a few minutes)
#   make repin  re-pin the fixtures a change of the math moves (scripts/repin.py; README "Editing")
#   make run    the main job
#   make gpu-bundle  the single-GPU programs (no MPI), stripped, in gpu-bundle/ (scripts/build_gpu_bundle.sh)
# Each but gpu-bundle first runs scripts/install_deps.sh: the Debian packages and the Python environment .venv.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all cpu test check repin run deps configure clean gpu-bundle

all: configure
	cmake --build $(BUILD) --target train_gpt -j $(JOBS)

cpu: configure
	cmake --build $(BUILD) --target cpu_all -j $(JOBS)

test: configure
	cmake --build $(BUILD) -j $(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

check: configure
	cmake --build $(BUILD) --target cpu_all -j $(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L fast

# After a change meant to change the math: every pinned fixture regenerated from this build, refused
# unless the default and strict runs agree, and what changed printed.
repin: configure
	cmake --build $(BUILD) --target repin -j $(JOBS)

# The main job: the tiny preset on the committed Tiny Shakespeare shards, one rank; on the GPU
# binary when there is a GPU and the GPU build is on, else on the CPU build. RUN_FLAGS adds
# trainer flags.
RUN_FLAGS ?=
TINY_RUN = --preset tiny --val-every 10 --log-train-loss $(RUN_FLAGS)
run: configure
	@if nvidia-smi -L >/dev/null 2>&1 && grep -q '^BUILD_GPU:BOOL=ON' $(BUILD)/CMakeCache.txt; then \
	  cmake --build $(BUILD) --target train_gpt -j $(JOBS) && ./$(BUILD)/train_gpt $(TINY_RUN); \
	else \
	  cmake --build $(BUILD) --target train_gpt_cpu -j $(JOBS) && ./$(BUILD)/train_gpt_cpu $(TINY_RUN); \
	fi

# The single-GPU bundle for a GPU machine (README: "One GPU, no MPI"): its own build folder,
# build-gpu-bundle/, and no Python environment needed.
gpu-bundle:
	scripts/build_gpu_bundle.sh --jobs $(JOBS)

# Debian packages and the Python environment .venv (scripts/install_deps.sh); quick when all is there.
deps:
	@scripts/install_deps.sh

configure: deps
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

clean:
	rm -rf $(BUILD)
