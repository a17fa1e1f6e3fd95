#!/usr/bin/env bash
# Usage: bash bench/gpu/flashqla_sass.sh [flashqla_compile.py options, e.g. --h-qk 16 --h-v 32]
#
# FlashQLA 0.1.3's Hopper kernels (backward: fused_bwd, prepare_h; forward: kkt_solve, fused_fwd; --kernels picks),
# per warp role, from their SASS, on a machine without a GPU: unpacks the anchors' site-packages, makes a python 3.12
# venv with torch, compiles the kernels for sm_90a (flashqla_compile.py), disassembles the cubins and prints, for each
# kernel, its launch and ptxas report and sass_roles.py's table of each role's largest loop (markdown, for
# bench/NOTES.md).
# Everything it writes stays under $WORK (FlashQLA's generated code: measurement only, never the repository).
#
# Environment: WORK (default /tmp/flashqla-sass; outputs in $WORK/sass), ANCHORS (default .device-build/anchors.tar.xz,
# made by ../shared/tools/anchor_site.sh), PY (a python 3.12; default python3.12 on PATH), REUSE_VENV=1 keeps an
# existing $WORK/venv, NVCC / CCBIN (see flashqla_compile.py), CUOBJDUMP (see kernel_diff.py).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=${WORK:-/tmp/flashqla-sass}
ANCHORS=${ANCHORS:-$repo/.device-build/anchors.tar.xz}
out=$WORK/sass
mkdir -p "$WORK/site" "$out"

# 1. The anchors' site-packages (tilelang with its TVM, tvm_ffi, flash_qla), unpacked once.
if [ ! -d "$WORK/site/flash_qla" ]; then
  [ -f "$ANCHORS" ] || { echo "flashqla_sass: no anchors tarball $ANCHORS" \
    "(make it with ../shared/tools/anchor_site.sh, or set ANCHORS)" >&2; exit 1; }
  tar -xJf "$ANCHORS" -C "$WORK/site"
fi

# 2. A python 3.12 venv (the anchors' wheels are cp312) with torch; the CPU build is enough and smaller.
if [ "${REUSE_VENV:-0}" != 1 ] || [ ! -x "$WORK/venv/bin/python" ]; then
  PY=${PY:-$(command -v python3.12 || true)}
  if [ -z "$PY" ] || [ ! -x "$PY" ]; then echo "flashqla_sass: no python3.12 (set PY)" >&2; exit 1; fi
  "$PY" -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q --timeout 20 --retries 0 torch --index-url https://download.pytorch.org/whl/cpu \
    || "$WORK/venv/bin/pip" install -q torch
  "$WORK/venv/bin/pip" install -q numpy psutil cloudpickle ml-dtypes tqdm
fi
python=$WORK/venv/bin/python

# 3. TileLang's CUDA source and nvcc's cubin (its JIT cache kept in $WORK, not in ~/.tilelang).
PYTHONPATH=$WORK/site TILELANG_CACHE_DIR=$WORK/tlcache \
  "$python" "$repo/bench/gpu/flashqla_compile.py" --out "$out" "$@" | tee "$out/compiled.txt"
built=$(sed -n 's/^\([a-z_]*\): .*/\1/p' "$out/compiled.txt")  # this run's kernels, by flashqla_compile's name

# 4. The SASS, with line info; cuobjdump is found as kernel_diff.py finds it, and nvdisasm beside it or on PATH.
cuobjdump=$("$python" -c "import sys; sys.path.insert(0, sys.argv[1]); import kernel_diff
print(kernel_diff.find_cuobjdump())" "$repo/bench/gpu")
nvdisasm=$(dirname "$cuobjdump")/nvdisasm
[ -x "$nvdisasm" ] || nvdisasm=$(command -v nvdisasm || true)
[ -n "$nvdisasm" ] || { echo "flashqla_sass: no nvdisasm beside $cuobjdump or on PATH" \
  "(pip install nvidia-cuda-nvdisasm into .venv)" >&2; exit 1; }
for name in $built; do
  "$nvdisasm" -c -gi "$out/$name.cubin" > "$out/$name.sass"
done

# 5. Per kernel (each __global__ that TileLang generated) and role: all its loops (text), and each role's largest loop
# (markdown), after its ptxas report and launch.
for name in $built; do
  for kernel in $(grep -oE '__global__ void( __launch_bounds__\([^)]*\))? \w+' "$out/$name.cu" | awk '{print $NF}' \
                  | sort -u); do
    "$python" "$repo/bench/gpu/sass_roles.py" "$out/$name.sass" "$kernel" > "$out/$kernel.roles.txt"
    { printf '\n### %s (%s)\n\n' "$kernel" "$name"
      awk -v k="$kernel" '/properties for/ {on = index($0, k)} (on && /Used/) || index($0, "launch " k ":")' \
        "$out/$name.ptxas.txt" | sed 's/^/    /'; echo
      "$python" "$repo/bench/gpu/sass_roles.py" "$out/$name.sass" "$kernel" --markdown; } | tee "$out/$kernel.roles.md"
  done
done
echo "outputs in $out" >&2
