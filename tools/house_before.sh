#!/usr/bin/env bash
# A checkout of an earlier commit for `benchmarks/gpu_check_x4.sh`'s HOUSE=DIR: the package, the benchmark scripts
# and the configs of REV in DIR (default .device-before), DIR kept out of git (.git/info/exclude), so that a GPU
# call can carry it and time the earlier code beside this one.
#
#   tools/house_before.sh REV [DIR]      then: HOUSE=DIR benchmarks/gpu_check_x4.sh ... (carry DIR)
set -euo pipefail
rev=${1:?REV}; dir=${2:-.device-before}
case $dir in /* | *..*) echo "house_before.sh: DIR must be a path inside the checkout, got $dir" >&2; exit 2 ;; esac
cd "$(git rev-parse --show-toplevel)"
git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "house_before.sh: no commit $rev" >&2; exit 2; }
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" tlt_rt 'benchmarks/*.py' configs | tar -x -C "$dir"
excl=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$excl")"
grep -qx "/$dir/" "$excl" 2>/dev/null || echo "/$dir/" >> "$excl"
# the earlier code must import on its own: a commit that left out a file its modules import (as f28829a, which
# deleted rollout/step/ops.py a later commit replaced) would only fail on the GPU machine, after the uploads
py=${PYTHON:-$PWD/.venv/bin/python}; [ -x "$py" ] || py=python3
log=$PWD/$dir/import.log
if ! (cd "$dir" && PYTHONPATH=$PWD "$py" -c "import tlt_rt.rollout.engine, tlt_rt.train.loop" 2> "$log"); then
  echo "house_before.sh: $rev's package does not import (see $log): pick another commit" >&2; exit 1
fi
rm -f "$log"
echo "$dir: $(git rev-parse --short "$rev") ($(du -sh "$dir" | cut -f1)); carry it with the call"
