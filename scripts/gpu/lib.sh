# Shell pieces the GPU-machine scripts share (source it: `source scripts/gpu/lib.sh`).
#
#   check_one_version DIR        fail when DIR holds two wheels of one distribution (pip --no-deps
#                                --target would install both)
#   split_carry OUT DIR SIZE     split DIR/*.whl into carry folders OUT/c01, c02, ... of at most SIZE
#                                (e.g. 55M) each, for machines reached through calls of at most 64 MiB
#                                (this workplace's device tool): first fit, largest part first, so as
#                                few folders (calls) as the bytes allow. Each folder holds a MANIFEST
#                                and a stash.sh (the scheme of ../shared/tools/carry-chunks): call k runs
#                                `bash OUT/cNN/stash.sh`, which gathers the parts in /tmp/carry-parts
#                                and, once all arrived, reassembles and sha256-checks every wheel into
#                                /tmp/carry. Prepare every call first: the machine keeps /tmp only
#                                while it stays warm (~30 s after a call).
#   pip_target PIP-ARGS...       offline install into SITE (default /tmp/site), nothing else touched:
#                                `python3 -m pip install --no-index --no-deps --no-cache-dir --upgrade
#                                --target SITE PIP-ARGS...` (wheels, or source trees with
#                                --no-build-isolation), pip's "already exists" notices left out of its
#                                output; returns pip's own exit status (not the filter's)
#   stack_dump_site DIR          write DIR/sitecustomize.py: every Python process that has DIR on its
#                                PYTHONPATH dumps all its threads' stacks (faulthandler) on SIGUSR1;
#                                the caller puts DIR on PYTHONPATH (a part's processes inherit it)
#   run_limited [--gpumem CSV] LIMIT LOG COMMAND...
#                                runs COMMAND (a program or a shell function) in a process group of its
#                                own, stdin /dev/null, stdout and stderr appended to LOG (/dev/stdout for
#                                a pipe), and waits for it. RUN_DUMP_LEAD s before LIMIT every process
#                                of the part that handles SIGUSR1 gets it (stacks, see stack_dump_site;
#                                a line in LOG says so first), RUN_DUMP_WAIT s later all are killed
#                                (SIGKILL). "The part's processes": its process group, and every
#                                descendant whatever group or session it moved to (Ray's, an SGLang
#                                server's), sampled every second, so one whose parent exits stays known.
#                                When COMMAND ends (or is killed) whatever is left of them is killed:
#                                nothing of a part outlives it, and nothing else is touched, so parts
#                                may share a host side by side. Returns COMMAND's exit status, 124
#                                when it was killed at its limit (as `timeout`). --gpumem CSV: GPU
#                                memory every RUN_GPUMEM_MS ms into CSV (nvidia-smi: timestamp, index,
#                                memory.used MiB; empty where there is no nvidia-smi).
#                                The part is killed as well when the shell that called run_limited
#                                dies (a script stopped by `timeout`, whose signal reaches only the
#                                script's own process group). After the part: gpu_host_cleanup.
#                                Knobs (environment): RUN_DUMP_LEAD (default 15), RUN_DUMP_WAIT (12),
#                                RUN_GPUMEM_MS (500), and gpu_host_cleanup's; RUN_STOP_RAY=1 also adds
#                                to a failed part's LOG the last 60 lines of up to 4 Ray worker logs
#                                that show an error.
#   gpu_host_cleanup             opt-in, and only where nvidia-smi exists (the GPU machine: on a shared
#                                CPU host it would hit others' processes): RUN_STOP_RAY=1 stops Ray
#                                (`ray stop --force`, every Ray of the host), RUN_FREE_GPU=1 kills
#                                every process that holds a GPU. Both assume the host runs only this
#                                script's one part at a time: leave them off for parts side by side.

check_one_version() {
  local dups
  dups=$(ls "$1"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
  [ -z "$dups" ] || { echo "[fetch] more than one version of: $dups (remove the extra wheels)" >&2; return 1; }
}

split_carry() {
  local OUT=$1 WHEELS=$2 CHUNK_SIZE=$3 bytes manifest f name d
  bytes=$(numfmt --from=iec "$CHUNK_SIZE")
  rm -rf "$OUT"/c[0-9]* "$OUT/.split"; mkdir -p "$OUT/.split"
  manifest="$OUT/.split/MANIFEST"; : > "$manifest"
  for f in "$WHEELS"/*.whl; do
    name=$(basename "$f")
    split -b "$bytes" -d -a 3 "$f" "$OUT/.split/$name.part"
    echo "$(sha256sum "$f" | cut -d' ' -f1) $name $(ls "$OUT/.split" | grep -c -F "$name.part")" >> "$manifest"
  done
  # first fit, largest part first: as few folders (calls) as the bytes allow
  (cd "$OUT/.split" && ls | grep '\.part[0-9]*$' | xargs stat -c '%s %n' | sort -rn) | {
    used=()
    while read -r s p; do
      k=0
      while [ "$k" -lt "${#used[@]}" ] && [ $((used[k] + s)) -gt "$bytes" ]; do k=$((k + 1)); done
      [ "$k" -eq "${#used[@]}" ] && used+=(0)
      used[k]=$((used[k] + s))
      dir=$(printf "%s/c%02d" "$OUT" $((k + 1))); mkdir -p "$dir"; mv "$OUT/.split/$p" "$dir/"
    done
  }
  for d in "$OUT"/c[0-9]*; do
    cp "$manifest" "$d/MANIFEST"
    cat > "$d/stash.sh" <<'STASH'
#!/usr/bin/env bash
# moves this folder's parts to /tmp/carry-parts; assembles and verifies once all have arrived
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/carry-parts /tmp/carry
cp "$here"/*.part* /tmp/carry-parts/ 2>/dev/null || true
missing=0
while read -r sum name nparts; do
  have=$(ls /tmp/carry-parts 2>/dev/null | grep -c -F "$name.part" || true)
  if [ "$have" -lt "$nparts" ]; then missing=$((missing + nparts - have)); continue; fi
  if [ ! -f "/tmp/carry/$name" ]; then
    cat $(ls -d /tmp/carry-parts/"$name".part* | sort) > "/tmp/carry/$name"
    echo "$sum  /tmp/carry/$name" | sha256sum -c --quiet || { rm -f "/tmp/carry/$name"; echo "BAD CHECKSUM $name"; exit 1; }
  fi
done < "$here/MANIFEST"
echo "parts here: $(ls /tmp/carry-parts | wc -l); parts still missing: $missing"
[ "$missing" -eq 0 ] && echo "CARRY COMPLETE: $(ls /tmp/carry | wc -l) wheels in /tmp/carry"
exit 0
STASH
    chmod +x "$d/stash.sh"
  done
  rm -rf "$OUT/.split"
  du -sh "$OUT"/c[0-9]* | sed 's/^/[fetch] carry /' >&2
}

pip_target() {
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-cache-dir --upgrade \
    --target "${SITE:-/tmp/site}" "$@" 2>&1 | { grep -v "already exists" || true; }
  return "${PIPESTATUS[0]}"
}

stack_dump_site() {
  mkdir -p "$1" && cat > "$1/sitecustomize.py" <<'PY'
# scripts/gpu/lib.sh (stack_dump_site): this Python process dumps its stacks on SIGUSR1
import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
PY
}

_part_members() {  # ROOT: "pid start-time" of ROOT's process group and of every descendant of ROOT
  ps -eo pid=,ppid=,pgid=,lstart= | awk -v root="$1" '
    { parent[$1] = $2; group[$1] = $3; start[$1] = $4 " " $5 " " $6 " " $7 " " $8; pids[++n] = $1 }
    END {
      for (i = 1; i <= n; i++) if (pids[i] == root || group[pids[i]] == root) member[pids[i]] = 1
      do {
        grew = 0
        for (i = 1; i <= n; i++) if (!(pids[i] in member) && (parent[pids[i]] in member)) { member[pids[i]] = 1; grew = 1 }
      } while (grew)
      for (p in member) print p, start[p]
    }'
}

_signal_known() {  # SIGNAL FILE: signal every process of FILE ("pid start-time" lines) that is still that process;
  # USR1 only to those that catch it (a process without a handler would die of it: a shell between
  # the limiter and Python, whose death would end the wait before the stacks are written)
  local p cgt
  ps -eo pid=,lstart= | awk 'NR == FNR { known[$0] = 1; next } ($1 " " $2 " " $3 " " $4 " " $5 " " $6) in known { print $1 }' \
    "$2" - | while read -r p; do
      if [ "$1" = USR1 ]; then
        cgt=$(awk '/^SigCgt:/ { print $2 }' "/proc/$p/status" 2>/dev/null)
        [ -n "$cgt" ] && (( (0x$cgt >> 9) & 1 )) || continue  # SIGUSR1 is signal 10: bit 9
      fi
      kill "-$1" "$p" 2>/dev/null
    done
}

gpu_host_cleanup() {
  command -v nvidia-smi > /dev/null || return 0
  [ "${RUN_STOP_RAY:-0}" = 1 ] || [ "${RUN_FREE_GPU:-0}" = 1 ] || return 0
  [ "${RUN_STOP_RAY:-0}" = 1 ] && python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  if [ "${RUN_FREE_GPU:-0}" = 1 ]; then
    local p
    for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  fi
  sleep 2
}

run_limited() {
  local gpumem="" limit log logfd pid dog smi="" rc state monitor caller=$BASHPID
  [ "${1:-}" = --gpumem ] && { gpumem=$2; shift 2; }
  limit=$1 log=$2; shift 2
  state=$(mktemp -d "${TMPDIR:-/tmp}/run_limited.XXXXXX")
  if [ -n "$gpumem" ]; then
    : > "$gpumem"
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits \
        -lms "${RUN_GPUMEM_MS:-500}" >> "$gpumem" 2>/dev/null < /dev/null &
      smi=$!
    fi
  fi
  exec {logfd}>> "$log"  # opened once: /dev/stdout stays the caller's pipe in the watchdog too
  case $- in *m*) monitor=1 ;; *) monitor=0 ;; esac
  set -m  # job control: each background job below gets a process group of its own (pgid = its pid)
  ( "$@" ) >&"$logfd" 2>&1 < /dev/null &
  pid=$!
  : > "$state/known"
  ( dump_at=$((limit - ${RUN_DUMP_LEAD:-15})) dumped="" t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null; do
      _part_members "$pid" | sort -u - "$state/known" > "$state/known.new" && mv "$state/known.new" "$state/known"
      if ! kill -0 "$caller" 2>/dev/null; then  # the script was killed (`timeout`): the part goes with it
        kill -9 -- "-$pid" 2>/dev/null; _signal_known KILL "$state/known"; rm -rf "$state"; exit
      fi
      if [ -z "$dumped" ] && [ $((SECONDS - t0)) -ge "$dump_at" ]; then
        echo "[run_limited] $1 reached its limit ($limit s): the stacks of every process of it follow" >&"$logfd"
        _signal_known USR1 "$state/known"; dumped=$SECONDS
      fi
      if [ -n "$dumped" ] && [ $((SECONDS - dumped)) -ge "${RUN_DUMP_WAIT:-12}" ]; then
        touch "$state/limit"; kill -9 -- "-$pid" 2>/dev/null; _signal_known KILL "$state/known"
      fi
      sleep 1
    done ) > /dev/null 2>&1 < /dev/null &
  dog=$!
  [ "$monitor" = 1 ] || set +m
  rc=0; { wait "$pid"; } 2>/dev/null || rc=$?
  kill -9 -- "-$dog" 2>/dev/null; { wait "$dog"; } 2>/dev/null
  [ -f "$state/limit" ] && rc=124
  # what is left of the part: its group (orphans stay in it), then every process it was seen to own
  kill -9 -- "-$pid" 2>/dev/null
  _signal_known KILL "$state/known"
  [ -n "$smi" ] && { kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null; }
  if [ "${RUN_STOP_RAY:-0}" = 1 ] && [ "$rc" != 0 ]; then  # what Ray actors printed last (their stacks too)
    local f
    for f in $(grep -l -E "Traceback|Thread 0x|Error" /tmp/ray/session_latest/logs/worker-*.err 2>/dev/null | head -4); do
      { echo "----- $f"; tail -n 60 "$f"; } >&"$logfd"
    done
  fi
  exec {logfd}>&-
  gpu_host_cleanup
  rm -rf "$state"
  return "$rc"
}
