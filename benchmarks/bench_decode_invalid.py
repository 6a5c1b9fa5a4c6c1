"""Evaluation speed of an untrained model: the bounds on degenerate decoding against none.

    python benchmarks/bench_decode_invalid.py [--recipe small] [--lines 60] [--beam 1 --beam 4] [--rounds 3]
    python benchmarks/bench_decode_invalid.py --checkpoint runs/RUN [--lines 60]   # a (barely) trained model

An untrained byte model writes bytes that are not UTF-8, or valid bytes that never end, and goes on to the
length limit (``eval.max_len_a * src + eval.max_len_b``), so evaluating it costs the longest possible decode
of every line. Three modes, as ``translate_examples`` runs them: ``none`` (neither bound: before),
``utf8`` (stop at invalid UTF-8), ``utf8+ratio`` (also the limit from training's length ratio: what
``scaletrain evaluate`` runs now). The recipe's model (random weights, seed 0) translates the first ``--lines`` test lines of the
bundled Django corpus (prepared into a temporary directory), or ``--checkpoint``'s model the first lines of
its own test split, through ``translate_examples`` with the recipe's length limits, the modes interleaved (none, utf8,
utf8+ratio, none, ...) after one warm-up each. Prints per beam and mode: seconds per sentence (median over
rounds), the speed-up over ``none`` (median and range of the per-round ratios), the mean output length in
bytes, how many hypotheses were cut at invalid UTF-8 and how many ended at their length limit.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="small")
    ap.add_argument("--checkpoint", default=None, help="a run or checkpoint directory instead of random weights")
    ap.add_argument("--lines", type=int, default=60, help="test lines to translate per run")
    ap.add_argument("--beam", type=int, action="append", help="beam sizes (repeatable; default 1 and 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from scaletrain.config import load_config
    from scaletrain.prepare import prepare_gettext
    from scaletrain.data.shards import read_split
    from scaletrain.eval.requests import translate_examples
    from scaletrain.models import build_model
    from scaletrain.vocab import ByteVocab

    if args.checkpoint:
        from scaletrain.checkpoint import load_for_inference

        from scaletrain.data.shards import load_manifest

        model, cfg, vocab, _, _ = load_for_inference(args.checkpoint, "cpu")
        manifest = load_manifest(cfg.data.shards)
        examples = read_split(cfg.data.shards, "test")[: args.lines]
        what = f"checkpoint {args.checkpoint}"
    else:
        cfg = load_config(args.recipe)
        with tempfile.TemporaryDirectory() as tmp:
            manifest = prepare_gettext(out=os.path.join(tmp, "django"), progress=False)
            examples = read_split(os.path.join(tmp, "django"), "test")[: args.lines]
        vocab = ByteVocab(manifest.languages)
        torch.manual_seed(0)
        model = build_model(cfg.model, vocab.size).eval()
        what = f"recipe {args.recipe}, random weights"
    ec = cfg.eval
    print(f"{what}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"{len(examples)} test lines; max length {ec.max_len_a} * src + {ec.max_len_b}; "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    from scaletrain.eval.bounds import train_length_ratios

    ratios = train_length_ratios(manifest)
    modes = {"none": dict(stop_invalid_utf8=False), "utf8": dict(stop_invalid_utf8=True),
             "utf8+ratio": dict(stop_invalid_utf8=True, length_ratios=ratios)}
    for beam in args.beam or [1, 4]:
        def run(mode: str):
            t0 = time.perf_counter()
            r = translate_examples(model, examples, vocab, batch_tokens=ec.batch_tokens, beam=beam, lenpen=ec.lenpen,
                                   max_len_a=ec.max_len_a, max_len_b=ec.max_len_b, **modes[mode])
            return time.perf_counter() - t0, r

        for mode in modes:  # warm-up
            run(mode)
        times: dict[str, list[float]] = {m: [] for m in modes}
        res = {}
        for _ in range(args.rounds):
            for mode in modes:
                dt, res[mode] = run(mode)
                times[mode].append(dt)
        for mode in modes:
            r = res[mode]
            sp = [a / b for a, b in zip(times["none"], times[mode])]
            print(f"beam {beam} {mode:10}: {statistics.median(times[mode]) / len(examples):.4f} s/sentence, "
                  f"{statistics.median(sp):.2f}x none (rounds {min(sp):.2f}-{max(sp):.2f}); mean output "
                  f"{sum(map(len, r.tokens)) / len(r.tokens):.1f} bytes; cut {r.n_cut}; at limit {r.n_at_limit}; "
                  f"lines with invalid UTF-8 {r.n_invalid_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
