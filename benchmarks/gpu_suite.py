"""One command for a lent GPU: the GPU test set and the GPU benchmarks, one table.

    python benchmarks/gpu_suite.py              # CUDA if there is one, else the CPU parts (tiny sizes), exit 0
    python benchmarks/gpu_suite.py --cpu        # the CPU parts even where CUDA exists (what CI runs)
    bash benchmarks/gpu_suite.sh                # the same, with the project's environment
    python benchmarks/gpu_suite.py --benches variants,moe,decode --json rows.json   # benchmarks/gpu_check.sh

Tests (PASS/FAIL/SKIP rows; every one has a CPU twin that CI runs, in benchmarks/gpu_check.sh --cpu):
  step/<variant>/<bf16|fp16>  one training step of every model variant under autocast (fp16 with a
                              GradScaler at 65536; the CPU runs fp16 autocast too): finite loss, the step
                              not skipped, every trainable parameter moves
  init-loss/<variant>         the loss at initialisation on random bytes is within [-0.25, +1] nats of
                              ln V (eval mode; the one-hot output scale, docs/MODELS.md §3)
  fp16-overflow               dynamic loss scaling: a forced overflow (inf in the loss) skips the
                              update and lowers the scale; on CUDA through the DeepSpeed engine's fp16
                              mode (StepInfo.skipped), CPU twin: torch.amp.GradScaler("cpu")
  moce-dense=routed           MoCE's dense one-conv expert path on the device equals the routed path on
                              the CPU: in float64 to 1e-9 of the largest gradient (the same function),
                              in float32 (TF32 off) to 1e-3 of the gradient's norm; why these two
                              tolerances: t_moce_dense_routed and docs/MODELS.md §8
  host-reads/<model>          device reads (syncs) per training forward+backward, counted by
                              scaletrain.models.host_reads: 0 for dense models, MoE and MoCE on one rank
                              where the grouped GEMM / dense experts apply, else at most 1 per routed layer
  moe-grouped-gemm            the MoE-FFN experts as torch._grouped_mm (CUTLASS on CUDA, bf16, compute
                              capability 9+) equal the per-expert loop, with no host read; step times
  sdpa-fused                  a bf16 forward+backward runs with SDPA restricted to the flash and
                              memory-efficient kernels (errors if neither applies to our masks)
  sdpa-unmasked               a batch without padding, forward(src_padded=False): every attention call
                              runs without a mask (FlashAttention only on CUDA); CPU: no mask passed
  max-tokens-auto             data.max_tokens: auto on this device, then one base-model bf16 step at that
                              budget: no OOM, peak memory reported (CPU: the fixed CPU value)
  compile                     torch.compile'd training step gives the eager loss; CPU twin uses the
                              aot_eager backend (Dynamo + AOTAutograd, no C++ toolchain / minutes)
Benchmarks (CUDA only; on CPU a tiny smoke run of the same code, numbers not meaningful):
  tok/s and MFU of the base byte Transformer in bf16 (DeepSpeed engine) at several batch sizes,
  every variant's step time relative to the byte Transformer, beam-4 decoding sentences/s, and the
  moe_base / moce_d5_moe step relative to a dense model of the same active FLOPs (the MoE layers'
  FFN k times as wide, k = top_k).
``--skip NAMES`` leaves checks out (a SKIP row each; e.g. ``compile``, whose inductor compile takes a minute
of a GPU window). ``--benches`` picks the benchmarks (engine: the DeepSpeed-engine throughput, compiled on CUDA, the slowest;
variants; moe; decode; default all); ``--json PATH`` writes the rows as they come ({name, result, detail}), so a
run stopped from outside leaves the rows it had.
Exit status: 1 if a test FAILed, else 0 (also on a machine without CUDA).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import VARIANTS, make_batch  # noqa: E402

from scaletrain.models import ModelConfig, build_model, estimate_flops_per_token  # noqa: E402
from scaletrain.models.loss import label_smoothed_ce  # noqa: E402
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET, PAD  # noqa: E402

N_LANGS = 8
VOCAB = LANG_OFFSET + N_LANGS
ROWS: list[tuple[str, str, str]] = []  # (name, result, detail)
JSON_OUT: list[Path] = []  # --json: rewritten after every row


def row(name, result, detail=""):
    ROWS.append((name, result, detail))
    print(f"{name:34s} {result:5s} {detail}", flush=True)
    save_rows(complete=False)


def save_rows(complete: bool) -> None:
    import json

    for path in JSON_OUT:
        path.write_text(json.dumps({"complete": complete, "rows": [dict(name=n, result=r, detail=d)
                                                                   for n, r, d in ROWS]}, indent=1))


SKIPPED: list[str] = []  # --skip: checks not run here, each a SKIP row


def check(name):
    """Decorator-free runner: call fn, record PASS / FAIL with the exception."""
    def run(fn, *a, **kw):
        if any(name == s or name.startswith(s + "/") for s in SKIPPED):
            row(name, "SKIP", "--skip")
            return
        try:
            detail = fn(*a, **kw)
            row(name, "PASS", detail or "")
        except Skip as e:
            row(name, "SKIP", str(e))
        except Exception as e:  # noqa: BLE001 - a suite reports every failure and goes on
            row(name, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:200])
            traceback.print_exc(file=sys.stderr)
    return run


class Skip(Exception):
    pass


def sizes(dev: torch.device) -> dict:
    """Model dims for the tests: tiny on CPU (CI), a bit larger on CUDA. d >= vocab for one-hot."""
    if dev.type == "cuda":
        return dict(d_model=512, n_heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=2048, dropout=0.1,
                    max_positions=136), dict(batch=8, src=64, tgt=64)
    return dict(d_model=288, n_heads=8, encoder_layers=2, decoder_layers=1, ffn_dim=288, dropout=0.1,
                max_positions=40), dict(batch=2, src=24, tgt=24)


def variant_cfg(name: str, base: dict, **extra) -> ModelConfig:
    return ModelConfig(**{**base, **VARIANTS[name], **extra})


def batch_on(dev, shape, seed=0):
    return [t.to(dev) for t in make_batch(shape["batch"], shape["src"], shape["tgt"], N_LANGS, seed=seed)]


# ---------------------------------------------------------------------------------------- tests
def t_step(name, dtype, dev, base, shape):
    """(fp16 on the CPU: autocast and GradScaler("cpu") run there, though preflight refuses fp16 training)"""
    torch.manual_seed(0)
    model = build_model(variant_cfg(name, base), VOCAB).to(dev).train()
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    src, tgt_in, tgt_out = batch_on(dev, shape)
    with torch.autocast(dev.type, dtype=dtype):
        logits = model(src, tgt_in)
    loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=PAD)
    if not torch.isfinite(loss):
        raise AssertionError(f"loss {float(loss)}")
    scaler.scale(loss / n).backward()
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(opt)
    scaler.update()
    if scale is not None and scaler.get_scale() < scale:
        raise AssertionError(f"the fp16 step was skipped (overflow at loss scale {scale:g})")
    still = [k for k, p in model.named_parameters() if k in before and torch.equal(p.detach(), before[k])]
    if still:
        raise AssertionError(f"{len(still)} parameters did not move, e.g. {still[:3]}")
    return f"loss/tok {float(loss / n):.3f}"


def t_init_loss(name, dev):
    """Eval-mode loss at initialisation on random bytes vs ln V. Full depth (the margin assumes the
    recipes' 6+6 layers: a shallow decoder keeps more of its input token in the output)."""
    import math

    base = dict(d_model=512, n_heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=2048, max_positions=136)
    rows = 8
    if dev.type == "cpu":
        base, rows = {**base, "d_model": 288, "ffn_dim": 288}, 2
    torch.manual_seed(0)
    model = build_model(variant_cfg(name, base), VOCAB).to(dev).eval()
    g = torch.Generator().manual_seed(0)  # uniformly random bytes (measured on the CPU: ln V + 0.31 to + 0.83)
    src = torch.randint(BYTE_OFFSET, LANG_OFFSET, (rows, 32), generator=g)
    tgt = torch.randint(BYTE_OFFSET, LANG_OFFSET, (rows, 33), generator=g)
    src[:, 0], tgt[:, 0] = LANG_OFFSET, LANG_OFFSET + 1
    src, tgt_in, tgt_out = src.to(dev), tgt[:, :-1].to(dev), tgt[:, 1:].to(dev)
    with torch.no_grad():
        loss, _, n = label_smoothed_ce(model(src, tgt_in).float(), tgt_out, epsilon=0.0, ignore_index=PAD)
    excess = float(loss / n) - math.log(VOCAB)
    if not -0.25 < excess < 1.0:
        raise AssertionError(f"initial loss {float(loss / n):.2f} nats/token, ln V = {math.log(VOCAB):.2f}")
    return f"loss/tok {float(loss / n):.3f} = ln V {excess:+.3f}"


def t_overflow_cuda(base, shape):
    import os

    import importlib.util

    from scaletrain.config import load_config
    from scaletrain.engine import build_engine

    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("deepspeed is not installed in this environment (scripts/bootstrap.sh lists what is missing)")
    os.environ.pop("SCALETRAIN_AUTO_PRECISION", None)
    m = base
    cfg = load_config("small", [
        f"model.d_model={m['d_model']}", f"model.n_heads={m['n_heads']}", "model.encoder_layers=2",
        "model.decoder_layers=2", f"model.ffn_dim={m['ffn_dim']}", "model.max_positions=136", "data.max_bytes=100",
        "engine.precision=fp16", "engine.ds_config=fp16.json", "tracking.enabled=false"])
    eng = build_engine(cfg)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, VOCAB))
    opt = eng.backend.e.optimizer
    scale0 = float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", float("nan"))))
    src, tgt_in, tgt_out = batch_on(eng.device, shape)
    # ds_configs/fp16.json has hysteresis 2: the first overflow only uses up the hysteresis, the
    # second lowers the scale; every overflowing step must be skipped
    skipped, scale1 = [], scale0
    for _ in range(3):
        loss, _, n = label_smoothed_ce(eng.forward(src, tgt_in).float(), tgt_out, epsilon=0.1, ignore_index=PAD)
        eng.backward(loss / n * float("inf"))  # forced overflow
        skipped.append(eng.step().skipped)
        scale1 = float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", float("nan"))))
        if scale1 < scale0:
            break
    if not all(skipped) or not scale1 < scale0:
        raise AssertionError(f"skipped={skipped}, loss scale {scale0} -> {scale1}")
    return f"DeepSpeed fp16: {len(skipped)} overflowing steps skipped, loss scale {scale0:g} -> {scale1:g}"


def t_overflow_twin(dev, base, shape):
    torch.manual_seed(0)
    model = build_model(variant_cfg("transformer", base), VOCAB).to(dev).train()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**16)
    src, tgt_in, tgt_out = batch_on(dev, shape)
    loss, _, n = label_smoothed_ce(model(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=PAD)
    scaler.scale(loss / n * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    moved = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])]
    if moved or not scaler.get_scale() < 2.0**16:
        raise AssertionError(f"{len(moved)} parameters moved, scale {scaler.get_scale()}")
    return f"GradScaler({dev.type}) twin: step skipped, scale 65536 -> {scaler.get_scale():g}"


def _moce_grads(model, dev, dtype, batch):
    """(logits, {name: gradient}) of one loss/token backward of ``model`` on ``dev`` in ``dtype``, on the CPU in fp64."""
    m = copy.deepcopy(model).to(dev, dtype)
    src, tgt_in, tgt_out = (t.to(dev) for t in batch)
    logits = m(src, tgt_in)
    loss, _, n = label_smoothed_ce(logits, tgt_out, epsilon=0.1, ignore_index=PAD)
    (loss / n).backward()
    return (logits.detach().cpu().double(),
            {k: p.grad.detach().cpu().double() for k, p in m.named_parameters() if p.grad is not None})


def t_moce_dense_routed(dev, base, shape):
    """The dense one-conv expert path on ``dev`` against the routed path on the CPU, same weights, eval mode.

    float64: the same function, so every gradient agrees to 1e-9 of the model's largest gradient (measured on
    the CPU at the CUDA sizes: 4e-16 relative). A real mismatch (a dropped expert, a capacity cut, another
    pad mask) moves the logits and gradients by 1e-3 or more.
    float32 (TF32 off): round-off only, but a gradient is piecewise smooth: ReLU and top-k routing turn a
    round-off change of a pre-activation near 0 into a whole token's contribution to one unit's weight row.
    An element-wise tolerance therefore fails at random (measured 4.45e-3 of a parameter's largest gradient
    on an H100 with the former check; 2.7e-4 on the CPU between the two paths of the same device, each of
    them 1.1e-4 from the float64 result in the per-parameter norm). So float32 is held to a norm-wise bound
    over the whole gradient: 1e-3 (measured on the CPU: 8e-6 between the paths, 4e-5 for either path
    against float64), and the logits to 1e-4."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, False
    try:
        return _moce_compare(dev, base, shape)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _moce_compare(dev, base, shape):
    torch.manual_seed(0)
    dense = build_model(variant_cfg("moce_d5", base, moce=copy.deepcopy(VARIANTS["moce_d5_dense"]["moce"])),
                        VOCAB).eval()
    routed_cfg = variant_cfg("moce_d5", base)
    routed_cfg.moce.dispatch = "routed"
    routed = build_model(routed_cfg, VOCAB).eval()
    routed.load_state_dict(dense.state_dict())
    batch = batch_on(torch.device("cpu"), shape)
    cpu = torch.device("cpu")
    out = []
    for dtype in (torch.float64, torch.float32):
        (ld, gd), (lr, gr) = _moce_grads(dense, dev, dtype, batch), _moce_grads(routed, cpu, dtype, batch)
        assert gd.keys() == gr.keys() and gd
        top = max(float(g.abs().max()) for g in gd.values())
        elem = max(float((gd[k] - gr[k]).abs().max()) for k in gd) / top
        norm = float(torch.cat([(gd[k] - gr[k]).flatten() for k in gd]).norm() /
                     torch.cat([g.flatten() for g in gr.values()]).norm())
        dl = float((ld - lr).abs().max())
        if dtype == torch.float64 and (elem > 1e-9 or dl > 1e-9):
            raise AssertionError(f"float64: the paths differ (logits {dl:.1e}, gradients {elem:.1e} of the largest)")
        if dtype == torch.float32 and (norm > 1e-3 or dl > 1e-4):
            raise AssertionError(f"float32: logits {dl:.1e}, gradient norm-wise {norm:.1e}")
        out.append(f"fp{64 if dtype == torch.float64 else 32}: logits {dl:.0e}, grads {elem:.0e} max / {norm:.0e} norm")
    return f"dense on {dev.type} = routed on cpu; " + "; ".join(out)


def suite_moe():
    """The MoE-FFN layout of the moe_base / moce_d5_moe recipes (8 experts, top-2, every 2nd layer)."""
    from scaletrain.models.config import MoEConfig

    return MoEConfig(num_experts=8, top_k=2, every=2, aux_loss_coef=0.01)


HOST_READ_MODELS = {"transformer": ("transformer", False), "moce_d5": ("moce_d5", False),
                    "moe": ("transformer", True), "moce_d5_moe": ("moce_d5", True)}


def t_host_reads(name, dev, base, shape):
    """Device reads per training forward + backward (bf16 on CUDA, fp32 on the CPU) (scaletrain.models.host_reads): none in a dense
    model, none in MoE layers whose experts run as a grouped GEMM, none in MoCE's dense path (CUDA), else at
    most one per routed layer. On CUDA torch's own sync debug mode counts the syncs beside it."""
    import warnings

    from scaletrain.models.host_reads import HostReads
    from scaletrain.models.moe import MoEFeedForward

    variant, with_moe = HOST_READ_MODELS[name]
    torch.manual_seed(0)
    model = build_model(variant_cfg(variant, base), VOCAB, moe=suite_moe() if with_moe else None).to(dev).train()
    src, tgt_in, tgt_out = batch_on(dev, shape)
    moe_layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    moce_layers = [m for m in model.modules() if type(m).__name__ == "MoCEExperts"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostReads() as reads, torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss, _, n = label_smoothed_ce(model(src, tgt_in).float(), tgt_out, epsilon=0.1, ignore_index=PAD)
                aux = model.last_aux_loss
                (loss / n + (aux if aux is not None else 0.0)).backward()
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    grouped = bool(moe_layers) and moe_layers[0].experts.grouped_ok(torch.empty(1, base["d_model"], device=dev,
                                                                                dtype=dtype))
    routed = sum(m.routed_path(src) for m in moce_layers)
    allowed = (0 if grouped else len(moe_layers)) + routed
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    detail = (f"{reads.count} reads ({', '.join(sorted(set(reads.events))) or '-'}) for {len(moe_layers)} MoE "
              f"layers (grouped GEMM: {grouped}) and {len(moce_layers)} MoCE layers ({routed} routed)"
              + (f"; CUDA sync debug: {syncs} syncs" if dev.type == "cuda" else ""))
    if reads.count > allowed:
        raise AssertionError(f"{detail}; at most {allowed} allowed")
    return detail


def t_moe_grouped(dev):
    """One MoE-FFN layer at the papers' size (d 512, 8 experts of 2048, top-2, pads): the grouped-GEMM path
    equals the per-expert loop and reads nothing; forward+backward times of both (bf16 on CUDA, fp32 on CPU)."""
    from scaletrain.models import moe as moe_mod
    from scaletrain.models.host_reads import HostReads

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    d, f, rows = (512, 2048, 16) if dev.type == "cuda" else (64, 128, 4)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(rows, 64, d, generator=g).to(dev, dtype)
    pad = torch.zeros(rows, 64, dtype=torch.bool, device=dev)
    pad[::3, 40:] = True
    layer = moe_mod.MoEFeedForward(d, suite_moe(), f, "relu", 0.0, "torch").to(dev, dtype)
    if not layer.experts.grouped_ok(x0):
        raise Skip(f"torch._grouped_mm does not apply here ({dev.type}, {dtype}; CUDA needs compute capability 9+)")

    def run(grouped: bool):
        original = moe_mod._grouped_mm_ok
        if not grouped:
            moe_mod._grouped_mm_ok = lambda x, f: False
        try:
            layer.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            with HostReads() as reads:
                y = layer(x, pad)
                y.float().pow(2).mean().backward()
            sync(dev)
            t = time.perf_counter()
            for _ in range(3):
                layer(x, pad).float().pow(2).mean().backward()
            sync(dev)
            return y.detach().float(), x.grad.float(), reads.count, (time.perf_counter() - t) / 3
        finally:
            moe_mod._grouped_mm_ok = original

    (yg, gg, rg, tg), (yl, gl, rl, tl) = run(True), run(False)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(yg, yl, **tol)
    torch.testing.assert_close(gg, gl, **tol)
    if rg:
        raise AssertionError(f"the grouped path read the device {rg} times")
    return f"grouped = loop ({dtype}); host reads {rg} vs {rl}; fwd+bwd {1e3 * tg:.2f} vs {1e3 * tl:.2f} ms ({tl / tg:.2f}x)"


def t_sdpa_unmasked(dev, base, shape):
    """A batch without padding with ``src_padded=False``: no attention call gets a mask; on CUDA SDPA is
    restricted to FlashAttention, which takes none (a masked call would fail to find a kernel)."""
    from collections import Counter

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from scaletrain.models.kernels import SdpaKernels, sdpa_backend

    torch.manual_seed(0)
    model = build_model(variant_cfg("transformer", base, kernels="torch"), VOCAB).to(dev).train()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 256, (shape["batch"], shape["src"]), generator=g).to(dev)
    tgt = torch.randint(4, 256, (shape["batch"], shape["tgt"] + 1), generator=g).to(dev)
    backends = [SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"), \
            SdpaKernels() as k:
        logits = model(src, tgt[:, :-1], src_padded=False)
        loss, _, n = label_smoothed_ce(logits.float(), tgt[:, 1:], epsilon=0.1, ignore_index=PAD)
        (loss / n).backward()
    calls = Counter(k.calls)
    if any(masked for _, masked in calls) or not calls:
        raise AssertionError(f"attention calls {dict(calls)}")
    q = torch.randn(shape["batch"], base["n_heads"], shape["src"], base["d_model"] // base["n_heads"], device=dev,
                    dtype=torch.bfloat16)
    mask = torch.ones(shape["batch"], 1, 1, shape["src"], dtype=torch.bool, device=dev)
    return (f"calls {dict(calls)}; SDPA picks {sdpa_backend(q, q, q)} unmasked, "
            f"{sdpa_backend(q, q, q, mask)} with a key-padding mask")


def t_max_tokens_auto(dev):
    """data.max_tokens: auto on this device for the base recipe, then one bf16 AdamW step of the base model
    on a batch filling that budget (128 + 128 tokens per row): no out-of-memory, the peak reported."""
    from scaletrain.config import load_config
    from scaletrain.models.memory import apply_max_tokens, training_memory

    cfg = load_config("base", ["data.max_tokens=auto", "engine.precision=bf16", "model.max_positions=256",
                               "data.max_bytes=200"])
    tokens = apply_max_tokens(cfg, VOCAB, dev)
    if dev.type != "cuda":
        return f"CPU: {cfg.data.max_tokens_auto}"
    rows = tokens // 256
    torch.manual_seed(0)
    model = build_model(cfg.model, VOCAB).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 256, (rows, 128), generator=g).to(dev)
    tgt = torch.randint(4, 256, (rows, 129), generator=g).to(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(src, tgt[:, :-1], src_padded=False)
    loss, _, n = label_smoothed_ce(logits.float(), tgt[:, 1:], epsilon=0.1, ignore_index=PAD)
    (loss / n).backward()
    opt.step()
    sync(dev)
    peak, total = torch.cuda.max_memory_allocated(dev), torch.cuda.get_device_properties(dev).total_memory
    fixed, per_token = training_memory(cfg.model, VOCAB, "bf16")
    return (f"auto {tokens} tokens; step of {rows}x(128+128): peak {peak / 2**30:.1f} of {total / 2**30:.1f} GiB "
            f"(estimate {(fixed + per_token * rows * 256) / 2**30:.1f} GiB)")


def t_sdpa_fused(dev, base, shape):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = build_model(variant_cfg("transformer", base, kernels="torch"), VOCAB).to(dev).train()
    src, tgt_in, tgt_out = batch_on(dev, shape)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends), torch.autocast(dev.type, dtype=torch.bfloat16):
        with torch.profiler.profile() as prof:
            logits = model(src, tgt_in)
            loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=PAD)
            (loss / n).backward()
    names = {e.key for e in prof.key_averages()}
    fused = sorted(k for k in names if "flash" in k.lower() or "efficient_attention" in k.lower())
    if not fused:
        raise AssertionError("no flash/efficient attention op ran")
    return f"ops: {', '.join(fused[:3])}"


def t_compile(dev, base, shape):
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    torch.manual_seed(0)
    eager = build_model(variant_cfg("transformer", base, dropout=0.0), VOCAB).to(dev).train()
    comp = copy.deepcopy(eager)
    comp.compile(backend=backend)
    src, tgt_in, tgt_out = batch_on(dev, shape)
    losses = []
    for m in (eager, comp):
        loss, _, n = label_smoothed_ce(m(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=PAD)
        (loss / n).backward()
        losses.append(float(loss / n))
    ge = next(p.grad for p in eager.parameters() if p.grad is not None)
    gc = next(p.grad for p in comp.parameters() if p.grad is not None)
    if abs(losses[0] - losses[1]) > 1e-3 * abs(losses[0]) or not torch.allclose(ge, gc, atol=1e-4, rtol=1e-3):
        raise AssertionError(f"compiled loss {losses[1]} vs eager {losses[0]}")
    return f"backend {backend}: loss {losses[1]:.4f} = eager {losses[0]:.4f}"


# ----------------------------------------------------------------------------------- benchmarks
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def gemm_peak(dev, dtype, n) -> float:
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    sync(dev)
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    sync(dev)
    return 2 * n**3 * 5 / (time.perf_counter() - t)


def b_engine_throughput(dev, batches, length, steps):
    """tok/s and MFU of the base byte Transformer in bf16 through the DeepSpeed engine."""
    import os

    from bench_engine_throughput import build_ours_engine, make_batch as flat_batch

    from scaletrain.vocab import ByteVocab

    os.environ.pop("SCALETRAIN_AUTO_PRECISION", None)
    V = ByteVocab(["de", "fr", "ru", "ar", "hi", "ja", "zh", "en"]).size
    peak = gemm_peak(dev, torch.bfloat16, 8192 if dev.type == "cuda" else 256)
    out = []
    for B in batches:
        batch = [t.to(dev) for t in flat_batch(B, length, V)]
        step, _, cfg = build_ours_engine("bf16", batch, "base")
        step()
        sync(dev)
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync(dev)
        dt = (time.perf_counter() - t) / steps
        tps = B * length / dt
        mfu = tps * estimate_flops_per_token(cfg.model, length, length, V) / peak
        out.append((f"bench/base-bf16/B{B}x{length}", f"{tps:,.0f} tok/s, MFU {100 * mfu:.1f}% "
                                                      f"(bf16 GEMM peak {peak / 1e12:.1f} TFLOP/s)"))
    return out


def make_step(model, dev, batch):
    """A bf16 autocast training step (forward, loss + MoE aux loss, backward, AdamW) of ``model``, synced."""
    src, tgt_in, tgt_out = batch
    m = model.to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = m(src, tgt_in)
        loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=PAD)
        aux = m.last_aux_loss
        (loss / n + (aux if aux is not None else 0.0)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
    step()
    return step


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired(ref, fn, rounds: int) -> str:
    """Median (and range) over rounds of ref's step time / fn's: fn's tok/s relative to ref's."""
    ratios = [timed(ref) / timed(fn) for _ in range(rounds)]
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def b_variants(dev, base, shape, rounds, names=None):
    """Every variant's bf16 autocast step time relative to the byte Transformer (paired rounds)."""
    batch = batch_on(dev, shape)

    def runner(name):
        torch.manual_seed(0)
        return make_step(build_model(variant_cfg(name, base), VOCAB), dev, batch)

    ref = runner("transformer")
    return [(f"bench/variant/{name}", f"{paired(ref, runner(name), rounds)} transformer tok/s")
            for name in names or VARIANTS if name != "transformer"]


def b_moe_vs_dense(dev, base, shape, rounds):
    """moe_base and moce_d5_moe (8 experts, top-2, every 2nd layer) against the same model with a dense FFN
    k = 2 times as wide on those layers: the same active FLOPs per token, so the ratio is what routing,
    dispatch and the grouped GEMM cost (or save)."""
    from scaletrain.models.registry import builder
    from scaletrain.models.transformer import FeedForward

    moe = suite_moe()
    batch = batch_on(dev, shape)
    out = []
    for name, variant in (("moe_base", "transformer"), ("moce_d5_moe", "moce_d5")):
        cfg = variant_cfg(variant, base)
        wide = moe.top_k * moe.expert_ffn_dim(cfg)

        def dense_ffn(side, i, cfg=cfg, wide=wide):
            return FeedForward(cfg.d_model, wide, cfg.activation, cfg.activation_dropout, cfg.kernels) \
                if moe.moe_layer(i) else None
        torch.manual_seed(0)
        dense = make_step(builder(cfg.arch)(cfg, VOCAB, None, ffn=dense_ffn), dev, batch)
        torch.manual_seed(0)
        sparse = make_step(build_model(cfg, VOCAB, moe=moe), dev, batch)
        out.append((f"bench/moe-vs-dense/{name}", f"{paired(dense, sparse, rounds)} tok/s of the dense model "
                                                  f"with the same active FLOPs (FFN {wide} on the MoE layers)"))
    return out


def b_decode(dev, base, batch, src_len, out_len, beam):
    from scaletrain.eval.generate import generate

    torch.manual_seed(0)
    m = build_model(variant_cfg("transformer", base, dropout=0.0), VOCAB).to(dev).eval()
    src, _, _ = batch_on(dev, dict(batch=batch, src=src_len, tgt=4))
    tags = LANG_OFFSET + 1
    kw = dict(beam=beam, max_len_a=0.0, max_len_b=out_len, min_len=out_len)  # equal output lengths
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        generate(m, src, tags, **kw)
        sync(dev)
        t = time.perf_counter()
        out = generate(m, src, tags, **kw)
        sync(dev)
    dt = time.perf_counter() - t
    n_tok = sum(len(o) for o in out)
    return [(f"bench/decode/beam{beam}", f"{batch / dt:,.1f} sentences/s, {n_tok / dt:,.0f} output tok/s "
                                         f"(batch {batch}, {out_len} steps)")]


BENCHES = ("engine", "variants", "moe", "decode")


def run_benches(dev, base, shape, cuda: bool, which=BENCHES) -> None:
    """Each benchmark on its own: one that cannot run (e.g. no DeepSpeed here) is a FAIL row, the rest go on."""
    big = dict(batch=32, src=128, tgt=128)
    if cuda:
        benches = {"engine": lambda: b_engine_throughput(dev, [16, 32, 64, 128], 128, steps=5),
                   "variants": lambda: b_variants(dev, base, big, rounds=5),
                   "moe": lambda: b_moe_vs_dense(dev, base, big, rounds=5),
                   "decode": lambda: b_decode(dev, {**base, "max_positions": 256}, batch=64, src_len=64, out_len=64,
                                              beam=4)}
    else:  # smoke run of the same code at tiny size: the numbers mean nothing
        benches = {"variants": lambda: b_variants(dev, base, shape, rounds=1, names=["moce_d5"]),
                   "moe": lambda: b_moe_vs_dense(dev, base, shape, rounds=1),
                   "decode": lambda: b_decode(dev, base, batch=2, src_len=12, out_len=8, beam=4)}
    for bench in (benches[k] for k in which if k in benches):
        try:
            for name, val in bench():
                row(name, "", val)
        except Exception as e:  # noqa: BLE001 - a suite reports every failure and goes on
            row("bench", "FAIL", f"{type(e).__name__}: {e}"[:200])
            traceback.print_exc(file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU parts even where CUDA is available")
    ap.add_argument("--no-bench", action="store_true", help="tests only")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants for the per-variant steps")
    ap.add_argument("--benches", default=",".join(BENCHES), help=f"benchmarks to run, of {','.join(BENCHES)}")
    ap.add_argument("--json", default="", help="write the rows here (rewritten after each)")
    ap.add_argument("--skip", default="", help="checks not to run, by name or name prefix (e.g. compile,init-loss)")
    args = ap.parse_args(argv)
    SKIPPED.extend(x for x in args.skip.split(",") if x)
    benches = [b for b in args.benches.split(",") if b]
    if set(benches) - set(BENCHES):
        ap.error(f"unknown benchmarks {sorted(set(benches) - set(BENCHES))}; choose from {', '.join(BENCHES)}")
    if args.json:
        JSON_OUT.append(Path(args.json))
    cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        print(f"CUDA: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"bf16 supported: {torch.cuda.is_bf16_supported()}")
    else:
        why = "--cpu given" if args.cpu else "no CUDA device on this machine"
        print(f"{why}: running the CPU parts (CPU twins of the GPU checks, tiny sizes); GPU-only rows are SKIP")
    torch.set_flush_denormal(True)
    base, shape = sizes(dev)
    names = [v for v in args.variants.split(",") if v]
    for name in names:
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            check(f"step/{name}/{label}")(t_step, name, dtype, dev, base, shape)
    if cuda:
        check("fp16-overflow (DeepSpeed)")(t_overflow_cuda, base, shape)
    check(f"fp16-overflow (GradScaler {dev.type})")(t_overflow_twin, dev, base, shape)
    check("moce-dense=routed")(t_moce_dense_routed, dev, base, shape)
    check("sdpa-fused")(t_sdpa_fused, dev, base, shape)
    check("sdpa-unmasked")(t_sdpa_unmasked, dev, base, shape)
    check("compile")(t_compile, dev, base, shape)
    for name in names:
        check(f"init-loss/{name}")(t_init_loss, name, dev)
    for name in HOST_READ_MODELS:
        check(f"host-reads/{name}")(t_host_reads, name, dev, base, shape)
    check("moe-grouped-gemm")(t_moe_grouped, dev)
    check("max-tokens-auto")(t_max_tokens_auto, dev)
    if not args.no_bench:
        run_benches(dev, base, shape, cuda, benches)
    print("\n" + "=" * 100)
    print(f"{'check / benchmark':34s} {'result':6s} detail   [{dev.type}]")
    for name, res, detail in ROWS:
        print(f"{name:34s} {res:6s} {detail}")
    failed = [n for n, r, _ in ROWS if r == "FAIL"]
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    save_rows(complete=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
