#!/usr/bin/env bash
# fla's own GDN tests (tests/ops/test_gdn.py: the chunk, varlen, varlen-prefill and fused-recurrent tests) run
# against deltatrain on an H200, with fla's functions swapped for deltatrain's by bench/gpu/fla_conftest.py
# (deltatrain.torch.install_as_fla). fla's tests are not in its wheel and the GPU machine has no network, so a
# fetched copy of the test file travels in .device-build (git-ignored), with the Python module built here:
#
#   bench/gpu/fla_tests.sh pack TEST_GDN_PY [BUILD]   here: build the Python module (CUDA, sm_90a) in BUILD
#                                                     (default build-fla) with $PYTHON (default python3; the GPU
#                                                     machine's is 3.12, with nanobind) and stage it, libgomp, fla
#                                                     (from ../shared/tools/anchor_site.sh's wheels) and fla's test
#                                                     file in .device-build/fla-tests (a few MB)
#   bench/gpu/fla_tests.sh run OUT                    there (the device tool, carrying .device-build/fla-tests): the
#                                                     tests; log and JUnit XML in OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=.device-build/fla-tests

pack() {
  local tests=${1:?usage: fla_tests.sh pack TEST_GDN_PY [BUILD]} build=${2:-build-fla} tmp
  cmake -S . -B "$build" -G Ninja -DDELTATRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DDELTATRAIN_PYTHON=ON \
    -DDELTATRAIN_CPU_ARCH=x86-64-v3 -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" >/dev/null || return 1
  cmake --build "$build" --target _deltatrain -j "$(nproc)" || return 1
  test -f .device-build/anchors.tar.xz || ../shared/tools/anchor_site.sh .device-build/anchors.tar.xz || return 1
  tmp=$(mktemp -d)
  mkdir -p "$stage" "$tmp/module/lib" "$tmp/site"
  cp "$build"/lib/_deltatrain*.so "$tmp/module/"
  # The GPU machine's image has no libgomp of its own (torch's is renamed).
  ldd "$build"/lib/_deltatrain*.so | awk '/gomp/ {print $3}' | xargs -r cp -L -t "$tmp/module/lib"
  tar -cJf "$stage/module.tar.xz" -C "$tmp/module" .
  # fla alone of the anchors' packages (the rest, tilelang and FlashQLA, are for fla's own dispatch, which is off).
  tar -xJf .device-build/anchors.tar.xz -C "$tmp/site" --wildcards './fla/*' './fla_core-*' './flash_linear_attention-*'
  tar -cJf "$stage/fla.tar.xz" -C "$tmp/site" .
  rm -rf "$tmp"
  cp "$tests" "$stage/test_gdn.py"
  du -sh "$stage"
}

run() {
  local out=${1:?usage: fla_tests.sh run OUT} work=/tmp/fla-tests
  mkdir -p "$out" "$work/deltatrain" "$work/site"
  tar -xJf "$stage/module.tar.xz" -C "$work/deltatrain" && tar -xJf "$stage/fla.tar.xz" -C "$work/site" || return 1
  cp python/deltatrain/*.py "$work/deltatrain/"
  cp "$stage/test_gdn.py" "$work/"
  cp bench/gpu/fla_conftest.py "$work/conftest.py"
  # The CUDA runtime the module links comes from the image's Python wheels (as torch's does).
  local cudart
  cudart=$(dirname "$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia" \
    -name 'libcudart.so.*' | head -1)")
  # fla's dispatch to other backends off, as in fla's own baseline run: its GVA chunk cases run then too.
  export PYTHONPATH=$work:$work/site LD_LIBRARY_PATH=$work/deltatrain/lib:$cudart:${LD_LIBRARY_PATH:-}
  export FLA_DISABLE_BACKEND_DISPATCH=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/fla-tests-gpu.txt"
  (cd "$work" && python3 -m pytest -p no:cacheprovider -q -rfE --junitxml "$out/fla-tests.xml" \
    test_gdn.py::test_fused_recurrent test_gdn.py::test_chunk test_gdn.py::test_chunk_varlen \
    test_gdn.py::test_chunk_varlen_prefill) >"$out/fla-tests.log" 2>&1
  local status=$?
  grep -E "passed|failed|FAILED|ERROR|deltatrain kernel calls" "$out/fla-tests.log" | tail -40
  return $status
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack TEST_GDN_PY [BUILD] | run OUT" >&2; exit 2 ;;
esac
