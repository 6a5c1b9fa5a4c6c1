#!/usr/bin/env bash
# The main job: prepare the bundled corpus if missing, train on every local GPU (2 CPU ranks when
# there is none), evaluate, and print BLEU/chrF and where the MLflow run is.
#
#   ./launch.sh                                   # default: recipe "small", bounded budget
#   ./launch.sh --recipe base optim.lr=7e-4       # a recipe and dotted overrides
#   ./launch.sh --nproc 4 --hostfile hosts --num_nodes 2 --master_addr 10.0.0.1
#   ./launch.sh --engine accelerate               # accelerate launch with our YAML
set -euo pipefail
cd "$(dirname "$0")"
usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  cat <<USAGE
options:
  --recipe NAME|PATH     packaged recipe or YAML file (default: small)
  --nproc N              processes per node (default: #GPUs, or 2 on a CPU-only machine)
  --hostfile F           DeepSpeed hostfile for multi-node runs
  --num_nodes N          number of nodes
  --node_rank K          this node's rank (with --no_ssh)
  --master_addr A        rendezvous address
  --master_port P        rendezvous port
  --no_ssh               launch only this node (one launcher per node)
  --engine E             deepspeed (default) or accelerate
  --out DIR              run directory (default: runs/RECIPE-TIMESTAMP)
  --no-eval              skip evaluation
  KEY=VALUE              config overrides (e.g. train.max_steps=200)
USAGE
}
recipe=small; nproc=""; engine=deepspeed; out=""; do_eval=1
ds_args=(); overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --recipe) recipe="$2"; shift 2 ;;
    --nproc|--num_gpus) nproc="$2"; shift 2 ;;
    --hostfile|--num_nodes|--node_rank|--master_addr|--master_port) ds_args+=("$1" "$2"); shift 2 ;;
    --no_ssh) ds_args+=("$1"); shift ;;
    --engine) engine="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-eval) do_eval=0; shift ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "launch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc=$(nvidia-smi -L | wc -l)
  else
    nproc=2
  fi
fi
[[ -n "$out" ]] || out="runs/$(basename "${recipe%.yaml}")-$(date +%Y%m%d-%H%M%S)"
overrides+=("train.out_dir=$out")
# Validate the config (and learn the shard directory) before starting any process.
shards=$(scaletrain train --config "$recipe" "${overrides[@]}" --print-config | python -c 'import sys,yaml; print(yaml.safe_load(sys.stdin)["data"]["shards"])')
if [[ ! -f "$shards/manifest.json" ]]; then
  echo "== preparing bundled corpus into $shards"
  scaletrain prepare --out "$shards" --overwrite
fi
echo "== training $recipe on $nproc process(es) per node with $engine -> $out"
t0=$(date +%s)
if [[ "$engine" == accelerate ]]; then
  accelerate launch --config_file ds_configs/accelerate_ddp.yaml --num_processes "$nproc" \
    -m scaletrain train --config "$recipe" engine.backend=accelerate "${overrides[@]}"
else
  deepspeed --num_gpus "$nproc" "${ds_args[@]}" --no_local_rank --module scaletrain \
    train --config "$recipe" "${overrides[@]}"
fi
t1=$(date +%s)
echo "== training took $((t1 - t0))s"
if [[ $do_eval == 1 ]]; then
  echo "== evaluating $out on the test split"
  scaletrain evaluate --checkpoint "$out" --json "$out/eval_test.json"
fi
echo "== MLflow: run 'mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlruns.db}' and open the experiment 'scaletrain'"
