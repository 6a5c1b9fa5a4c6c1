#!/usr/bin/env bash
# The papers' comparison at equal GPU time (`scaletrain compare-models`) in one call of at most 9 minutes on one
# GPU, with no network (run benchmarks/gpu_check.sh's install first in the same window, or bring the wheels:
# this script installs them the same way when DeepSpeed is missing).
#
#   OUT=DIR bash benchmarks/gpu_compare.sh          # on the GPU machine; default OUT: ./gpu_compare_out
#   OUT=DIR bash benchmarks/gpu_compare.sh --cpu    # two models at toy size on the CPU, half a minute each
#
# What it runs: the catalogs corpus with its SentencePiece model (the subword baseline needs it) unless SHARDS
# holds one, then `scaletrain compare-models --size small` for the seven runs (byte Transformer seeds 1 and 2,
# Embeddingless, Byte-nCF, MSC, MoCE Δ5 +lid, subword CG), one after another, each trained for the same minutes:
# what the budget leaves after the corpus and each run's start-up and evaluation (about half a minute each with
# the default 540 s, i.e. thousands of updates of the small models on an H100), eager (`engine.compile=false`:
# seven compiles would take the budget), each evaluated on the first GPU_COMPARE_EVAL_LINES (10) test lines of
# every direction. compare-models resumes: a second call with the same OUT_DIR trains only what is missing.
# Everything is written under $OUT (compare.md/.csv/.json, compare.png, each run's eval_test.json and log);
# the checkpoints stay in WORK. Exit 0 whatever was measured; compare.log says what failed.
# Environment: OUT, GPU_COMPARE_BUDGET_S (540), GPU_COMPARE_MINUTES (override the computed minutes),
# GPU_COMPARE_MODELS, GPU_COMPARE_EVAL_LINES, GPU_CHECK_PYTHON, WHEELS, GPU_CHECK_WORK, SHARDS (as gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
cpu=0
[[ "${1:-}" == --cpu ]] && cpu=1
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0; }
OUT="${OUT:-$ROOT/gpu_compare_out}"
WORK="${GPU_CHECK_WORK:-$ROOT/.gpu_check}"
mkdir -p "$OUT" "$WORK" || exit 0
OUT="$(cd "$OUT" && pwd)"; WORK="$(cd "$WORK" && pwd)"
PY="${GPU_CHECK_PYTHON:-python3}"  # the GPU image's Python; --cpu: .venv/bin/python if there is one
[[ $cpu == 1 && -z "${GPU_CHECK_PYTHON:-}" && -x .venv/bin/python ]] && PY="$ROOT/.venv/bin/python"
SITE="$WORK/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)
log() { echo "[gpu_compare $(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/compare.log"; }
: > "$OUT/compare.log"

if [[ $cpu == 1 ]]; then
  budget="${GPU_COMPARE_BUDGET_S:-600}"; SHARDS="${SHARDS:-$WORK/shards/compare}"
  models="${GPU_COMPARE_MODELS:-base,msc}"; size=tiny; per_run=60
  GPU_COMPARE_MINUTES="${GPU_COMPARE_MINUTES:-0.5}"
  export SCALETRAIN_AUTO_PRECISION=fp32 DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  extra=(--base-seeds 1 --set model.d_model=64 --set model.ffn_dim=128 --set data.max_bytes=96
         --set model.max_positions=128 --set train.valid_every=0 --set train.save_every=0)
else
  budget="${GPU_COMPARE_BUDGET_S:-540}"; SHARDS="${SHARDS:-$ROOT/shards/catalogs}"
  models="${GPU_COMPARE_MODELS:-}"; size=small; per_run=40  # start-up + final save + evaluation, eager
  extra=()
fi
deadline=$((t0 + budget))

if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  whl=(); for w in "${WHEELS:-$ROOT/wheels}"/*.whl; do [[ -f "$w" && "$w" != */setuptools-* ]] && whl+=("$w"); done
  log "DeepSpeed not importable: installing ${#whl[@]} wheels into $SITE"
  [[ ${#whl[@]} -gt 0 ]] && "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade \
    --target "$SITE" "${whl[@]}" >> "$OUT/compare.log" 2>&1
fi
tracking=()
"$PY" -c "import mlflow" >/dev/null 2>&1 || tracking=(--set tracking.enabled=false)

# the corpus, with the SentencePiece model of the subword baseline
spm=$(ls "$SHARDS"/spm*.model 2>/dev/null | head -1)
if [[ ! -f "$SHARDS/manifest.json" || -z "$spm" ]]; then
  if [[ $cpu == 1 ]]; then
    prep=(--langs de,ru --max-per-lang 300 --max-bytes 96 --valid-frac 0.05 --test-frac 0.05 --spm-vocab-size 500)
  else
    prep=(--max-per-lang 20000 --max-bytes 256 --valid-frac 0.01 --test-frac 0.02 --spm-vocab-size 8000)
  fi
  log "corpus: scaletrain prepare --catalogs system,packages ${prep[*]} --out $SHARDS"
  timeout 240 "$PY" -m scaletrain prepare --catalogs system,packages "${prep[@]}" --out "$SHARDS" --overwrite \
    > "$OUT/corpus.log" 2>&1 || log "corpus: failed or timed out (corpus.log)"
fi

# runs: the models, the byte Transformer (base) once per seed: two on the GPU, one with --cpu
n_runs=$(tr ',' '\n' <<<"${models:-base,embeddingless,byte_ncf,msc,moce_d5_lid,subword_cg}" | grep -c .)
[[ $cpu == 0 ]] && grep -qx base < <(tr ',' '\n' <<<"${models:-base}") && n_runs=$((n_runs + 1))
left=$((deadline - $(date +%s) - 20))
minutes="${GPU_COMPARE_MINUTES:-$(awk -v l="$left" -v n="$n_runs" -v p="$per_run" \
  'BEGIN { m = (l / n - p) / 60; if (m < 0.1) m = 0.1; printf "%.2f", m }')}"
log "$n_runs runs x $minutes min (size $size), $left s left"
args=(--out "$WORK/compare" --size "$size" --minutes "$minutes" --shards "$SHARDS"
      --eval-lines "${GPU_COMPARE_EVAL_LINES:-10}" --set engine.compile=false "${tracking[@]}" "${extra[@]}")
[[ -n "$models" ]] && args+=(--models "$models")
timeout --kill-after=15 $((deadline - $(date +%s) > 30 ? deadline - $(date +%s) - 10 : 20)) \
  "$PY" -m scaletrain compare-models "${args[@]}" >> "$OUT/compare.log" 2>&1
log "compare-models: exit $?"
# the results (not the checkpoints) into $OUT
cp "$WORK/compare"/compare.* "$OUT/" 2>/dev/null
cp -r "$WORK/compare/logs" "$OUT/" 2>/dev/null
for d in "$WORK/compare/runs"/*/; do
  [[ -d "$d" ]] || continue
  n=$(basename "$d"); mkdir -p "$OUT/runs/$n"
  cp "$d"/eval_test.json "$d"/config.yaml "$OUT/runs/$n/" 2>/dev/null
done
cat "$OUT/compare.md" 2>/dev/null || tail -20 "$OUT/compare.log"
log "done in $(( $(date +%s) - t0 ))s"
exit 0
