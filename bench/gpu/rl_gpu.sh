#!/usr/bin/env bash
# Colocated RL on one H200, in two steps:
#
#   bench/gpu/rl_gpu.sh pack [BUILD]     here: build the CLI for sm_90a and a portable CPU target in BUILD (default
#                                        build-rlgpu), pack it with the libraries the GPU machine lacks (OpenBLAS,
#                                        Open MPI from make_ompi_bundle.sh) into .device-build/rl-gpu.tar.xz
#   bench/gpu/rl_gpu.sh run OUT ARGS...  there (the device tool, carrying .device-build): `deltatrain rl --device
#                                        cuda ARGS...` with its log in OUT/rl.jsonl and its output in OUT/rl.txt
set -uo pipefail
cd "$(dirname "$0")/../.."

pack() {
  local build=${1:-build-rlgpu}
  cmake -S . -B "$build" -G Ninja -DDELTATRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DDELTATRAIN_CPU_ARCH=x86-64-v3 -DCMAKE_BUILD_TYPE=Release -DDELTATRAIN_TESTS=OFF >/dev/null || return 1
  cmake --build "$build" --target deltatrain -j "$(nproc)" || return 1
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" .device-build
  cp "$build/bin/deltatrain" "$stage/bin/"
  ldd "$build/bin/deltatrain" | awk '/openblas|gfortran|quadmath|gomp|libcrypto/ {print $3}' | xargs -r cp -L -t "$stage/lib"
  bench/gpu/make_ompi_bundle.sh "$stage/ompi" >/dev/null || return 1
  tar -cJf .device-build/rl-gpu.tar.xz -C "$stage" .
  rm -rf "$stage"
  du -h .device-build/rl-gpu.tar.xz
}

run() {
  local out=$1
  shift
  local root=/tmp/rl-gpu
  mkdir -p "$root" "$out"
  tar -xJf .device-build/rl-gpu.tar.xz -C "$root" || return 1
  local ompi=$root/ompi wheels
  export OPAL_PREFIX=$ompi PATH=$ompi/bin:$PATH PMIX_MCA_mca_base_component_path=$ompi/pmix2/lib/pmix
  [ -e /usr/lib/x86_64-linux-gnu/pmix2 ] || ln -s "$ompi/pmix2" /usr/lib/x86_64-linux-gnu/pmix2
  wheels=$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia
  export LD_LIBRARY_PATH=$ompi/lib:$root/lib:$(dirname "$(find "$wheels" -name 'libcublasLt.so.*' | head -1)"):$(dirname "$(find "$wheels" -name 'libcudart.so.*' | head -1)"):$(dirname "$(find "$wheels" -name 'libnccl.so.*' | head -1)"):${LD_LIBRARY_PATH:-}
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export HWLOC_COMPONENTS=-gl,-opencl NCCL_NVLS_ENABLE=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  ldd "$root/bin/deltatrain" | grep -E "not found" && return 1
  "$root/bin/deltatrain" rl --device cuda --log "$out/rl.jsonl" --chart none "$@" >"$out/rl.txt" 2>&1
  local status=$?
  grep -vE "^step [0-9]+/" "$out/rl.txt" | tail -30
  grep -E "^step [0-9]+/" "$out/rl.txt" | awk 'NR <= 3 || NR % 10 == 0'
  return $status
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack [BUILD] | run OUT ARGS..." >&2; exit 2 ;;
esac
