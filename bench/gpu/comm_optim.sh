#!/usr/bin/env bash
# On the 2-GPU machine (device kind nvidia-h200-x2), from the repository root: the comm and optim test
# suites on the NCCL engine (and MPI), the memory check's per-call cost, the communicator's memory and
# rebuild time, checkpoint save/load GB/s beside the disk's own dd write/read rates, and Python's
# safetensors reading one of our shards. Everything it needs is carried in build-optim-gpu/carry
# (binaries built on the development machine, Open MPI from bench/gpu/make_ompi_bundle.sh, libraries).
# usage: bench/gpu/comm_optim.sh STATE_GIB
set -uo pipefail
state_gib=${1:-6}
out=${OUT:-/tmp/out}
mkdir -p "$out"
carry=$PWD/build-optim-gpu/carry
ompi=$carry/ompi

# Open MPI from the bundle, relocated; PMIx looks for its plugins at its build path, so point that there.
export OPAL_PREFIX=$ompi PATH=$ompi/bin:$PATH PMIX_MCA_mca_base_component_path=$ompi/pmix2/lib/pmix
[ -e /usr/lib/x86_64-linux-gnu/pmix2 ] || ln -s "$ompi/pmix2" /usr/lib/x86_64-linux-gnu/pmix2
nccl_dir=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$ompi/lib:$carry/lib:${nccl_dir}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HWLOC_COMPONENTS=-gl,-opencl
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
run="mpirun -np 2 --allow-run-as-root --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x PMIX_MCA_mca_base_component_path"

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  head -2 /etc/os-release; ldd --version | head -1; nproc; free -g | head -2
  echo "mpirun on the PATH: $(type -a mpirun | tr '\n' ' ')"
  echo "nccl from: $nccl_dir"; df -h /tmp "$PWD"
  ldd "$carry"/bin/* | grep -E "not found|nccl|cudart|libmpi|crypto"
} > "$out/env.txt" 2>&1
head -4 "$out/env.txt"

for suite in test_comm_group test_optim_distributed; do
  timeout 100 $run "$carry/bin/$suite" --gtest_color=no > "$out/$suite.log" 2>&1
  echo "$suite on 2 ranks: exit $? | $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$out/$suite.log" | tr '\n' ' ')"
  grep -E "Failure|^\[  FAILED|\[rank [0-9]\]" "$out/$suite.log" | head -10
done

"$carry/bin/bench_comm_memory_check" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_out="$out/comm-memory-check.json" --benchmark_out_format=json > "$out/comm-memory-check.txt" 2>&1
grep -E "median" "$out/comm-memory-check.txt"

# The disk's own rates at the size of one shard, two writers at once as in a 2-rank save.
work=/tmp/deltatrain-bench
[ "$(df --output=fstype /tmp | tail -1)" = tmpfs ] && work=$PWD/build-optim-gpu/bench-tmp  # a disk, not memory
echo "benchmark directory: $work ($(df --output=fstype,source "${work%/*}" | tail -1))" | tee -a "$out/env.txt"
rm -rf "$work"; mkdir -p "$work"
shard_mib=$(python3 -c "print(int($state_gib * 1024 / 2))")
for r in 0 1; do head -c $((64 << 20)) /dev/urandom > "$work/block$r"; done
start=$(date +%s.%N)
for r in 0 1; do
  (for i in $(seq 1 $((shard_mib / 64))); do cat "$work/block$r"; done | dd of="$work/dd$r" bs=64M iflag=fullblock conv=fsync 2>/dev/null) &
done
wait
write_s=$(python3 -c "import time; print(time.time() - $start)")
for r in 0 1; do dd if="$work/dd$r" iflag=nocache count=0 2>/dev/null; done
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
start=$(date +%s.%N)
for r in 0 1; do dd if="$work/dd$r" of=/dev/null bs=64M 2>/dev/null & done
wait
read_s=$(python3 -c "import time; print(time.time() - $start)")
python3 - "$shard_mib" "$write_s" "$read_s" > "$out/disk-dd.json" <<'EOF'
import json, sys
mib, write_s, read_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
size = 2 * (mib // 64) * 64 * 2**20
print(json.dumps({"bytes": size, "writers": 2, "write_s": write_s, "write_gb_per_s": size / write_s / 1e9,
                  "read_s": read_s, "read_gb_per_s": size / read_s / 1e9,
                  "how": "2 parallel dd conv=fsync of random data; page cache dropped; 2 parallel dd reads"}))
EOF
cat "$out/disk-dd.json"
rm -f "$work"/dd* "$work"/block*

timeout 150 $run "$carry/bin/bench_comm_optim_gpu" --dir "$work/ckpt" --state-gib "$state_gib" --repeats 3 \
  > "$out/comm-optim-gpu.json" 2> "$out/comm-optim-gpu.err"
echo "bench_comm_optim_gpu exit $?"; cat "$out/comm-optim-gpu.json"; tail -5 "$out/comm-optim-gpu.err"

# Python's safetensors reads our shard: names, dtypes, shapes, and the first values against raw bytes.
python3 - "$work/ckpt" > "$out/safetensors-python.txt" 2>&1 <<'EOF'
import json, os, struct, sys
import numpy as np
from safetensors import safe_open
root = sys.argv[1]
step_dir = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
meta = json.load(open(os.path.join(step_dir, "metadata.json")))
path = os.path.join(step_dir, meta["files"][1]["name"])
with safe_open(path, framework="numpy") as f:
    keys = list(f.keys())
    print("metadata", f.metadata())
    name = keys[0]
    tensor = f.get_tensor(name)
raw = open(path, "rb").read(16 << 20)
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
start = 8 + n + header[name]["data_offsets"][0]
by_hand = np.frombuffer(raw[start:start + 64], dtype="<f4")
print("tensors", len(keys), "first", name, tensor.dtype, tensor.shape, "step in metadata.json", meta["step"])
print("first values equal to the raw little-endian bytes:", bool(np.array_equal(tensor[:16], by_hand)))
EOF
cat "$out/safetensors-python.txt"
rm -rf "$work"
