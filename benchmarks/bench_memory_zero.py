"""Per-rank model-state memory (parameters + gradients + optimizer states) for ZeRO 0/1/2/3.

    python benchmarks/bench_memory_zero.py [--ranks 1,2,4] [--stages 0,1,2,3] [--precision fp32]

Byte Transformer base (d 512, 6+6 layers, FFN 2048, 8 heads), CPU ranks under the `deepspeed` launcher
(gloo), one launch per world size training each stage in turn for one update on a tiny batch. Memory is
counted, not sampled, at the moment of the second optimizer step (gradients present, Adam moments
allocated): every distinct tensor storage of the model parameters (ZeRO-3: their partitions), their
gradients, the optimizer's fp32 master partitions with their gradients, and the Adam moments.
Communication buckets are not model state and are not counted. The rank holding the most is shown;
ratios are against stage 0 at the same world size and against the ideal (stage-0 memory) / N.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views into one flat buffer count once)."""
    import torch

    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.numel() > 0:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def model_states(module, base_opt) -> dict:
    """What a rank holds for the model at the optimizer step: parameters (ZeRO-3: partitions), gradients
    (full or partitioned), fp32 master partitions and Adam moments. Communication buckets are not
    model state and are not counted."""
    params, grads = [], []
    for p in module.parameters():
        params.append(getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p.data)
        grads.append(p.grad)
    for g in base_opt.param_groups:
        for p in g["params"]:
            params.append(p.data)  # fp32 master partitions (the module params themselves at stage 0)
            grads.append(p.grad)
    states = [v for st in base_opt.state.values() for v in st.values()]
    out = {"params": storage_bytes(params), "grads": storage_bytes(grads), "optim": storage_bytes(states)}
    out["total"] = storage_bytes(params + grads + states)
    return out


def worker(out: str, stages: list[int], precision: str) -> None:
    import torch

    from scaletrain.config import load_config
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.models.loss import label_smoothed_ce
    from scaletrain.vocab import ByteVocab

    res = {}
    for stage in stages:
        cfg = load_config("base", [f"engine.ds_config=zero{stage}.json", f"engine.precision={precision}",
                                   "engine.grad_accum=1", "optim.clip_norm=0", "tracking.enabled=false"])
        eng = build_engine(cfg)
        torch.manual_seed(0)
        model = build_model(cfg.model, ByteVocab(["de", "fr", "ru", "ar", "hi", "ja", "zh", "en"]).size)
        n_params = sum(p.numel() for p in model.parameters())
        eng.setup(model)
        ds = eng.backend.e
        base = ds.basic_optimizer
        seen = []
        inner_step = base.step

        def measured_step(*a, **k):
            seen.append(model_states(ds.module, base))  # grads present, moments from the previous update
            return inner_step(*a, **k)

        base.step = measured_step
        for _ in range(2):
            src = torch.randint(4, 200, (2, 16))
            tgt = torch.randint(4, 200, (2, 17))
            loss, _, n = label_smoothed_ce(eng.forward(src, tgt[:, :-1]), tgt[:, 1:], epsilon=0.1, ignore_index=0)
            eng.backward(loss / n)
            eng.step()
        res[stage] = {**seen[-1], "n_params": n_params}
        eng.parallel.barrier()
        base.step = inner_step
    rank = int(os.environ["RANK"])
    Path(out, f"mem_ws{os.environ['WORLD_SIZE']}_rank{rank}.json").write_text(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"], help="bf16: the base recipe's")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    if args.worker:
        worker(args.worker, stages, args.precision)
        return
    out = tempfile.mkdtemp(prefix="bench_mem_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    exe = str(Path(sys.executable).with_name("deepspeed"))
    ranks = [int(r) for r in args.ranks.split(",")]
    for n in ranks:
        cmd = [exe, "--num_gpus", str(n), "--master_port", str(29700 + n), "--no_local_rank", __file__,
               "--worker", out, "--stages", args.stages, "--precision", args.precision]
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    mb = 2**20
    print(f"per-rank model-state memory (params + grads + optimizer states), byte Transformer base, {args.precision}")
    print(f"{'ranks':>5s} {'stage':>5s} {'MiB/rank':>9s} {'params':>8s} {'grads':>8s} {'optim':>8s} "
          f"{'vs stage0':>9s} {'vs stage0/N':>11s}")
    for n in ranks:
        per = [json.loads(Path(out, f"mem_ws{n}_rank{r}.json").read_text()) for r in range(n)]
        base = None
        for s in stages:
            big = max(per, key=lambda p: p[str(s)]["total"])[str(s)]  # the rank holding the most
            m = big["total"]
            if s == 0:
                base = m
            rel = f"{m / base:8.2f}x" if base else "-"
            ideal = f"{m / (base / n):10.2f}x" if base else "-"
            print(f"{n:5d} {s:5d} {m / mb:9.1f} {big['params'] / mb:8.1f} {big['grads'] / mb:8.1f} "
                  f"{big['optim'] / mb:8.1f} {rel:>9s} {ideal:>11s}")
    print(f"(parameters: {per[0][str(stages[0])]['n_params'] / 1e6:.1f}M; raw per-rank numbers in {out})")


if __name__ == "__main__":
    main()
