"""Expert-parallel MoCE: the conv experts of each Ada-MSHA layer spread over the ranks of an EP group.

With ``moe.ep_size = P > 1`` (``scaletrain.parallel.context``) each conv expert of a MoCE layer lives
on ONE rank of the expert-parallel group (``conv_owners``: greedy by kernel size, the biggest first,
each to the rank with the fewest taps so far, so the work per rank is balanced however Δ and P
fall); identity experts have no weights and stay on every rank. A rank keeps only the weights of its
own experts; the other experts' entries of ``MoCEExperts.weights`` / ``biases`` are empty tensors,
so parameter names (and checkpoint keys) are those of the ep_size=1 model and consolidation only
has to fill the empty entries from their owners (``scaletrain.parallel.state``: "owned" expert
tensors, beside the stacked MoE-FFN experts; checkpoints, export and resharding handle both).

Forward of one layer on one rank (R rows = (q|k|v, sentence, head, position), top-k slots):

1. identity slots: ``out = z * (sum of the row's identity weights)``, locally;
2. for every conv expert e (kernel k): the routed rows' k-wide windows X_e [M_e, Dh*k] (one unfold
   of the zero-padded sequences, then an index_select: no window crosses a sentence);
3. the counts M_e of all ranks are all-gathered (one small collective per layer, and the layer's one
   host read: every split size comes from it), the windows are
   flattened and sent to their owners in ONE variable-size all-to-all (windows of different experts
   have different widths, so the payload is a 1-D stream of elements; every rank knows every split
   from the counts);
4. each owner computes ``X W_e + b_e`` for the rows of all ranks at once, and sends the [rows, Dh]
   results back in the reverse all-to-all;
5. ``out[row] += w * y`` for every conv slot (the routing weight stays on the token's own rank, so
   the router's gradient never travels).

Autograd carries the backward (``all_to_all_v`` reverses itself), so expert-weight gradients on the
owner sum the contributions of every rank's tokens: the engine then reduces them over the
expert-data-parallel group only and scales them as every other gradient (``scaletrain.parallel.grads``).
Each rank takes part in exactly two all-to-alls (and one all-gather) per layer forward and two in
backward, whatever its tokens: a rank with no routed rows sends and receives empty streams.

Exchange volume per layer and step (forward; the backward repeats it): every conv slot routed to an
expert on another rank sends its window (k Dh values) and receives Dh values; with uniform routing
over P ranks a fraction (P-1)/P of the slots travels. Compared with computing the window locally
(2 k Dh^2 FLOPs per slot), sending it costs (k + 1) Dh elements: MoCE's experts are small, so the
exchange pays only where the link moves (k + 1) Dh elements faster than the rank computes 2 k Dh^2
FLOPs, see ``benchmarks/bench_expert_parallel_moce.py`` and docs/EXPERT_PARALLEL.md ("Expert-parallel MoCE").
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaletrain.errors import ScaletrainError
from scaletrain.models.moce_routed import conv_slots_by_expert
from scaletrain.parallel.context import ParallelContext, balanced_owners
from scaletrain.parallel.exchange import all_to_all_v


def conv_owners(conv_kernels: Sequence[int], ep_size: int) -> list[int]:
    """EP rank owning each conv expert (in ``conv_kernels`` order): the largest kernels first, each
    to the rank with the fewest taps so far (ties: lowest rank). Every rank gets at least one expert
    when there are at least ``ep_size`` of them."""
    if ep_size > len(conv_kernels):
        raise ScaletrainError(
            f"moe.ep_size={ep_size} is larger than the {len(conv_kernels)} conv experts of a MoCE layer "
            f"(model.conv.kernels without the identity 0); use moe.ep_size <= {len(conv_kernels)}")
    return balanced_owners(conv_kernels, ep_size)


def _gather_counts(counts: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """[P, C]: the routed rows of every conv expert on every EP rank."""
    parts = [torch.empty_like(counts) for _ in range(ctx.ep_size)]
    dist.all_gather(parts, counts, group=ctx.ep_group)
    return torch.stack(parts)


def _windows(z: torch.Tensor, T: int, r: int, rows: torch.Tensor, k: int) -> torch.Tensor:
    """[M, Dh*k]: the k-wide windows (zero padded at sentence ends) centred on ``rows`` of z [R, Dh]."""
    R, Dh = z.shape
    if rows.numel() == 0:  # nothing routed to this expert here (or no rows at all: lock-step decoding);
        return z[:0].repeat(1, k)  # still a view of z, so the exchange is in the graph on every rank
    zp = F.pad(z.view(R // T, T, Dh), (0, 0, r, r)).view(-1, Dh)
    centre = rows + (rows // T) * (2 * r) + r
    return zp.unfold(0, k, 1).index_select(0, centre - k // 2).reshape(-1, Dh * k)  # [M, Dh, k] flattened


def routed_experts_ep(z, w, idx, real, kernels: list[int], is_identity: torch.Tensor, weights, biases,
                      owners: list[int], ctx: ParallelContext) -> torch.Tensor:
    """The expert mixture of ``moce_routed.routed_experts`` with the conv experts on their owners.

    z [N, T, Dh] (pads zero), w/idx [N, T, K], real [N, T] bool; ``weights``/``biases``: per conv
    expert, the owner's tensors (empty elsewhere); ``owners``: EP rank of each conv expert."""
    N, T, Dh = z.shape
    K = w.shape[-1]
    R = N * T
    zf, wf, idxf = z.reshape(R, Dh), w.reshape(R * K), idx.reshape(R, K)
    realf = real.reshape(R)
    is_id = is_identity[idxf] & realf[:, None]
    out = zf * (w.reshape(R, K) * is_id).sum(-1, keepdim=True)
    conv = [(e, k) for e, k in enumerate(kernels) if k > 0]
    order, mine_counts = conv_slots_by_expert(idxf, realf, kernels)
    counts = _gather_counts(mine_counts, ctx).tolist()  # [P][C]: the splits, the layer's one host read
    P, me, r = ctx.ep_size, ctx.ep_rank, max(k for _, k in conv) // 2
    sels = order[: sum(counts[me])].split(counts[me])
    mine = [j for j, o in enumerate(owners) if o == me]
    # dispatch: windows, grouped by owner, then by expert
    send = [_windows(zf, T, r, sels[j] // K, conv[j][1]).reshape(-1)
            for p in range(P) for j, o in enumerate(owners) if o == p]
    in_split = [sum(counts[me][j] * conv[j][1] * Dh for j, o in enumerate(owners) if o == p) for p in range(P)]
    out_split = [sum(counts[s][j] * conv[j][1] * Dh for j in mine) for s in range(P)]
    recv = all_to_all_v(torch.cat(send), out_split, in_split, ctx.ep_group)
    # this rank's experts over every rank's rows
    pieces = recv.split([counts[s][j] * conv[j][1] * Dh for s in range(P) for j in mine])
    ys = {}
    for i, j in enumerate(mine):
        X = torch.cat([pieces[s * len(mine) + i] for s in range(P)]).view(-1, Dh * conv[j][1])
        wmat = weights[j].to(z.dtype).reshape(Dh, Dh * conv[j][1])  # [out, in*k], matching the window layout
        ys[j] = torch.addmm(biases[j].to(z.dtype), X, wmat.t()).split([counts[s][j] for s in range(P)])
    # combine: results back to the rows' ranks, grouped by owner, then by expert
    back = torch.cat([ys[j][s].reshape(-1) for s in range(P) for j in mine])
    in_back = [sum(counts[s][j] * Dh for j in mine) for s in range(P)]
    out_back = [sum(counts[me][j] * Dh for j, o in enumerate(owners) if o == p) for p in range(P)]
    got = all_to_all_v(back, out_back, in_back, ctx.ep_group)
    order = [j for p in range(P) for j, o in enumerate(owners) if o == p]
    for j, y in zip(order, got.split([counts[me][j] * Dh for j in order])):
        sel = sels[j]
        out = out.index_add(0, sel // K, y.view(-1, Dh) * wf.index_select(0, sel)[:, None])
    return out.view(N, T, Dh)


def shard_conv_experts(weights, biases, conv_kernels: Sequence[int], ctx: ParallelContext) -> list[int]:
    """Keep only this rank's conv experts in the ParameterLists ``weights``/``biases`` (built in full
    on every rank from the same seed, so every owner holds the weights an ep_size=1 model would have);
    the others become empty. Marks each expert parameter: ``expert`` (its own optimizer group, gradients
    reduced over the expert-data-parallel group), ``ep_owner`` (EP rank), ``full_shape`` and
    ``owner_rule`` (``scaletrain.parallel.state``: consolidation, checkpoints, resharding)."""
    owners = conv_owners(conv_kernels, ctx.ep_size)
    for j, owner in enumerate(owners):
        for plist in (weights, biases):
            full = plist[j]
            if owner != ctx.ep_rank:
                plist[j] = torch.nn.Parameter(full.detach().new_empty(0))
            q = plist[j]
            q.expert, q.ep_owner, q.full_shape = True, owner, tuple(full.shape)
            q.owner_rule = (tuple(conv_kernels), j)  # the owner at any ep_size (resharding a checkpoint)
    return owners
