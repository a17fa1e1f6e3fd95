#!/usr/bin/env bash
# The model's GPU checks and benchmarks, in two steps:
#
#   bench/gpu/model_gpu.sh pack [BUILD]         here: build the GPU binaries (sm_90a, a portable CPU target) in BUILD
#                                               (default build-gpu), pack them with the shared libraries they need
#                                               that the GPU machine lacks into $BUNDLE, and fla's wheels
#                                               (../shared/tools/anchor_site.sh) into .device-build/anchors.tar.xz
#   bench/gpu/model_gpu.sh run OUT COMMIT       there (the device tool, carrying both): the GPU kernels against the
#                                               CPU ones, the GPU model against the CPU model, then one training step
#                                               of the 0.8B shape beside HF transformers + fla (bench/model_h200.py)
#   bench/gpu/model_gpu.sh rollout OUT COMMIT   there: the same tests, then the rollout engine on the 0.8B shape
#                                               (rollout_benchmark) beside HF transformers' generate
#                                               (bench/gpu/rollout_hf.py)
#
# BUNDLE (default .device-build/model-gpu.tar.xz) names the binaries' archive, so that builds for different runs
# need not share one.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${BUNDLE:-.device-build/model-gpu.tar.xz}

pack() {
  local build=${1:-build-gpu}
  cmake -S . -B "$build" -G Ninja -DDELTATRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DDELTATRAIN_CPU_ARCH=x86-64-v3 -DCMAKE_BUILD_TYPE=Release >/dev/null || return 1
  cmake --build "$build" --target test_cuda_ops test_cuda_model test_cuda_sampling model_step_benchmark rollout_benchmark -j "$(nproc)" ||
    return 1
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/lib" .device-build
  cp "$build"/bin/{test_cuda_ops,test_cuda_model,test_cuda_sampling,model_step_benchmark,rollout_benchmark} "$stage/"
  # Libraries the GPU machine's image does not have (its CUDA libraries come from its Python wheels).
  ldd "$build/bin/test_cuda_model" | awk '/openblas|gfortran|quadmath|gomp/ {print $3}' | xargs -r cp -L -t "$stage/lib"
  tar -cJf "$BUNDLE" -C "$stage" .
  rm -rf "$stage"
  test -f .device-build/anchors.tar.xz || ../shared/tools/anchor_site.sh .device-build/anchors.tar.xz
  du -h .device-build/*.tar.xz
}

# Unpacks the binaries and fla, and points the loader and Python at them.
setup() {
  local out=$1
  mkdir -p /tmp/gpu "$out" /tmp/site
  tar -xJf "$BUNDLE" -C /tmp/gpu || return 1
  tar -xJf .device-build/anchors.tar.xz -C /tmp/site || return 1
  local wheels
  wheels=$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia
  export LD_LIBRARY_PATH=/tmp/gpu/lib:$(dirname "$(find "$wheels" -name 'libcublasLt.so.*' | head -1)"):$(dirname "$(find "$wheels" -name 'libcudart.so.*' | head -1)"):${LD_LIBRARY_PATH:-}
  # fla as a user installs it, its own dispatch on (tilelang for the gated backward on Hopper, which fla
  # refuses to run through Triton < 3.7.1 there)
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
}

tests() {
  local out=$1
  timeout 120 /tmp/gpu/test_cuda_ops >"$out/test_cuda_ops.log" 2>&1
  echo "test_cuda_ops exit $?: $(grep -E '^\[  (PASSED|FAILED) ' "$out/test_cuda_ops.log" | tr '\n' ' ')"
  timeout 120 /tmp/gpu/test_cuda_model >"$out/test_cuda_model.log" 2>&1
  echo "test_cuda_model exit $?"
  grep -E 'loss:|gradients:|logits relative|Failure|FAILED|PASSED|Expected|actual' "$out/test_cuda_model.log" | head -30
  timeout 300 /tmp/gpu/test_cuda_sampling >"$out/test_cuda_sampling.log" 2>&1
  echo "test_cuda_sampling exit $?: $(grep -E '^\[  (PASSED|FAILED) ' "$out/test_cuda_sampling.log" | tr '\n' ' ')"
}

run() {
  local out=$1 commit=$2
  setup "$out" || return 1
  tests "$out"
  python3 bench/model_h200.py --ours /tmp/gpu/model_step_benchmark --commit "$commit" --out "$out/model-h200" \
    2>&1 | grep -v -i warning | tail -40
}

rollout() {
  local out=$1 commit=$2
  setup "$out" || return 1
  echo "commit $commit" >>"$out/gpu.txt"
  tests "$out"
  timeout 200 /tmp/gpu/rollout_benchmark --json "$out/rollout-ours.json" >"$out/rollout-ours.log" 2>&1
  echo "rollout_benchmark exit $?"
  tail -4 "$out/rollout-ours.log"
  # fla's own calls stay on fla (FlashQLA's JIT would cost 10-40 s per kernel); generate uses fla's kernels.
  FLA_DISABLE_BACKEND_DISPATCH=1 timeout 200 python3 bench/gpu/rollout_hf.py --json "$out/rollout-hf.json" \
    >"$out/rollout-hf.log" 2>&1
  echo "rollout_hf exit $?"
  grep -v -i warning "$out/rollout-hf.log" | tail -6
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  rollout) shift; rollout "$@" ;;
  *) echo "usage: $0 pack [BUILD] | run OUT COMMIT | rollout OUT COMMIT" >&2; exit 2 ;;
esac
