#!/usr/bin/env bash
# The memory saver on the GPU machine, in one call (run from the repository root, with .memsaver-gpu and
# .whl carried; see bench/NOTES.md "Memory saver"): GPU tests, the native cycle benchmark at 1, 8 and 32 GiB
# with and without a CPU copy, the torch-process check through the LD_PRELOAD shim, and torch_memory_saver's
# pause/resume in the same harness. Every step has its own time limit, so a slow one still leaves the rest.
set -u
CARRY=$PWD/.memsaver-gpu
export LD_LIBRARY_PATH=$CARRY:${LD_LIBRARY_PATH:-}
log=$OUT/memsaver-gpu-log.txt
step() { echo "== $(date +%T) $*" | tee -a "$log"; }

step environment
{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  uname -r; nproc; free -g | head -2
  for f in test_memsaver deltatrain_memsaver_bench libdeltatrain_memsaver_preload.so; do echo "ldd $f"; ldd "$CARRY/$f"; done
} >> "$log" 2>&1

step gpu tests
timeout 90 "$CARRY/test_memsaver" --gtest_filter='CudaVmm.*' > "$OUT/memsaver-gtest.txt" 2>&1; echo "rc $?" >> "$log"

step native cycle benchmark
for size in 1GiB 8GiB 32GiB; do
  for backup in cpu none; do
    timeout 90 "$CARRY/deltatrain_memsaver_bench" memsaver --backend cuda --bytes "$size" --backup "$backup" \
      --cycles 3 --json >> "$OUT/memsaver-native.json" 2>> "$log"
    echo "$size $backup rc $?" >> "$log"
  done
done

step torch check with the deltatrain shim
LD_PRELOAD=$CARRY/libdeltatrain_memsaver_preload.so timeout 90 python3 bench/gpu/memsaver_torch.py \
  --saver deltatrain --check --sizes-gib 1,8 --out "$OUT/memsaver-torch.jsonl" >> "$log" 2>&1; echo "rc $?" >> "$log"

step torch_memory_saver
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/torch_memory_saver-*.whl >> "$log" 2>&1
TMS=$(ls /tmp/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so)
PYTHONPATH=/tmp/site LD_PRELOAD=$TMS timeout 120 python3 bench/gpu/memsaver_torch.py \
  --saver tms --sizes-gib 1,8,32 --out "$OUT/memsaver-torch.jsonl" >> "$log" 2>&1; echo "rc $?" >> "$log"
step done
