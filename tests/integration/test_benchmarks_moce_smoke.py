"""The MoCE benchmarks named in the README run at tiny shapes and print tables whose numbers agree with the
benchmarks' own definitions: the counts asked for, the target tokens and parameters of the models built, the
ratio as the median (and IQR) of the per-round ratios printed while running, tokens/s as tokens over the step
time, the baseline's ratio exactly 1, the FLOPs ratio from the model's FLOP estimate; the layer benchmark's
extra cost and routed/dense ratios from its printed medians. (The timings themselves are not checked.)"""
from __future__ import annotations

import importlib.util
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(?P<name>\S+)\s+(?P<params>[\d.]+)M\s+(?P<ms>[\d.]+)\s+(?P<tps>\d+)\s+(?P<ratio>[\d.]+)x\s+"
                 r"\[(?P<q1>[\d.]+), (?P<q3>[\d.]+)\]\s+(?P<flops>[\d.]+)x$", re.M)


def _run(*args: str) -> tuple[str, str]:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _interval(f, values: list[float], half: float) -> tuple[float, float]:
    """The range of ``f`` (monotone in each argument) over the printed values +- ``half`` (their rounding)."""
    import itertools

    outs = [f(*(v + s * half for v, s in zip(values, signs))) for signs in itertools.product((-1, 1), repeat=len(values))]
    return min(outs), max(outs)


def check_bench_models_table(out: str, err: str, variants: list[str], batch: int, src: int, tgt: int,
                             rounds: int, warmup: int) -> None:
    from scaletrain.models import ModelConfig, build_model, estimate_flops_per_token
    from scaletrain.vocab import PAD

    bm = _bench_module("bench_models")
    n_langs, vocab = 8, bm.LANG_OFFSET + 8
    _, _, tgt_out = bm.make_batch(batch, src, tgt, n_langs)
    n_tok = int(tgt_out.ne(PAD).sum())
    assert (f"batch {batch} x src {src} / tgt {tgt} ({n_tok} target tokens); torch threads 1, {warmup} warm-up "
            f"steps, {rounds} paired rounds") in out, out
    names = ["transformer", *variants]
    per_round = [line for line in err.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in per_round] == [f"round {i}/{rounds}" for i in range(1, rounds + 1)], err
    printed = {n: [] for n in names}
    for line in per_round:
        fields = line.split(": ", 1)[1].split()
        assert fields[0::2] == names, line
        for n, v in zip(fields[0::2], fields[1::2]):
            printed[n].append(float(v))
    rows = {m["name"]: m for m in ROW.finditer(out)}
    assert list(rows) == names, out
    base = dict(d_model=288, n_heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=1152, dropout=0.1,
                max_positions=max(src, tgt) + 8)
    ref_flops = estimate_flops_per_token(ModelConfig(**base), src, tgt, vocab)
    for n in names:
        r = rows[n]
        ratio, q1, q3, ms = float(r["ratio"]), float(r["q1"]), float(r["q3"]), float(r["ms"])
        # the ratio is the median of the per-round ratios (printed to 3 decimals), the IQR their quartiles
        rs = sorted(printed[n])
        assert abs(ratio - statistics.median(rs)) <= 0.0015, (n, ratio, rs)
        if len(rs) > 1:
            want_q = statistics.quantiles(rs, n=4)
            assert abs(q1 - want_q[0]) <= 0.003 and abs(q3 - want_q[2]) <= 0.003, (n, q1, q3, rs)
        assert q1 <= ratio + 0.0015 and ratio <= q3 + 0.0015, (n, q1, ratio, q3)
        # tokens/s is the target tokens over the median step time (ms printed to 0.1)
        lo, hi = _interval(lambda t: n_tok / (t / 1000), [ms], 0.05)
        assert lo - 1 <= int(r["tps"]) <= hi + 1, (n, r["tps"], ms, n_tok)
        cfg = ModelConfig(**{**base, **bm.VARIANTS[n]})
        params = sum(p.numel() for p in build_model(cfg, vocab).parameters())
        assert abs(float(r["params"]) - params / 1e6) <= 0.005, (n, r["params"], params)
        assert abs(float(r["flops"]) - estimate_flops_per_token(cfg, src, tgt, vocab) / ref_flops) <= 0.0005, n
    t = rows["transformer"]
    assert (t["ratio"], t["q1"], t["q3"], t["flops"]) == ("1.000", "1.000", "1.000", "1.000")  # its own baseline
    assert printed["transformer"] == [1.0] * rounds


def test_bench_models_reports_routed_and_dense_moce():
    out, err = _run("benchmarks/bench_models.py", "--variants", "moce_d5,moce_d5_dense", "--batch", "2",
                    "--src-len", "16", "--tgt-len", "16", "--rounds", "2", "--warmup", "0", "--threads", "1")
    check_bench_models_table(out, err, ["moce_d5", "moce_d5_dense"], batch=2, src=16, tgt=16, rounds=2, warmup=0)
    rows = {m["name"]: m for m in ROW.finditer(out)}
    # the routed and the dense MoCE are the same model: same parameters, same FLOP estimate
    assert rows["moce_d5"]["params"] == rows["moce_d5_dense"]["params"]
    assert rows["moce_d5"]["flops"] == rows["moce_d5_dense"]["flops"] and float(rows["moce_d5"]["flops"]) > 1.0


def check_bench_moce_layer_table(out: str, batch: int, length: int, rounds: int, reps: int) -> None:
    head = re.search(r"^d 288, 8 heads, batch (\d+) x (\d+) \((\d+) real tokens\), experts \[0, 1, 3, 5, 7, 9\], "
                     r"torch threads 1, (\d+) rounds x (\d+)$", out, re.M)
    assert head, out
    assert [int(x) for x in head.groups()[:2] + head.groups()[3:]] == [batch, length, rounds, reps]
    # every sentence is 50-100% of the length (the benchmark's definition), the rest padding
    assert batch * ((length + 1) // 2) <= int(head[3]) <= batch * length
    ms = {}
    for name in ("plain", "moce routed", "moce dense"):
        m = re.search(rf"^{name}\s+([\d.]+) ms fwd\+bwd(?:\s+extra over plain\s+(-?[\d.]+) ms)?$", out, re.M)
        assert m, (name, out)
        ms[name] = float(m[1])
        if name == "plain":
            assert m[2] is None
        else:  # the extra cost is the difference of the printed medians (each rounded to 0.01 ms)
            assert abs(float(m[2]) - (ms[name] - ms["plain"])) <= 0.011, (name, m[2], ms)
    m = re.search(r"^routed / dense layer time: ([\d.]+); extra cost routed / dense: (-?[\d.]+|-?inf|nan)$", out, re.M)
    assert m, out
    r, d, p = ms["moce routed"], ms["moce dense"], ms["plain"]
    lo, hi = _interval(lambda a, b: a / b, [r, d], 0.005)
    assert lo - 0.005 <= float(m[1]) <= hi + 0.005, (m[1], ms)
    lo, hi = _interval(lambda a, b, c: (a - c) / (b - c), [r, d, p], 0.005)
    if d - p > 0.02:  # away from a zero denominator the printed ratio is pinned down by the medians
        assert lo - 0.005 <= float(m[2]) <= hi + 0.005, (m[2], ms)


def test_bench_moce_layer_reports_three_layers():
    out, _ = _run("benchmarks/bench_moce_layer.py", "--batch", "2", "--len", "16", "--rounds", "2", "--reps", "1",
                  "--threads", "1")
    check_bench_moce_layer_table(out, batch=2, length=16, rounds=2, reps=1)
