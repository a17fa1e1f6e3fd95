#!/usr/bin/env bash
# On the GPU machine (through the device tool), from the repository root: the cuda backend's GPU tests,
# compute-sanitizer on small cases, and the benchmark beside fla. Carried along: build-cuda/carry (the
# test binary, the Python module, libgomp and libcudart built on the development machine) and .whl (fla).
# usage: bench/gpu/run.sh STEPS COMMIT [BENCH ARGS...]    STEPS: comma list of info,tests,sanitize,host,overhead,bench,profile,source
# CARRY=dir runs the binaries of another build (a branch being compared) carried in that folder.
set -uo pipefail
steps=",$1,"
commit=$2
shift 2
out=${OUT:-/tmp/out}
mkdir -p "$out"
carry=$(realpath "${CARRY:-build-cuda/carry}")
export LD_LIBRARY_PATH=$carry/lib:$PWD/build-cuda/carry/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1

if [[ $steps == *,info,* ]]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
  ldd "$carry/test_gdn_cuda" | grep -E "not found|cudart|gomp"
fi

if [[ $steps == *,tests,* ]]; then
  "$carry/test_gdn_cuda" > "$out/tests.log" 2>&1
  echo "tests exit $?"
  grep -E "^\[  FAILED|exception|PASSED|SKIPPED \]" "$out/tests.log" | head -40
  # The same checks on the mma.sync passes (as tests/gdn_cuda/CMakeLists.txt registers them).
  DELTATRAIN_CUDA_WGMMA=0 "$carry/test_gdn_cuda" --gtest_filter='Grid/CudaVsReference.*:CudaBackend.*-*K256*:*float32*:*f32_*' \
    > "$out/tests-mma-sync.log" 2>&1
  echo "tests with DELTATRAIN_CUDA_WGMMA=0 exit $?"
  grep -E "^\[  FAILED|exception|PASSED|SKIPPED \]" "$out/tests-mma-sync.log" | head -20
fi

if [[ $steps == *,sanitize,* ]]; then
  small='Grid/CudaVsReference.*/bfloat16_K64_unaligned:Grid/CudaVsReference.*/bfloat16_K128_unaligned:Grid/CudaVsReference.*/f16_single_token:Grid/CudaVsReference.*/bf16_many_heads'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 "$carry/test_gdn_cuda" --gtest_filter="$small" \
      > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$tool.log" | tail -1)"
  done
fi

if [[ $steps == *,host,* ]]; then
  "$carry/bench_gdn_cuda_host" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/host.json" --benchmark_out_format=json 2>&1 | tee "$out/host.txt" | grep -E "median|ERROR"
fi

python_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl || exit 1
  mkdir -p /tmp/pkg/deltatrain
  cp python/deltatrain/*.py "$carry"/_deltatrain*.so /tmp/pkg/deltatrain/
  export PYTHONPATH=/tmp/pkg:/tmp/site
}

if [[ $steps == *,bench,* ]]; then
  python_env
  python3 bench/gdn_h200.py --out "$out" --commit "$commit" "$@" 2>&1 | tee "$out/bench.log" | grep -v Warning
fi

if [[ $steps == *,overhead,* ]]; then
  python_env
  python3 bench/gpu/host_breakdown.py --json "$out/host-breakdown.json" --profile "$out/host-profile.txt" 2>&1 | grep -v Warning
fi

if [[ $steps == *,profile,* ]]; then
  # ncu on the kernels named by PROFILE_KERNELS (regex, default the forward state pass) on PROFILE_SHAPE
  # ("h_qk h_v tokens pass", default 2 8 8192 fwd), PROFILE_COUNT launches of them after skipping two.
  python_env
  ncu --clock-control none --kernel-name "regex:${PROFILE_KERNELS:-state_forward}" --launch-skip 2 --launch-count ${PROFILE_COUNT:-1} \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 bench/gpu/profile_state.py ${PROFILE_SHAPE:-2 8 8192 fwd} > "$out/ncu.txt" 2>&1
  echo "ncu exit $?"
  grep -E "^  [a-z_]+.*kernel|issue_stalled|Duration|Throughput|Stall|Warp Cycles|Issued Ipc|Eligible|Active Warps|No Eligible|Registers|Shared Memory Configuration Size|Dynamic Shared" "$out/ncu.txt" | awk '$NF+0 > 0.05 || !/issue_stalled/' | head -70
fi

if [[ $steps == *,source,* ]]; then
  # Warp-state samples per SASS instruction and per source line of the kernel PROFILE_KERNELS names (the
  # carried module must be built with -lineinfo), for finding where a kernel's time goes.
  python_env
  ncu --clock-control none --kernel-name "regex:${PROFILE_KERNELS:-state_forward}" --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --import-source yes -f -o "$out/source" \
    python3 bench/gpu/profile_state.py ${PROFILE_SHAPE:-2 8 8192 fwd} > "$out/source.log" 2>&1
  echo "ncu exit $?"
  # Per SASS instruction; bench/gpu/stall_lines.py charges them to source lines (same build, -lineinfo).
  ncu --import "$out/source.ncu-rep" --page source --csv --print-source sass > "$out/source-sass.csv" 2>&1
  echo "source view: exit $?, $(wc -l < "$out/source-sass.csv") lines"
  gzip -f "$out/source-sass.csv"
  rm -f "$out/source.ncu-rep"
fi
