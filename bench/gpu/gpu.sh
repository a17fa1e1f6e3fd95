#!/usr/bin/env bash
# Everything deltatrain runs on a GPU machine without its build dependencies (the H200 the device tool lends:
# CUDA, torch and Python 3.12, but no compilers' libraries, no Open MPI, no network), from one bundle:
#
#   bench/gpu/gpu.sh pack [BUILD]        here (`make gpu-bundle`): build for sm_90a and the CPU target CPU_ARCH
#                                        (default x86-64-v3) in BUILD (default build-gpu-bundle): the CLI, the GPU
#                                        tests and benchmarks ($GPU_BINARIES) with the libraries that machine lacks
#                                        (OpenBLAS, libgomp, Open MPI from make_ompi_bundle.sh) into
#                                        .device-build/gpu/binaries.tar.xz, and the Python module for $GPU_PYTHON
#                                        (default python3.12, the GPU machine's; nanobind is installed into a venv
#                                        under .device-build when it lacks it) with the package's Python layer into
#                                        .device-build/gpu/module.tar.xz.
#                                        GPU_BASELINE=DIR adds each executable in DIR as bin/NAME_base, for an A/B
#                                        of a change in one lease (copy the binaries there before the change);
#                                        GPU_BASELINE_MODULE=FILE adds a module.tar.xz packed before the change as
#                                        module_base.tar.xz, for `ab` (FILE may be the bundle's own module.tar.xz:
#                                        it is copied before the build; without it a stale one is removed).
#                                        Each archive carries BUILT_FROM (the revision, a hash of uncommitted
#                                        changes, the time), which the verbs there print beside the GPU's name
#   bench/gpu/gpu.sh pack-base REV       here: the baseline of an A/B, built from git revision REV in a worktree
#                                        (.device-build/base-src, built in .device-build/base-build, kept for the
#                                        next time): its bundle in .device-build/base/ and, in .device-build/base/bin,
#                                        its $BASE_BINARIES (default model_step_benchmark), so that
#                                        GPU_BASELINE=.device-build/base/bin
#                                        GPU_BASELINE_MODULE=.device-build/base/module.tar.xz make gpu-bundle packs
#                                        the change beside exactly that revision
#
# There (the device tool, carrying the archives a verb needs; OUT receives the logs):
#   bench/gpu/gpu.sh tests OUT           binaries: every packed test_* executable (the trainer's GPU tests only),
#                                        then the GDN tests again on the mma.sync passes (DELTATRAIN_CUDA_WGMMA=0)
#                                        and the backward ones with the fused backward forced on and off
#                                        (DELTATRAIN_CUDA_FUSED_BACKWARD=1, then 0) and split by role
#                                        (DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1)
#   bench/gpu/gpu.sh sanitize OUT        binaries: compute-sanitizer memcheck, racecheck and synccheck on small GDN
#                                        cases and a segmented one
#   bench/gpu/gpu.sh python OUT SCRIPT ARGS...
#                                        module and/or binaries (and $ANCHORS, default .device-build/anchors.tar.xz, fla
#                                        and FlashQLA from ../shared/tools/anchor_site.sh, when carried): a Python script with
#                                        deltatrain importable, e.g. bench/gdn_h200.py --out OUT --commit HASH
#                                        (with the binaries carried too, those are under /tmp/deltatrain-gpu/bin);
#                                        WRAP prefixes the command (WRAP="ncu --clock-control none ...": gpu.sh refuses
#                                        an ncu that would lock the GPU's clocks).
#                                        The just-in-time compilers' caches (FlashQLA's TileLang kernels, fla's Triton
#                                        ones; their first compiles take minutes) are restored from
#                                        .device-build/{tilelang,triton}-cache.tar.xz when carried and saved to
#                                        OUT/{tilelang,triton}-cache.tar.xz where the script added to them (where it
#                                        did not, the carried archive is still the whole cache); PYTHON_TIMEOUT_S=N
#                                        interrupts the script after N s so that they are saved within the device
#                                        tool's limit
#   bench/gpu/gpu.sh ab OUT ROUNDS ARGS...
#                                        module and module_base (no anchors: --ours-only imports no fla): the GDN
#                                        grid's cells (bench/gdn_h200.py --ours-only ARGS, e.g. --only 8 15) with
#                                        the baseline module (or the same module with AB_BASE_ENV=NAME=VALUE set,
#                                        for a change a switch turns off) and the change's in turn, ROUNDS times each, then
#                                        bench/gdn_ab.py's comparison: OUT/gdn-ab.md and OUT/gdn-ab.json (every
#                                        run's rows with it); each run's log in OUT/runs.log
#   bench/gpu/gpu.sh same-bits OUT ARGS...
#                                        module and a baseline as for ab: bench/gpu/same_bits.py over the grid with the
#                                        baseline, then with the change, then their comparison (OUT/same-bits.txt;
#                                        status 1 where any output tensor differs), for a change that claims the
#                                        baseline's bits
#   bench/gpu/gpu.sh step-ab OUT ROUNDS ARGS...
#                                        binaries with a baseline (GPU_BASELINE holding a model_step_benchmark, or
#                                        the same binary with AB_BASE_ENV=NAME=VALUE set, as for ab):
#                                        the baseline and model_step_benchmark ARGS in turn, ROUNDS
#                                        times each, then bench/model_step_ab.py's comparison: OUT/model-step-ab.md
#                                        and .json (every run in it), e.g. ARGS = --sequences 8 --seq-len 4096
#                                        --steps 4 --warmup 2
#   bench/gpu/gpu.sh train OUT ARGS...   binaries: `deltatrain train --device cuda ARGS...`, log OUT/train.jsonl
#   bench/gpu/gpu.sh rl OUT ARGS...      binaries: `deltatrain rl --device cuda ARGS...`, log OUT/rl.jsonl
#   bench/gpu/gpu.sh exec OUT BINARY ARGS...
#                                        binaries: a packed binary (a benchmark) with the same environment; WRAP
#                                        prefixes it as for python (e.g. a per-kernel time of a few decode steps:
#                                        WRAP="ncu --clock-control none --cache-control none
#                                        --metrics gpu__time_duration.sum --launch-skip 3000
#                                        --launch-count 1000 --csv" ... rollout_benchmark --cuda-graphs false)
#   bench/gpu/gpu.sh disk OUT DIR        the fsynced write and the cold read bandwidth of DIR's disk (dd, 4 GiB),
#                                        what checkpoint saves and loads are measured against
set -uo pipefail
cd "$(dirname "$0")/../.."
# BUNDLE=DIR packs into or runs from another folder, so that one call can carry and test several builds
# (e.g. the commits of a branch to bisect: binaries.tar.xz alone is ~18 MB, three fit a transfer).
BUNDLE=${BUNDLE:-.device-build/gpu}
GPU_BINARIES=${GPU_BINARIES:-test_core test_train_mpi test_cuda_ops test_cuda_model test_gdn_cuda test_cuda_sampling test_memsaver \
  rollout_benchmark model_step_benchmark gemm_candidates attention_benchmark bench_gdn_cuda_host state_bandwidth}
ROOT=/tmp/deltatrain-gpu
ANCHORS=${ANCHORS:-.device-build/anchors.tar.xz}

# A Python of the GPU machine's version with the module's build requirements (pyproject.toml: nanobind, and
# apache-tvm-ffi for its DLPack header), for building the module: GPU_PYTHON itself, or a venv of it.
module_python() {
  local python=${GPU_PYTHON:-python3.12} venv=.device-build/py-module
  local ready='import importlib.util as u; exit(not (u.find_spec("nanobind") and u.find_spec("tvm_ffi")))'
  command -v "$python" >/dev/null || { echo "gpu.sh: $python not found (set GPU_PYTHON to the GPU machine's Python version)" >&2; return 1; }
  if "$python" -c "$ready" 2>/dev/null; then command -v "$python"; return; fi
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2 || return 1
  "$venv/bin/python" -c "$ready" 2>/dev/null ||
    "$venv/bin/python" -m pip install -q "nanobind>=2.0" "apache-tvm-ffi>=0.1.15" >&2 || return 1
  echo "$PWD/$venv/bin/python"
}

pack() {
  local build=${1:-build-gpu-bundle} python stage
  # The baseline module is taken before anything is rebuilt, so that it may be this bundle's own module.tar.xz
  # from before the change.
  mkdir -p "$BUNDLE"
  if [ -n "${GPU_BASELINE_MODULE:-}" ]; then
    cp "$GPU_BASELINE_MODULE" "$BUNDLE/module_base.tar.xz" || return 1
  else
    rm -f "$BUNDLE/module_base.tar.xz"
  fi
  python=$(module_python) || return 1
  cmake -S . -B "$build" -G Ninja -DDELTATRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DDELTATRAIN_CPU_ARCH="${CPU_ARCH:-x86-64-v3}" -DCMAKE_BUILD_TYPE=Release -DDELTATRAIN_TESTS=ON \
    -DDELTATRAIN_PYTHON=ON -DPython_EXECUTABLE="$python" >/dev/null || return 1
  # shellcheck disable=SC2086
  cmake --build "$build" --target deltatrain _deltatrain $GPU_BINARIES -j "$(nproc)" || return 1
  stage=$(mktemp -d)
  mkdir -p "$stage/binaries/bin" "$stage/binaries/lib" "$stage/module/lib" "$BUNDLE"
  # What each archive was built from, which the verbs there print: an A/B whose baseline came from another revision
  # than the one meant is then visible in its log (a baseline's archive says its own, if packed since).
  # Changes to results build nothing, so they neither count nor enter the hash.
  local source built=(-- . ':!bench/results')
  source="$(git rev-parse --short HEAD)$(git diff --quiet HEAD "${built[@]}" ||
    echo "+changes $(git diff HEAD "${built[@]}" | sha1sum | cut -c1-8)") packed $(date -u +%FT%TZ)"
  echo "$source" >"$stage/binaries/BUILT_FROM"
  echo "$source" >"$stage/module/BUILT_FROM"
  for binary in deltatrain $GPU_BINARIES; do cp "$build/bin/$binary" "$stage/binaries/bin/"; done
  if [ -n "${GPU_BASELINE:-}" ]; then
    cat "$GPU_BASELINE/BUILT_FROM" 2>/dev/null >"$stage/binaries/BUILT_FROM_base" || echo "unknown" >"$stage/binaries/BUILT_FROM_base"
    for binary in "$GPU_BASELINE"/*; do
      if [ -f "$binary" ] && [ -x "$binary" ]; then cp "$binary" "$stage/binaries/bin/$(basename "$binary")_base"; fi
    done
  fi
  ldd "$build/bin/deltatrain" | awk '/openblas|gfortran|quadmath|gomp|libcrypto/ {print $3}' |
    xargs -r cp -L -t "$stage/binaries/lib"
  bench/gpu/make_ompi_bundle.sh "$stage/binaries/ompi" >/dev/null || return 1
  # The package's Python layer with its extension, so that a baseline module brings the Python it was built with.
  cp "$build"/lib/_deltatrain*.so python/deltatrain/*.py "$stage/module/"
  # The GPU machine's image has no libgomp of its own (torch's is renamed).
  ldd "$build"/lib/_deltatrain*.so | awk '/gomp/ {print $3}' | xargs -r cp -L -t "$stage/module/lib"
  tar -cJf "$BUNDLE/binaries.tar.xz" -C "$stage/binaries" .
  tar -cJf "$BUNDLE/module.tar.xz" -C "$stage/module" .
  rm -rf "$stage"
  du -h "$BUNDLE"/*.tar.xz
}

# The directory of the image's CUDA wheel library whose file name matches $1 (the CUDA runtime, cuBLASLt, NCCL,
# cuDNN, NVRTC).
wheel_lib() {
  dirname "$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia" -name "$1" | head -1)"
}

# Unpacks the binaries and points the loader at them, Open MPI's runtime and the image's CUDA wheels.
setup() {
  local out=$1
  mkdir -p "$ROOT" "$out"
  [ -f "$BUNDLE/binaries.tar.xz" ] || { echo "gpu.sh: carry $BUNDLE/binaries.tar.xz (make gpu-bundle)" >&2; return 1; }
  # Unpacked once an archive: every run of an A/B passes here, and xz over the binaries takes seconds a run.
  local stamp
  stamp="$(realpath "$BUNDLE/binaries.tar.xz") $(stat -c '%s %Y' "$BUNDLE/binaries.tar.xz")"
  if [ "$(cat "$ROOT/.unpacked-from" 2>/dev/null)" != "$stamp" ]; then
    tar -xJf "$BUNDLE/binaries.tar.xz" -C "$ROOT" || return 1
    echo "$stamp" >"$ROOT/.unpacked-from"
  fi
  local ompi=$ROOT/ompi
  export OPAL_PREFIX=$ompi PATH=$ompi/bin:$PATH PMIX_MCA_mca_base_component_path=$ompi/pmix2/lib/pmix
  [ -e /usr/lib/x86_64-linux-gnu/pmix2 ] || ln -s "$ompi/pmix2" /usr/lib/x86_64-linux-gnu/pmix2
  export LD_LIBRARY_PATH=$ompi/lib:$ROOT/lib:$(wheel_lib 'libcublasLt.so.*'):$(wheel_lib 'libcudart.so.*'):$(wheel_lib 'libnccl.so.*'):$(wheel_lib 'libcudnn.so.*'):$(wheel_lib 'libnvrtc.so.*'):${LD_LIBRARY_PATH:-}
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export HWLOC_COMPONENTS=-gl,-opencl NCCL_NVLS_ENABLE=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  echo "binaries: $(cat "$ROOT/BUILT_FROM" 2>/dev/null || echo unknown); the *_base ones: $(cat "$ROOT/BUILT_FROM_base" 2>/dev/null || echo none)" |
    tee -a "$out/gpu.txt"
  if ldd "$ROOT/bin/deltatrain" | grep -E "not found"; then return 1; fi
}

# WRAP's profiler must leave the lent GPU's clocks alone: ncu locks them to base (and flushes the caches before
# each kernel) unless told --clock-control none, which also keeps its times comparable with the running step's.
check_wrap() {
  if [[ "${WRAP:-}" == *ncu* && "${WRAP}" != *"--clock-control none"* ]]; then
    echo "gpu.sh: WRAP runs ncu without --clock-control none, which would lock the GPU's clocks; add" \
         "--clock-control none --cache-control none" >&2
    return 2
  fi
}

# run_test OUT LOG BINARY ARGS...: one test executable with its log in OUT/LOG.log and a one-line verdict; its
# exit status, which tests() returns if any is not 0.
run_test() {
  local out=$1 log=$2 status
  shift 2
  # A bundle packed with a few GPU_BINARIES lacks the others: say so rather than fail on a missing file.
  if [ ! -x "$1" ]; then echo "$log skipped: $(basename "$1") is not in this bundle"; return 0; fi
  timeout 300 "$@" >"$out/$log.log" 2>&1
  status=$?
  echo "$log exit $status: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$log.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$log.log" | head -10
  return "$status"
}

tests() {
  local out=$1 binary name filter failed=0 backward='Grid/CudaVsReference.Backward*/*:CudaBackend.*'
  setup "$out" || return 1
  for binary in "$ROOT"/bin/test_*; do
    name=$(basename "$binary")
    # The trainer's executable holds the 4-rank CPU tests too; here only its GPU ones, on one rank.
    filter=*
    [ "$name" = test_train_mpi ] && filter='TrainerCuda.*'
    run_test "$out" "$name" "$binary" --gtest_filter="$filter" || failed=1
  done
  # The mma.sync passes that GPUs other than sm_90 take, on this one (as tests/gdn_cuda/CMakeLists.txt registers them).
  DELTATRAIN_CUDA_WGMMA=0 run_test "$out" test_gdn_cuda-mma-sync "$ROOT/bin/test_gdn_cuda" \
    --gtest_filter='Grid/CudaVsReference.*:CudaBackend.*-*K256*:*float32*:*f32_*' || failed=1
  # The fused backward wherever it applies, not only where the plan takes it (as tests/gdn_cuda/CMakeLists.txt).
  DELTATRAIN_CUDA_FUSED_BACKWARD=1 run_test "$out" test_gdn_cuda-fused-backward "$ROOT/bin/test_gdn_cuda" \
    --gtest_filter="$backward" || failed=1
  # And nowhere: the unfused wgmma backward of the calls the plan fuses (as tests/gdn_cuda/CMakeLists.txt).
  DELTATRAIN_CUDA_FUSED_BACKWARD=0 run_test "$out" test_gdn_cuda-unfused-backward "$ROOT/bin/test_gdn_cuda" \
    --gtest_filter="$backward" || failed=1
  # The fused backward split by role, wherever the fused one applies (as tests/gdn_cuda/CMakeLists.txt).
  DELTATRAIN_CUDA_FUSED_BACKWARD=1 DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1 run_test "$out" \
    test_gdn_cuda-role-split-backward "$ROOT/bin/test_gdn_cuda" --gtest_filter="$backward" || failed=1
  # The unfused attention that builds without cuDNN run (as the portable wheel does), on this GPU too.
  DELTATRAIN_CUDNN_ATTENTION=0 run_test "$out" test_cuda_ops-unfused-attention "$ROOT/bin/test_cuda_ops" \
    --gtest_filter='*Attention*' || failed=1
  return "$failed"
}

sanitize() {
  local out=$1 tool status
  setup "$out" >/dev/null || return 1
  # The small cases, and one long enough for fifteen segments (segment_starts_kernel's copies and barriers);
  # then the backward of five through the fused backward (a partial chunk, many CTAs, 32 segments of its own; dq
  # and dk finished per value head, in one CTA with and without the L2 norm, and in cluster pairs with and without
  # segments).
  local small='Grid/CudaVsReference.*/bfloat16_K64_unaligned:Grid/CudaVsReference.*/bfloat16_K128_unaligned:Grid/CudaVsReference.*/f16_single_token:Grid/CudaVsReference.*/bf16_many_heads:Grid/CudaVsReference.*/bf16_long_few_heads'
  local fused='Grid/CudaVsReference.Backward/bfloat16_K128_unaligned:Grid/CudaVsReference.Backward/bf16_many_heads:Grid/CudaVsReference.Backward/bf16_fused_segments:Grid/CudaVsReference.Backward/bf16_l2norm_no_gva:Grid/CudaVsReference.Backward/bfloat16_huge_or_weak'
  # One tool over one filter (the environment the caller sets applies): its log, and a line with its verdict.
  run_sanitizer() {  # TOOL NAME LABEL FILTER
    compute-sanitizer --tool "$1" --error-exitcode 9 "$ROOT/bin/test_gdn_cuda" --gtest_filter="$4" \
      >"$out/sanitize-$2.log" 2>&1
    status=$?
    echo "compute-sanitizer $3 exit $status: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$2.log" | tail -1)"
  }
  for tool in memcheck racecheck; do
    run_sanitizer "$tool" "$tool" "$tool" "$small"
    DELTATRAIN_CUDA_FUSED_BACKWARD=1 run_sanitizer "$tool" "$tool-fused" "$tool (fused backward)" "$fused"
    DELTATRAIN_CUDA_FUSED_BACKWARD=1 DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1 \
      run_sanitizer "$tool" "$tool-role-split" "$tool (role split backward)" "$fused"
  done
  # Barriers every thread meets, the named ones of the mma.sync passes' warp pairs too.
  run_sanitizer synccheck synccheck synccheck "$small"
  DELTATRAIN_CUDA_WGMMA=0 run_sanitizer synccheck synccheck-mma-sync "synccheck (mma.sync passes)" "$small"
  DELTATRAIN_CUDA_FUSED_BACKWARD=1 DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD=1 \
    run_sanitizer synccheck synccheck-role-split "synccheck (role split backward)" "$fused"
}

# MODULE (default the bundle's module.tar.xz) is the Python module archive the script imports.
python_script() {
  local out=$1 site=/tmp/deltatrain-site module=${MODULE:-$BUNDLE/module.tar.xz} status
  shift
  rm -rf "$site/deltatrain"
  mkdir -p "$out" "$site/deltatrain"
  [ -f "$module" ] || [ -f "$BUNDLE/binaries.tar.xz" ] ||
    { echo "gpu.sh: carry $module and/or $BUNDLE/binaries.tar.xz (make gpu-bundle)" >&2; return 1; }
  # With the binaries carried, a script can run them (bench/model_h200.py --ours $ROOT/bin/model_step_benchmark);
  # the module only for scripts that import deltatrain (leaving it out makes room for the anchors).
  if [ -f "$BUNDLE/binaries.tar.xz" ]; then setup "$out" >/dev/null || return 1; fi
  if [ -f "$module" ]; then
    tar -xJf "$module" -C "$site/deltatrain" || return 1
    # Archives packed before they carried the Python layer take the working tree's.
    [ -f "$site/deltatrain/__init__.py" ] || cp python/deltatrain/*.py "$site/deltatrain/"
  fi
  if [ -f "$ANCHORS" ]; then tar -xJf "$ANCHORS" -C "$site" || return 1; fi
  export TILELANG_CACHE_DIR=/tmp/tilelang-cache TRITON_CACHE_DIR=/tmp/triton-cache
  for cache in tilelang-cache triton-cache; do
    mkdir -p "/tmp/$cache"
    if [ -f ".device-build/$cache.tar.xz" ]; then tar -xJf ".device-build/$cache.tar.xz" -C "/tmp/$cache"; fi
  done
  export PYTHONPATH=$site:${PYTHONPATH:-} LD_LIBRARY_PATH=$site/deltatrain/lib:$(wheel_lib 'libcudart.so.*'):${LD_LIBRARY_PATH:-}
  # fla's own dispatch to FlashQLA off unless the caller sets it (FlashQLA is then measured as itself).
  export FLA_DISABLE_BACKEND_DISPATCH=${FLA_DISABLE_BACKEND_DISPATCH-1} PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  if [ -f "$module" ]; then
    echo "module $module: $(cat "$site/deltatrain/BUILT_FROM" 2>/dev/null || echo unknown)" | tee -a "$out/gpu.txt"
  fi
  check_wrap || return 2
  touch /tmp/deltatrain-caches-restored
  # shellcheck disable=SC2086
  # PYTHON_TIMEOUT_S ends the script (SIGINT) before the device tool's own limit would kill this shell, so that
  # the caches below are still saved (a script that writes its results as it goes keeps them too); 0: none.
  ${WRAP:-} timeout --signal=INT "${PYTHON_TIMEOUT_S:-0}" python3 "$@"
  status=$?
  # Only a cache the script added to: xz over a warm cache (10 MB packed after a grid) takes about a minute, which
  # every run of an A/B or same-bits on that machine paid for nothing (session 47: both timed out so).
  for cache in tilelang-cache triton-cache; do
    if [ -n "$(find "/tmp/$cache" -newer /tmp/deltatrain-caches-restored -type f -print -quit)" ]; then
      tar -cJf "$out/$cache.tar.xz" -C "/tmp/$cache" .
    fi
  done
  return $status
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
  check_wrap || return 2
  setup "$out" >/dev/null || return 1
  # shellcheck disable=SC2086
  ${WRAP:-} "$ROOT/bin/$binary" "$@"
}

disk() {
  local out=$1 dir=$2
  mkdir -p "$out" "$dir"
  { dd if=/dev/zero of="$dir/disk-probe" bs=16M count=256 conv=fsync 2>&1 | tail -1
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped: the read may be cached)"
    dd if="$dir/disk-probe" of=/dev/null bs=16M 2>&1 | tail -1; } | tee "$out/disk.txt"
  rm -f "$dir/disk-probe"
}

# The baseline and the change in turn (base first), each run in a scratch folder of its own; only the
# comparison, which holds every run's rows, and the runs' log come back in OUT (a device call returns 8 files).
# The baseline is module_base.tar.xz where packed, else the same module with AB_BASE_ENV (NAME=VALUE ...) set,
# for a change that a switch turns off (e.g. AB_BASE_ENV=DELTATRAIN_CUDA_OUTPUT_WARPGROUP=0).
# check_rounds VERB ROUNDS: ROUNDS is a positive integer, or a message naming the verb and status 2.
check_rounds() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "gpu.sh: $1 ROUNDS must be a positive integer, got '$2'" >&2; return 2; }
}

# alternate OUT ROUNDS RUN: `RUN SIDE ROUND` for the baseline (SIDE base, with AB_BASE_ENV's NAME=VALUE settings
# exported) and the change (new) in turn, ROUNDS times each, every run's output in OUT/runs.log; stops at a failed run.
alternate() {
  local out=$1 rounds=$2 run=$3 round side settings
  for ((round = 1; round <= rounds; ++round)); do
    for side in base new; do
      settings=()
      [ "$side" = base ] && read -r -a settings <<<"${AB_BASE_ENV:-}"
      echo "== $side, round $round ${settings[*]}" >>"$out/runs.log"
      ( [ ${#settings[@]} -eq 0 ] || export "${settings[@]}"
        "$run" "$side" "$round" ) >>"$out/runs.log" 2>&1 ||
        { echo "gpu.sh: the $side run of round $round failed (OUT/runs.log)" >&2; return 1; }
    done
  done
}

# require_baseline VERB: the bundle holds the change's module and a baseline for it (module_base.tar.xz, or the same
# module with AB_BASE_ENV set), or a message naming the verb and status 1.
require_baseline() {
  [ -f "$BUNDLE/module.tar.xz" ] && { [ -f "$BUNDLE/module_base.tar.xz" ] || [ -n "${AB_BASE_ENV:-}" ]; } ||
    { echo "gpu.sh: $1 needs $BUNDLE/module.tar.xz and a baseline: module_base.tar.xz (GPU_BASELINE_MODULE=FILE" \
           "make gpu-bundle) or AB_BASE_ENV=NAME=VALUE" >&2
      return 1; }
}

# side_module SIDE: the module archive a side of a comparison runs, the baseline's (base) where there is one.
side_module() {
  if [ "$1" = base ] && [ -f "$BUNDLE/module_base.tar.xz" ]; then
    echo "$BUNDLE/module_base.tar.xz"
  else
    echo "$BUNDLE/module.tar.xz"
  fi
}

ab() {
  local out=$1 rounds=$2 scratch=/tmp/deltatrain-ab
  shift 2
  local args=("$@")
  check_rounds ab "$rounds" || return
  require_baseline ab || return
  ab_run() {
    MODULE=$(side_module "$1") python_script "$scratch/$1-$2" bench/gdn_h200.py --out "$scratch/$1-$2" --commit "$1" \
      --ours-only "${args[@]}"
  }
  mkdir -p "$out"
  rm -rf "$scratch"
  alternate "$out" "$rounds" ab_run || return
  python3 bench/gdn_ab.py --base "$scratch"/base-*/gdn-h200-ours.json --new "$scratch"/new-*/gdn-h200-ours.json \
    --out "$out"
}

# Whether the change gives the baseline's bits on the anchor grid (bench/gpu/same_bits.py: every forward and backward
# output hashed, with and without the L2 norm), for a change that claims to: the baseline (as for ab), then the change,
# then the comparison, in OUT/same-bits.txt with both runs' hashes; status 1 where a tensor differs. ARGS go to
# same_bits.py run (e.g. --only 12 13 14).
same_bits() {
  local out=$1 scratch=/tmp/deltatrain-same-bits
  shift
  local args=("$@")
  require_baseline same-bits || return
  bits_run() {
    MODULE=$(side_module "$1") python_script "$scratch/$1" bench/gpu/same_bits.py run "$out/$1-bits.json" "${args[@]}"
  }
  mkdir -p "$out"
  rm -rf "$scratch"
  alternate "$out" 1 bits_run || return
  python3 bench/gpu/same_bits.py compare "$out/base-bits.json" "$out/new-bits.json" >"$out/same-bits.txt"
  local status=$?
  cat "$out/same-bits.txt"
  return $status
}

pack_base() {
  local rev=${1:-} root=$PWD src=.device-build/base-src out=.device-build/base binary
  [ -n "$rev" ] || { echo "gpu.sh: pack-base needs a git revision (e.g. main)" >&2; return 2; }
  git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "gpu.sh: pack-base: no commit '$rev'" >&2; return 2; }
  git worktree remove --force "$src" 2>/dev/null
  git worktree add --detach --quiet "$src" "$rev" || return 1
  rm -rf "$out"
  # The module's build Python (module_python's venv), shared rather than made again in the worktree.
  if [ -d .device-build/py-module ]; then mkdir -p "$src/.device-build" && ln -s "$root/.device-build/py-module" "$src/.device-build/"; fi
  # The revision's own packer, so that the baseline is built as that revision builds itself.
  ( cd "$src" && BUNDLE="$root/$out" bench/gpu/gpu.sh pack "$root/.device-build/base-build" ) || return 1
  mkdir -p "$out/bin"
  for binary in ${BASE_BINARIES:-model_step_benchmark}; do
    cp "$root/.device-build/base-build/bin/$binary" "$out/bin/" || return 1
  done
  echo "$(git rev-parse --short "$rev") (pack-base $rev)" >"$out/bin/BUILT_FROM"
  # A revision packed before archives carried BUILT_FROM: its module says it too, for ab's log.
  if ! tar -tJf "$out/module.tar.xz" ./BUILT_FROM >/dev/null 2>&1; then
    local stage
    stage=$(mktemp -d)
    tar -xJf "$out/module.tar.xz" -C "$stage" && cp "$out/bin/BUILT_FROM" "$stage/" &&
      tar -cJf "$out/module.tar.xz" -C "$stage" . || return 1
    rm -rf "$stage"
  fi
  git worktree remove --force "$src"
}

# The model's training step with the baseline binary and the change's in turn (base first); each run's JSON in a
# scratch folder, the comparison (which holds them all) and the runs' log in OUT.
step_ab() {
  local out=$1 rounds=$2 scratch=/tmp/deltatrain-step-ab
  shift 2
  local args=("$@")
  check_rounds step-ab "$rounds" || return
  mkdir -p "$out"
  setup "$out" >>"$out/runs.log" 2>&1 || { echo "gpu.sh: step-ab's setup failed (OUT/runs.log)" >&2; return 1; }
  [ -x "$ROOT/bin/model_step_benchmark" ] && { [ -x "$ROOT/bin/model_step_benchmark_base" ] || [ -n "${AB_BASE_ENV:-}" ]; } ||
    { echo "gpu.sh: step-ab needs model_step_benchmark in GPU_BINARIES and a baseline: in GPU_BASELINE" \
           "(make gpu-bundle) or AB_BASE_ENV=NAME=VALUE" >&2
      return 1; }
  # One training-step run: the baseline's binary where there is one.
  step_run() {
    local binary=model_step_benchmark
    [ "$1" = base ] && [ -x "$ROOT/bin/model_step_benchmark_base" ] && binary=model_step_benchmark_base
    "$ROOT/bin/$binary" "${args[@]}" --json "$scratch/$1-$2.json"
  }
  rm -rf "$scratch"
  mkdir -p "$scratch"
  alternate "$out" "$rounds" step_run || return
  python3 bench/model_step_ab.py --base "$scratch"/base-*.json --new "$scratch"/new-*.json --out "$out"
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  pack-base) shift; pack_base "$@" ;;
  tests) shift; tests "$@" ;;
  sanitize) shift; sanitize "$@" ;;
  python) shift; python_script "$@" ;;
  ab) shift; ab "$@" ;;
  same-bits) shift; same_bits "$@" ;;
  step-ab) shift; step_ab "$@" ;;
  rl | train) cli "$@" ;;
  exec) shift; run_binary "$@" ;;
  disk) shift; disk "$@" ;;
  *) echo "usage: $0 pack [BUILD] | pack-base REV | tests OUT | sanitize OUT | python OUT SCRIPT ARGS... | ab OUT ROUNDS ARGS... |" \
          "same-bits OUT ARGS... |" \
          "step-ab OUT ROUNDS ARGS... | train OUT ARGS... |" \
          "rl OUT ARGS... | exec OUT BINARY ARGS... | disk OUT DIR" >&2
     exit 2 ;;
esac
