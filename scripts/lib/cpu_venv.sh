# Shared by every venv script (scripts/setup_venv.sh, scripts/megatron_suite.sh, scripts/suites/*):
# a venv on the CPU build of torch, stamped with a hash of its inputs so an unchanged venv is reused
# in well under a second. Source it, then:
#
#   hash="$(venv_inputs_hash file... [-- extra text...])"
#   if venv_is_current "$VENV" "$hash"; then ...reuse...; else
#     venv_create_cpu_torch "$VENV" [setuptools-spec] [extra packages installed with torch...]
#     "${PIP[@]}" ...                      # PIP: pip install with scripts/constraints.txt
#     venv_stamp "$VENV" "$hash"
#   fi
#
# Why torch first, with the constraints file on every later install: an unpinned torch (or one a
# dependency asks for) pulls several GB of CUDA packages; the machine's find-links carry the CPU
# build of torch==2.13.0, and the constraint keeps any later install from replacing it.

_RLCORE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# sha256 of the given files' contents, followed by any text after `--` (versions, package lists).
venv_inputs_hash() {
  local files=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do files+=("$1"); shift; done
  if [ $# -gt 0 ]; then shift; fi
  { cat "${files[@]}"; if [ $# -gt 0 ]; then printf '%s\n' "$@"; fi; } | sha256sum | cut -d' ' -f1
}

# True when VENV was completed by venv_stamp with the same hash and still has a python.
venv_is_current() {
  local venv="$1" hash="$2"
  [ -f "$venv/.rlcore-setup" ] && [ "$(cat "$venv/.rlcore-setup")" = "$hash" ] && [ -x "$venv/bin/python" ]
}

# Create (or repair) VENV with setuptools, wheel and the CPU torch==2.13.0 (plus any extra
# packages given, installed in the same pip call), and set PIP to this venv's constrained
# `pip install`. Exits with a message naming the problem when torch is not the CPU build.
venv_create_cpu_torch() {
  local venv="$1" setuptools_spec="${2:-setuptools>=68}"
  shift; if [ $# -gt 0 ]; then shift; fi
  rm -f "$venv/.rlcore-setup"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  PIP=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$_RLCORE_ROOT/scripts/constraints.txt")
  "${PIP[@]}" "$setuptools_spec" wheel
  "${PIP[@]}" torch==2.13.0 "$@"
  "$venv/bin/python" -W ignore - <<'PYEOF'
import sys, torch
if torch.version.cuda is not None or not torch.__version__.endswith("+cpu"):
    sys.exit(f"torch {torch.__version__} is not the CPU build this machine needs "
             "(torch==2.13.0+cpu from the local find-links; see scripts/constraints.txt)")
PYEOF
}

# Mark VENV complete for HASH (written last, so an interrupted setup is redone next time).
venv_stamp() {
  echo "$2" > "$1/.rlcore-setup"
}
