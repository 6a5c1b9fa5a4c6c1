"""Scaling on paper: predicted step time and communication per rank for ZeRO 0-3 at 8-512 GPUs.

    python benchmarks/scaling_model.py --step-time 0.35 [--recipe base] [--gpus 8,16,32,64,128,256,512]
        [--gpus-per-node 8] [--intra-gbps 300] [--inter-gbps 25] [--latency-us 10] [--grad-accum 2]
        [--bytes 2] [--overlap 0.0]

Weak scaling: every GPU keeps the per-device batch of the measured single-device step
(``--step-time``, seconds, e.g. from ``benchmarks/gpu_suite.py``'s tok/s rows), so compute per step
is constant and only communication is added. Per rank and update, ring collectives over N ranks move
(Psi = parameters, b = bytes per element of the communicated tensors, 2 for bf16):

* ZeRO-0 (DDP): all-reduce of the gradients once per update: 2 (N-1)/N Psi b;
* ZeRO-1: reduce-scatter of the gradients + all-gather of the updated parameters: the same 2 (N-1)/N Psi b;
* ZeRO-2: gradients reduce-scattered after every micro-batch (``grad_accum`` times) + one all-gather:
  (grad_accum + 1) (N-1)/N Psi b;
* ZeRO-3: parameters all-gathered in the forward and again in the backward of every micro-batch, and
  gradients reduce-scattered: 3 grad_accum (N-1)/N Psi b.

Time of a collective: volume / bandwidth + latency x 2 (N-1) ring hops per bucket (``--bucket-mb``).
The ring runs at the slowest link it crosses: ``--intra-gbps`` (per GPU, NVLink) inside a node,
``--inter-gbps`` (per GPU's NIC) once N exceeds ``--gpus-per-node``. Step time = compute +
(1 - overlap) x communication (``--overlap 0``: nothing hidden, an upper bound; 1: fully hidden while
the compute lasts).

``--ep`` adds expert parallelism (EP group = all P GPUs, uniform routing): the MoE-FFN all-to-all per
update (4 transfers of D values per routed (token, slot) pair that leaves its rank) against the
all-reduce that replicated experts would need instead, the break-even batch (E F / k tokens per GPU),
and expert-parallel MoCE's window exchange against the compute it would replace. The 2-rank CPU
check of the ZeRO predictions against 2-rank gloo measurements is not done yet.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Link:
    intra_gbps: float = 300.0  # GB/s per GPU inside a node
    inter_gbps: float = 25.0  # GB/s per GPU across nodes
    gpus_per_node: int = 8
    latency_us: float = 10.0
    bucket_mb: float = 500.0


def comm_bytes(stage: int, n: int, params: int, bytes_per: int = 2, grad_accum: int = 1) -> float:
    """Bytes sent (= received) per rank per update by ZeRO ``stage`` over ``n`` ranks (ring collectives)."""
    if n <= 1:
        return 0.0
    ring = (n - 1) / n * params * bytes_per  # one reduce-scatter or one all-gather
    passes = {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage]
    return passes * ring


def comm_seconds(stage: int, n: int, params: int, link: Link, bytes_per: int = 2, grad_accum: int = 1) -> float:
    vol = comm_bytes(stage, n, params, bytes_per, grad_accum)
    if vol == 0:
        return 0.0
    bw = (link.intra_gbps if n <= link.gpus_per_node else min(link.intra_gbps, link.inter_gbps)) * 1e9
    buckets = max(1, math.ceil(vol / (link.bucket_mb * 1e6)))
    return vol / bw + buckets * 2 * (n - 1) * link.latency_us * 1e-6


def step_seconds(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
    hidden = min(comm_s, compute_s) * overlap
    return compute_s + comm_s - hidden


# ---------------------------------------------------------------------------------------------
# expert parallelism
@dataclass(frozen=True)
class MoEShape:
    d_model: int = 512
    expert_ffn: int = 2048
    experts: int = 8  # per MoE layer
    top_k: int = 2
    layers: int = 6  # MoE layers (encoder + decoder)


def ep_a2a_bytes(p: int, tokens: int, shape: MoEShape, bytes_per: int = 2) -> float:
    """MoE-FFN all-to-all bytes sent per rank per update: each (token, slot) pair goes to its expert's
    rank and back (dispatch + combine) in the forward, and again in the backward: 4 transfers of D
    values; a pair whose expert is on its own rank (1/P of them, uniform routing) stays."""
    if p <= 1:
        return 0.0
    return 4 * tokens * shape.top_k * shape.d_model * bytes_per * (p - 1) / p * shape.layers


def replicated_expert_allreduce_bytes(n: int, shape: MoEShape, bytes_per: int = 2) -> float:
    """What keeping every expert on every rank costs instead: a ring all-reduce of the expert
    gradients over n data-parallel ranks, 2 (n-1)/n x expert parameters."""
    params = shape.experts * 2 * shape.d_model * shape.expert_ffn * shape.layers
    return 0.0 if n <= 1 else 2 * (n - 1) / n * params * bytes_per


def ep_break_even_tokens(shape: MoEShape) -> float:
    """Tokens per rank per update below which the all-to-all (P, n large) moves fewer bytes than the
    all-reduce of replicated expert gradients: 4 T k D = 2 E 2 D F  ->  T = E F / k."""
    return shape.experts * shape.expert_ffn / shape.top_k


def moce_a2a_bytes(p: int, slots: int, kernels: list[int], head_dim: int, bytes_per: int = 2,
                   layers: int = 1) -> float:
    """Expert-parallel MoCE (moe.moce_partition): every routed slot of a conv expert on another rank
    sends its window (k Dh) and receives Dh, forward and backward. ``slots``: routed (q|k|v, head,
    token, top-k) slots per rank per update; uniform routing over the experts of ``kernels``."""
    if p <= 1:
        return 0.0
    per_slot = sum((k + 1) * head_dim for k in kernels if k > 0) / len(kernels)  # identities send nothing
    return 2 * slots * per_slot * bytes_per * (p - 1) / p * layers


def moce_local_flops(slots: int, kernels: list[int], head_dim: int, layers: int = 1) -> float:
    """FLOPs the same slots cost computed locally (forward + backward = 3x the forward's 2 k Dh^2)."""
    per_slot = sum(2 * k * head_dim * head_dim for k in kernels if k > 0) / len(kernels)
    return 3 * slots * per_slot * layers


def ep_link_gbps(p: int, link: Link) -> float:
    return link.intra_gbps if p <= link.gpus_per_node else min(link.intra_gbps, link.inter_gbps)


def print_ep_table(gpus: list[int], link: Link, shape: MoEShape, tokens: int, bytes_per: int,
                   delta: int, head_dim: int, heads: int, peak_tflops: float) -> None:
    """Per P (EP group = all GPUs): MoE-FFN all-to-all vs the replicated experts' all-reduce, and
    expert-parallel MoCE's exchange time vs the compute it moves."""
    kernels = [0] + [2 * i - 1 for i in range(1, delta + 1)]
    slots = 3 * heads * tokens * 2  # q|k|v x heads x tokens x top-2
    print(f"\nExpert parallelism: MoE-FFN d {shape.d_model}, expert FFN {shape.expert_ffn}, {shape.experts} experts, "
          f"top-{shape.top_k}, {shape.layers} MoE layers; {tokens} tokens per GPU per update; MoCE Δ={delta}, "
          f"Dh {head_dim}, {heads} heads (one layer); {peak_tflops:g} TFLOP/s per GPU")
    print(f"{'GPUs=P':>7}{'MoE a2a MB':>12}{'a2a ms':>9}{'replicated all-reduce MB':>26}{'ms':>8}"
          f"{'MoCE a2a MB':>13}{'ms':>8}{'MoCE local compute ms':>23}")
    for p in gpus:
        bw = ep_link_gbps(p, link) * 1e9
        a2a, rep = ep_a2a_bytes(p, tokens, shape, bytes_per), replicated_expert_allreduce_bytes(p, shape, bytes_per)
        mo = moce_a2a_bytes(p, slots, kernels, head_dim, bytes_per)
        local = moce_local_flops(slots, kernels, head_dim) / (peak_tflops * 1e12)
        print(f"{p:>7}{a2a / 1e6:>12.1f}{a2a / bw * 1e3:>9.2f}{rep / 1e6:>26.1f}{rep / bw * 1e3:>8.2f}"
              f"{mo / 1e6:>13.1f}{mo / bw * 1e3:>8.2f}{local * 1e3:>23.3f}")
    print(f"MoE-FFN: the all-to-all moves fewer bytes than the replicated experts' all-reduce below "
          f"{ep_break_even_tokens(shape):.0f} tokens per GPU per update (E F / k), and splits expert memory by P "
          f"whatever the batch. MoCE: the exchange costs more time than computing the windows locally at "
          f"every P (its experts are k Dh^2 weights: moving a window is (k+1) Dh values for 2 k Dh^2 FLOPs).")


def count_params(recipe: str) -> int:
    from scaletrain.config import load_config
    from scaletrain.models import build_model
    from scaletrain.vocab import ByteVocab

    cfg = load_config(recipe)
    model = build_model(cfg.model, ByteVocab(["en", "de"] + [f"x{i}" for i in range(98)]).size)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-time", type=float, required=True, help="measured single-device seconds per update")
    ap.add_argument("--recipe", default="base")
    ap.add_argument("--params", type=int, default=0, help="parameter count (0 = count the recipe's model)")
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra-gbps", type=float, default=300.0)
    ap.add_argument("--inter-gbps", type=float, default=25.0)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--bucket-mb", type=float, default=500.0)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--bytes", type=int, default=2, help="bytes per communicated element (2: bf16)")
    ap.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden behind compute")
    ap.add_argument("--ep", action="store_true", help="also print the expert-parallel exchange model")
    ap.add_argument("--moe-experts", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=2048)
    ap.add_argument("--moe-layers", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--moce-delta", type=int, default=5)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=400.0, help="dense bf16 per GPU, for MoCE's local compute")
    a = ap.parse_args(argv)
    params = a.params or count_params(a.recipe)
    link = Link(a.intra_gbps, a.inter_gbps, a.gpus_per_node, a.latency_us, a.bucket_mb)
    print(f"{a.recipe}: {params / 1e6:.1f}M parameters; single-device step {a.step_time:.3f} s; links: "
          f"{a.intra_gbps:g} GB/s in a node of {a.gpus_per_node}, {a.inter_gbps:g} GB/s across nodes, "
          f"{a.latency_us:g} us per hop; grad_accum {a.grad_accum}, {a.bytes} B/element, overlap {a.overlap:g}")
    print(f"{'GPUs':>5} " + " ".join(f"{f'ZeRO-{s} MB/rank':>15} {'step s':>7} {'eff':>5}" for s in range(4)))
    for n in (int(x) for x in a.gpus.split(",")):
        cells = []
        for s in range(4):
            c = comm_seconds(s, n, params, link, a.bytes, a.grad_accum)
            t = step_seconds(a.step_time, c, a.overlap)
            cells.append(f"{comm_bytes(s, n, params, a.bytes, a.grad_accum) / 1e6:15.1f} {t:7.3f} {a.step_time / t:5.2f}")
        print(f"{n:5d} " + " ".join(cells))
    print("eff = single-device step / predicted step (weak scaling: tokens/s per GPU relative to one GPU)")
    if a.ep:
        shape = MoEShape(512, a.moe_ffn, a.moe_experts, a.top_k, a.moe_layers)
        print_ep_table([int(x) for x in a.gpus.split(",")], link, shape, a.tokens_per_gpu, a.bytes,
                       a.moce_delta, a.head_dim, a.heads, a.peak_tflops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
