#!/usr/bin/env bash
# The command line and the GPU test suites on one H200, in two steps:
#
#   bench/gpu/cli_gpu.sh pack [BUILD]      here: build the CLI and the GPU tests and benchmarks ($GPU_BINARIES) for
#                                          sm_90a and the CPU target CPU_ARCH (default x86-64-v3) in BUILD
#                                          (default build-cligpu), pack them with the libraries the GPU machine
#                                          lacks (OpenBLAS, Open MPI from make_ompi_bundle.sh) into
#                                          .device-build/cli-gpu.tar.xz
#   bench/gpu/cli_gpu.sh tests OUT         there (the device tool, carrying .device-build): every packed test_*
#                                          executable, its log in OUT/<name>.log
#   bench/gpu/cli_gpu.sh rl OUT ARGS...    there: `deltatrain rl --device cuda ARGS...`, log OUT/rl.jsonl, output
#                                          OUT/rl.txt
#   bench/gpu/cli_gpu.sh train OUT ARGS... there: `deltatrain train --device cuda ARGS...`, log OUT/train.jsonl,
#                                          output OUT/train.txt
#   bench/gpu/cli_gpu.sh exec OUT BINARY ARGS...
#                                          there: a packed binary (a benchmark) with the same environment
#   bench/gpu/cli_gpu.sh disk OUT DIR      there: the fsynced write and the cold read bandwidth of DIR's disk (dd,
#                                          4 GiB), what checkpoint saves and loads are measured against
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=.device-build/cli-gpu.tar.xz
GPU_BINARIES=${GPU_BINARIES:-test_train_mpi test_cuda_ops test_cuda_model test_gdn_cuda test_cuda_sampling rollout_benchmark model_step_benchmark}
ROOT=/tmp/cli-gpu

pack() {
  local build=${1:-build-cligpu}
  cmake -S . -B "$build" -G Ninja -DDELTATRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DDELTATRAIN_CPU_ARCH="${CPU_ARCH:-x86-64-v3}" -DCMAKE_BUILD_TYPE=Release -DDELTATRAIN_TESTS=ON >/dev/null || return 1
  # shellcheck disable=SC2086
  cmake --build "$build" --target deltatrain $GPU_BINARIES -j "$(nproc)" || return 1
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" .device-build
  for binary in deltatrain $GPU_BINARIES; do cp "$build/bin/$binary" "$stage/bin/"; done
  ldd "$build/bin/deltatrain" | awk '/openblas|gfortran|quadmath|gomp|libcrypto/ {print $3}' | xargs -r cp -L -t "$stage/lib"
  bench/gpu/make_ompi_bundle.sh "$stage/ompi" >/dev/null || return 1
  tar -cJf "$BUNDLE" -C "$stage" .
  rm -rf "$stage"
  du -h "$BUNDLE"
}

# Unpacks the bundle and points the loader at it, Open MPI's runtime and the image's CUDA wheels.
setup() {
  local out=$1
  mkdir -p "$ROOT" "$out"
  tar -xJf "$BUNDLE" -C "$ROOT" || return 1
  local ompi=$ROOT/ompi wheels
  export OPAL_PREFIX=$ompi PATH=$ompi/bin:$PATH PMIX_MCA_mca_base_component_path=$ompi/pmix2/lib/pmix
  [ -e /usr/lib/x86_64-linux-gnu/pmix2 ] || ln -s "$ompi/pmix2" /usr/lib/x86_64-linux-gnu/pmix2
  wheels=$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia
  export LD_LIBRARY_PATH=$ompi/lib:$ROOT/lib:$(dirname "$(find "$wheels" -name 'libcublasLt.so.*' | head -1)"):$(dirname "$(find "$wheels" -name 'libcudart.so.*' | head -1)"):$(dirname "$(find "$wheels" -name 'libnccl.so.*' | head -1)"):${LD_LIBRARY_PATH:-}
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export HWLOC_COMPONENTS=-gl,-opencl NCCL_NVLS_ENABLE=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  if ldd "$ROOT/bin/deltatrain" | grep -E "not found"; then return 1; fi
}

tests() {
  local out=$1 binary name status filter
  setup "$out" || return 1
  for binary in "$ROOT"/bin/test_*; do
    name=$(basename "$binary")
    # The trainer's executable holds the 4-rank CPU tests too; here only its GPU ones, on one rank.
    filter=*
    [ "$name" = test_train_mpi ] && filter='TrainerCuda.*'
    timeout 300 "$binary" --gtest_filter="$filter" >"$out/$name.log" 2>&1
    status=$?
    echo "$name exit $status: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$name.log" | head -10
  done
}

# cli COMMAND OUT ARGS...: the command on the GPU with its JSONL log and output in OUT; progress lines thinned.
cli() {
  local command=$1 out=$2
  shift 2
  setup "$out" || return 1
  "$ROOT/bin/deltatrain" "$command" --device cuda --log "$out/$command.jsonl" --chart none "$@" >"$out/$command.txt" 2>&1
  local status=$?
  grep -vE "^step [0-9]+/" "$out/$command.txt" | tail -30
  grep -E "^step [0-9]+/" "$out/$command.txt" | awk 'NR <= 3 || NR % 10 == 0'
  return $status
}

run_binary() {
  local out=$1 binary=$2
  shift 2
  setup "$out" >/dev/null || return 1
  "$ROOT/bin/$binary" "$@"
}

disk() {
  local out=$1 dir=$2
  mkdir -p "$out" "$dir"
  { dd if=/dev/zero of="$dir/disk-probe" bs=16M count=256 conv=fsync 2>&1 | tail -1
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped: the read may be cached)"
    dd if="$dir/disk-probe" of=/dev/null bs=16M 2>&1 | tail -1; } | tee "$out/disk.txt"
  rm -f "$dir/disk-probe"
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  tests) shift; tests "$@" ;;
  rl | train) cli "$@" ;;
  exec) shift; run_binary "$@" ;;
  disk) shift; disk "$@" ;;
  *) echo "usage: $0 pack [BUILD] | tests OUT | rl OUT ARGS... | train OUT ARGS... | exec OUT BINARY ARGS... | disk OUT DIR" >&2
     exit 2 ;;
esac
