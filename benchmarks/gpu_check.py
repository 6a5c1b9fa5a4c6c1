"""The Python side of ``benchmarks/gpu_check.sh``: what a step needs besides its command, and the summary.

    python benchmarks/gpu_check.py modules --wheels wheels --json OUT/install.json   # what imports, what is missing
    python benchmarks/gpu_check.py env --json OUT/env.json                           # GPU, driver, versions
    python benchmarks/gpu_check.py eval-lines SHARDS --lines 2000                    # lines per direction to decode
    python benchmarks/gpu_check.py summary OUT [--cpu]                               # OUT/summary.json + summary.md

``summary`` reads what the steps left in OUT (``steps.tsv``, ``install.json``, ``env.json``, ``bench.json``,
``suite.json``, ``train.log``, ``eval.json``, ``launch.log``, ``corpus.log``), whichever of them exist: a step
that failed or ran out of time is a status in the table and "not run" in the targets it feeds, never a missing
summary. Written with the standard library only, so it runs whatever else the machine lacks.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: modules scaletrain imports (the ones the GPU image is known to lack first) and what lacking each costs
MODULES = {
    "deepspeed": "the DeepSpeed engine (engine.backend=deepspeed, the default) and its launcher",
    "webdataset": "the shard format's reader",
    "django": "the bundled corpus and the catalogs corpus's 'packages' catalogs",
    "mlflow": "tracking: run with tracking.enabled=false",
    "torch": "everything", "accelerate": "engine.backend=accelerate", "transformers": "HF export, the HF baseline",
    "sacrebleu": "evaluation", "yaml": "configs", "numpy": "everything", "safetensors": "checkpoints",
    "tqdm": "progress", "psutil": "rank monitoring", "matplotlib": "plots", "sentencepiece": "subword models",
    "pyarrow": "prepare --source hf-parquet", "pydantic": "DeepSpeed's config", "hjson": "DeepSpeed's config",
}
#: the variant of bench_gpu_step.py that is our step as a user's CUDA run gets it (engine.compile: auto compiles)
OURS = "ds-compiled"
TARGETS = [  # key, what, threshold (as shown)
    ("mfu_16k", "MFU of our step at 16,384 tokens/step (DeepSpeed engine, compiled)", ">= 45%"),
    ("mfu_64k", "MFU of our step at 65,536 tokens/step", ">= 55%"),
    ("vs_hf_eager", "our tok/s / HF MarianMTModel eager's, same batch (16k and 64k)", ">= 3x"),
    ("host_syncs", "host syncs per step, ours (profiler and set_sync_debug_mode, 16k and 64k)", "<= 1"),
    ("moce_d5_speed", "MoCE Δ=5 tok/s / byte Transformer's (GPU suite, paired rounds)", ">= 0.95x"),
    ("groups_above_copy", "the job: every eval group's chrF above copy-the-source", "all groups"),
    ("chrf_into_en", "the job: chrF into English / copy-the-source's", ">= 2x"),
    ("launch_fresh", "./launch.sh on a fresh tree with no index gets to its plan (dry run)", "ok, or one line"),
]


# ---------------------------------------------------------------------------------------------- modules, env
#: imported for real (the others are only found): what the wheels bring and the step benchmark needs at once
IMPORTED = ("deepspeed",)
#: distribution names where they differ from the module's
DISTRIBUTIONS = {"yaml": "pyyaml"}


def module_facts(name: str, load: bool = False) -> dict:
    """{"ok", "version", "path"} of finding ``name`` (``load``: of importing it; a failure is {"ok": False, "error"})."""
    from importlib import metadata, util

    try:
        spec = util.find_spec(name)
        if spec is None:
            return {"ok": False, "error": "not found"}
        if load:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a broken install is a fact to report
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    try:
        version = metadata.version(DISTRIBUTIONS.get(name, name))
    except metadata.PackageNotFoundError:
        version = ""
    return {"ok": True, "version": version, "path": str(Path(spec.origin or "").parent)}


def cmd_modules(args) -> int:
    wheels = sorted(p.name for p in Path(args.wheels).glob("*.whl")) if args.wheels else []
    facts = {name: module_facts(name, load=name in IMPORTED) for name in MODULES}
    missing = [n for n, f in facts.items() if not f["ok"]]
    line = ("missing: " + "; ".join(f"{n} ({MODULES[n]})" for n in missing)) if missing else "missing: nothing"
    res = {"python": sys.executable, "wheels": wheels, "modules": facts, "missing": missing, "missing_line": line}
    Path(args.json).write_text(json.dumps(res, indent=1))
    for n, f in facts.items():
        print(f"{n:14s} {f.get('version') or '-':14s} {f.get('path') or f.get('error')}")
    print(line)
    return 0


def nvidia_smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    first = [x.strip() for x in out.splitlines()[0].split(",")] if out else []
    keys = ("name", "driver", "memory", "power_limit")
    return {**dict(zip(keys, first)), "gpus": len(out.splitlines())} if first else {"error": "nvidia-smi listed no GPU"}


def cmd_env(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": platform.node(),
        "python": sys.version.split()[0], "python_executable": sys.executable,
        "python_is_venv": sys.prefix != sys.base_prefix, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None, "cuda_available": cuda,
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "load_average": list(os.getloadavg()),
        "nvidia_smi": nvidia_smi() if cuda else None,
    }
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   compute_capability=f"{p.major}.{p.minor}", bf16_supported=torch.cuda.is_bf16_supported())
    for name in ("deepspeed", "accelerate", "transformers"):
        env[name] = module_facts(name).get("version") or "not importable"
    Path(args.json).write_text(json.dumps(env, indent=1))
    print(json.dumps(env, indent=1))
    return 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cmd_eval_lines(args) -> int:
    """The smallest N such that the first N lines of every direction of the test split add up to ``--lines``."""
    m = json.loads((Path(args.shards) / "manifest.json").read_text())
    counts = [d["n"] for d in m["splits"][args.split]["directions"].values()]
    if not counts:
        print(f"{args.shards}: the {args.split} split has no directions", file=sys.stderr)
        return 1
    n = 1
    while sum(min(n, c) for c in counts) < args.lines and n < max(counts):
        n += 1
    print(n)
    return 0


# ------------------------------------------------------------------------------------------------- readers
def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(out: Path) -> list[dict]:
    rows = []
    try:
        lines = (out / "steps.tsv").read_text().splitlines()[1:]
    except OSError:
        return rows
    for line in lines:
        name, status, rc, secs, lim = (line.split("\t") + [""] * 5)[:5]
        rows.append({"step": name, "status": status, "rc": None if rc in ("", "-") else int(rc),
                     "seconds": int(secs or 0), "limit": int(lim or 0)})
    return rows


STEP_LINE = re.compile(r"step\s+(\d+) \| loss ([\d.]+) \| nll ([\d.]+) \| lr \S+ \| gnorm \S+ \|\s+([\d.]+) tgt tok/s"
                       r"(?: \| mfu ([\d.]+)%)?")
VALID_LINE = re.compile(r"step\s+(\d+) \| valid nll ([\d.]+)")
PEAK_LINE = re.compile(r"MFU peak per device: .*?([\d.]+) ([TG])FLOP/s")


def job_log(path: Path) -> dict | None:
    """The training log's own figures: steps, losses, target tokens/s and MFU (medians over the second half of
    the log intervals: the first ones hold the compile and the warm-up)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    steps = [m.groups() for m in STEP_LINE.finditer(text)]
    valid = [(int(s), float(v)) for s, v in VALID_LINE.findall(text)]
    peak = PEAK_LINE.search(text)
    res = {"log_lines": len(steps), "valid_nll": valid[-1][1] if valid else None,
           "mfu_peak_flops": float(peak.group(1)) * (1e12 if peak.group(2) == "T" else 1e9) if peak else None}
    if steps:
        late = steps[len(steps) // 2:]
        mfu = [float(x[4]) / 100 for x in late if x[4]]
        res.update(last_step=int(steps[-1][0]), last_loss=float(steps[-1][1]), last_nll=float(steps[-1][2]),
                   tgt_tokens_per_s=statistics.median(float(x[3]) for x in late), mfu=statistics.median(mfu) if mfu else None)
    return res


def job_mfu_measured(t: dict | None, bench: dict | None) -> dict | None:
    """The job's MFU is against its log's peak (the GPU's data sheet); beside it, against the GEMM peak the step
    benchmark measured in this run, as the benchmark's own MFU is."""
    if t and t.get("mfu") is not None and t.get("mfu_peak_flops") and bench and bench.get("peak_flops"):
        t["mfu_vs_measured_peak"] = t["mfu"] * t["mfu_peak_flops"] / bench["peak_flops"]
    return t


def group_scores(ev: dict) -> list[dict]:
    """Per average (all, xx->en, en->xx, each group and its directions): model and copy-the-source chrF/BLEU."""
    copy = {a["name"]: a for a in ev.get("copy_baseline", {}).get("averages", [])}
    out = []
    for a in ev.get("model", {}).get("averages", []):
        c = copy.get(a["name"], {})
        out.append({"name": a["name"], "chrf": a.get("chrf"), "bleu": a.get("bleu"), "copy_chrf": c.get("chrf"),
                    "copy_bleu": c.get("bleu"), "directions": a.get("n_directions"), "lines": a.get("n_lines"),
                    "group": " " not in a["name"] and a["name"] != "all" and "->" not in a["name"]})
    return out


def translations(ev: dict, hyp_dir: Path, n: int = 10) -> list[dict]:
    """``n`` translations from the evaluation's src/ref/hyp files, spread over the directions (the i-th line of
    every direction, then the (i+1)-th, ...)."""
    rows = {}
    arrows = {f"{d['src_lang']}-{d['tgt_lang']}": f"{d['src_lang']}->{d['tgt_lang']}"
              for d in ev.get("model", {}).get("directions", [])}
    for d in sorted(arrows):
        try:
            cols = [(hyp_dir / f"{k}.{d}.txt").read_text(encoding="utf-8").splitlines() for k in ("src", "ref", "hyp")]
        except OSError:
            continue
        rows[d] = list(zip(*cols))
    out = []
    for i in range(max((len(v) for v in rows.values()), default=0)):
        for d, lines in rows.items():
            if i < len(lines) and len(out) < n:
                src, ref, hyp = lines[i]
                out.append({"direction": arrows[d], "source": src, "reference": ref, "hypothesis": hyp})
    return out


def eval_summary(ev: dict | None, hyp_dir: Path) -> dict | None:
    if not ev:
        return None
    samples = translations(ev, hyp_dir) or ev.get("samples", [])
    return {"lines": ev.get("lines"), "beam": ev.get("beam"), "step": ev.get("step"),
            "decode_seconds": ev.get("decode_seconds"), "sentences_per_s": ev.get("sentences_per_s"),
            "cut_invalid_utf8": ev.get("cut_invalid_utf8"), "scores": group_scores(ev), "translations": samples[:10]}


def launch_summary(path: Path, step: dict | None) -> dict | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    missing = next((ln for ln in lines if "missing:" in ln), None)
    at = next((i for i, ln in enumerate(lines) if ln.startswith("== dry run")), None)
    plan = None if at is None else " ".join(ln.strip() for ln in lines[at:at + 2] if ln == lines[at] or ln[0] == " ")
    return {"status": step["status"] if step else "not run", "plan": plan, "missing_line": missing,
            "last_lines": lines[-6:]}


def corpus_summary(path: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    hit = [ln for ln in lines if ln.startswith("wrote ") or "there already" in ln or re.search(r"languages \(\+", ln)]
    return "; ".join(hit or lines[-1:])[:400] or None


# ------------------------------------------------------------------------------------------------- targets
def bench_rows(bench: dict | None) -> dict:
    return {(r["variant"], r["budget"]): r for r in (bench or {}).get("rows", [])}


def target(status_ok: bool | None, value: str) -> dict:
    return {"status": "not run" if status_ok is None else ("met" if status_ok else "missed"), "value": value}


def speed_targets(bench: dict | None, big: tuple[int, int]) -> dict:
    rows = bench_rows(bench)
    ours = [rows.get((OURS, b)) for b in big]
    timed = [r for r in ours if r and r.get("mfu") is not None]
    out = {}
    for key, r, need in (("mfu_16k", ours[0], 0.45), ("mfu_64k", ours[1], 0.55)):
        out[key] = (target(r["mfu"] >= need, f"{100 * r['mfu']:.1f}%") if r and r.get("mfu") is not None
                    else target(None, (r or {}).get("error") or "no timing"))
    ratios = [r["vs_hf"] for r in ours if r and r.get("vs_hf") is not None]
    out["vs_hf_eager"] = (target(len(ratios) == 2 and min(ratios) >= 3, " / ".join(f"{x:.2f}x" for x in ratios))
                          if ratios else target(None, "no ratio"))
    syncs = [max(v for v in (r.get("syncs_per_step"), r.get("sync_debug_per_step")) if v is not None)
             for r in timed if r.get("syncs_per_step") is not None]
    out["host_syncs"] = (target(len(syncs) == 2 and max(syncs) <= 1, " / ".join(f"{x:g}" for x in syncs))
                         if syncs else target(None, "not counted"))
    return out


def moce_target(suite: dict | None) -> dict:
    row = next((r for r in (suite or {}).get("rows", []) if r["name"] == "bench/variant/moce_d5"), None)
    m = re.match(r"\s*([\d.]+)x", row["detail"]) if row else None
    if not m:
        return target(None, "no measurement")
    return target(float(m.group(1)) >= 0.95, f"{float(m.group(1)):.2f}x")


def job_targets(ev: dict | None) -> dict:
    if not ev:
        return {"groups_above_copy": target(None, "no evaluation"), "chrf_into_en": target(None, "no evaluation")}
    scores = {s["name"]: s for s in ev["scores"]}
    groups = [s for s in ev["scores"] if s["group"] and s["chrf"] is not None and s["copy_chrf"] is not None]
    below = [f"{s['name']} {s['chrf']:.1f} vs {s['copy_chrf']:.1f}" for s in groups if not s["chrf"] > s["copy_chrf"]]
    out = {"groups_above_copy": target(not below, f"{len(groups) - len(below)} of {len(groups)} above"
                                       + (f"; below: {', '.join(below)}" if below else "")) if groups
           else target(None, "no groups scored")}
    into = next((s for k, s in scores.items() if k.startswith("xx->")), None)
    if into and into["chrf"] is not None and into["copy_chrf"]:
        out["chrf_into_en"] = target(into["chrf"] >= 2 * into["copy_chrf"],
                                     f"{into['chrf']:.1f} vs copy {into['copy_chrf']:.1f} "
                                     f"({into['chrf'] / into['copy_chrf']:.2f}x)")
    else:
        out["chrf_into_en"] = target(None, "no xx->en directions scored")
    return out


def launch_target(launch: dict | None) -> dict:
    if not launch or launch["status"] == "not run":
        return target(None, "not run")
    ok = launch["status"] == "ok" and bool(launch["plan"])
    return target(ok, launch["plan"] if ok else (launch["missing_line"] or (launch["last_lines"] or [""])[-1]))


# ------------------------------------------------------------------------------------------------- summary
def build_summary(out: Path, args) -> dict:
    steps = read_steps(out)
    by_step = {s["step"]: s for s in steps}
    bench, suite = read_json(out / "bench.json"), read_json(out / "suite.json")
    ev = eval_summary(read_json(out / "eval.json"), out / "hyp")
    launch = launch_summary(out / "launch.log", by_step.get("launch"))
    big = (64, 256) if args.cpu else (16384, 65536)
    targets = {**speed_targets(bench, big), "moce_d5_speed": moce_target(suite), **job_targets(ev),
               "launch_fresh": launch_target(launch)}
    suite_rows = (suite or {}).get("rows", [])
    return {
        "mode": "cpu (toy sizes: the numbers mean nothing)" if args.cpu else "gpu",
        "budget_s": args.budget, "elapsed_s": args.elapsed, "steps": steps,
        "install": read_json(out / "install.json"), "env": read_json(out / "env.json"),
        "bench": bench, "bench_budgets": list(big),
        "suite": {"complete": (suite or {}).get("complete", False), "rows": suite_rows,
                  "counts": {k: sum(1 for r in suite_rows if r["result"] == k) for k in ("PASS", "FAIL", "SKIP")}}
        if suite else None,
        "job": {"corpus": corpus_summary(out / "corpus.log"), "train_minutes": args.train_minutes,
                "train": job_mfu_measured(job_log(out / "train.log"), bench), "eval": ev},
        "launch": launch,
        "targets": [{"key": k, "what": what, "threshold": thr, **targets[k]} for k, what, thr in TARGETS],
    }


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def md_head(s: dict) -> list[str]:
    env, inst = s["env"] or {}, s["install"] or {}
    gpu = env.get("gpu") or "no GPU"
    lines = [f"# GPU check: {gpu}", "",
             f"Mode {s['mode']}; {s['elapsed_s']} s of a {s['budget_s']} s budget; {env.get('date_utc', '?')} UTC.",
             f"Python {env.get('python', '?')} ({'a venv' if env.get('python_is_venv') else 'not a venv'}), "
             f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda')}), driver "
             f"{(env.get('nvidia_smi') or {}).get('driver', '-')}, DeepSpeed {env.get('deepspeed', '?')}, "
             f"{env.get('cpu_count', '?')} CPUs ({env.get('cpu_model', '?')}), load {env.get('load_average', '?')}.",
             f"Installed from the wheels brought along: {len(inst.get('wheels', []))} wheels; "
             f"{inst.get('missing_line', 'missing: (install step did not run)')}.", "",
             "| step | status | seconds | limit |", "|---|---|---:|---:|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['limit']} |" for r in s["steps"]]
    lines += ["", "## Targets", "", "| target | threshold | status | value |", "|---|---|---|---|"]
    lines += [f"| {t['what']} | {t['threshold']} | **{t['status']}** | {t['value']} |" for t in s["targets"]]
    return lines


def md_bench(s: dict) -> list[str]:
    b = s["bench"]
    if not b:
        return ["", "## Step benchmark", "", "not run (see bench.log)"]
    lines = ["", "## Step benchmark", "",
             f"{b['device']}, {b['precision']}, matmul peak {b['peak_flops'] / 1e12:.3g} TFLOP/s (measured in the run), "
             f"{b['flops_per_target_token'] / 1e6:.1f} MFLOP per target token; {b['rounds']} interleaved rounds x "
             f"{b['steps_per_round']} steps, medians{'' if b.get('complete') else ' (cut short: partial)'}.", "",
             "| variant | tokens/step | ms/step | tok/s | vs HF eager | MFU | host syncs (profiler / debug mode) "
             "| kernel launches | peak MiB | warm-up s (compile) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in b["rows"]:
        if r.get("ms_per_step") is None:
            lines.append(f"| {r['variant']} | {r['budget']} | {r['error'] or 'no timing'} | | | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['budget']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{fmt(r['vs_hf'], '.2f')} | {100 * r['mfu']:.1f}% | {fmt(r['syncs_per_step'], 'g')} / "
                     f"{fmt(r['sync_debug_per_step'], 'd')} | {fmt(r['launches_per_step'], '.0f')} | "
                     f"{fmt(r['peak_mb'], '.0f')} | {fmt(r['warmup_s'], '.1f')} |")
    return lines


def md_suite(s: dict) -> list[str]:
    su = s["suite"]
    if not su:
        return ["", "## GPU suite", "", "not run (see suite.log)"]
    c = su["counts"]
    lines = ["", "## GPU suite", "", f"{c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP"
             + ("" if su["complete"] else " (cut short: the rows it reached)"), "",
             "| check / benchmark | result | detail |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['result']} | {r['detail'].replace('|', '/')} |" for r in su["rows"]]
    return lines


def md_job(s: dict) -> list[str]:
    j = s["job"]
    t, ev = j["train"], j["eval"]
    lines = ["", "## The job (catalogs_gpu)", "", f"Corpus: {j['corpus'] or 'not built (corpus.log)'}"]
    if t and t.get("last_step"):
        peak = fmt(t["mfu_peak_flops"] and t["mfu_peak_flops"] / 1e12, ".3g")
        lines.append(f"Training ({j['train_minutes']} min budget): {t['last_step']} updates, loss {t['last_loss']:.3f}, "
                     f"valid nll {fmt(t['valid_nll'], '.3f')}; {t['tgt_tokens_per_s']:,.0f} target tokens/s, MFU "
                     f"{fmt(t['mfu'] and 100 * t['mfu'], '.1f')}% of the log's peak ({peak} TFLOP/s), "
                     f"{fmt(t.get('mfu_vs_measured_peak') and 100 * t['mfu_vs_measured_peak'], '.1f')}% of the step "
                     "benchmark's measured GEMM peak (the job's own log, medians of its later intervals).")
    else:
        lines.append("Training: no log lines (see train.log)")
    if not ev:
        return lines + ["", "Evaluation: not run (see eval.log)"]
    lines += ["", f"Evaluation: {ev['lines']} test lines, beam {ev['beam']}, step {ev['step']}, "
              f"{fmt(ev['sentences_per_s'], '.1f')} sentences/s.", "",
              "| average | chrF | copy chrF | BLEU | copy BLEU | directions | lines |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {x['name']} | {fmt(x['chrf'], '.2f')} | {fmt(x['copy_chrf'], '.2f')} | {fmt(x['bleu'], '.2f')} | "
              f"{fmt(x['copy_bleu'], '.2f')} | {x['directions']} | {x['lines']} |" for x in ev["scores"]]
    lines += ["", "Ten translations:", ""]
    lines += [f"- `{x['direction']}` {x['source']!r} → {x['hypothesis']!r} (reference {x['reference']!r})"
              for x in ev["translations"]]
    return lines


def md_launch(s: dict) -> list[str]:
    la = s["launch"]
    if not la:
        return ["", "## ./launch.sh on a fresh tree", "", "not run"]
    return ["", "## ./launch.sh on a fresh tree", "", f"status {la['status']}; plan: {la['plan'] or '-'}; "
            f"{la['missing_line'] or 'no missing-modules line'}", "", "```", *la["last_lines"], "```"]


def cmd_summary(args) -> int:
    out = Path(args.out)
    s = build_summary(out, args)
    (out / "summary.json").write_text(json.dumps(s, indent=1, ensure_ascii=False))
    md = md_head(s) + md_bench(s) + md_suite(s) + md_job(s) + md_launch(s)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'summary.json'} and {out / 'summary.md'}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("modules", help="which of scaletrain's modules import; the one missing line")
    m.add_argument("--wheels", default="")
    m.add_argument("--json", required=True)
    e = sub.add_parser("env", help="GPU, driver, torch/CUDA, DeepSpeed, CPU")
    e.add_argument("--json", required=True)
    el = sub.add_parser("eval-lines", help="lines per direction so that the test lines add up to --lines")
    el.add_argument("shards")
    el.add_argument("--lines", type=int, default=2000)
    el.add_argument("--split", default="test")
    s = sub.add_parser("summary", help="summary.json and summary.md from what the steps left in OUT")
    s.add_argument("out")
    s.add_argument("--cpu", action="store_true")
    s.add_argument("--budget", type=int, default=0)
    s.add_argument("--elapsed", type=int, default=0)
    s.add_argument("--train-minutes", type=float, default=None)
    args = ap.parse_args(argv)
    return {"modules": cmd_modules, "env": cmd_env, "eval-lines": cmd_eval_lines, "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
