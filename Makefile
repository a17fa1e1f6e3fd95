# Quick start: `make demo` and `make test` on a fresh machine; each installs what is missing first.
#   make deps    system packages (apt) and the Python environment .venv/ (pip)
#   make build   configure and build everything into build/ and install the Python module into .venv/
#   make test    build, then the C++ suite (ctest) and the binding's suite (pytest)
#   make demo    the GDN operator on a Qwen3.5-shaped layer, checked against the reference, with throughput

APT_PACKAGES := cmake ninja-build g++ git python3-venv libgtest-dev libbenchmark-dev libcli11-dev \
                nlohmann-json3-dev libopenmpi-dev openmpi-bin libopenblas-dev libssl-dev
PY_PACKAGES  := nanobind scikit-build-core apache-tvm-ffi numpy pytest
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build
JOBS   ?= $(shell nproc)
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build test demo clean

all: build

deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:" $$missing; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import importlib.util as u, sys; \
	  sys.exit(any(u.find_spec(m) is None for m in ('nanobind', 'scikit_build_core', 'tvm_ffi', 'numpy', 'pytest')))" || \
	  $(PY) -m pip install -q $(PY_PACKAGES)

# scikit-build-core drives the one CMake build in build/: the library, the CLI, the tests and the module.
build: deps
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install -q --no-build-isolation .

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(PY) -m pytest -q tests/python

demo: build
	$(PY) examples/qwen35_layer.py

clean:
	rm -rf $(BUILD)
