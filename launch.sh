#!/usr/bin/env bash
# The main job: prepare the bundled corpus if missing, train on every local GPU (2 CPU ranks when
# there is none), evaluate, print BLEU/chrF and the commands to try next on this run.
#
#   ./launch.sh                                   # default: recipe "small" (catalogs_gpu on a GPU), 9 minutes
#   ./launch.sh --recipe base optim.lr=7e-4       # a recipe and dotted overrides
#   ./launch.sh --nproc 4 --hostfile hosts --num_nodes 2 --master_addr 10.0.0.1
#   ./launch.sh --engine accelerate               # accelerate launch with our YAML
#   ./launch.sh --elastic 1:4 --nproc 8 --master_addr node0   # on each node: torchrun's elastic agent
set -euo pipefail
cd "$(dirname "$0")"
usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'USAGE'
options:
  --recipe NAME|PATH     packaged recipe or YAML file (default: small; catalogs_gpu where nvidia-smi lists a GPU)
  --nproc N              processes per node (default: #GPUs, or 2 on a CPU-only machine)
  --hostfile F           DeepSpeed hostfile for multi-node runs
  --num_nodes N          number of nodes
  --node_rank K          this node's rank (with --no_ssh)
  --master_addr A        rendezvous address
  --master_port P        rendezvous port
  --no_ssh               launch only this node (one launcher per node)
  --engine E             deepspeed (default) or accelerate
  --elastic MIN:MAX      torchrun's elastic agent, the same command on each node (MIN to MAX nodes, --nproc
                         each; --master_addr: the node holding the rendezvous, port --master_port or 29500):
                         a lost node makes the others restart from the last checkpoint with the same global
                         batch, up to 3 times (SCALETRAIN_ELASTIC_RESTARTS); a configuration error is not
                         retried. Rendezvous: join_timeout=600 (s a node waits for MIN nodes),
                         last_call_timeout=30 (s it then waits for more, up to MAX), close_timeout=30
  --rdzv_conf K=V,...    with --elastic: replaces those rendezvous settings (torchrun's --rdzv-conf)
  --out DIR              run directory (default: runs/RECIPE-TIMESTAMP)
  --no-eval              skip evaluation
  --verbose              every library's log lines too (DeepSpeed's launcher, MLflow, ...)
  --dry-run              check everything, print what would run (recipe, ranks, corpus, precision), start nothing
  KEY=VALUE              config overrides (e.g. train.max_steps=200)

Only the bundled corpus (data.shards=shards/django, the CPU default) and the catalogs corpus (shards/catalogs,
from every gettext catalog of this machine: the GPU default) are built here when missing; any other
data.shards must hold shards written by 'scaletrain prepare' (else one error line, exit 2, nothing started).
At the end: the commands to try next on this run (translate, evaluate with a beam, compare, export, mlflow ui),
on node 0 only (--node_rank 0 or none); the other nodes print one line each.
A lost node or rank (killed, cut off from the network): exit code 76 (retry) on every surviving node;
re-run with the same --out to resume from the last checkpoint.
SIGTERM/SIGINT/SIGUSR1 to this script or the job's process group: every rank checkpoints at the next step
boundary, the MLflow run ends KILLED, exit code 75; re-run with the same --out to resume.
USAGE
}
recipe=""; nproc=""; engine=deepspeed; out=""; do_eval=1; verbose=0; dry_run=0; elastic=""
rdzv_conf="join_timeout=600,last_call_timeout=30,close_timeout=30"
ds_args=(); overrides=()
declare -A launcher_opt=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --recipe) recipe="$2"; shift 2 ;;
    --nproc|--num_gpus) nproc="$2"; shift 2 ;;
    --hostfile|--num_nodes|--node_rank|--master_addr|--master_port)
      ds_args+=("$1" "$2"); launcher_opt["${1#--}"]="$2"; shift 2 ;;
    --no_ssh) ds_args+=("$1"); shift ;;
    --engine) engine="$2"; shift 2 ;;
    --elastic) elastic="$2"; shift 2 ;;
    --rdzv_conf) rdzv_conf="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-eval) do_eval=0; shift ;;
    --verbose) verbose=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "launch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
bash scripts/bootstrap.sh
user_path="$PATH"
export PATH="$PWD/.venv/bin:$PATH"
gpus=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpus=$(nvidia-smi -L | wc -l)
[[ -n "$nproc" ]] || { if [[ $gpus -gt 0 ]]; then nproc=$gpus; else nproc=2; fi; }
# The default job: the small model on the bundled corpus on CPU; on a GPU the papers' base model on the
# catalogs corpus, sized for one GPU (scaletrain/recipes/catalogs_gpu.yaml), in the same 9 minutes.
[[ -n "$recipe" ]] || { if [[ $gpus -gt 0 ]]; then recipe=catalogs_gpu; else recipe=small; fi; }
[[ -n "$out" || -z "$elastic" ]] || { echo "launch.sh: --elastic needs --out DIR, the same on every node (a directory every node sees: the run resumes from it after a restart)" >&2; exit 2; }
[[ -n "$out" ]] || out="runs/$(basename "${recipe%.yaml}")-$(date +%Y%m%d-%H%M%S)"
overrides+=("train.out_dir=$out")
[[ "$engine" == deepspeed || "$engine" == accelerate ]] || { echo "launch.sh: --engine must be deepspeed or accelerate" >&2; exit 2; }
[[ "$engine" == accelerate ]] && overrides=("engine.backend=accelerate" "${overrides[@]}")
num_nodes=${launcher_opt[num_nodes]:-1}
if [[ -n "$elastic" ]]; then  # torchrun's elastic agent: it, not these options, places the nodes and ranks
  [[ "$elastic" =~ ^([0-9]+):([0-9]+)$ && ${BASH_REMATCH[1]} -ge 1 && ${BASH_REMATCH[2]} -ge ${BASH_REMATCH[1]} ]] \
    || { echo "launch.sh: --elastic must be MIN:MAX node counts with 1 <= MIN <= MAX (e.g. 1:4), got '$elastic'" >&2; exit 2; }
  [[ -n "${launcher_opt[master_addr]:-}" ]] || { echo "launch.sh: --elastic needs --master_addr (the node that holds the rendezvous; the same on every node)" >&2; exit 2; }
  for o in hostfile num_nodes node_rank; do
    [[ -z "${launcher_opt[$o]:-}" ]] || { echo "launch.sh: --$o does not go with --elastic (torchrun's rendezvous places the nodes); give --elastic MIN:MAX and --master_addr only" >&2; exit 2; }
  done
  [[ " ${ds_args[*]} " != *" --no_ssh "* && "$engine" == deepspeed ]] || { echo "launch.sh: --elastic runs the deepspeed engine under torchrun on every node: drop --no_ssh and --engine accelerate" >&2; exit 2; }
  num_nodes=${BASH_REMATCH[2]}  # the checks below are for the largest world
fi
[[ $verbose == 1 ]] && export SCALETRAIN_VERBOSE=1
# One check before any process starts: the config (unknown keys, ZeRO stage, ds_config file, fp16 without
# a GPU...), the shards (only the bundled corpus may be missing: it is built below) and the output
# directory fail here in one line. engine.precision=auto is resolved here once (GPU bf16 support / CPU bf16
# units + GEMM probe) and exported, so every rank of the job runs the same precision.
declare -A plan=()
plan_out=$(python -m scaletrain.engine.preflight --launch-plan --config "$recipe" --world-size $((nproc * num_nodes)) --local-ranks "$nproc" "${overrides[@]}")
while IFS='=' read -r key value; do plan["$key"]="$value"; done <<<"$plan_out"
export SCALETRAIN_AUTO_PRECISION="${SCALETRAIN_AUTO_PRECISION:-${plan[precision]}}"
# the engine the ranks will run: the config's (an engine.backend=accelerate override under --elastic too)
engine_said="${plan[backend]:-$engine}"; [[ "$engine_said" == accelerate ]] && engine_said="accelerate (${plan[accelerate]})"
if [[ -n "$elastic" ]]; then
  launch_cmd=(torchrun "--nnodes=$elastic" "--nproc-per-node=$nproc" "--max-restarts=${SCALETRAIN_ELASTIC_RESTARTS:-3}"
              --rdzv-backend=c10d "--rdzv-endpoint=${launcher_opt[master_addr]}:${launcher_opt[master_port]:-29500}"
              "--rdzv-id=$(basename "$out")" "--rdzv-conf=$rdzv_conf" -m scaletrain train --config "$recipe" "${overrides[@]}")
  # A node that comes back while the job runs joins it: the agents restart the workers for the larger world.
  # With the rendezvous TCP store shared with the workers (torch's default), torch's
  # DynamicRendezvousHandler.next_rendezvous keeps the first round's store address on the node that stays
  # rank 0 and never writes MASTER_ADDR/PORT under the new round's keys: the new node waits for them until
  # the rendezvous times out. With this each round builds them (and rank 0 of each attempt its own store).
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
if [[ $dry_run == 1 ]]; then
  [[ -n "$elastic" ]] && echo "== dry run: would run on each node: ${launch_cmd[*]}"
  echo "== dry run: recipe $recipe, $nproc process(es) per node x $num_nodes node(s) with $engine_said, GPUs seen $gpus,"
  echo "   precision $SCALETRAIN_AUTO_PRECISION, shards ${plan[shards]}$([[ "${plan[prepare]}" == 1 ]] && echo " (to build: scaletrain prepare --out ${plan[shards]}${plan[prepare_args]:+ ${plan[prepare_args]}})"), out $out"
  exit 0
fi
# Quiet start: DeepSpeed need not probe for an accelerator (its "Setting accelerator to CPU" warning) on a
# machine torch finds no GPU on; the ranks take the user's OMP_NUM_THREADS, not a launcher's.
[[ "${plan[cuda]}" == 0 && -z "${DS_ACCELERATOR:-}" ]] && export DS_ACCELERATOR=cpu
export SCALETRAIN_USER_OMP_NUM_THREADS="${OMP_NUM_THREADS:-}"
# A fresh clone has no MLflow store yet: MLflow's schema migrations (3-10 s) run beside the corpus
# preparation and the launcher's start, not on rank 0's way to the first step.
python -m scaletrain.engine.preflight --init-tracking-store --config "$recipe" "${overrides[@]}" >/dev/null &
store_pid=$!
shards="${plan[shards]}"
if [[ "${plan[prepare]}" == 1 ]]; then
  read -r -a prepare_args <<<"${plan[prepare_args]}"
  echo "== preparing the corpus: scaletrain prepare --out $shards${plan[prepare_args]:+ ${plan[prepare_args]}}"
  scaletrain prepare --out "$shards" --overwrite "${prepare_args[@]}"
fi
echo "== training $recipe on $nproc process(es) per node with $engine_said -> $out"
t0=$(date +%s)
if [[ -n "$elastic" ]]; then
  echo "== elastic ($elastic nodes): ${launch_cmd[*]}"
elif [[ "$engine" == accelerate ]]; then
  # Accelerate: our YAML (DDP or the DeepSpeed plugin, from engine.accelerate); launcher flags mapped.
  acc_args=(--num_processes $((nproc * num_nodes)))
  # its launcher (torch.distributed.run under the DeepSpeed plugin) warns when OMP_NUM_THREADS is unset; the
  # ranks pick their threads by our rule either way (the user's value is in SCALETRAIN_USER_OMP_NUM_THREADS)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${plan[threads]}}"
  [[ -n "${launcher_opt[hostfile]:-}" ]] && { echo "launch.sh: --hostfile is a deepspeed-launcher option; with --engine accelerate give --num_nodes/--node_rank/--master_addr on each node" >&2; exit 2; }
  [[ $num_nodes -gt 1 ]] && acc_args+=(--num_machines "$num_nodes" --machine_rank "${launcher_opt[node_rank]:-0}")
  [[ -n "${launcher_opt[master_addr]:-}" ]] && acc_args+=(--main_process_ip "${launcher_opt[master_addr]}")
  [[ -n "${launcher_opt[master_port]:-}" ]] && acc_args+=(--main_process_port "${launcher_opt[master_port]}")
  if [[ "${plan[accelerate]}" == deepspeed ]]; then
    acc_args+=(--config_file ds_configs/accelerate_deepspeed.yaml --deepspeed_config_file "${plan[ds_json]}")
  else
    acc_args+=(--config_file ds_configs/accelerate_ddp.yaml)
  fi
  launch_cmd=(accelerate launch "${acc_args[@]}" -m scaletrain train --config "$recipe" "${overrides[@]}")
else
  # --log_level error: the runner's and launcher's INFO lines (their command lines, CUDA_VISIBLE_DEVICES on
  # a machine without GPU, "Unable to find hostfile") are not facts of the run; --verbose shows them.
  ds_log=error; [[ $verbose == 1 ]] && ds_log=info
  if [[ ${#ds_args[@]} -eq 0 || ( ${#ds_args[@]} -eq 2 && -n "${launcher_opt[master_port]:-}" ) ]]; then
    # one node: DeepSpeed's per-node launcher directly (no `deepspeed` dispatcher process, no MLflow import
    # in the launcher; scaletrain/engine/launch.py), on a free port unless --master_port is given
    launch_cmd=(python -m scaletrain.engine.launch --nproc "$nproc" --log_level "$ds_log"
                --master_port "${launcher_opt[master_port]:-0}" -- scaletrain train --config "$recipe" "${overrides[@]}")
  else
    launch_cmd=(deepspeed --log_level "$ds_log" --num_gpus "$nproc" "${ds_args[@]}" --no_local_rank --module scaletrain
                train --config "$recipe" "${overrides[@]}")
  fi
fi
# Preemption: a signal to this script alone (a container runtime's SIGTERM to PID 1) goes to the launcher
# and every rank (the deepspeed runner forwards signals only for multi-node launches). The ranks
# checkpoint at the next step boundary and exit; we exit 75 and a re-run with the same --out resumes.
rm -f "$out/preempted.json"
# A rank that stops on an error writes its exit code here too (2: fix the input, 71: out of memory, 76: a
# peer or host was lost, retry), because torchrun and `accelerate launch` exit 1 whatever code a rank ended
# with (DeepSpeed's launchers pass it on).
exit_file=$(mktemp "${TMPDIR:-/tmp}/scaletrain-exit.XXXXXX")
export SCALETRAIN_EXIT_FILE="$exit_file"
set -m  # the launcher and its ranks get a process group of their own
"${launch_cmd[@]}" &
child=$!
set +m
forward() { kill -s "$1" -- "-$child" 2>/dev/null || true; }
trap 'forward TERM' TERM; trap 'forward INT' INT; trap 'forward USR1' USR1
while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done  # a trapped signal interrupts wait
rc=0; wait "$child" || rc=$?
trap - TERM INT USR1
if [[ -f "$out/preempted.json" ]]; then
  echo "== preempted: $(cat "$out/preempted.json"); re-run with --out $out (same arguments) to resume" >&2
  exit 75
fi
rank_code=$(cat "$exit_file" 2>/dev/null || true); rm -f "$exit_file"
if [[ $rc -ne 0 && "$rank_code" == 76 ]]; then
  echo "== a peer or host was lost (exit 76: retry): re-run the same command (--out $out) to resume from the last checkpoint" >&2
  exit 76
fi
if [[ $rc -ne 0 && "$rank_code" =~ ^[0-9]+$ && "$rank_code" != 0 ]]; then
  exit "$rank_code"  # the rank's own code (its line is above), not the launcher's 1
fi
[[ $rc -eq 0 ]] || exit "$rc"
node_rank=${launcher_opt[node_rank]:-0}
if [[ -n "$elastic" ]]; then  # the node holding the rendezvous speaks for the job (any node could: one run dir)
  node_rank=1
  for a in $(hostname) $(hostname -I 2>/dev/null); do [[ "$a" == "${launcher_opt[master_addr]}" ]] && node_rank=0; done
fi
if [[ "$node_rank" != 0 ]]; then  # one voice per job: the summary and next commands are node 0's
  wait "$store_pid" 2>/dev/null || true
  echo "== $(hostname) (node $node_rank): training done; the summary and the commands to try next are on node 0"
  exit 0
fi
wait "$store_pid" 2>/dev/null || true
t1=$(date +%s)
echo "== training took $((t1 - t0))s"
if [[ $do_eval == 1 ]]; then
  echo "== evaluating $out on the test split"
  scaletrain evaluate --checkpoint "$out" --json "$out/eval_test.json"
fi
# What to try next, on this run (the venv's commands: activate it first unless scaletrain is on PATH).
python - "$out" "$(PATH="$user_path" command -v scaletrain || true)" <<'NEXT'
import json, shlex, sys
from pathlib import Path
run, on_path = Path(sys.argv[1]), sys.argv[2]
q = shlex.quote(str(run))
langs = ["en", "de"]
try:
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    langs = json.loads((ckpt / "langs.json").read_text()) or langs
except (OSError, ValueError):
    pass
src = "en" if "en" in langs else langs[0]
tgt = "de" if "de" in langs and src != "de" else next((l for l in langs if l != src), src)
try:
    info = json.loads((run / "tracking" / "run.json").read_text())
    uri, exp = info["uri"], info.get("experiment", "scaletrain")
except (OSError, ValueError, KeyError):
    uri, exp = None, None
print("== next: try these on this run" + ("" if on_path else " (first: source .venv/bin/activate)"))
print(f"  echo 'Save changes' | scaletrain translate --checkpoint {q} --src-lang {src} --tgt-lang {tgt}")
print(f"  scaletrain evaluate --checkpoint {q} --beam 4 --json {shlex.quote(str(run / 'eval_test_beam4.json'))}")
others = sorted((p.parent.parent for p in run.parent.glob("*/tracking/run.json")
                 if p.parent.parent.resolve() != run.resolve()), key=lambda p: p.stat().st_mtime)
other = f" {shlex.quote(str(others[-1]))}" if others else ""
print(f"  scaletrain compare {q}{other} --plot {shlex.quote(str(run / 'compare.png'))}    # more run dirs or run ids: more columns")
print(f"  scaletrain export {q} --out {shlex.quote(str(run / 'model.safetensors'))}"
      f"    # or --format hf --out {shlex.quote(str(run / 'hf'))}")
def page(base):  # the run's page, in the UI's training view (MLflow 3 opens on its GenAI view otherwise)
    eid = info.get("experiment_id")
    return (f"{base}/#/experiments/{eid}/runs/{info['run_id']}?workflowType=machine_learning" if eid
            else f"{base} (experiment '{exp}', run {info['run_id']})")
if uri and uri.startswith(("sqlite:", "file:", "/")):
    print(f"  mlflow ui --backend-store-uri {shlex.quote(uri)}    # then open {page('http://127.0.0.1:5000')}")
elif uri:
    print(f"  MLflow: {page(uri.rstrip('/'))}")
else:
    print("  (MLflow tracking was off for this run: tracking.enabled=false)")
NEXT
