"""One command for a lent GPU: the GPU test set and the GPU benchmarks, one table.

    python benchmarks/gpu_suite.py              # CUDA if there is one, else the CPU parts (tiny sizes), exit 0
    python benchmarks/gpu_suite.py --cpu        # the CPU parts even where CUDA exists (what CI runs)
    bash benchmarks/gpu_suite.sh                # the same, with the project's environment

Tests (PASS/FAIL/SKIP rows):
  step/<variant>/<bf16|fp16>  one training step of every model variant under autocast (fp16 with a
                              GradScaler): finite loss, every trainable parameter moves
  fp16-overflow               dynamic loss scaling: a forced overflow (inf in the loss) skips the
                              update and lowers the scale; on CUDA through the DeepSpeed engine's fp16
                              mode (StepInfo.skipped), CPU twin: torch.amp.GradScaler("cpu")
  moce-dense=routed           MoCE's dense one-conv expert path on the device equals the CPU routed
                              path (logits and gradients); CPU twin: both on the CPU
  sdpa-fused                  a bf16 forward+backward runs with SDPA restricted to the flash and
                              memory-efficient kernels (errors if neither applies to our masks)
  compile                     torch.compile'd training step gives the eager loss; CPU twin uses the
                              aot_eager backend (Dynamo + AOTAutograd, no C++ toolchain / minutes)
Benchmarks (CUDA only; on CPU a tiny smoke run of the same code, numbers not meaningful):
  tok/s and MFU of the base byte Transformer in bf16 (DeepSpeed engine) at several batch sizes,
  every variant's step time relative to the byte Transformer, beam-4 decoding sentences/s.
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
from scaletrain.vocab import LANG_OFFSET, PAD  # noqa: E402

N_LANGS = 8
VOCAB = LANG_OFFSET + N_LANGS
ROWS: list[tuple[str, str, str]] = []  # (name, result, detail)


def row(name, result, detail=""):
    ROWS.append((name, result, detail))
    print(f"{name:34s} {result:5s} {detail}", flush=True)


def check(name):
    """Decorator-free runner: call fn, record PASS / FAIL with the exception."""
    def run(fn, *a, **kw):
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
    if dtype == torch.float16 and dev.type == "cpu":
        raise Skip("fp16 training needs CUDA (preflight refuses it on CPU)")
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
    scaler.step(opt)
    scaler.update()
    still = [k for k, p in model.named_parameters() if k in before and torch.equal(p.detach(), before[k])]
    if still:
        raise AssertionError(f"{len(still)} parameters did not move, e.g. {still[:3]}")
    return f"loss/tok {float(loss / n):.3f}"


def t_overflow_cuda(base, shape):
    import os

    from scaletrain.config import load_config
    from scaletrain.engine import build_engine

    os.environ.pop("SCALETRAIN_AUTO_PRECISION", None)
    m = base
    cfg = load_config("small", [
        f"model.d_model={m['d_model']}", f"model.n_heads={m['n_heads']}", "model.encoder_layers=2",
        "model.decoder_layers=2", f"model.ffn_dim={m['ffn_dim']}", "model.max_positions=136", "data.max_bytes=100",
        "engine.precision=fp16", "engine.ds_config=fp16.json", "tracking.enabled=false"])
    eng = build_engine(cfg)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, VOCAB))
    opt = eng.driver.e.optimizer
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


def t_moce_dense_routed(dev, base, shape):
    """Same weights: dense on ``dev`` vs routed on the CPU, eval mode, fp32; logits and gradients."""
    # true fp32 on the GPU: cuDNN convolutions default to TF32 (10-bit mantissa) on Ampere and later
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    dense = build_model(variant_cfg("moce_d5", base, moce=copy.deepcopy(VARIANTS["moce_d5_dense"]["moce"])),
                        VOCAB).to(dev).eval()
    routed_cfg = variant_cfg("moce_d5", base)
    routed_cfg.moce.dispatch = "routed"
    routed = build_model(routed_cfg, VOCAB).eval()
    routed.load_state_dict({k: v.cpu() for k, v in dense.state_dict().items()})
    src, tgt_in, tgt_out = batch_on(torch.device("cpu"), shape)
    outs = {}
    for name, m, d in (("dense", dense, dev), ("routed", routed, torch.device("cpu"))):
        m.zero_grad(set_to_none=True)
        logits = m(src.to(d), tgt_in.to(d))
        loss, _, _ = label_smoothed_ce(logits, tgt_out.to(d), epsilon=0.1, ignore_index=PAD)
        loss.backward()
        outs[name] = (logits.detach().cpu(), {k: p.grad.cpu() for k, p in m.named_parameters() if p.grad is not None})
    (ld, gd), (lr, gr) = outs["dense"], outs["routed"]
    tol = dict(atol=2e-4, rtol=2e-4) if dev.type == "cuda" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lr, ld, **tol)
    assert gd.keys() == gr.keys() and gd
    # relative to the gradient's size, floored at 1e-3 of the largest gradient: k_proj biases have
    # mathematically zero gradients (their values are ~1e-7 round-off on both paths)
    floor = 1e-3 * max(float(g.abs().max()) for g in gd.values())
    worst = max(float((gd[k] - gr[k]).abs().max() / max(float(gd[k].abs().max()), floor)) for k in gd)
    if worst > 1e-3:
        raise AssertionError(f"gradients differ: max relative {worst:.2e}")
    return f"dense on {dev.type} = routed on cpu: logits max|d| {float((ld - lr).abs().max()):.1e}, grads rel {worst:.1e}"


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


def b_variants(dev, base, shape, rounds, names=None):
    """Every variant's bf16 autocast step time relative to the byte Transformer (paired rounds)."""
    src, tgt_in, tgt_out = batch_on(dev, shape)

    def runner(name):
        torch.manual_seed(0)
        m = build_model(variant_cfg(name, base), VOCAB).to(dev).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = m(src, tgt_in)
            loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=PAD)
            (loss / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
        step()
        return step

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    ref = runner("transformer")
    out = []
    for name in names or VARIANTS:
        if name == "transformer":
            continue
        fn = runner(name)
        ratios = [timed(ref) / timed(fn) for _ in range(rounds)]
        out.append((f"bench/variant/{name}", f"{statistics.median(ratios):.2f}x transformer tok/s "
                                             f"[{min(ratios):.2f}-{max(ratios):.2f}]"))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU parts even where CUDA is available")
    ap.add_argument("--no-bench", action="store_true", help="tests only")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants for the per-variant steps")
    args = ap.parse_args(argv)
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
    check("compile")(t_compile, dev, base, shape)
    if not args.no_bench:
        benches = []
        try:
            if cuda:
                benches += b_engine_throughput(dev, [16, 32, 64, 128], 128, steps=5)
                benches += b_variants(dev, base, dict(batch=32, src=128, tgt=128), rounds=5)
                benches += b_decode(dev, {**base, "max_positions": 256}, batch=64, src_len=64, out_len=64, beam=4)
            else:  # smoke run of the same code at tiny size: the numbers mean nothing
                benches += b_variants(dev, base, shape, rounds=1, names=["moce_d5"])
                benches += b_decode(dev, base, batch=2, src_len=12, out_len=8, beam=4)
        except Exception as e:  # noqa: BLE001
            row("bench", "FAIL", f"{type(e).__name__}: {e}"[:200])
            traceback.print_exc(file=sys.stderr)
        for name, val in benches:
            row(name, "", val)
    print("\n" + "=" * 100)
    print(f"{'check / benchmark':34s} {'result':6s} detail   [{dev.type}]")
    for name, res, detail in ROWS:
        print(f"{name:34s} {res:6s} {detail}")
    failed = [n for n, r, _ in ROWS if r == "FAIL"]
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
