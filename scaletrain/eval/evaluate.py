"""Evaluate a checkpoint: decode every line of a split, score BLEU/chrF per direction and group.

A copy-the-source baseline is scored on the same lines (``scaletrain evaluate`` prints it beside the
model). Each evaluation is named by what it evaluated (:mod:`scaletrain.tracking.records`: split, lines,
beam, length penalty, length limit, step) and recorded under that name: :func:`write_record` writes
``RUN/eval/<name>/`` and :func:`log_to_mlflow` a run nested under the training run; only the run's full
evaluation of a split (every line, the recipe's settings) updates the training run's own ``<split>/...``
metrics, so a subset or a differently decoded evaluation never replaces it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from scaletrain.checkpoint import load_for_inference
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.errors import ScaletrainError
from scaletrain.eval.bounds import decoding_bounds
from scaletrain.eval.requests import translate_examples
from scaletrain.eval.in_training import first_n_per_direction
from scaletrain.tracking.records import EvalSpec, checkpoint_label, headline_tag, record_dir, shards_label
from scaletrain.eval.scoring import example_records, report_to_json, score_copy_baseline, score_directions

log = logging.getLogger("scaletrain")

RESULT_FILE = "eval.json"
PLOT_FILE = "scores.png"


def _examples(shards, split: str, langs, max_lines: int):
    """(the first ``max_lines`` lines of each direction of the split, whether that is every line)."""
    manifest = load_manifest(shards)
    if manifest.languages != langs:
        raise ScaletrainError(
            f"{shards}: its languages {manifest.languages} differ from the model's {langs}; "
            "evaluate on shards prepared with the same language list"
        )
    examples = read_split(shards, split)
    if not examples:
        raise ScaletrainError(f"{shards}: split '{split}' is empty")
    kept = first_n_per_direction(examples, max_lines)
    return kept, len(kept) == len(examples)


def _spec(cfg, ckpt, trainer_state, *, split, shards, lines, max_lines, full, beam, lenpen, max_len) -> EvalSpec:
    ec = cfg.eval
    recipe_max_len = (float(max_len[0]), int(max_len[1])) == (float(ec.max_len_a), int(ec.max_len_b))
    step = trainer_state.get("step")
    return EvalSpec(
        split=split, lines=lines, max_lines=max_lines if not full else 0, full=full, beam=int(beam),
        lenpen=float(lenpen), max_len_a=float(max_len[0]), max_len_b=int(max_len[1]), recipe_max_len=recipe_max_len,
        recipe_decoding=recipe_max_len and int(beam) == int(ec.beam) and float(lenpen) == float(ec.lenpen),
        step=int(step) if step not in (None, "") else None, checkpoint=str(ckpt), checkpoint_label=checkpoint_label(ckpt),
        shards=str(shards), shards_label=shards_label(str(shards), str(cfg.data.shards)),
    )


def evaluate_checkpoint(path, *, split=None, shards=None, beam=None, lenpen=None, max_lines=0, max_len_a=None,
                        max_len_b=None, device="cpu", progress=True, batch_tokens=None) -> dict:
    """Decode ``split`` (default: the recipe's ``eval.split``) of the checkpoint and score it; decoding
    settings default to the recipe's ``eval`` section (``batch_tokens``: ``eval.batch_tokens``). The result's
    ``evaluation`` describes what was evaluated (:class:`~scaletrain.tracking.records.EvalSpec`), ``name``
    names it. Out of memory while decoding: one line naming the batch and ``--batch-tokens``."""
    model, cfg, vocab, trainer_state, ckpt = load_for_inference(path, device)
    ec = cfg.eval
    split = split or ec.split
    shards = shards or cfg.data.shards
    examples, full = _examples(shards, split, vocab.langs, max_lines)
    beam = beam or ec.beam
    lenpen = ec.lenpen if lenpen is None else lenpen
    max_len = (ec.max_len_a if max_len_a is None else max_len_a, ec.max_len_b if max_len_b is None else max_len_b)
    spec = _spec(cfg, ckpt, trainer_state, split=split, shards=shards, lines=len(examples), max_lines=max_lines,
                 full=full, beam=beam, lenpen=lenpen, max_len=max_len)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(examples), desc=f"decoding {split}", unit="sent", leave=False)
    t0 = time.time()
    try:
        res = translate_examples(  # within the bounds the in-training BLEU decodes with too
            model, examples, vocab, batch_tokens=batch_tokens or ec.batch_tokens, beam=beam, lenpen=lenpen,
            progress=(bar.update if bar else None), **decoding_bounds(ec, shards, *max_len),
            stage=f"evaluate, decoding the {split} split on {device}", batch_tokens_key="--batch-tokens",
        )
    finally:  # an error line starts on a line of its own
        if bar:
            bar.close()
    secs = time.time() - t0
    L = vocab.langs
    refs = [ex.tgt.decode("utf-8", errors="replace") for ex in examples]
    srcs = [ex.src.decode("utf-8", errors="replace") for ex in examples]
    records = example_records(examples, L, res.texts, res.invalid)
    report = score_directions(records, pivot=ec.pivot, groups=ec.groups or None)
    baseline = score_copy_baseline(
        [(L[ex.src_lang], L[ex.tgt_lang], s, r) for ex, s, r in zip(examples, srcs, refs)],
        pivot=ec.pivot, groups=ec.groups or None,
    )
    return {
        "name": spec.name, "evaluation": spec.to_json(),
        "checkpoint": str(ckpt), "split": split, "shards": str(shards), "beam": beam, "lenpen": lenpen,
        "max_len_a": max_len[0], "max_len_b": max_len[1],
        "lines": len(examples), "decode_seconds": secs, "sentences_per_s": len(examples) / max(secs, 1e-9),
        # hypotheses stopped before a byte that made them invalid UTF-8 (generate.py, stop_invalid_utf8)
        "cut_invalid_utf8": res.n_cut,
        # hypotheses that ended at their length limit (max_len_a/b, or 2 x the direction's training ratio + 20)
        "at_length_limit": res.n_at_limit,
        "step": trainer_state.get("step"), "run_id": trainer_state.get("run_id"),
        "tracking": {"uri": cfg.tracking.uri, "experiment": cfg.tracking.experiment},
        # (src_lang, tgt_lang, source, reference, hypothesis) per line, in split order (write_hypotheses)
        "records": [(r.src_lang, r.tgt_lang, s, r.reference, r.hypothesis) for r, s in zip(records, srcs)],
        "report": report, "baseline": baseline,
        "samples": [
            {"direction": f"{r.src_lang}->{r.tgt_lang}", "source": s, "reference": r.reference, "hypothesis": r.hypothesis}
            for r, s in list(zip(records, srcs))[:: max(1, len(records) // 12)][:12]
        ],
    }


def spec_of(result: dict) -> EvalSpec:
    """The :class:`EvalSpec` of an :func:`evaluate_checkpoint` result (or of its JSON)."""
    fields = EvalSpec.__dataclass_fields__
    return EvalSpec(**{k: v for k, v in result["evaluation"].items() if k in fields})


def run_dir_of(checkpoint: str | Path) -> Path:
    """The training run directory of a checkpoint (``RUN/checkpoints/step-N`` -> ``RUN``)."""
    ckpt = Path(checkpoint)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def _line(text: str) -> str:
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def write_hypotheses(result: dict, out_dir: str | Path) -> list[Path]:
    """``out_dir/{src,ref,hyp}.<src>-<tgt>.txt`` per direction: line-aligned plain text (line breaks inside
    a sentence become spaces, which neither BLEU's tokenizers nor chrF count), so sacrebleu or any other
    scorer can be run on them. Returns the files written."""
    from scaletrain.fileio import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_dir: dict[str, list] = {}
    for s, t, src, ref, hyp in result["records"]:
        by_dir.setdefault(f"{s}-{t}", []).append((src, ref, hyp))
    written = []
    for d, rows in sorted(by_dir.items()):
        for i, kind in enumerate(("src", "ref", "hyp")):
            f = out / f"{kind}.{d}.txt"
            atomic_write_text(f, "".join(_line(r[i]) + "\n" for r in rows))
            written.append(f)
    return written


def result_to_json(result: dict) -> dict:
    out = {k: v for k, v in result.items() if k not in ("report", "baseline", "records")}
    out["model"] = report_to_json(result["report"])
    out["copy_baseline"] = report_to_json(result["baseline"])
    return out


def write_record(result: dict, run_dir: str | Path, hyp_dir: str | Path | None = None) -> Path:
    """``RUN/eval/<name>/``: ``eval.json`` (:func:`result_to_json`), the src/ref/hyp files (in ``hyp_dir``
    instead when given) and ``scores.png`` + ``.json`` (a plot failure is a warning). Written in a directory
    beside it and swapped in whole, so only this same evaluation's earlier record is replaced."""
    from scaletrain.fileio import atomic_write_text, replace_dir

    final = record_dir(run_dir, result["name"])
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_hypotheses(result, tmp if hyp_dir is None else hyp_dir)
        data = result_to_json(result)
        atomic_write_text(tmp / RESULT_FILE, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        try:
            from scaletrain.tracking.plots import plot_eval_scores

            plot_eval_scores(data, tmp / PLOT_FILE)
        except Exception as e:  # noqa: BLE001 - a plot must not lose an evaluation that already ran
            log.warning("could not plot the scores of %s: %s", result["name"], e)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def mlflow_metrics(result: dict) -> dict[str, float]:
    """``<split>/bleu/<group>``, ``<split>/chrf/<group>`` (groups: ``->`` as ``2``, spaces as ``_``), the same
    per direction, ``<split>/copy_baseline/{bleu,chrf}`` of the copy-the-source baseline on every line and
    ``<split>/copy_baseline_{bleu,chrf}/<group>`` per group (``scaletrain compare --plot`` marks its bars with them)."""
    split = result["split"]
    metrics = {}
    for a in result["report"].averages:
        key = a.name.replace("->", "2").replace(" ", "_")
        metrics[f"{split}/bleu/{key}"] = a.bleu
        metrics[f"{split}/chrf/{key}"] = a.chrf
    for d in result["report"].directions:
        metrics[f"{split}/bleu/{d.src_lang}-{d.tgt_lang}"] = d.bleu
        metrics[f"{split}/chrf/{d.src_lang}-{d.tgt_lang}"] = d.chrf
    for a in result["baseline"].averages:
        key = a.name.replace("->", "2").replace(" ", "_")
        metrics[f"{split}/copy_baseline_bleu/{key}"] = a.bleu
        metrics[f"{split}/copy_baseline_chrf/{key}"] = a.chrf
        if a.name == "all":
            metrics[f"{split}/copy_baseline/bleu"] = a.bleu
            metrics[f"{split}/copy_baseline/chrf"] = a.chrf
    return metrics


def log_to_mlflow(result: dict, record: str | Path | None = None):
    """A run nested under the training run that wrote the checkpoint, named by the evaluation, with its
    scores and the record's files (``record``: :func:`write_record`'s directory) as artifacts; the training
    run's own ``<split>/...`` metrics only when this is its full evaluation (:attr:`EvalSpec.headline`).
    None when the checkpoint names no training run. Returns :class:`scaletrain.tracking.EvaluationLogged`."""
    run_id = result.get("run_id")
    if not run_id:
        return None
    from scaletrain.tracking import log_evaluation

    spec = spec_of(result)
    t = result.get("tracking") or {}  # the recipe's tracking settings, as the training run used them
    return log_evaluation(
        t.get("uri") or None, run_id, spec.name, tags=spec.tags(), metrics=mlflow_metrics(result),
        step=int(result.get("step") or 0), artifact_dir=record, headline=spec.headline,
        headline_tag=headline_tag(spec.split), headline_metric=f"{spec.split}/bleu/all", project_dir=Path.cwd(),
    )
