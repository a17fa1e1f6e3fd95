#!/usr/bin/env bash
# The wheel as a user on another machine gets it: installed with its dependencies into a fresh venv, then used
# from outside the source tree. Checks its manylinux tag, that the native code needs no library the wheel does
# not carry (the CUDA runtime included), CPU code for x86-64-v3 (AVX2, no AVX-512), the
# version, the `deltatrain` console script, and a GDN forward of the cpu backend against the fp64 reference.
# Usage: tests/packaging/test_wheel.sh WHEEL   (`make wheel-test` builds the wheel and runs this)
set -euo pipefail

wheel=${1:?"usage: $0 WHEEL (a manylinux deltatrain wheel; make wheel builds one into dist/)"}
[ -f "$wheel" ] || { echo "test_wheel: WHEEL '$wheel' is not a file" >&2; exit 2; }
case "$(basename "$wheel")" in
  *manylinux*) ;;
  *) echo "test_wheel: FAIL: '$wheel' has no manylinux tag" >&2; exit 1 ;;
esac
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
version=$(basename "$wheel" | cut -d- -f2)
source_root=$(cd "$(dirname "$0")/../.." && pwd)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
echo "test_wheel: installed $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) into a fresh venv"

failed=0
check() {  # check NAME COMMAND...: runs the command, reports it, remembers a failure
  local name=$1
  shift
  if "$@"; then echo "PASS $name"; else echo "FAIL $name"; failed=$((failed + 1)); fi
}

libraries_resolve() {
  local missing
  missing=$(find "$site/deltatrain" "$site"/deltatrain.libs -name '*.so*' -exec ldd {} + 2>/dev/null |
            grep -E 'not found|libcudart' || true)
  [ -z "$missing" ] || { echo "$missing"; return 1; }
}
x86_64_v3() {  # AVX2 (ymm registers, which baseline x86-64 code never uses) and no AVX-512 (zmm)
  local code
  code=$(objdump -d --no-show-raw-insn "$site"/deltatrain/_deltatrain*.so)
  grep -q '%ymm' <<<"$code" && ! grep -q '%zmm' <<<"$code"
}
version_matches() {
  [ "$(cd "$work" && "$work/venv/bin/deltatrain" --version)" = "deltatrain $version" ]
}
without_cli_says_how_to_get_it() {
  local message status=0
  message=$(cd "$work" && "$work/venv/bin/deltatrain" info 2>&1) || status=$?
  [ "$status" = 2 ] && grep -q "make build" <<<"$message"
}
python_call() {
  (cd "$work" && "$work/venv/bin/python" - "$version" "$source_root") <<'PY'
import sys
import numpy as np
import deltatrain as dt

version, source_root = sys.argv[1], sys.argv[2]
assert not dt.__file__.startswith(source_root), f"imported from the source tree: {dt.__file__}"
assert dt.__version__ == version, (dt.__version__, version)
names = {b["name"]: b for b in dt.backends()}
assert names["cpu"]["available"] and names["reference"]["available"], names
rng = np.random.default_rng(0)
B, T, H, HV, K, V = 1, 100, 2, 4, 64, 64
q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
v = rng.standard_normal((B, T, HV, V)).astype(np.float32)
g = -rng.uniform(0.01, 0.5, (B, T, HV)).astype(np.float32)
beta = rng.uniform(0.1, 0.9, (B, T, HV)).astype(np.float32)
o, state = dt.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     backend="cpu")
o_ref, state_ref = dt.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, backend="reference")
error = max(np.abs(o - o_ref).max() / np.abs(o_ref).max(), np.abs(state - state_ref).max() / np.abs(state_ref).max())
assert error < 1e-4, error
print(f"deltatrain {dt.__version__} from {dt.__file__}: cpu forward within {error:.1e} of the reference; "
      f"backends {sorted(names)}")
PY
}

check "libraries resolve, CUDA runtime static" libraries_resolve
check "CPU code for x86-64-v3: AVX2, no AVX-512" x86_64_v3
check "deltatrain --version prints $version" version_matches
check "deltatrain SUBCOMMAND without the CLI says how to get it" without_cli_says_how_to_get_it
check "import, version, GDN forward cpu vs reference" python_call
echo "test_wheel: $((5 - failed)) passed, $failed failed"
[ "$failed" = 0 ]
