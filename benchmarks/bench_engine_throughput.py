"""Training-step throughput: our byte Transformer (through the engine) vs Hugging Face MarianMTModel.

    python benchmarks/bench_engine_throughput.py [--sizes base,small] [--rounds 5] [--steps 2] [--warmup 2]
                                                 [--batch 16] [--len 128] [--bf16 auto|yes|no] [--clock wall|cpu]

Same dimensions (``base``: the papers' base, d 512, 6+6 layers, FFN 2048, 8 heads; ``small``: the
default job's d 256, 3+3 layers, FFN 1024, 4 heads), same vocabulary size, same batch shapes (B x L
source and target, no padding), same optimizer (AdamW), same label-smoothed loss. A full step is
forward + loss + backward + optimizer update.

Rows: HF fp32, HF bf16 (torch.autocast, fp32 weights), ours fp32 and bf16 through the DeepSpeed engine
(bf16 at ZeRO-0 = fp32 weights under torch autocast, ds_config.runtime_ds_config), and ours with plain
autocast and no engine (to separate the model from the engine path). The bf16 rows run only where the
CPU has native bf16 matrix units (what ``engine.precision=auto`` decides, scaletrain/engine/precision.py;
``--bf16 yes`` forces them: on an AVX2-only CPU a bf16 step is ~40x slower than fp32). Ratios are
against HF in the same run (per round, then the median over rounds with the min-max spread: the shared
host's speed drifts by tens of percent); MFU is against the matmul peak measured in the same run (fp32
and bf16 GEMM of 2048^3), and for every row also against the bf16 peak. ``--clock cpu`` times each step by
this process's CPU time instead of the wall clock (the time other jobs on a shared host take is not counted;
their competition for caches and memory still is): s/step is then CPU seconds of all threads, tok/s and MFU
are not printed, the ratios are the measurement.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LANGS = ["de", "fr", "ru", "ar", "hi", "ja", "zh", "en"]


def matmul_peak(dtype, n=2048, reps=5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def make_batch(B, L, vocab_size):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab_size, (B, L), generator=g)
    tgt = torch.randint(4, vocab_size, (B, L + 1), generator=g)
    return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()


def base_cfg(precision: str, size: str = "base"):
    from scaletrain.config import load_config

    return load_config(size, [
        f"engine.precision={precision}", "engine.ds_config=zero0.json", "engine.grad_accum=1", "optim.clip_norm=0",
        "optim.warmup_steps=10", "model.max_positions=256", "data.max_bytes=200", "tracking.enabled=false",
        f"engine.threads={torch.get_num_threads()}",
    ])


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def time_steps(step, warmup, steps) -> float:
    for _ in range(warmup):
        step()
    t = clock()
    for _ in range(steps):
        step()
    return (clock() - t) / steps


def build_hf(vocab_size, batch, bf16, size="base"):
    from transformers import MarianConfig, MarianMTModel

    from scaletrain.models.loss import label_smoothed_ce

    m = base_cfg("fp32", size).model
    cfg = MarianConfig(
        vocab_size=vocab_size, d_model=m.d_model, encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.ffn_dim,
        decoder_ffn_dim=m.ffn_dim, max_position_embeddings=256,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, activation_function="relu", scale_embedding=True,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=1, share_encoder_decoder_embeddings=True,
    )
    torch.manual_seed(0)
    model = MarianMTModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    src, tgt_in, tgt_out = batch

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=src, decoder_input_ids=tgt_in).logits
        loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=0)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def build_ours_engine(precision, batch, size="base"):
    from scaletrain.engine import build_engine
    from scaletrain.models import build_model
    from scaletrain.models.loss import label_smoothed_ce
    from scaletrain.vocab import ByteVocab

    cfg = base_cfg(precision, size)
    eng = build_engine(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, ByteVocab(LANGS).size)
    n_params = sum(p.numel() for p in model.parameters())
    eng.setup(model)
    eng.train(True)
    src, tgt_in, tgt_out = batch

    def step():
        logits = eng.forward(src, tgt_in)
        loss, _, n = label_smoothed_ce(logits, tgt_out, epsilon=0.1, ignore_index=0)
        eng.backward(loss / n)
        eng.step()

    return step, n_params, cfg


def build_ours_autocast(batch, size="base"):
    from scaletrain.models import build_model
    from scaletrain.models.loss import label_smoothed_ce
    from scaletrain.vocab import ByteVocab

    cfg = base_cfg("fp32", size)
    torch.manual_seed(0)
    model = build_model(cfg.model, ByteVocab(LANGS).size).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    src, tgt_in, tgt_out = batch

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(src, tgt_in)
        loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=0)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cpu_header() -> tuple[bool, str]:
    """(run bf16 rows?, the CPU line to print), from the same decision as engine.precision=auto."""
    from scaletrain.engine.precision import cpu_flags, cpu_model, resolve_precision

    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    res = resolve_precision("auto", cuda=False, env={})
    return res.precision == "bf16", f"CPU: {cpu_model()}; flags {' '.join(shown) or '-'}; auto -> {res.line()}"


def spread(xs) -> str:
    return f"{statistics.median(xs):.2f}x [{min(xs):.2f}-{max(xs):.2f}]"


def run_size(size, args, with_bf16, peak32, peak16, peaks_after=None):
    from scaletrain.models import estimate_flops_per_token
    from scaletrain.vocab import ByteVocab

    V = ByteVocab(LANGS).size
    batch = make_batch(args.batch, args.len, V)
    tokens = args.batch * args.len  # target tokens per step
    hf32, n_hf = build_hf(V, batch, False, size)
    ours32, n_ours, cfg = build_ours_engine("fp32", batch, size)
    contenders = [("HF Marian fp32", hf32, "fp32"), ("ours fp32 (DeepSpeed engine)", ours32, "fp32")]
    if with_bf16:
        hf16, _ = build_hf(V, batch, True, size)
        ours16, _, _ = build_ours_engine("bf16", batch, size)
        contenders[1:1] = [("HF Marian bf16 autocast", hf16, "bf16")]
        contenders += [("ours bf16 (DeepSpeed engine)", ours16, "bf16"),
                       ("ours bf16 autocast, no engine", build_ours_autocast(batch, size), "bf16")]
    for _, step, _ in contenders:
        for _ in range(args.warmup):
            step()
    # The machine's speed drifts (shared host): every round times every contender back to back, and
    # each ratio is taken within a round before the median over rounds.
    times = {name: [] for name, _, _ in contenders}
    for _ in range(args.rounds):
        for name, step, _ in contenders:
            times[name].append(time_steps(step, 0, args.steps))
    if peaks_after is not None:
        peak32, peak16 = peaks_after()
    fpt = estimate_flops_per_token(cfg.model, args.len, args.len, V)
    print(f"\n== {size}: best GEMM peak fp32 {peak32/1e9:.0f}, bf16 {peak16/1e9:.0f} GFLOP/s")
    print(f"== {size}: d {cfg.model.d_model}, {cfg.model.encoder_layers}+{cfg.model.decoder_layers} layers, "
          f"FFN {cfg.model.ffn_dim}; batch {args.batch}x{args.len} (src and tgt), vocab {V}, "
          f"params ours {n_ours/1e6:.1f}M / HF {n_hf/1e6:.1f}M, {fpt/1e6:.1f} MFLOP per target token; "
          f"{args.rounds} rounds x {args.steps} steps, medians [min-max over rounds]")
    hf_name = {"fp32": "HF Marian fp32", "bf16": "HF Marian bf16 autocast"}
    print(f"{'run':32s} {'s/step':>7s} {'tok/s':>7s} {'vs HF same prec':>20s} {'vs HF bf16':>20s} "
          f"{'MFU':>6s} {'MFU bf16pk':>10s}")
    for name, _, prec in contenders:
        t = statistics.median(times[name])
        same = spread([h / o for h, o in zip(times[hf_name[prec]], times[name])])
        vs16 = spread([h / o for h, o in zip(times[hf_name["bf16"]], times[name])]) if with_bf16 else "-"
        peak = peak16 if prec == "bf16" else peak32
        tps = tokens / t
        if clock is CLOCKS["cpu"]:  # CPU seconds: no throughput or MFU to print
            print(f"{name:32s} {t:7.2f} {'-':>7s} {same:>20s} {vs16:>20s} {'-':>6s} {'-':>10s}")
            continue
        print(f"{name:32s} {t:7.2f} {tps:7.0f} {same:>20s} {vs16:>20s} {100 * tps * fpt / peak:5.1f}% "
              f"{100 * tps * fpt / peak16:9.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="base,small", help="recipes whose model sizes to compare")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; every contender runs in every round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bf16", default="auto", choices=["auto", "yes", "no"],
                    help="bf16 rows: auto = only on a CPU with native bf16 (engine.precision=auto's decision)")
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="what a step's time is: wall clock, or this process's CPU time (less load-sensitive)")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    os.environ.pop("SCALETRAIN_AUTO_PRECISION", None)
    native, line = cpu_header()
    with_bf16 = {"auto": native, "yes": True, "no": False}[args.bf16]
    print(line)
    peak32, peak16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16) if with_bf16 else float("nan")
    print(f"threads {args.threads}; clock {args.clock}; measured GEMM peak: fp32 {peak32/1e9:.0f} GFLOP/s, bf16 {peak16/1e9:.0f} GFLOP/s"
          + ("" if with_bf16 else " (bf16 rows skipped: no native bf16 on this CPU; --bf16 yes forces them)"))
    for size in args.sizes.split(","):
        # the GEMM peak is re-measured after each size and the best kept (a peak taken while the shared
        # host was busier than during the steps would put MFU above 100%); rows print at the end
        run_size(size, args, with_bf16, peak32, peak16, peaks_after=lambda: (
            max(peak32, matmul_peak(torch.float32)),
            max(peak16, matmul_peak(torch.bfloat16)) if with_bf16 else float("nan")))


if __name__ == "__main__":
    main()
