"""Training-step throughput of every paper variant relative to the byte Transformer of the same size.

    python benchmarks/bench_models.py                 # mid size (d 288, 8 heads, FFN 1152, 6+6), CPU friendly
    python benchmarks/bench_models.py --base          # the papers' size (d 512, 8 heads, FFN 2048, 6+6)
    python benchmarks/bench_models.py --variants transformer,moce_d5 --rounds 12

One step = forward + label-smoothed CE + backward + Adam update, on the same batch (same shapes, same
right-padded byte sentences with a source tag, spaces for WSF's word blocks) for every variant. Every
variant keeps the base dimensions and only switches its own options, so the ratio is the variant's
cost. The mid size keeps the papers' ratios that matter (8 heads, FFN = 4 d, 6+6 layers), so a
variant's extra FLOPs are the same fraction of the step as at full size; its d is the smallest
multiple of 32 above the vocabulary (one-hot needs V <= d).

Timing is paired: in each round every variant's step is timed right after a step of the byte
Transformer, and the ratio reported is the median over rounds of (baseline step time / variant step
time) = the variant's tokens/s relative to the baseline, with its interquartile range; a load change
on a shared machine hits both steps of a pair alike. The ratios are the result, not absolute numbers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scaletrain.models import ModelConfig, build_model, estimate_flops_per_token  # noqa: E402
from scaletrain.models.config import ConvConfig, LobefConfig, MoCEConfig, OneHotConfig  # noqa: E402
from scaletrain.models.loss import label_smoothed_ce  # noqa: E402
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET, PAD  # noqa: E402

# model-section options of each paper recipe (scaletrain/recipes/<name>.yaml), applied to the same base dims
VARIANTS: dict[str, dict] = {
    "transformer": {},
    "embeddingless": dict(embedding="onehot", onehot=OneHotConfig(learnable_scales=True), encoder_input_dropout=False,
                          decoder_last_layer_dropout=False),
    "byte_ncf": dict(arch="byte_ncf", lobef=LobefConfig(byte_layers=4), encoder_layers=2, embedding="onehot",
                     share_embeddings=False, onehot=OneHotConfig(learnable_scales=False), encoder_input_dropout=False),
    "byte_wsf": dict(arch="byte_wsf", lobef=LobefConfig(byte_layers=2), encoder_layers=4, embedding="onehot",
                     share_embeddings=False, onehot=OneHotConfig(learnable_scales=False)),
    "msc": dict(arch="msc", conv=ConvConfig(kernels=[0, 0, 3, 3, 5, 5, 7, 7], layers=[0])),
    "msha": dict(arch="msha", conv=ConvConfig(kernels=[0, 0, 1, 1, 3, 5, 7, 9], layers=[0])),
    "moce_d4": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7], layers=[0])),
    "moce_d5": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9], layers=[0])),
    # the same model with every expert evaluated densely in one conv (the accelerator path)
    "moce_d5_dense": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9], layers=[0]),
                          moce=MoCEConfig(dispatch="dense")),
    "moce_d5_lid": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9], layers=[0]), moce=MoCEConfig(lid=True)),
    "moce_d6": dict(arch="moce", conv=ConvConfig(kernels=[0, 1, 3, 5, 7, 9, 11], layers=[0])),
}


def make_batch(batch: int, src_len: int, tgt_len: int, n_langs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def side(length: int, tag_first: bool):
        rows = torch.full((batch, length), PAD, dtype=torch.long)
        for b in range(batch):
            n = int(torch.randint(length // 2, length - 1, (1,), generator=g))  # bytes incl. tag/eos slots
            body = torch.randint(ord("a"), ord("z") + 1, (n,), generator=g)
            body[torch.rand(n, generator=g) < 0.18] = ord(" ")
            tag = LANG_OFFSET + int(torch.randint(0, n_langs, (1,), generator=g))
            rows[b, 0] = tag
            rows[b, 1 : n + 1] = body + BYTE_OFFSET
            rows[b, n + 1] = EOS
        return rows

    src = side(src_len, True)
    tgt = side(tgt_len + 1, True)
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_out[tgt_in.eq(PAD)] = PAD
    return src, tgt_in, tgt_out


class Runner:
    def __init__(self, name: str, cfg: ModelConfig, vocab: int):
        torch.manual_seed(0)
        self.name, self.cfg = name, cfg
        self.model = build_model(cfg, vocab).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, betas=(0.9, 0.98), foreach=True)
        self.times: list[float] = []

    def step(self, src, tgt_in, tgt_out) -> float:
        t = time.perf_counter()
        loss, _, ntok = label_smoothed_ce(self.model(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=PAD)
        self.opt.zero_grad(set_to_none=True)
        (loss / ntok).backward()
        self.opt.step()
        return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", action="store_true", help="paper size: d 512, FFN 2048, 6+6, OPUS-100 vocabulary (360)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (transformer is always run)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--src-len", type=int, default=64)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    if a.base:
        d, ffn, n_langs = 512, 2048, 100
    else:
        d, ffn, n_langs = 288, 1152, 8
    vocab = LANG_OFFSET + n_langs
    base = dict(d_model=d, n_heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=ffn, dropout=0.1,
                max_positions=max(a.src_len, a.tgt_len) + 8)
    names = ["transformer"] + [v for v in a.variants.split(",") if v and v != "transformer"]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    runners = [Runner(n, ModelConfig(**{**base, **VARIANTS[n]}), vocab) for n in names]
    src, tgt_in, tgt_out = make_batch(a.batch, a.src_len, a.tgt_len, n_langs)
    n_tok = int(tgt_out.ne(PAD).sum())
    print(f"size: d {d}, 8 heads, FFN {ffn}, 6+6 layers, vocabulary {vocab}; batch {a.batch} x src {a.src_len} / "
          f"tgt {a.tgt_len} ({n_tok} target tokens); torch threads {torch.get_num_threads()}, "
          f"{a.warmup} warm-up steps, {a.rounds} paired rounds", flush=True)
    for r in runners:
        for _ in range(a.warmup):
            r.step(src, tgt_in, tgt_out)
    ref_runner = runners[0]
    ratios: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(a.rounds):
        for r in runners:
            # paired: the baseline step right before each variant step, so load changes on a shared
            # machine cancel in the ratio; the reported ratio is the median of the paired ratios
            t_ref = ref_runner.step(src, tgt_in, tgt_out)
            ref_runner.times.append(t_ref)
            t = t_ref if r is ref_runner else r.step(src, tgt_in, tgt_out)
            if r is not ref_runner:
                r.times.append(t)
            ratios[r.name].append(t_ref / t)
        print(f"round {i + 1}/{a.rounds}: " + " ".join(f"{n} {v[-1]:.3f}" for n, v in ratios.items()),
              file=sys.stderr, flush=True)
    ref_flops = estimate_flops_per_token(ref_runner.cfg, a.src_len, a.tgt_len, vocab)
    print(f"\n{'variant':<14}{'params':>10}{'ms/step':>10}{'tgt tok/s':>11}{'ratio':>9}{'IQR':>15}{'FLOPs':>9}")
    for r in runners:
        med = statistics.median(r.times)
        rs = sorted(ratios[r.name])
        q1, q3 = (statistics.quantiles(rs, n=4)[0], statistics.quantiles(rs, n=4)[2]) if len(rs) > 1 else (rs[0], rs[0])
        n_params = sum(p.numel() for p in r.model.parameters())
        fl = estimate_flops_per_token(r.cfg, a.src_len, a.tgt_len, vocab) / ref_flops
        print(f"{r.name:<14}{n_params / 1e6:>9.2f}M{1000 * med:>10.1f}{n_tok / med:>11.0f}"
              f"{statistics.median(rs):>8.3f}x  [{q1:.3f}, {q3:.3f}]{fl:>8.3f}x")
    print("ratio = tokens/s of the variant / tokens/s of transformer (median of paired steps); "
          "FLOPs = estimated training FLOPs per token relative to transformer")
    print(f"\ncommand: python benchmarks/bench_models.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
