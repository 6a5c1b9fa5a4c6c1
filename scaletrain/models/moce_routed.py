"""MoCE expert mixture computed only where the router sends each token (CPU path).

The dense formulation (``MoCEExperts.expert_bank``) runs every conv expert on every position in one
convolution whose kernels are zero padded to the largest size: for Δ=5 that is 5 experts x 9 taps =
45 taps per position, although the experts have 1+3+5+7+9 = 25 real taps and top-2 routing keeps at
most two of them per (q|k|v, head, position). On CPU the convolution already runs near the GEMM
peak, so the only way to make MoCE cheap there is to do less arithmetic: this path evaluates, for
each expert, only the slots routed to it, on real tokens only (under balanced top-2 routing over
6 experts, 2 x 25/6 = 8.3 taps per position instead of 45):

    for expert e with kernel k:  rows routed to e  ->  their k-wide windows (one gather from the
    zero-padded sequences)  ->  one GEMM [M_e, k*Dh] x [k*Dh, Dh] + bias  ->  weighted scatter-add.

Identity experts cost one dense multiply (``out`` starts as the row's identity weight times ``z``).
The backward is written out (weight gradient from the saved
windows, input gradient scattered back to the window positions, routing-weight gradient
``<dL/dy, expert output>``), so autograd does not keep a graph of the per-expert pieces.

Results equal the dense formulation at real positions up to float round-off (tests check outputs
and every gradient); at pad positions both paths return 0. The per-expert row counts are read on
the host once per layer and forward (the GEMM sizes), which is free on CPU and would be a device
sync on an accelerator: CUDA keeps the dense one-convolution path, which reads nothing
(``MoCEExperts.forward`` chooses).

Memory: the gathered windows are saved for the backward: top_k x (share of conv picks) x (mean
picked kernel size) x the size of ``z``, about 8x for Δ=5 under balanced routing; the dense path
keeps about as much (the stacked outputs of all conv experts and the picked pairs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from scaletrain.parallel.exchange import expert_counts


def conv_slots_by_expert(idx: torch.Tensor, real: torch.Tensor, kernels) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, slot) positions of ``idx`` [R, K] routed to conv experts, grouped by conv expert in
    expert order (ascending position within an expert), followed by the identity and pad slots; and the
    slots per conv expert [C] (int64, on the device). No host read: the caller reads the counts once."""
    conv = [e for e, k in enumerate(kernels) if k > 0]
    C = len(conv)
    rank = torch.full((len(kernels) + 1,), C, dtype=torch.long, device=idx.device)  # conv expert -> 0..C-1
    rank[conv] = torch.arange(C, device=idx.device)
    key = rank[idx.masked_fill(~real[:, None], len(kernels)).view(-1)]  # identity and pad slots -> C
    order = torch.sort(key, stable=True).indices
    return order, expert_counts(key, C + 1)[:C]


class RoutedExperts(torch.autograd.Function):
    """out[r] = sum over the top-k slots (e, w) of row r of  w * expert_e(z)[r]; 0 at pad rows.

    z [R, Dh] rows = (sequence, position) with R = N * T and pads already zero; w [R, K] routing
    weights; idx [R, K] expert indices; real [R] bool (False = pad row, never computed);
    kernels: kernel size per expert (0 = identity); is_identity [E] bool (kernel 0); params: (weight
    [Dh, Dh, k], bias [Dh]) per conv expert in order, flattened.
    """

    @staticmethod
    def forward(ctx, z, w, idx, real, kernels, is_identity, seq_len, *params):
        R, Dh = z.shape
        K = w.shape[1]
        T, E = seq_len, len(kernels)
        r = max(kernels) // 2
        # identity experts, densely: out = (sum of the row's identity weights) * z
        is_id = is_identity[idx] & real[:, None]  # [R, K]
        w_id = (w * is_id).sum(-1, keepdim=True)
        out = z * w_id
        conv = [k for k in kernels if k > 0]
        if not conv:
            ctx.save_for_backward(z, is_id, w_id)
            ctx.meta = (T, r, K, (0, Dh), [], [])
            return out
        # conv slots grouped by expert (their counts read on the host once: the GEMM sizes), then
        # everything that is not the per-expert GEMM runs once over all groups
        order, counts = conv_slots_by_expert(idx, real, kernels)
        counts = counts.tolist()
        sel = order[: sum(counts)]
        rows = sel // K
        we = w.reshape(-1).index_select(0, sel)[:, None]
        # each sequence padded by r zeros on both sides, so a window never reads a neighbour; row
        # (n, t) sits at padded row n*(T+2r) + t + r, and a k-window is k*Dh contiguous values
        zp = F.pad(z.view(R // T, T, Dh), (0, 0, r, r)).view(-1, Dh)
        i = torch.arange(R, device=z.device)
        centre = (i + (i // T) * (2 * r) + r).index_select(0, rows)
        y = z.new_empty(sel.numel(), Dh)
        Xs, wmats, o = [], [], 0
        for j, (k, M) in enumerate(zip(conv, counts)):
            weight, bias = params[2 * j], params[2 * j + 1]
            X = zp.as_strided((zp.shape[0] - k + 1, k * Dh), (Dh, 1)).index_select(0, centre[o : o + M] - k // 2)
            wmat = weight.permute(2, 1, 0).reshape(k * Dh, Dh)  # [k*Dh_in, Dh_out]
            torch.addmm(bias, X, wmat, out=y[o : o + M])
            Xs.append(X)
            wmats.append(wmat)
            o += M
        out.index_add_(0, rows, y * we)
        ctx.Xs, ctx.wmats = Xs, wmats
        ctx.save_for_backward(z, is_id, w_id, sel, rows, we, y, centre)
        ctx.meta = (T, r, K, zp.shape, conv, counts)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        z, is_id, w_id, *conv_saved = ctx.saved_tensors
        T, r, K, zp_shape, conv, counts = ctx.meta
        R, Dh = g.shape
        g = g.contiguous()
        gz = g * w_id
        gw = torch.linalg.vecdot(g, z)[:, None] * is_id  # identity slots; conv slots written below
        if not conv:
            return (gz, gw, None, None, None, None, None)
        sel, rows, we, y, centre = conv_saved
        Xs, wmats = ctx.Xs, ctx.wmats
        ctx.Xs = ctx.wmats = None
        gs = g.index_select(0, rows)
        gw.view(-1).index_copy_(0, sel, torch.linalg.vecdot(gs, y))
        gy = gs * we
        gX = g.new_empty(sum(X.numel() for X in Xs))  # every expert's window gradients, one scatter
        taps = []
        grads, o, xo = [], 0, 0
        for k, M, X, wmat in zip(conv, counts, Xs, wmats):
            gyk = gy[o : o + M]
            g_wmat = (gyk.t() @ X).t()  # [k*Dh, Dh]; this orientation is the faster GEMM here
            grads += [g_wmat.reshape(k, Dh, Dh).permute(2, 1, 0), gyk.sum(0)]
            torch.mm(gyk, wmat.t(), out=gX[xo : xo + X.numel()].view(M, k * Dh))
            taps.append((centre[o : o + M, None] + torch.arange(-(k // 2), k // 2 + 1, device=g.device)).view(-1))
            o, xo = o + M, xo + X.numel()
        gzp = g.new_zeros(zp_shape)
        gzp.index_add_(0, torch.cat(taps), gX.view(-1, Dh))
        N = R // T
        gz.view(N, T, Dh).add_(gzp.view(N, T + 2 * r, Dh)[:, r : r + T])
        return (gz, gw, None, None, None, None, None, *grads)


def routed_experts(z: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, real: torch.Tensor,
                   kernels: list[int], is_identity: torch.Tensor, weights, biases) -> torch.Tensor:
    """z [N, T, Dh] (pads zero), w/idx [N, T, K], real [N, T], is_identity [E] bool -> mixture
    [N, T, Dh] (0 at pads)."""
    N, T, Dh = z.shape
    K = w.shape[-1]
    params = []
    for wt, b in zip(weights, biases):
        params += [wt.to(z.dtype), b.to(z.dtype)]
    out = RoutedExperts.apply(
        z.reshape(N * T, Dh), w.reshape(N * T, K), idx.reshape(N * T, K), real.reshape(N * T),
        tuple(kernels), is_identity, T, *params,
    )
    return out.view(N, T, Dh)
