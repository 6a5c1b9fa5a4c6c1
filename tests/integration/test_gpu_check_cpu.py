"""``benchmarks/gpu_check.sh --cpu``: the one-call GPU check runs every step at toy size on the CPU and its
summary holds real figures; a step that fails or runs out of time leaves the others' results.

One full run is shared by the assertions (it also covers what the CPU smoke runs of
``benchmarks/bench_gpu_step.py`` and ``benchmarks/gpu_suite.py`` checked: the step benchmark's ds, ds-compiled,
acc-compiled and hf variants build, train at both budgets and are counted, HF's compiled one being left to the
GPU; every GPU-suite check's CPU twin passes). A second,
short run plants faults through a stand-in Python: the step benchmark crashes, the suite hangs past its
limit, and the install step installs a wheel made here (the GPU machine's path: wheels onto PYTHONPATH)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, make_wheel

pytestmark = pytest.mark.slow


def gpu_check(out: Path, work: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "OMP_NUM_THREADS": "1",
           "GPU_CHECK_PYTHON": env_extra.pop("GPU_CHECK_PYTHON", sys.executable), **env_extra}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    p = gpu_check(tmp / "out", tmp / "work")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    print((tmp / "out" / "steps.tsv").read_text())  # each step's seconds, in the test's output
    return tmp / "out", json.loads((tmp / "out" / "summary.json").read_text()), p.stdout


def test_every_step_ran_and_the_summary_says_so(full):
    out, s, stdout = full
    steps = {r["step"]: r for r in s["steps"]}
    assert set(steps) == {"install", "env", "launch", "corpus", "bench", "suite", "train", "eval"}
    for name in ("install", "env", "corpus", "bench", "suite", "train", "eval"):
        log = (out / f"{name}.log").read_text()[-2000:]
        assert steps[name]["status"] == "ok" and steps[name]["rc"] == 0, (name, steps[name], log)
        assert 0 <= steps[name]["seconds"] <= steps[name]["limit"], steps[name]
    assert s["env"]["torch"] and s["env"]["cpu_count"] >= 1 and s["env"]["deepspeed"][0].isdigit()
    assert s["install"]["modules"]["deepspeed"]["ok"] and s["install"]["missing_line"].startswith("missing:")
    assert 0 < s["elapsed_s"] <= s["budget_s"]
    md = (out / "summary.md").read_text()
    assert "## Targets" in md and "## Step benchmark" in md and "## GPU suite" in md and "Ten translations" in md
    assert md in stdout  # the script prints the summary at its end


def test_step_benchmark_figures(full):
    _, s, _ = full
    rows = {(r["variant"], r["budget"]): r for r in s["bench"]["rows"]}
    assert {v for v, _ in rows} == {"ds", "ds-compiled", "acc-compiled", "hf"}
    assert {b for _, b in rows} == {64, 256} and s["bench"]["complete"] and s["bench"]["rounds"] >= 1
    assert s["bench"]["peak_flops"] > 1e8 and s["bench"]["flops_per_target_token"] > 0
    for key, r in rows.items():
        assert not r["error"] and r["ms_per_step"] > 0 and 0 < r["mfu"] < 1 and r["vs_hf"] > 0, (key, r)
        assert r["tokens_per_s"] == pytest.approx(key[1] / (r["ms_per_step"] / 1e3))
        assert r["warmup_s"] > 0 and r["launches_per_step"] is None and r["sync_debug_per_step"] is None
    for b in (64, 256):  # our step reads nothing back per step, eager, compiled, DeepSpeed or Accelerate
        assert rows[("ds", b)]["syncs_per_step"] == 0 and rows[("ds-compiled", b)]["syncs_per_step"] == 0
        assert rows[("acc-compiled", b)]["syncs_per_step"] == 0 and rows[("hf", b)]["vs_hf"] == 1.0
    # compiling is counted: the compiled variants' warm-up holds the compile
    assert rows[("ds-compiled", 64)]["warmup_s"] > 2 * rows[("ds", 64)]["warmup_s"]


def test_gpu_suite_cpu_twins_pass(full):
    _, s, _ = full
    rows = {r["name"]: r for r in s["suite"]["rows"]}
    assert s["suite"]["complete"] and s["suite"]["counts"]["FAIL"] == 0
    for check in ("step/transformer/bf16", "step/moce_d5_lid/bf16", "step/byte_wsf/bf16", "moce-dense=routed",
                  "sdpa-fused", "compile", "step/transformer/fp16", "step/embeddingless/fp16",
                  "init-loss/embeddingless", "init-loss/moce_d5", "host-reads/transformer", "host-reads/moe",
                  "host-reads/moce_d5_moe", "moe-grouped-gemm", "sdpa-unmasked", "max-tokens-auto"):
        assert rows[check]["result"] == "PASS", (check, rows.get(check))
    assert "scale 65536 -> 32768" in rows["fp16-overflow (GradScaler cpu)"]["detail"]
    assert "0 reads (-) for 1 MoE layers (grouped GEMM: True)" in rows["host-reads/moe"]["detail"]
    assert "sentences/s" in rows["bench/decode/beam4"]["detail"]
    assert {"bench/moe-vs-dense/moe_base", "bench/moe-vs-dense/moce_d5_moe", "bench/variant/moce_d5"} <= set(rows)


def test_the_job_trained_evaluated_and_is_scored_against_copying(full):
    _, s, _ = full
    job = s["job"]
    assert job["corpus"].startswith("wrote ") and "test" in job["corpus"] and "2 languages (+ en)" in job["corpus"]
    t = job["train"]
    assert t["last_step"] == 8 and t["log_lines"] == 2 and t["tgt_tokens_per_s"] > 0 and 0 < t["mfu"] < 1
    assert 0 < t["last_loss"] < 20 and t["mfu_peak_flops"] > 1e8  # CPU: the GEMM probe's GFLOP/s, from the log
    assert t["mfu_vs_measured_peak"] == pytest.approx(t["mfu"] * t["mfu_peak_flops"] / s["bench"]["peak_flops"])
    ev = job["eval"]
    assert ev["beam"] == 2 and ev["step"] == 8 and ev["lines"] == 8 * 4  # 8 lines x de/ru <-> en
    scores = {x["name"]: x for x in ev["scores"]}
    assert {"all", "xx->en", "en->xx", "latin", "cyrillic"} <= set(scores)
    for x in scores.values():
        if x["directions"]:  # groups of the recipe without a language in this corpus have no score
            assert 0 <= x["chrf"] <= 100 and 0 <= x["copy_chrf"] <= 100 and x["lines"] > 0
        else:
            assert x["chrf"] is None and x["lines"] == 0
    assert scores["latin"]["group"] and not scores["xx->en"]["group"]
    assert len(ev["translations"]) == 10 and all(x["source"] and x["reference"] for x in ev["translations"])


def test_targets_table(full):
    _, s, _ = full
    t = {x["key"]: x for x in s["targets"]}
    assert list(t) == ["mfu_16k", "mfu_64k", "vs_hf_eager", "host_syncs", "moce_d5_speed", "groups_above_copy",
                       "chrf_into_en", "launch_fresh"]
    for key in ("mfu_16k", "mfu_64k", "vs_hf_eager", "host_syncs", "moce_d5_speed", "groups_above_copy",
                "chrf_into_en"):
        assert t[key]["status"] in ("met", "missed") and t[key]["value"], t[key]
    assert t["host_syncs"]["status"] == "met" and t["host_syncs"]["value"] == "0 / 0"
    if (ROOT / ".venv" / "bin" / "python").exists():  # --cpu: ./launch.sh --dry-run with the project's .venv
        assert t["launch_fresh"]["status"] == "met", t["launch_fresh"]
        assert t["launch_fresh"]["value"].startswith("== dry run: recipe catalogs_gpu") and "precision" in \
            t["launch_fresh"]["value"]
    ours = {r["budget"]: r for r in s["bench"]["rows"] if r["variant"] == "ds-compiled"}
    assert t["mfu_16k"]["value"] == f"{100 * ours[64]['mfu']:.1f}%"
    assert (t["mfu_16k"]["status"] == "met") == (ours[64]["mfu"] >= 0.45)
    groups = [x for x in s["job"]["eval"]["scores"] if x["group"]]
    assert (t["groups_above_copy"]["status"] == "met") == all(x["chrf"] > x["copy_chrf"] for x in groups)


def test_a_failing_and_a_hanging_step_leave_the_others(tmp_path):
    """A stand-in Python: the step benchmark exits 3 at once, the suite sleeps past its 8 s limit; the wheel
    directory holds a made-up wheel, which the install step must put on every later step's path."""
    shim = tmp_path / "python"
    shim.write_text(f"""#!/bin/bash
case "$*" in
  *bench_gpu_step.py*) echo "planted crash" >&2; exit 3 ;;
  *gpu_suite.py*) exec sleep 600 ;;
  *"gpu_check.py env"*) {sys.executable} -c "import gpucheck_probe" || exit 9 ;;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    p = gpu_check(out, tmp_path / "work", "--steps", "install,env,bench,suite", GPU_CHECK_PYTHON=str(shim),
                  WHEELS=str(make_wheel(tmp_path / "wheels", "gpucheck_probe").parent), GPU_CHECK_TIMEOUT_SUITE="8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    steps = {r["step"]: r for r in s["steps"]}
    assert steps["bench"]["status"] == "failed" and steps["bench"]["rc"] == 3
    assert steps["suite"]["status"] == "timed out" and steps["suite"]["limit"] == 8
    assert steps["suite"]["seconds"] < 30  # killed at its limit, not at the sleep's end
    assert steps["install"]["status"] == "ok" and steps["env"]["status"] == "ok"  # the probe imported there
    assert s["install"]["wheels"] == ["gpucheck_probe-1.0-py3-none-any.whl"]
    assert s["env"]["torch"] and s["install"]["modules"]["torch"]["ok"]
    for name in ("launch", "corpus", "train", "eval"):
        assert steps[name]["status"] == "not run", steps[name]
    t = {x["key"]: x for x in s["targets"]}
    assert all(t[k]["status"] == "not run" for k in t), t
    assert "planted crash" in (out / "bench.log").read_text()
    assert "| bench | failed |" in (out / "summary.md").read_text()
