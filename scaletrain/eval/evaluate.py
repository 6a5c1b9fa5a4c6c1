"""Evaluate a checkpoint: decode every line of a split, score BLEU/chrF per direction and group.

A copy-the-source baseline is scored on the same lines (``scaletrain evaluate`` prints it beside the
model); :func:`log_to_mlflow` adds the scores to the run that trained the checkpoint.
"""
from __future__ import annotations

import time
from pathlib import Path

from scaletrain.checkpoint import load_for_inference
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.errors import ScaletrainError
from scaletrain.eval.generate import train_length_ratios, translate_examples
from scaletrain.eval.scoring import example_records, report_to_json, score_copy_baseline, score_directions


def evaluate_checkpoint(path, *, split=None, shards=None, beam=None, lenpen=None, max_lines=0, device="cpu",
                        progress=True) -> dict:
    model, cfg, vocab, trainer_state, ckpt = load_for_inference(path, device)
    ec = cfg.eval
    split = split or ec.split
    shards = shards or cfg.data.shards
    manifest = load_manifest(shards)
    if manifest.languages != vocab.langs:
        raise ScaletrainError(
            f"{shards}: its languages {manifest.languages} differ from the model's {vocab.langs}; "
            "evaluate on shards prepared with the same language list"
        )
    examples = read_split(shards, split)
    if not examples:
        raise ScaletrainError(f"{shards}: split '{split}' is empty")
    if max_lines:
        seen: dict[tuple[int, int], int] = {}
        kept = []
        for ex in examples:
            k = (ex.src_lang, ex.tgt_lang)
            if seen.get(k, 0) < max_lines:
                kept.append(ex)
                seen[k] = seen.get(k, 0) + 1
        examples = kept
    beam = beam or ec.beam
    lenpen = ec.lenpen if lenpen is None else lenpen
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(examples), desc=f"decoding {split}", unit="sent", leave=False)
    t0 = time.time()
    res = translate_examples(
        model, examples, vocab, batch_tokens=ec.batch_tokens, beam=beam, lenpen=lenpen,
        max_len_a=ec.max_len_a, max_len_b=ec.max_len_b, progress=(bar.update if bar else None),
        length_ratios=train_length_ratios(manifest),  # a degenerate model stops near training's lengths
    )
    secs = time.time() - t0
    if bar:
        bar.close()
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
        "checkpoint": str(ckpt), "split": split, "shards": str(shards), "beam": beam, "lenpen": lenpen,
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


def plot_scores(result: dict, run_dir: str | Path) -> Path:
    """``run_dir/plots/eval_<split>_scores.png`` (+ ``.json``): BLEU/chrF per group beside the copy baseline."""
    from scaletrain.plots import plot_eval_scores

    return plot_eval_scores(result_to_json(result), Path(run_dir) / "plots" / f"eval_{result['split']}_scores.png")


def log_to_mlflow(result: dict, hyp_dir: str | Path | None = None, plots: tuple = ()) -> None:
    run_id = result.get("run_id")
    if not run_id:
        return
    from scaletrain.tracking import Tracker

    t = result.get("tracking") or {}  # the recipe's tracking settings, as the training run used them
    tr = Tracker(uri=t.get("uri") or None, experiment=t.get("experiment") or "scaletrain", run_name=None,
                 is_main=True, project_dir=Path.cwd())
    tr.resume(run_id)
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
        if a.name == "all":
            metrics[f"{split}/copy_baseline/bleu"] = a.bleu
            metrics[f"{split}/copy_baseline/chrf"] = a.chrf
    tr.log_metrics(metrics, step=int(result.get("step") or 0))
    tr.log_dict(result_to_json(result), f"eval_{split}.json")
    if hyp_dir is not None and Path(hyp_dir).is_dir():
        tr.log_artifact(hyp_dir, f"eval/{split}")
    for p in plots:  # PNGs and the JSON beside each
        for f in (Path(p), Path(p).with_suffix(".json")):
            if f.is_file():
                tr.log_artifact(f, "plots")
    tr.end("FINISHED")
