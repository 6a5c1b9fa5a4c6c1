"""One training step on a GPU: our engines (DeepSpeed, Accelerate; eager, compiled, CUDA-graphed) vs HF Marian.

    python benchmarks/bench_gpu_step.py [--budgets 4096,16384,65536] [--rounds 3] [--steps 10] [--warmup 3]
                                        [--variants ds,acc,ds-compiled,acc-compiled,ds-graphed,ds-old,hf,hf-compiled]
                                        [--json OUT.json] [--deadline-s S] [--smoke]

Every variant trains the same model size (``base``: d 512, 8 heads, FFN 2048, 6+6 layers; our byte
vocabulary) on the same fixed batches (B x 128 tokens per side, B = budget / 128) in bf16 with AdamW and
label-smoothed cross-entropy; a step is forward + loss + backward + update:

* ``ds``: our step (``train_step``: the step's host token count, ``TranslationUnit.loss``, the engine's
  backward and update) through the DeepSpeed engine, ZeRO-0 (bf16 by torch autocast, fp32 weights, fused
  AdamW, the non-finite check on the device); ``acc``: the same through Accelerate (plain DDP);
* ``ds-compiled``: ``ds`` with ``engine.compile=true`` (what a user's CUDA run gets: ``engine.compile: auto``
  compiles there); ``acc-compiled``: the same through Accelerate; ``ds-graphed``:
  ``engine.compile_mode=reduce-overhead`` (CUDA graphs; one capture per batch shape);
* ``ds-old``: ``ds`` with the DeepSpeed config of before (DeepSpeed's bf16 mode, i.e. its unfused optimizer,
  and its synchronising throughput timer);
* ``hf``: Hugging Face ``MarianMTModel`` of the same size under ``torch.autocast(bfloat16)`` with fused AdamW;
  ``hf-compiled``: the same after ``torch.compile``.

Rounds are interleaved (every variant at every budget, then the next round); each figure is the median
over rounds and each ratio (vs ``hf``) is taken within a round first. Per variant and budget it prints tokens/s
(target tokens), MFU (model FLOPs per target token x tokens/s over the bf16 matmul peak measured in the same
run: the best of a probe at the start and one after each round), host syncs per step (``aten::_local_scalar_dense`` plus CUDA stream/device/event synchronisations outside
torch's optimizer step in a ``torch.profiler`` trace of ``--profile-steps`` steps, ``sync_count.host_syncs``; and
the synchronising calls ``torch.cuda.set_sync_debug_mode('warn')`` reports in one step, column ``dbg``), kernel
launches per step and peak memory, and the warm-up (column ``warm s``: the first steps at that budget, the
compile included for the compiled variants, so what compiling costs is counted). The batches sit on the device
already (the training loop's prefetcher moves them while the previous step computes).

``--deadline-s S``: finish within S seconds of the start: a variant is warmed up only while its warm-up is
expected to fit, rounds stop when the next would not; what did not run is a row saying so. ``--json`` is
rewritten after every variant's warm-up and every round, so a run killed from outside (a time limit) leaves
what it had measured (``"complete": false`` until the end).

``--smoke``: CPU, tiny model, fp32, a few steps, compile with ``aot_eager``, no CUDA graphs: the CI test
(``benchmarks/gpu_check.sh --cpu``, tests/integration/test_gpu_check_cpu.py) runs it so the script keeps working
without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LANGS = ["de", "fr", "ru", "ar", "hi", "ja", "zh", "en"]
SEQ = 128  # tokens per sentence and side
VARIANTS = ("ds", "acc", "ds-compiled", "acc-compiled", "ds-graphed", "ds-old", "hf", "hf-compiled")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


@dataclass
class Row:
    variant: str
    budget: int
    seconds: list = field(default_factory=list)  # per round: mean seconds per step
    syncs: float | None = None
    sync_debug: int | None = None
    launches: float | None = None
    peak_mb: float | None = None
    warmup_s: float | None = None  # the warm-up steps at this budget, the compile included
    error: str = ""


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def matmul_peak(dev, dtype, n: int, reps: int = 10) -> float:
    """Best matmul throughput (FLOP/s) of n^3 products, this run."""
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        a @ b
        sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(dev)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n**3 / best


def model_overrides(smoke: bool) -> list[str]:
    if smoke:
        return ["model.d_model=64", "model.n_heads=2", "model.encoder_layers=2", "model.decoder_layers=2",
                "model.ffn_dim=128", "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40"]
    return ["model.max_positions=256", "data.max_bytes=200"]


def make_cfg(args, *over):
    from scaletrain.config import load_config

    return load_config("base", [*model_overrides(args.smoke), f"engine.precision={args.precision}",
                                "engine.ds_config=zero0.json", "engine.grad_accum=1", "optim.warmup_steps=10",
                                "tracking.enabled=false", "engine.compile=false", "data.max_tokens=100000", *over])


def make_batch(B: int, L: int, V: int, dev):
    from scaletrain.data.batch import Batch

    g = torch.Generator().manual_seed(B)
    src = torch.randint(4, V, (B, L), generator=g)
    tgt = torch.randint(4, V, (B, L + 1), generator=g)
    lang = torch.zeros(B, dtype=torch.long)
    b = Batch(src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous(), lang, lang, B * L, B * L)
    return b.to(dev)


def build_ours(args, variant: str, V: int):
    """(step(batch), the engine) for our variants."""
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.train.unit import TranslationUnit, train_step

    acc = ["engine.backend=accelerate", "engine.accelerate=ddp"]
    over = {"ds": [], "acc": acc, "ds-compiled": ["engine.compile=true"], "acc-compiled": [*acc, "engine.compile=true"],
            "ds-old": [],
            "ds-graphed": ["engine.compile=true", "engine.compile_mode=reduce-overhead"]}[variant]
    if args.smoke and "engine.compile=true" in over:
        over.append("engine.compile_backend=aot_eager")
    cfg = make_cfg(args, *over)
    eng = build_engine(cfg)
    if variant == "ds-old":  # the DeepSpeed config of before: its bf16 optimizer, its synchronising timer
        b = eng.backend  # the config DeepSpeed is given at setup
        b.ds_config = dict(b.ds_config, timers={"throughput": {"enabled": True, "synchronized": True}})
        if b.ds_config.get("torch_autocast", {}).get("enabled"):
            b.ds_config.update(torch_autocast={"enabled": False}, bf16={**b.ds_config["bf16"], "enabled": True})
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, V))
    eng.train(True)
    unit = TranslationUnit(eng, cfg.optim.label_smoothing, pad=0, langs=[])
    return (lambda batch: train_step(eng, unit, [batch], stop_vote=False)), eng


def build_hf(args, variant: str, V: int, dev):
    """step(batch) for MarianMTModel of the same size: autocast, fused AdamW, our label-smoothed loss."""
    from transformers import MarianConfig, MarianMTModel

    from scaletrain.models.loss import label_smoothed_ce

    m = make_cfg(args).model
    cfg = MarianConfig(vocab_size=V, d_model=m.d_model, encoder_layers=m.encoder_layers,
                       decoder_layers=m.decoder_layers, encoder_attention_heads=m.n_heads,
                       decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.ffn_dim, decoder_ffn_dim=m.ffn_dim,
                       max_position_embeddings=m.max_positions, dropout=m.dropout, attention_dropout=0.0,
                       activation_dropout=0.0, activation_function="relu", scale_embedding=True, pad_token_id=0,
                       eos_token_id=2, decoder_start_token_id=1, share_encoder_decoder_embeddings=True)
    torch.manual_seed(0)
    model = MarianMTModel(cfg).to(dev).train()
    if variant == "hf-compiled":
        model.compile(backend="aot_eager" if args.smoke else "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=True)
    bf16 = args.precision == "bf16"

    def step(b):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=b.src, decoder_input_ids=b.tgt_in).logits
        loss, _, n = label_smoothed_ce(logits, b.tgt_out, epsilon=0.1, ignore_index=0)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(step, batch, n: int, dev) -> float:
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        step(batch)
    sync(dev)
    return (time.perf_counter() - t) / n


def profile_counts(step, batch, n: int, dev) -> tuple[float, float | None]:
    """(host syncs, kernel launches) per step from a profiler trace of ``n`` steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(n):
            step(batch)
        sync(dev)
    from scaletrain.train.sync_count import host_syncs

    events = prof.events()
    syncs = host_syncs(events) - (dev.type == "cuda")  # less the synchronize that ends the trace
    launches = sum(1 for e in events if e.name in LAUNCH_EVENTS) / n if dev.type == "cuda" else None
    return syncs / n, launches


def sync_debug_count(step, batch, dev) -> int | None:
    """Synchronising CUDA calls in one step, as ``torch.cuda.set_sync_debug_mode('warn')`` reports them."""
    if dev.type != "cuda":
        return None
    sync(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync(dev)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def measure(rows: dict, name: str, step, batches: dict, args, dev) -> None:
    """Warm-up, counts and peak memory for one variant at every budget (its timed rounds come later)."""
    for budget, batch in batches.items():
        row = rows[(name, budget)]
        try:
            t = time.perf_counter()
            for _ in range(args.warmup):
                step(batch)
            sync(dev)
            row.warmup_s = time.perf_counter() - t
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            row.syncs, row.launches = profile_counts(step, batch, args.profile_steps, dev)
            row.sync_debug = sync_debug_count(step, batch, dev)
            row.peak_mb = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
        except Exception as e:  # noqa: BLE001 - one variant failing (e.g. out of memory at 64k) is a row, not a crash
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def build_one(args, name: str, dev, V: int):
    """The step of one variant, or None (said why) where it cannot run here."""
    if name == "ds-graphed" and dev.type != "cuda":
        print(f"{name}: skipped (CUDA graphs need a GPU)")
        return None
    t = time.perf_counter()
    try:
        step = build_hf(args, name, V, dev) if name.startswith("hf") else build_ours(args, name, V)[0]
    except Exception as e:  # noqa: BLE001 - e.g. deepspeed or transformers missing on this machine
        print(f"{name}: not built: {type(e).__name__}: {e}")
        return None
    print(f"{name}: built in {time.perf_counter() - t:.1f} s", flush=True)
    return step


class Clock:
    """Seconds left before ``--deadline-s`` (infinite without one)."""

    def __init__(self, deadline_s: float):
        self.t0, self.deadline = time.perf_counter(), deadline_s

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.t0) if self.deadline > 0 else float("inf")


def run(args) -> dict:
    from scaletrain.vocab import ByteVocab

    clock = Clock(args.deadline_s)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    V = ByteVocab(LANGS).size
    batches = {b: make_batch(max(1, b // args.seq), args.seq, V, dev) for b in args.budgets}
    state = dict(args=args, dev=dev, V=V, peak=0.0, rows={}, rounds=0)
    probe_peak(state)
    steps, spent = {}, 0.0  # spent: the longest build + warm-up of one variant so far
    for name in args.variants:
        if clock.left() < spent:
            for b in args.budgets:
                state["rows"][(name, b)] = Row(name, b, error=f"not run: --deadline-s {args.deadline_s:g} reached")
            continue
        t = time.perf_counter()
        step = build_one(args, name, dev, V)
        if step is None:
            continue
        steps[name] = step
        state["rows"].update({(name, b): Row(name, b) for b in args.budgets})
        measure(state["rows"], name, step, batches, args, dev)
        spent = max(spent, time.perf_counter() - t)
        save(state)
    timed_rounds(state, steps, batches, clock)
    return report(state, complete=True)


def probe_peak(state: dict) -> None:
    """The matmul peak: the best of every probe of the run (one at the start, one after each round), so a machine
    busier at the start than later (a shared CPU) does not put a step above its peak."""
    args = state["args"]
    n = 512 if args.smoke else 8192
    state["peak"] = max(state["peak"], matmul_peak(state["dev"], torch.bfloat16 if args.precision == "bf16"
                                                   else torch.float32, n))


def timed_rounds(state: dict, steps: dict, batches: dict, clock: Clock) -> None:
    """``--rounds`` interleaved rounds (the machine's speed drifts between rounds, not within one), fewer when the
    next round would pass ``--deadline-s``."""
    args, rows, last = state["args"], state["rows"], 0.0
    for _ in range(args.rounds):
        if clock.left() < 1.2 * last:
            print(f"rounds: {state['rounds']} of {args.rounds} (--deadline-s {args.deadline_s:g})")
            break
        t = time.perf_counter()
        for name, step in steps.items():
            for budget, batch in batches.items():
                row = rows[(name, budget)]
                if not row.error:
                    try:
                        row.seconds.append(time_steps(step, batch, args.steps, state["dev"]))
                    except Exception as e:  # noqa: BLE001
                        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        state["rounds"] += 1
        probe_peak(state)
        last = time.perf_counter() - t
        save(state)


def save(state: dict) -> None:
    """Rewrite ``--json`` with what has been measured so far (``complete: false``)."""
    if state["args"].json:
        Path(state["args"].json).write_text(json.dumps(result(state, complete=False), indent=1))


def result(state: dict, complete: bool) -> dict:
    from scaletrain.models import estimate_flops_per_token

    args, dev, V, peak, rows = (state[k] for k in ("args", "dev", "V", "peak", "rows"))
    m = make_cfg(args).model
    fpt = estimate_flops_per_token(m, args.seq, args.seq, V)
    out = []
    for (variant, budget), r in rows.items():
        rec = {"variant": variant, "budget": budget, "error": r.error, "syncs_per_step": r.syncs,
               "sync_debug_per_step": r.sync_debug, "launches_per_step": r.launches, "peak_mb": r.peak_mb,
               "warmup_s": r.warmup_s, "rounds": len(r.seconds)}
        if r.seconds:
            t = statistics.median(r.seconds)
            tps = budget / t
            hf = rows.get(("hf", budget))
            ratio = (statistics.median([h / s for h, s in zip(hf.seconds, r.seconds)])
                     if hf is not None and hf.seconds else None)
            rec.update(ms_per_step=1e3 * t, tokens_per_s=tps, vs_hf=ratio, mfu=fpt * tps / peak)
        out.append(rec)
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU", "torch": torch.__version__,
            "precision": args.precision, "peak_flops": peak, "flops_per_target_token": fpt,
            "model": {"d_model": m.d_model, "encoder_layers": m.encoder_layers, "decoder_layers": m.decoder_layers,
                      "ffn_dim": m.ffn_dim, "vocab": V, "seq": args.seq},
            "rounds": state["rounds"], "steps_per_round": args.steps, "complete": complete, "rows": out}


def report(state: dict, complete: bool) -> dict:
    res = result(state, complete)
    m = res["model"]
    print(f"\n{res['device']}, torch {res['torch']}, {res['precision']}; d {m['d_model']}, "
          f"{m['encoder_layers']}+{m['decoder_layers']} layers, FFN {m['ffn_dim']}, vocab {m['vocab']}; "
          f"{res['flops_per_target_token'] / 1e6:.1f} MFLOP per target token; matmul peak "
          f"{res['peak_flops'] / 1e12:.1f} TFLOP/s; {res['rounds']} rounds x {res['steps_per_round']} steps, medians")
    print(f"{'variant':<12} {'tokens':>6} {'ms/step':>8} {'tok/s':>9} {'vs hf':>6} {'MFU':>6} {'syncs':>6} "
          f"{'dbg':>4} {'launch':>7} {'peak MB':>8} {'warm s':>7}")
    for rec in res["rows"]:
        print(_line(rec))
    if state["args"].json:
        Path(state["args"].json).write_text(json.dumps(res, indent=1))
    return res


def _line(rec: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    head = f"{rec['variant']:<12} {rec['budget']:>6}"
    if rec["error"] or "ms_per_step" not in rec:
        return f"{head} {rec['error'] or 'no timing'}"
    return (f"{head} {rec['ms_per_step']:>8.2f} {rec['tokens_per_s']:>9.0f} {f(rec['vs_hf'], '.2f'):>6} "
            f"{100 * rec['mfu']:>5.1f}% {f(rec['syncs_per_step'], '.1f'):>6} {f(rec['sync_debug_per_step'], 'd'):>4} "
            f"{f(rec['launches_per_step'], '.0f'):>7} {f(rec['peak_mb'], '.0f'):>8} {f(rec['warmup_s'], '.1f'):>7}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="4096,16384,65536", help="target tokens per step (and as many source tokens)")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sentence and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", default="", help="write the results here (rewritten as they come)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="finish within this many seconds: fewer variants warmed up or fewer rounds (0 = no limit)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32, few steps (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.precision, args.seq, args.rounds, args.steps, args.warmup, args.profile_steps = "fp32", 16, 2, 1, 1, 1
        if args.budgets == ap.get_default("budgets"):
            args.budgets = "64,256"
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.smoke:
        os.environ.setdefault("SCALETRAIN_AUTO_PRECISION", "fp32")
        torch.set_num_threads(1)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
