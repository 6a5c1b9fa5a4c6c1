"""engine.precision=auto: the decision on each kind of hardware, with the hardware facts injected
(no test depends on the real CPU's speed), and its wiring into preflight, DeepSpeed and the saved config."""
from __future__ import annotations

import logging

import pytest

from scaletrain.config import dump_yaml, load_config
from scaletrain.engine import precision as P
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError

# The three CPUs we have been lent (2-thread GEMM GFLOP/s measured on each).
AMX = dict(flags={"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, probe=lambda: P.Probe(120.0, 670.0))
AVX512_BF16 = dict(flags={"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, probe=lambda: P.Probe(37.0, 94.0))
AVX2 = dict(flags={"avx2", "fma"}, probe=lambda: P.Probe(98.0, 2.5))
NO_ENV: dict = {}

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=2", "model.decoder_layers=2", "model.ffn_dim=64",
        "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600"]


def never():
    raise AssertionError("the GEMM probe must not run here")


@pytest.mark.parametrize("cpu,want", [(AMX, "bf16"), (AVX512_BF16, "bf16"), (AVX2, "fp32")])
def test_auto_on_each_kind_of_cpu(cpu, want):
    r = P.resolve_precision("auto", cuda=False, env=NO_ENV, **cpu)
    assert r.precision == want and r.requested == "auto" and not r.warning
    if want == "bf16":
        assert "GEMM probe bf16" in r.reason and "bf16" in r.reason.split(";")[0]
    else:
        assert "no native bf16" in r.reason


def test_auto_without_bf16_flags_does_not_probe():
    assert P.resolve_precision("auto", cuda=False, env=NO_ENV, flags={"avx2"}, probe=never).precision == "fp32"


def test_auto_needs_the_probe_to_agree_with_the_flags():
    # flags present but the measured bf16 GEMM is slower (e.g. a kernel library without the path): fp32
    r = P.resolve_precision("auto", cuda=False, env=NO_ENV, flags={"avx512_bf16"}, probe=lambda: P.Probe(50.0, 40.0))
    assert r.precision == "fp32" and "not faster" in r.reason and "0.80x" in r.reason


@pytest.mark.parametrize("bf16_ok,want", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_bf16_support(bf16_ok, want):
    r = P.resolve_precision("auto", cuda=True, cuda_bf16=bf16_ok, env=NO_ENV, flags={"avx2"}, probe=never)
    assert r.precision == want and "CUDA" in r.reason


def test_env_pins_auto_without_probing():
    r = P.resolve_precision("auto", cuda=False, env={P.ENV: "bf16"}, flags={"avx2"}, probe=never)
    assert (r.precision, r.reason) == ("bf16", f"${P.ENV}=bf16")
    with pytest.raises(ScaletrainError, match=P.ENV):
        P.resolve_precision("auto", cuda=False, env={P.ENV: "fp8"}, flags={"avx2"}, probe=never)


def test_explicit_bf16_on_avx2_warns_with_the_measured_slowdown():
    r = P.resolve_precision("bf16", cuda=False, env=NO_ENV, **AVX2)
    assert r.precision == "bf16"  # an explicit choice is kept
    assert "39.2x slower" in r.warning and "2 vs fp32 98" in r.warning and "auto would pick fp32" in r.warning
    for cpu in (AMX, AVX512_BF16):
        assert P.resolve_precision("bf16", cuda=False, env=NO_ENV, **cpu).warning == ""


def test_explicit_fp32_is_kept_everywhere():
    for cpu in (AMX, AVX2):
        assert P.resolve_precision("fp32", cuda=False, env=NO_ENV, **cpu).precision == "fp32"


def test_cpu_flags_reads_the_first_processor(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert P.cpu_flags(str(f)) == {"fpu", "avx2", "avx512_bf16"}
    assert P.cpu_model(str(f)) == "Test CPU"
    assert P.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_probe_is_cached_per_process_and_thread_count(monkeypatch):
    calls = []
    monkeypatch.setattr(P, "_PROBE_CACHE", {})
    monkeypatch.setattr(P, "measure_gemm", lambda: calls.append(1) or P.Probe(1.0, 2.0))
    assert P.cached_probe() is P.cached_probe() and len(calls) == 1


def test_real_probe_is_short_and_positive():
    r = P.measure_gemm(n=64, budget_s=0.0)
    assert r.fp32_gflops > 0 and r.bf16_gflops > 0 and r.speedup == r.bf16_gflops / r.fp32_gflops


def test_preflight_resolves_auto_into_the_config_and_the_ds_config(caplog):
    cfg = load_config("small", [*TINY, "engine.precision=auto"])
    with caplog.at_level(logging.INFO, logger="scaletrain.engine.precision"):
        ds = preflight(cfg, cuda_available=False, precision_hw=dict(env=NO_ENV, **AVX512_BF16))
    assert cfg.engine.precision == "bf16" and ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert cfg.engine.precision_auto.startswith("bf16: CPU flags avx512_bf16")
    saved = dump_yaml(cfg)
    assert "precision: bf16" in saved and "precision_auto: 'bf16: CPU flags avx512_bf16" in saved
    assert [r.getMessage() for r in caplog.records] == [f"engine.precision auto -> bf16: {cfg.engine.precision_auto[6:]}"]
    # resolved once: a second preflight (another engine in the process) keeps it without probing
    preflight(cfg, cuda_available=False, precision_hw=dict(env=NO_ENV, flags={"avx2"}, probe=never))
    assert cfg.engine.precision == "bf16"

    cfg = load_config("small", [*TINY])
    ds = preflight(cfg, cuda_available=False, precision_hw=dict(env=NO_ENV, **AVX2))
    assert cfg.engine.precision == "fp32" and ds["bf16"]["enabled"] is False


def test_explicit_bf16_warning_is_logged(caplog):
    cfg = load_config("small", [*TINY, "engine.precision=bf16"])
    with caplog.at_level(logging.WARNING, logger="scaletrain.engine.precision"):
        preflight(cfg, cuda_available=False, precision_hw=dict(env=NO_ENV, **AVX2))
    assert cfg.engine.precision == "bf16" and cfg.engine.precision_auto == ""
    assert any("slower than fp32" in r.getMessage() for r in caplog.records)


def test_auto_is_the_default_of_the_config_and_the_recipes():
    from scaletrain.config import Config

    assert Config().engine.precision == "auto"
    for name in ("small", "base", "moce_d4", "moce_d6_lid", "msc", "subword_base"):
        assert load_config(name).engine.precision == "auto", name


def test_tests_pin_auto_to_fp32():
    import os

    assert os.environ[P.ENV] == "fp32"
    assert P.resolve_precision("auto", cuda=False, flags={"avx512_bf16"}, probe=never).precision == "fp32"


def test_preflight_cli_prints_the_resolved_precision_for_launch_sh():
    import os
    import subprocess
    import sys

    from helpers import ROOT

    def cli(*args, **env):
        e = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        return subprocess.run([sys.executable, "-m", "scaletrain.engine.preflight", "--config", "small", *args],
                              capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)

    p = cli("--print-precision", SCALETRAIN_AUTO_PRECISION="bf16")  # what launch.sh exports to every rank
    assert p.returncode == 0 and p.stdout == "bf16\n", p.stderr
    p = cli("--print-precision", "engine.precision=fp32")
    assert p.returncode == 0 and p.stdout == "fp32\n", p.stderr
    assert cli("engine.precision=fp32").stdout == ""  # without the flag: silent on success
