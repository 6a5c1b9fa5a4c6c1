#!/usr/bin/env bash
# The training step on one GPU, in one shot, for a session lent a GPU (no network needed; at most 11 minutes):
#   OUT=/some/dir bash benchmarks/gpu_step.sh        (the device tool provides $OUT; default ./gpu_step_out)
# The GPU image has torch, accelerate and transformers; DeepSpeed comes as a wheel carried with the tree:
# $DS_WHEEL, or wheels/deepspeed-*.whl (its dependencies as wheels beside it, if the image lacks them).
# Steps, each with its own time limit so a slow one leaves the others' results:
#   1. env.txt: nvidia-smi, torch/CUDA versions, the DeepSpeed install
#   2. eager.{log,json}: bench_gpu_step.py at 4k/16k/64k tokens per step, interleaved rounds: ours through the
#      DeepSpeed engine (now and with the old DeepSpeed config), through Accelerate, and HF MarianMTModel;
#      tokens/s, MFU against the bf16 matmul peak measured in the run, host syncs (profiler and
#      torch.cuda.set_sync_debug_mode), kernel launches, peak memory, ratios vs HF
#   3. syncs.{log,json}: count_host_syncs.py on the GPU: the real trainer (small model, generated shards) per
#      engine: host reads and CUDA synchronisations per update (profiler) and set_sync_debug_mode's count,
#      log steps apart
#   4. compiled.{log,json}: the same as 2 for ours compiled (inductor), ours with CUDA graphs (reduce-overhead)
#      and HF compiled, with HF eager again as the baseline of the ratios
# Everything is written under $OUT; the script exits 0 when the steps ran, whatever they measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_step_out}"
mkdir -p "$OUT"
py=python
[[ -x .venv/bin/python ]] && py=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="$PWD/.torch_ext"
export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor_cache"

{
  date -u
  nvidia-smi || true
  "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
} > "$OUT/env.txt" 2>&1

if ! "$py" -c "import deepspeed" >/dev/null 2>&1; then
  whl="${DS_WHEEL:-$(ls wheels/deepspeed-*.whl 2>/dev/null | head -1)}"
  if [[ -n "$whl" ]]; then
    "$py" -m pip install --no-index --find-links "$(dirname "$whl")" "$whl" >> "$OUT/env.txt" 2>&1 \
      || "$py" -m pip install --no-index --no-deps "$whl" >> "$OUT/env.txt" 2>&1
  fi
fi
"$py" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >> "$OUT/env.txt" 2>&1 \
  || echo "deepspeed not importable: the ds variants will say 'not built'" | tee -a "$OUT/env.txt"

timeout 200 "$py" benchmarks/bench_gpu_step.py --variants ds,ds-old,acc,hf --json "$OUT/eager.json" \
  > "$OUT/eager.log" 2>&1
echo "eager: exit $?" | tee -a "$OUT/env.txt"
tail -25 "$OUT/eager.log"

timeout 150 "$py" benchmarks/count_host_syncs.py --synthetic --size small --steps 9 --log-every 4 \
  --runs ds-bf16,acc-bf16,ds-bf16-z2 --json "$OUT/syncs.json" > "$OUT/syncs.log" 2>&1
echo "syncs: exit $?" | tee -a "$OUT/env.txt"
tail -6 "$OUT/syncs.log"

timeout 300 "$py" benchmarks/bench_gpu_step.py --variants hf,ds-compiled,ds-graphed,hf-compiled \
  --json "$OUT/compiled.json" > "$OUT/compiled.log" 2>&1
echo "compiled: exit $?" | tee -a "$OUT/env.txt"
tail -25 "$OUT/compiled.log"
exit 0
