"""Subword (SentencePiece BPE) tokenizer and stream throughput, as ratios measured in one run.

Corpus: the bundled django gettext corpus (all languages <-> en, real text), prepared into a
temporary directory, with a BPE model of ``--vocab-size`` pieces trained by ``add_spm_model``.

Printed:
* tokenizer: sentences/s and MB/s of SentencePiece's own batch encoder (list of lists: the
  baseline) and of ``SubwordVocab.encode_flat`` (what the stream calls: one flat id array), for 1
  and 2 threads; the sentences are the train split's both sides, repeated to ``--sentences``;
* stream: one epoch of ``ShardStream`` as examples/s with the byte vocabulary (the baseline), with
  the subword vocabulary (own blocks tokenized, other slots' lengths from the lengths file), and
  with the subword vocabulary and no lengths file at ``--world-size`` slots (every rank tokenizes
  every slot's blocks to plan: what the lengths file saves).

    python benchmarks/bench_subword.py --vocab-size 8000 --sentences 200000
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.prepare import prepare_gettext  # noqa: E402
from scaletrain.data.shards import load_manifest, read_split  # noqa: E402
from scaletrain.data.spm_models import load_shard_vocab  # noqa: E402
from scaletrain.data.stream import ShardStream  # noqa: E402
from scaletrain.prepare import add_spm_model  # noqa: E402


def best(fn, rounds: int) -> float:
    t = []
    for _ in range(rounds):
        a = time.perf_counter()
        fn()
        t.append(time.perf_counter() - a)
    return min(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--sentences", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "django"
        prepare_gettext(out=d, progress=False)
        t0 = time.perf_counter()
        add_spm_model(d, args.vocab_size)
        t_train = time.perf_counter() - t0
        m = load_manifest(d)
        print(f"corpus: {len(m.languages)} languages, {m.split('train').n_examples:,} train examples; "
              f"spm{args.vocab_size} trained + lengths files written in {t_train:.2f} s")

        texts = [t for e in read_split(d, "train") for t in (e.src, e.tgt)]
        texts = (texts * (args.sentences // len(texts) + 1))[: args.sentences]
        mb = sum(map(len, texts)) / 1e6
        print(f"\ntokenizer: {len(texts):,} sentences, {mb:.1f} MB, best of {args.rounds}")
        print(f"{'contender':<44}{'sent/s':>12}{'MB/s':>9}{'ratio':>8}")
        base = None
        for threads in (1, 2):
            v = load_shard_vocab(m.languages, "spm", d, num_threads=threads)
            contenders = ((f"sentencepiece encode (list), {threads} thr",
                           lambda: v._sp.encode(texts, num_threads=threads)),
                          (f"SubwordVocab.encode_flat, {threads} thr", lambda: v.encode_flat(texts)))
            for name, fn in contenders:
                s = best(fn, args.rounds)
                base = base or s
                print(f"{name:<44}{len(texts) / s:>12,.0f}{mb / s:>9.2f}{base / s:>8.2f}")

        v = load_shard_vocab(m.languages, "spm", d)
        kw = dict(max_tokens=8192, max_bytes=256, buffer_size=16, epochs=1)
        n_ex = m.split("train").n_examples
        print(f"\nstream: one epoch of {n_ex:,} examples, best of {args.rounds} (1 thread)")
        print(f"{'contender':<44}{'examples/s':>12}{'batches':>9}{'ratio':>8}")
        rows = []
        rows.append(("byte vocabulary (baseline)", lambda: list(ShardStream(d, **kw))))
        rows.append(("spm, 1 slot", lambda: list(ShardStream(d, vocab=v, **kw))))
        ws = args.world_size

        def spm_slots(lengths: bool):
            out = []
            for r in range(ws):
                s = ShardStream(d, vocab=v, world_size=ws, rank=r, **dict(kw, buffer_size=4))
                if not lengths:
                    s.blocks.token_lengths = None
                out += list(s)
            return out

        rows.append((f"spm, {ws} slots, lengths file", lambda: spm_slots(True)))
        rows.append((f"spm, {ws} slots, no lengths file", lambda: spm_slots(False)))
        base = None
        for name, fn in rows:
            n_b = len(fn())
            s = best(fn, args.rounds)
            base = base or s
            print(f"{name:<44}{n_ex / s:>12,.0f}{n_b:>9}{base / s:>8.2f}")


if __name__ == "__main__":
    main()
