#!/bin/bash
# The device check as one command on a lent CUDA machine (no network there): installs OR-Tools
# and what it needs from carried wheels (.whl), lays memcompile out as installed, runs
# benchmarks/gpu_check.py under a time budget, and leaves at most 5 files in $OUT (the device
# tool returns 8 at most): rows.jsonl, table.md, log.txt, env.txt, snapshots.tar.gz (if any).
#
#   bash benchmarks/gpu_run.sh [SECONDS] [GPU_CHECK_ARGS...]     (SECONDS: gpu_check's --time-budget-s, 480)
#
# First call (device tool, carry [".whl"], timeout_s 580):  bash benchmarks/gpu_run.sh 480
# Second call, right after, on the still-warm machine: commit the first call's rows.jsonl as
# $RESUME (below; the next call's tree carries it), then:    bash benchmarks/gpu_run.sh 200 --quick
# Rows already in $RESUME are not run again; each call's rows.jsonl holds them all.
#
# The wheels, once, in the repo root here (cp312, as the machine's python3; .whl/ is ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl ortools==9.15.6755 protobuf==6.33.5 immutabledict==4.3.1       (30 MB; the rest is in the image)
#
# Locally (no CUDA: gpu_check's CPU smoke mode):  PYTHON=.venv/bin/python OUT=/tmp/gpu_out bash benchmarks/gpu_run.sh 120
set -u
OUT=${OUT:-/tmp/gpu_out}
PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # it also runs from /tmp
RESUME=${RESUME:-benchmarks/results/gpu_check_h200_s28.jsonl}
BUDGET=${1:-480}
[ $# -gt 0 ] && shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  SITE=/tmp/site
fi
# The installed layout (pyproject's package-dir) without a build: passes/ and cost_models/ live
# inside the memcompile package.
rm -rf /tmp/mc && mkdir -p /tmp/mc && cp -r memcompile /tmp/mc/ && cp -r passes /tmp/mc/memcompile/passes \
  && cp -r cost_models /tmp/mc/memcompile/cost_models || exit 1
export PYTHONPATH=/tmp/mc${SITE:+:$SITE}
{
  date -u
  git log -1 --format="code %h %s" 2>/dev/null | cut -c1-120
  (cd /tmp && "$PY" -c "import sys, torch, transformers, ortools, memcompile
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__,
      'ortools', ortools.__version__, 'memcompile', memcompile.__file__)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')")
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv 2>/dev/null
  nproc
  free -g 2>/dev/null | head -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
ARGS=(--out "$OUT" --time-budget-s "$BUDGET")
[ -f "$RESUME" ] && ARGS+=(--resume "$RESUME")
# gpu_check stops its workers at its deadline; this limit is for a hang past it.
timeout $((BUDGET + 60)) "$PY" benchmarks/gpu_check.py "${ARGS[@]}" "$@" > "$OUT/parent.txt" 2>&1
echo "gpu_check exit $?" >> "$OUT/parent.txt"
cat "$OUT/parent.txt"
"$PY" benchmarks/gpu_table.py "$OUT/rows.jsonl" --out "$OUT/table.md" && cat "$OUT/table.md" | head -40
# One log (parent first, then each worker; Inductor's warnings out), its last 15 MiB.
{ cat "$OUT/parent.txt"; for f in "$OUT"/logs/*.txt; do [ -f "$f" ] && { echo "==== $f"; cat "$f"; }; done; } \
  | grep -v "UserWarning\|warnings.warn\|FutureWarning" | tail -c 15000000 > "$OUT/log.txt"
rm -rf "$OUT/logs" "$OUT/parent.txt"
if [ -d "$OUT/snapshots" ]; then
  tar czf "$OUT/snapshots.tar.gz" -C "$OUT" snapshots
  while [ "$(stat -c %s "$OUT/snapshots.tar.gz")" -gt 15000000 ] && [ "$(ls "$OUT/snapshots" | wc -l)" -gt 1 ]; do
    rm "$OUT/snapshots/$(ls "$OUT/snapshots" | tail -1)"  # the largest that fits: drop the last until it does
    tar czf "$OUT/snapshots.tar.gz" -C "$OUT" snapshots
  done
  rm -rf "$OUT/snapshots"
fi
ls -la "$OUT"
