"""Evaluation speed of an untrained model with and without stopping at invalid UTF-8 (``stop_invalid_utf8``).

    python benchmarks/bench_decode_invalid.py [--recipe small] [--lines 60] [--beam 1 --beam 4] [--rounds 3]
    python benchmarks/bench_decode_invalid.py --checkpoint runs/RUN [--lines 60]   # a (barely) trained model

An untrained byte model writes bytes that are not UTF-8 and, without the check, goes on to the length
limit (``eval.max_len_a * src + eval.max_len_b``), so evaluating it costs the longest possible decode of
every line. The recipe's model (random weights, seed 0) translates the first ``--lines`` test lines of the
bundled Django corpus (prepared into a temporary directory), or ``--checkpoint``'s model the first lines of
its own test split, through ``translate_examples`` - the path of
``scaletrain evaluate`` - with the recipe's length limits, the check off and on, interleaved (off, on, off,
on, ...) after one warm-up each. Prints per beam: seconds per sentence of each (median over rounds), the
ratio off/on (median and range of the per-round ratios), the mean output length in bytes, and how many
hypotheses the check cut.
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
    from scaletrain.data.prepare import prepare_gettext
    from scaletrain.data.shards import read_split
    from scaletrain.eval.generate import translate_examples
    from scaletrain.models import build_model
    from scaletrain.vocab import ByteVocab

    if args.checkpoint:
        from scaletrain.checkpoint import load_for_inference

        model, cfg, vocab, _, _ = load_for_inference(args.checkpoint, "cpu")
        examples = read_split(cfg.data.shards, "test")[: args.lines]
        what = f"checkpoint {args.checkpoint}"
    else:
        cfg = load_config(args.recipe)
        with tempfile.TemporaryDirectory() as tmp:
            m = prepare_gettext(out=os.path.join(tmp, "django"), progress=False)
            examples = read_split(os.path.join(tmp, "django"), "test")[: args.lines]
        vocab = ByteVocab(m.languages)
        torch.manual_seed(0)
        model = build_model(cfg.model, vocab.size).eval()
        what = f"recipe {args.recipe}, random weights"
    ec = cfg.eval
    print(f"{what}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"{len(examples)} test lines; max length {ec.max_len_a} * src + {ec.max_len_b}; "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    for beam in args.beam or [1, 4]:
        def run(stop: bool):
            t0 = time.perf_counter()
            r = translate_examples(model, examples, vocab, batch_tokens=ec.batch_tokens, beam=beam, lenpen=ec.lenpen,
                                   max_len_a=ec.max_len_a, max_len_b=ec.max_len_b, stop_invalid_utf8=stop)
            return time.perf_counter() - t0, r

        run(False), run(True)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        res = {}
        for _ in range(args.rounds):
            for stop in (False, True):
                dt, res[stop] = run(stop)
                times[stop].append(dt)
        ratios = [a / b for a, b in zip(times[False], times[True])]
        for stop in (False, True):
            r = res[stop]
            print(f"beam {beam} stop_invalid_utf8={stop!s:5}: {statistics.median(times[stop]) / len(examples):.4f} "
                  f"s/sentence; mean output {sum(map(len, r.tokens)) / len(r.tokens):.1f} bytes; "
                  f"cut {r.n_cut}; lines with invalid UTF-8 {r.n_invalid_lines}")
        print(f"beam {beam}: RATIO off/on {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
