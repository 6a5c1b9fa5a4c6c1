#!/usr/bin/env bash
# Every GPU figure in one call: speed, the GPU suite and a short translating job, within 9 minutes on one GPU,
# with no network (DeepSpeed and what the GPU image lacks come as wheels: bash scripts/gpu_wheels.sh, here).
#
#   OUT=DIR bash benchmarks/gpu_check.sh            # on the GPU machine; default OUT: ./gpu_check_out
#   OUT=DIR bash benchmarks/gpu_check.sh --cpu      # every step at toy size on the CPU (CI runs this)
#   OUT=DIR bash benchmarks/gpu_check.sh --steps env,bench      # some steps only
#
# Steps, each under its own `timeout` (a slow or failing step leaves the others' results; its status says
# which), every file under $OUT; exit 0 whatever was measured:
#   install  the wheels of WHEELS (default wheels/) into WORK/site (pip --no-index --no-deps --target; then on
#            PYTHONPATH); one line names what is still missing (no MLflow: jobs run with tracking.enabled=false)
#   env      GPU, driver, torch/CUDA, DeepSpeed, CPU: env.json
#   launch   (beside the others) ./launch.sh --dry-run as on a fresh clone, no index, wheels/ as the only
#            source: does the user's command get as far as starting the job? launch.log
#   corpus   (beside the others) the catalogs corpus built on this machine (scaletrain prepare --catalogs
#            system,packages, as README's Data section), unless SHARDS already holds one: corpus.log
#   bench    benchmarks/bench_gpu_step.py at 16k and 64k tokens per step: ours through the DeepSpeed engine and
#            through Accelerate as a user's CUDA run gets them (compiled), HF MarianMTModel eager and compiled;
#            interleaved rounds, tok/s, MFU against the bf16 GEMM peak of this run, host syncs, kernel launches,
#            warm-up (compile) seconds: bench.json
#   suite    benchmarks/gpu_suite.py (every variant's bf16/fp16 step, MoE grouped GEMM, max_tokens: auto against
#            the GPU's memory, ...; its benchmarks but the engine throughput, which `bench` measures; on the GPU
#            without its inductor compile check, a minute, which gpu_suite.sh keeps): suite.json
#   train    catalogs_gpu for min(GPU_CHECK_TRAIN_MINUTES (4), what the budget leaves) minutes: train.log
#   eval     beam evaluation (the recipe's beam) of >= GPU_CHECK_EVAL_LINES (2,000) test lines: eval.json
#   summary  summary.json and summary.md: every figure, each step's status, the targets met / missed / not run
#
# Environment: OUT; GPU_CHECK_BUDGET_S (default 540: every limit shrinks to what is left of it);
# GPU_CHECK_TIMEOUT_<STEP> (seconds, e.g. GPU_CHECK_TIMEOUT_SUITE=60); GPU_CHECK_PYTHON (default python3; --cpu:
# .venv/bin/python if there is one); WHEELS (default wheels/); GPU_CHECK_WORK (site, run directory; default
# .gpu_check/, git-ignored); SHARDS (default shards/catalogs; --cpu: WORK/shards); GPU_CHECK_TRAIN_MINUTES.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
cpu=0
steps="install,env,launch,corpus,bench,suite,train,eval"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) cpu=1; shift ;;
    --steps) steps="$2"; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/gpu_check_out}"
WORK="${GPU_CHECK_WORK:-$ROOT/.gpu_check}"
WHEELS="${WHEELS:-$([[ $cpu == 1 ]] || echo "$ROOT/wheels")}"  # --cpu: none unless given (they are the GPU's)
mkdir -p "$OUT" "$WORK" || exit 0
OUT="$(cd "$OUT" && pwd)"; WORK="$(cd "$WORK" && pwd)"
PY="${GPU_CHECK_PYTHON:-python3}"  # the GPU image's Python (a .venv made by launch.sh's dry run is not used)
[[ $cpu == 1 && -z "${GPU_CHECK_PYTHON:-}" && -x .venv/bin/python ]] && PY="$ROOT/.venv/bin/python"
SITE="$WORK/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor_cache}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$WORK/torch_ext}"
if [[ $cpu == 1 ]]; then
  budget="${GPU_CHECK_BUDGET_S:-1200}"
  SHARDS="${SHARDS:-$WORK/shards/catalogs}"
  export SCALETRAIN_AUTO_PRECISION=fp32 DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
  budget="${GPU_CHECK_BUDGET_S:-540}"
  SHARDS="${SHARDS:-$ROOT/shards/catalogs}"
fi
t_start=$(date +%s)
deadline=$((t_start + budget))
steps_tsv="$OUT/steps.tsv"
printf 'step\tstatus\trc\tseconds\tlimit\n' > "$steps_tsv"
declare -A want=()
for s in ${steps//,/ }; do
  [[ ",install,env,launch,corpus,bench,suite,train,eval," == *",$s,"* ]] \
    || { echo "gpu_check.sh: --steps: unknown step '$s' (install,env,launch,corpus,bench,suite,train,eval)" >&2; exit 2; }
  want[$s]=1
done
: > "$OUT/gpu_check.log"
say() { echo "[gpu_check $(( $(date +%s) - t_start ))s] $*" | tee -a "$OUT/gpu_check.log"; }
say "mode $([[ $cpu == 1 ]] && echo cpu || echo gpu), budget ${budget}s, steps $steps, python $PY, OUT $OUT"

# limit NAME GPU CPU RESERVE: the step's seconds: GPU_CHECK_TIMEOUT_<NAME>, else GPU (or CPU with --cpu), at most
# what the budget leaves after RESERVE seconds kept for the steps after it
limit() {
  local var="GPU_CHECK_TIMEOUT_${1^^}" left=$((deadline - $(date +%s) - $4)) d=$2
  [[ $cpu == 1 ]] && d=$3
  local l="${!var:-$d}"
  (( l > left )) && l=$left
  echo $(( l > 0 ? l : 0 ))
}
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$steps_tsv"; say "$1: $2 (rc $3, $4 s of $5 s)"; }
status_of() {  # rc -> ok / failed / timed out
  case "$1" in 0) echo ok ;; 124|137) echo "timed out" ;; *) echo failed ;; esac
}
# step NAME LIMIT CMD...: run CMD under `timeout LIMIT`, output to $OUT/NAME.log, status recorded
step() {
  local name="$1" lim="$2"; shift 2
  if [[ -z "${want[$name]:-}" ]]; then record "$name" "not run" - 0 0; return 0; fi
  if (( lim < 5 )); then record "$name" "not run" - 0 "$lim"; say "$name: no time left in the budget"; return 0; fi
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$lim" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  record "$name" "$(status_of $rc)" "$rc" $(( $(date +%s) - t0 )) "$lim"
  return 0
}
# background NAME LIMIT CMD...: the same, started now; `finish NAME` waits for it and records it
declare -A bg_pid=() bg_t0=() bg_lim=()
background() {
  local name="$1" lim="$2"; shift 2
  if [[ -z "${want[$name]:-}" ]]; then record "$name" "not run" - 0 0; return 0; fi
  bg_t0[$name]=$(date +%s); bg_lim[$name]=$lim
  ( rc=0; timeout --kill-after=10 "$lim" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    echo "$rc $(( $(date +%s) - bg_t0[$name] ))" > "$WORK/$name.rc" ) &
  bg_pid[$name]=$!
}
finish() {
  local name="$1" rc secs
  [[ -n "${bg_pid[$name]:-}" ]] || return 0
  wait "${bg_pid[$name]}" 2>/dev/null
  read -r rc secs < "$WORK/$name.rc" 2>/dev/null || { rc=1; secs=$(( $(date +%s) - bg_t0[$name] )); }
  record "$name" "$(status_of "$rc")" "$rc" "$secs" "${bg_lim[$name]}"
  unset "bg_pid[$name]"
}

# ---- the steps' functions (each runs under `timeout` in a child bash) -------------------------------------------
install_wheels() {  # the wheels brought along, onto PYTHONPATH
  local whl=()
  [[ -n "$WHEELS" ]] && for w in "$WHEELS"/*.whl; do [[ -f "$w" && "$(basename "$w")" != setuptools-* ]] && whl+=("$w"); done
  if [[ ${#whl[@]} -gt 0 ]]; then
    echo "installing ${#whl[@]} wheels of $WHEELS into $SITE"
    "$PY" -m pip install --disable-pip-version-check --no-index --no-deps --upgrade --target "$SITE" "${whl[@]}" \
      || return 1
  else
    echo "no wheels in '$WHEELS' (bash scripts/gpu_wheels.sh builds them where an index is reachable)"
  fi
  "$PY" benchmarks/gpu_check.py modules --wheels "$WHEELS" --json "$OUT/install.json"
}
launch_check() {  # the user's command, as far as its dry run goes
  if [[ $cpu == 1 ]]; then  # the project's .venv as it is (a fresh one would download torch here)
    [[ -x .venv/bin/python ]] || { echo "no .venv here: a dry run would install one (not on a CPU check)"; return 3; }
    bash launch.sh --dry-run --recipe catalogs_gpu
  else  # as a user on this image: no PYTHONPATH, no index, the wheels as the only source of packages
    env -u PYTHONPATH PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS" PIP_CONFIG_FILE=/dev/null bash launch.sh --dry-run
  fi
}
build_corpus() {
  if [[ -f "$SHARDS/manifest.json" ]]; then echo "corpus: $SHARDS is there already"; return 0; fi
  if [[ $cpu == 1 ]]; then  # two languages, a few hundred pairs each
    "$PY" -m scaletrain prepare --catalogs system,packages --langs de,ru --max-per-lang 300 --max-bytes 96 \
      --valid-frac 0.05 --test-frac 0.05 --out "$SHARDS" --overwrite
  else  # README's Data section (no SentencePiece model: catalogs_gpu is a byte model)
    "$PY" -m scaletrain prepare --catalogs system,packages --max-per-lang 20000 --max-bytes 256 \
      --valid-frac 0.01 --test-frac 0.02 --out "$SHARDS" --overwrite
  fi
}
train_job() {  # catalogs_gpu through DeepSpeed's per-node launcher, as ./launch.sh starts one node
  [[ -f "$SHARDS/manifest.json" ]] || { echo "no corpus at $SHARDS (see corpus.log)"; return 3; }
  rm -rf "$RUN"
  local over=("data.shards=$SHARDS" "train.out_dir=$RUN" "train.max_minutes=$1" $TRACKING)
  if [[ $cpu == 1 ]]; then
    over+=(model.d_model=32 model.n_heads=2 model.encoder_layers=1 model.decoder_layers=1 model.ffn_dim=64
           model.max_positions=128 data.max_bytes=96 data.max_tokens=512 train.max_steps=8 train.log_every=4
           train.valid_every=0 train.save_every=0 eval.beam=2 engine.compile=false)
  fi
  echo "training catalogs_gpu for at most $1 minutes: ${over[*]}"
  "$PY" -m scaletrain.engine.launch --nproc 1 --log_level error -- scaletrain train --config catalogs_gpu "${over[@]}"
}
eval_job() {
  [[ -f "$RUN/checkpoints/latest" ]] || { echo "no checkpoint in $RUN (see train.log)"; return 3; }
  local n
  n=$("$PY" benchmarks/gpu_check.py eval-lines "$SHARDS" --lines "$EVAL_LINES") || return 1
  echo "evaluating $RUN: the first $n test lines of each direction"
  "$PY" -m scaletrain evaluate --checkpoint "$RUN" --max-lines "$n" --no-track --json "$OUT/eval.json" \
    --hyp-dir "$OUT/hyp"
}
TRACKING=""
EVAL_LINES="${GPU_CHECK_EVAL_LINES:-$((cpu == 1 ? 32 : 2000))}"
export PY WHEELS SITE OUT WORK cpu SHARDS EVAL_LINES RUN="$WORK/run"
export -f install_wheels launch_check build_corpus train_job eval_job

# ---- install, env ---------------------------------------------------------------------------------------------------
step install "$(limit install 90 90 420)" install_wheels
grep -h "^missing:" "$OUT/install.log" 2>/dev/null | tee -a "$OUT/gpu_check.log"
"$PY" -c "import mlflow" >/dev/null 2>&1 || TRACKING="tracking.enabled=false"
export TRACKING
step env "$(limit env 45 90 400)" "$PY" benchmarks/gpu_check.py env --json "$OUT/env.json"

# ---- beside the GPU steps: the user's command on a fresh tree, and the corpus (CPU work) -----------------------------
background launch "$(limit launch 240 150 60)" launch_check
background corpus "$(limit corpus 300 150 60)" build_corpus

# ---- bench: the training step, ours vs HF Marian ----------------------------------------------------------------------
if [[ $cpu == 1 ]]; then
  bench_args=(--smoke --budgets 64,256 --variants ds,ds-compiled,acc-compiled,hf)  # HF's compile: a GPU's minute
else
  bench_args=(--budgets 16384,65536 --variants hf,ds-compiled,acc-compiled,hf-compiled --rounds 3 --steps 5
              --warmup 2 --profile-steps 2)
fi
lim=$(limit bench 130 300 320)
step bench "$lim" "$PY" benchmarks/bench_gpu_step.py "${bench_args[@]}" --deadline-s $((lim > 30 ? lim - 15 : lim)) \
  --json "$OUT/bench.json"

# ---- suite --------------------------------------------------------------------------------------------------------------
suite_args=(--benches variants,moe,decode --json "$OUT/suite.json")
# on the GPU the compile check (inductor: a minute) is left to gpu_suite.sh; the step benchmark compiles our step
if [[ $cpu == 1 ]]; then suite_args+=(--cpu); else suite_args+=(--skip compile); fi
step suite "$(limit suite 90 200 240)" "$PY" benchmarks/gpu_suite.py "${suite_args[@]}"

# ---- the real job: train for what the budget leaves (at most GPU_CHECK_TRAIN_MINUTES), then evaluate ------------------
finish corpus
eval_reserve=$((cpu == 1 ? 120 : 60))
startup=$((cpu == 1 ? 180 : 60))
left=$((deadline - $(date +%s) - eval_reserve - 15))
minutes=$(awk -v l="$left" -v s="$startup" -v m="${GPU_CHECK_TRAIN_MINUTES:-4}" \
  'BEGIN { t = (l - s) / 60; if (t > m) t = m; if (t < 0) t = 0; printf "%.2f", t }')
if [[ -n "${want[train]:-}" ]] && awk -v m="$minutes" 'BEGIN { exit !(m < 0.25) }'; then
  record train "not run" - 0 0; say "train: no time left in the budget ($left s before the evaluation)"
else
  say "train: $minutes minutes of training ($left s left before the evaluation)"
  lim=$(awk -v m="$minutes" -v s="$startup" 'BEGIN { printf "%d", m * 60 + s }')
  step train "$(limit train "$lim" "$lim" $((eval_reserve + 10)))" train_job "$minutes"
fi
step eval "$(limit eval 120 240 10)" eval_job
finish launch

# ---- summary ------------------------------------------------------------------------------------------------------------
say "summary"
timeout 60 "$PY" benchmarks/gpu_check.py summary "$OUT" --budget "$budget" --elapsed $(( $(date +%s) - t_start )) \
  --train-minutes "$minutes" $([[ $cpu == 1 ]] && echo --cpu) > "$OUT/summary.log" 2>&1 \
  || say "summary: failed (summary.log)"
cat "$OUT/summary.md" 2>/dev/null
say "done in $(( $(date +%s) - t_start ))s"
exit 0
