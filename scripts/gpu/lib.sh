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
