#!/usr/bin/env bash
# The python tool's sandbox (rlcore-sandbox, plugins/sandbox) needs bubblewrap (bwrap) and libseccomp: install them from Debian's
# packages where they are missing (root, or passwordless sudo). Idempotent: nothing to do once
# bwrap is on the machine. Elsewhere it says what to install and exits 1 (the sandbox tests fail
# rather than pass without the fence: plugins/sandbox/tests).
set -uo pipefail
if command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  exit 0
fi
as_root=()
[ "$(id -u)" -ne 0 ] && as_root=(sudo -n)
if command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing bubblewrap and libseccomp2 (the python tool's sandbox)" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1 \
    || { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 && "${as_root[@]}" apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1; }
fi
if ! command -v bwrap >/dev/null 2>&1; then
  echo "[setup] bubblewrap is missing: apt-get install bubblewrap (Debian/Ubuntu), dnf install bubblewrap (Fedora)" >&2
  exit 1
fi
