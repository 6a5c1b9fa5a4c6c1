"""Forward+backward time of ONE MoCE (Ada-MSHA) attention layer: routed vs dense expert evaluation,
with the plain self-attention layer of the same size as the reference.

    python benchmarks/bench_moce_layer.py                    # d 288 (bench_models' reduced size), batch 4x64
    python benchmarks/bench_moce_layer.py --base --batch 32  # the papers' d 512

The three layers share the projections' weights and see the same input and padding (sentences of
50-100% of the length, right padded, a source tag first). Timing is interleaved: every round runs
each contender a few times in turn; medians over rounds are reported, and the extra cost of each
MoCE layer over the plain layer. The routed path is the CPU default (``model.moce.dispatch: auto``);
dense is what accelerators run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scaletrain.models import ModelConfig, build_model  # noqa: E402
from scaletrain.models.config import ConvConfig, MoCEConfig  # noqa: E402
from scaletrain.models.transformer import EncoderContext  # noqa: E402
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET, PAD  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", action="store_true", help="d 512 (papers' size) instead of d 288")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--len", type=int, default=64)
    p.add_argument("--kernels", default="0,1,3,5,7,9", help="MoCE experts (0 = identity)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5, help="fwd+bwd per contender per round")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    d = 512 if a.base else 288
    kernels = [int(k) for k in a.kernels.split(",")]
    vocab = LANG_OFFSET + 8
    g = torch.Generator().manual_seed(0)
    src = torch.full((a.batch, a.len), PAD, dtype=torch.long)
    for b in range(a.batch):
        n = int(torch.randint(a.len // 2, a.len + 1, (1,), generator=g))
        src[b, :n] = torch.randint(BYTE_OFFSET + 97, BYTE_OFFSET + 123, (n,), generator=g)
        src[b, 0] = LANG_OFFSET + b % 8
    x0 = torch.randn(a.batch, a.len, d, generator=g)
    layers = {}
    for name, extra in (("plain", dict()), ("moce routed", dict(arch="moce", moce=MoCEConfig(dispatch="routed"))),
                        ("moce dense", dict(arch="moce", moce=MoCEConfig(dispatch="dense")))):
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=d, n_heads=8, encoder_layers=1, decoder_layers=1, ffn_dim=2 * d, dropout=0.0,
                          max_positions=a.len + 8, conv=ConvConfig(kernels=kernels), **extra)
        m = build_model(cfg, vocab).train()
        layers[name] = (m.encoder_layers[0].self_attn, m.embeddings)

    def step(attn, emb):
        x = x0.clone().requires_grad_()
        attn(x, EncoderContext(src, src.eq(PAD), emb)).square().sum().backward()

    times: dict[str, list[float]] = {n: [] for n in layers}
    for attn, emb in layers.values():
        for _ in range(3):
            step(attn, emb)
    for _ in range(a.rounds):
        for name, (attn, emb) in layers.items():
            t = time.perf_counter()
            for _ in range(a.reps):
                step(attn, emb)
            times[name].append((time.perf_counter() - t) / a.reps * 1e3)
    real = int(src.ne(PAD).sum())
    print(f"d {d}, 8 heads, batch {a.batch} x {a.len} ({real} real tokens), experts {kernels}, "
          f"torch threads {torch.get_num_threads()}, {a.rounds} rounds x {a.reps}")
    plain = statistics.median(times["plain"])
    for name, ts in times.items():
        med = statistics.median(ts)
        extra = "" if name == "plain" else f"   extra over plain {med - plain:6.2f} ms"
        print(f"{name:<13}{med:8.2f} ms fwd+bwd{extra}")
    r, dn = statistics.median(times["moce routed"]), statistics.median(times["moce dense"])
    print(f"routed / dense layer time: {r / dn:.2f}; extra cost routed / dense: {(r - plain) / (dn - plain):.2f}")
    print(f"\ncommand: python benchmarks/bench_moce_layer.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
