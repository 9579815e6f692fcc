#!/usr/bin/env bash
# Prepare .verl-kit/ in the project checkout: verl 0.9.1 and everything it needs that the GPU machine's image
# lacks, for benchmarks/gpu_verl.sh (verl's GRPO trainer with actor_rollout_ref.rollout.name=tlt_rt).
# Run from the project root, where pip reaches the package index:
#
#   tools/verl-device-kit.sh             # the wheels of tools/verl-device-kit.lock, packed
#   tools/verl-device-kit.sh --resolve   # first walk verl's Requires-Dist again and rewrite the lock
#
# Writes (all ignored by git):
#   .verl-kit/wheels/{site,verl-tf}/   the wheels, CPython 3.12 x86-64 (one version of each package)
#   .verl-kit/pNN.tar.xz               the kit in parts of at most 55 MiB, one device call each
#   .verl-kit/unpack.sh                source it on the GPU machine, from the project root, once every part is in
#                                      /tmp/verl-kit: installs the `site` wheels into /tmp/site and the `verl-tf`
#                                      ones (transformers 5.10.4 and its tokenizers, which verl pins below the
#                                      image's) into /tmp/site-verl-tf; exports PYTHONPATH (/tmp/site and the
#                                      checkout) and VERL_TF_SITE, which gpu_verl.sh puts first on verl's path only
# ray goes in as device-prep.sh cuts it (no Java jars, no rllib/serve/tune/train/data/llm, no dashboard client,
# stripped binaries); verl uses ray core, placement groups, ray.util.collective and ray.util.state.
#
# The device calls, back to back (the machine keeps /tmp while warm, about 30 s after a call):
#   each part:  carry [".verl-kit/pNN.tar.xz"]   command: mkdir -p /tmp/verl-kit && cp .verl-kit/pNN.tar.xz /tmp/verl-kit/
#   the last part may travel with the run itself: carry [".verl-kit/pNN.tar.xz", ".verl-kit/unpack.sh", ...]
#   then:       carry [".verl-kit/unpack.sh"]    command: source .verl-kit/unpack.sh && benchmarks/gpu_verl.sh ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
PY=${PY:-python3}  # any Python with pip and packaging; the wheels are for the GPU machine's 3.12
kit=${VERL_KIT_DIR:-.verl-kit}  # VERL_KIT_DIR and VERL_KIT_PART_MIB: for trying the packing elsewhere
part_mib=${VERL_KIT_PART_MIB:-55}
mkdir -p "$kit"
if [ "${1:-}" = "--resolve" ]; then
  rm -rf "$kit/resolve"
  "$PY" tools/verl_device_kit.py resolve "$kit/resolve"
fi
"$PY" tools/verl_device_kit.py fetch "$kit/wheels"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# the parts' tree: site/ (ray unpacked and cut, the other wheels in site/_wheels), verl-tf/_wheels, LOCK
stage() {
  local s=$work/kit w
  mkdir -p "$s/site/_wheels" "$s/verl-tf/_wheels"
  for w in "$kit"/wheels/site/*.whl; do
    case $(basename "$w") in
      ray-*) "$PY" -m zipfile -e "$w" "$s/site" ;;
      *) cp "$w" "$s/site/_wheels/" ;;
    esac
  done
  cp "$kit"/wheels/verl-tf/*.whl "$s/verl-tf/_wheels/"
  (cd "$s/site/ray" && rm -rf jars rllib serve llm tune train data dashboard/client)
  find "$s/site/ray" -type f \( -name '*.so' -o -name raylet -o -name gcs_server \) \
      -exec strip --strip-unneeded {} \; 2>/dev/null || true
  cp tools/verl-device-kit.lock "$s/LOCK"
  (cd "$s" && find . -type f ! -name LOCK | sort) > "$work/files"
}

# whole files in each part, so that each part unpacks on its own: all in one if that fits, else first fit by
# each file's (ray: each top folder's) compressed size, with 10% headroom
split_lists() {
  "$PY" - "$work" "$part_mib" <<'PACK'
import lzma, os, sys
work, limit = sys.argv[1], (int(sys.argv[2]) << 20) * 0.9
stage = os.path.join(work, "kit")
groups = {}
for f in open(os.path.join(work, "files")).read().split():
    parts = f.split("/")
    groups.setdefault("/".join(parts[:4]) if parts[2] == "ray" else f, []).append(f)
def xz_size(fs):
    c, n = lzma.LZMACompressor(preset=6), 0
    for f in fs:
        with open(os.path.join(stage, f), "rb") as fh:
            n += len(c.compress(fh.read()))
    return n + len(c.flush())
bins = []
for size, key in sorted(((xz_size(fs), k) for k, fs in groups.items()), reverse=True):
    b = next((b for b in bins if b[0] + size <= limit), None)
    if b is None:
        bins.append([size, [key]])
    else:
        b[0] += size
        b[1].append(key)
for i, (_, keys) in enumerate(bins, 1):
    with open(os.path.join(work, f"part{i:02d}"), "w") as fh:
        fh.write("\n".join(sorted(f for k in keys for f in groups[k])) + "\n")
PACK
}

pack() {
  local list n size
  rm -f "$kit"/p*.tar.xz
  for list in "$work"/part*; do
    n=${list##*part}
    { echo ./LOCK; cat "$list"; } | tar -C "$work/kit" -cf - -T - | xz -9 -T2 > "$kit/p$n.tar.xz"
    size=$(stat -c %s "$kit/p$n.tar.xz")
    if [ "$size" -gt $((part_mib << 20)) ]; then
      echo "verl kit: p$n.tar.xz has $size bytes, over $part_mib MiB" >&2
      return 1
    fi
  done
}

stamp=$(cat tools/verl-device-kit.lock "$kit"/wheels/*/*.whl | sha256sum | cut -d' ' -f1)
if [ "$(cat "$kit/stamp" 2>/dev/null)" = "$stamp" ] && ls "$kit"/p*.tar.xz >/dev/null 2>&1; then
  echo "verl kit: the parts are up to date with the lock"
else
  rm -f "$kit/stamp"
  stage
  cp "$work/files" "$work/part01"
  if ! pack 2>/dev/null; then
    rm "$work/part01"
    split_lists
    pack
  fi
  echo "$stamp" > "$kit/stamp"
fi
parts=$(ls "$kit"/p*.tar.xz | wc -l | tr -d ' ')
sums=$(cd "$kit" && sha256sum p*.tar.xz)

cat > "$kit/unpack.sh" <<UNPACK
# source this on the GPU machine, from the project root, once every part is in /tmp/verl-kit (written by
# tools/verl-device-kit.sh: $parts part(s))
_verl_kit_unpack() {
  # the folders can be moved (VERL_KIT_TMP, VERL_KIT_SITE, VERL_TF_SITE), for a trial away from /tmp
  local parts=$parts in=\${VERL_KIT_TMP:-/tmp/verl-kit} site=\${VERL_KIT_SITE:-/tmp/site} tf=\${VERL_TF_SITE:-/tmp/site-verl-tf}
  local have pip="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target"
  if [ ! -f "\$in/.installed" ]; then
    have=\$(ls "\$in"/p*.tar.xz 2>/dev/null | wc -l)
    if [ "\$have" != "\$parts" ]; then
      echo "unpack.sh: \$in holds \$have of \$parts parts: carry the missing ones first" >&2; return 1
    fi
    (cd "\$in" && sha256sum --quiet -c) <<'SUMS' || { echo "unpack.sh: a part is damaged" >&2; return 1; }
$sums
SUMS
    rm -rf "\$in/x" && mkdir -p "\$in/x" "\$site" "\$tf"
    for p in "\$in"/p*.tar.xz; do tar -C "\$in/x" -xJf "\$p" || return 1; done
    cp -r "\$in/x/site/." "\$site"/
    find "\$site/ray" -type f \( -name raylet -o -name gcs_server \) -exec chmod +x {} \;
    \$pip "\$site" "\$in"/x/site/_wheels/*.whl || return 1
    \$pip "\$tf" "\$in"/x/verl-tf/_wheels/*.whl || return 1
    cp "\$in/x/LOCK" "\$in/LOCK"
    touch "\$in/.installed"
  fi
  export PYTHONPATH=\$site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH} VERL_TF_SITE=\$tf RAY_AUTH_MODE=disabled
  export VERL_USE_EXTERNAL_MODULES=tlt_rt.integrations.verl
  # what the kit's wheels ask of the image: a version the image does not meet is printed, not fatal
  VERL_KIT_LOCK=\$in/LOCK PYTHONPATH=\$tf:\$PYTHONPATH python3 - <<'CHECK'
import importlib.metadata as md
import os
from packaging.requirements import Requirement
bad, lines = [], open(os.environ["VERL_KIT_LOCK"]).read().splitlines()
left_out = {line.split()[3] for line in lines if line.startswith("# left out: ")}
for line in lines:
    line = line.split("#")[0].strip()
    if not line:
        continue
    name = line.split("==")[0]
    for r in md.requires(name) or []:
        req = Requirement(r)
        if req.name in left_out:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            v = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{name}: {req} (absent)")
            continue
        if not req.specifier.contains(v, prereleases=True):
            bad.append(f"{name}: {req} (found {v})")
print("verl kit: every requirement met" if not bad else "verl kit: unmet requirements:\n  " + "\n  ".join(bad))
CHECK
}
_verl_kit_unpack
UNPACK

total=$(du -cb "$kit"/p*.tar.xz | tail -1 | cut -f1)
echo "verl kit: $(wc -l < <(grep -v '^#' tools/verl-device-kit.lock)) packages in $parts part(s), $total bytes ($((total >> 20)) MiB)"
ls -l "$kit"/p*.tar.xz "$kit/unpack.sh"
echo "device calls, back to back:"
for p in "$kit"/p*.tar.xz; do
  echo "  carry [\"$p\"]  command: mkdir -p /tmp/verl-kit && cp $p /tmp/verl-kit/"
done
echo "  carry [\"$kit/unpack.sh\", ...]  command: source $kit/unpack.sh && benchmarks/gpu_verl.sh OUT MODEL"
