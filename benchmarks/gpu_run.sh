#!/bin/bash
# The device check as one command (benchmarks/gpu_check.py on a lent CUDA machine): installs the
# package and OR-Tools from carried wheels (.whl, no network there), then runs the check.
# Usage there: bash benchmarks/gpu_run.sh   (writes $OUT/{bf16,fp32,graph_order}/{gpu_check.jsonl,log.txt})
#         or:  bash benchmarks/gpu_run.sh NAME SECONDS GPU_CHECK_ARGS...   (one run only)
# Inductor's generated wrappers that hold our transfer ops are copied to $OUT/wrappers, to read
# beside a memory snapshot (gpu_check writes one where a measured peak exceeds the prediction).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# The installed layout (pyproject's package-dir) without a build: passes/ and cost_models/ live
# inside the memcompile package.
rm -rf /tmp/mc && mkdir -p /tmp/mc && cp -r memcompile /tmp/mc/ && cp -r passes /tmp/mc/memcompile/passes \
  && cp -r cost_models /tmp/mc/memcompile/cost_models || exit 1
export PYTHONPATH=/tmp/mc:/tmp/site
(cd /tmp && python3 -c "import torch, ortools, memcompile; print('torch', torch.__version__, 'ortools', ortools.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', memcompile.__file__)")
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
run() {  # run NAME SECONDS ARGS...: one gpu_check invocation, its rows and log under $OUT/NAME
  local name=$1 seconds=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$seconds" python3 benchmarks/gpu_check.py --out "$OUT/$name" "$@" 2>&1 \
    | tee "$OUT/$name/log.txt" | grep -v "^W1\|UserWarning\|warnings.warn\|^    \|^graph():"
}
save_wrappers() {
  mkdir -p "$OUT/wrappers"
  grep -rl --include=*.py "copy_to_host\|copy_to_device" "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null \
    | while read -r f; do cp "$f" "$OUT/wrappers/"; done
}
if [ $# -gt 0 ]; then
  run "$@"
  save_wrappers
  exit 0
fi
# bf16 GPT: every variant; the async offload check first.
run bf16 "${T1:-260}" --blocks "${BLOCKS:-4}"
# float32 with float32 matmuls at full precision: compute slow enough for offload to pay.
run fp32 "${T2:-110}" --blocks "${BLOCKS:-4}" --dtype float32 --variants "recompute only,+ offload" --skip-offload-check
# The older count (every node a buffer, graph order) beside the default check over Inductor's schedule.
MEMCOMPILE_FUSION_CHECK=0 run graph_order "${T3:-110}" --blocks "${BLOCKS:-4}" --variants "recompute only,+ int8" --skip-offload-check
save_wrappers
