"""The bar a model must clear to show it uses the source at all: a target-side unigram model."""
from __future__ import annotations

from itertools import islice

import numpy as np

from scaletrain.data.shards import iter_split


def unigram_nll(shards: str, split: str = "valid", vocab=None, max_examples: int = 200_000,
                on_corrupt: str = "stop") -> float:
    """Cross-entropy (nats/token) of `split` targets under a target-side unigram model fit on train.

    The bar a model must clear to show it uses the source at all (add-one smoothing; EOS counted).
    Tokens are bytes, or the subword pieces of ``vocab`` when it is a SentencePiece vocabulary. The
    unigram is fit on the first ``max_examples`` training pairs and scored on as many ``split`` pairs
    (the whole split of the bundled corpus; a bounded pass on OPUS-scale data).
    """


    spm = vocab is not None and getattr(vocab, "kind", "byte") != "byte"

    def ids(exs) -> list[np.ndarray]:
        if spm:
            return [a.astype(np.int64) for a in vocab.encode_batch([ex.tgt for ex in exs])]
        return [np.frombuffer(ex.tgt, dtype=np.uint8).astype(np.int64) for ex in exs]

    n_ids = vocab.size if spm else 256
    eos = vocab.eos if spm else 256
    counts = np.ones(n_ids + (0 if spm else 1), dtype=np.float64)  # + EOS (bytes: index 256)
    for a in ids(list(islice(iter_split(shards, "train", on_corrupt), max_examples))):
        counts += np.bincount(a, minlength=len(counts))
        counts[eos] += 1
    logp = np.log(counts / counts.sum())
    tot, n = 0.0, 0
    for a in ids(list(islice(iter_split(shards, split, on_corrupt), max_examples))):
        tot -= logp[a].sum() + logp[eos]
        n += len(a) + 1
    return float(tot / max(n, 1))
