#!/bin/bash
# Variants: base = a worktree of main at f2d390d (/work/wt-base), new = wip/disk-csum (/work/wt-disk),
# any other name N = /work/wt-N (d4: wip/disk-csum at 517d48e); JSON under OUTDIR/<variant>-<round>/.
# alternate bench disk runs of the base tree and the branch: ab.sh OUTDIR ROUNDS PAIRS [variant...]
out=$1; rounds=$2; pairs=$3; shift 3
variants=${*:-base new}
. /work/main/.venv/bin/activate
mkdir -p $out
for r in $(seq 1 $rounds); do
  for v in $variants; do
    case $v in base) src=/work/wt-base/src;; new) src=/work/wt-disk/src;; *) src=/work/wt-$v/src;; esac
    echo "== round $r $v $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$src flock /tmp/kvtier-heavy.lock python -m kvtier.cli bench disk /work/tmp-disk --pairs $pairs --total-mib 512 --out $out/$v-$r 2>&1 | grep -v "^wrote"
  done
done
