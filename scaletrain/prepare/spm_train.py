"""SentencePiece training for the subword baseline: a BPE model trained on a shard directory.

``add_spm_model`` samples sentences from the train split, trains the model, writes
``spm<N>.model`` beside the shards, tokenizes every split once to store its token lengths, and
records both in the manifest (``scaletrain.data.spm_models``). The vocabulary that uses the model
is ``scaletrain.vocab.SubwordVocab``.

Training choices (``train_spm_bytes``): ``model_type=bpe``; ``byte_fallback=True``, so no input ever
becomes <unk> (the character-aware decoder paper's BPE had no unknown tokens either: a character
outside the model is spelled as its UTF-8 bytes); normalization ``identity`` with
``remove_extra_whitespaces=False`` (no NFKC, no whitespace folding): decoding gives back exactly
the text, the same text the byte models see and the references hold; ``add_dummy_prefix`` on (a
sentence's first word is ``▁word`` like every other word; decoding drops that one leading space).
Sentences are sampled from the train split with a fixed seed and the trainer runs with a fixed
thread count, so the same shards give a byte-identical model. SentencePiece needs
``character_coverage`` in [0.98, 1] and a vocabulary holding the specials, the 256 byte pieces and
every character it keeps (``vocab_size >= 260 + characters``): on the bundled django corpus that is
891 for the 5 test languages and 1,943 for all 15 at coverage 0.9995 (520 / 837 at 0.98).
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from scaletrain.data.shards import load_manifest, read_block, write_manifest
from scaletrain.data.spm_models import SPM_TYPE, lengths_file_name, spm_entries, spm_file_name
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_bytes, replace_synced, sha256_bytes, sha256_file, temp_path
from scaletrain.vocab.base import BOS, EOS, PAD, SPECIALS, UNK
from scaletrain.vocab.subword import SubwordVocab, sentencepiece_module

DEFAULT_SENTENCES = 2_000_000
DEFAULT_COVERAGE = 0.9995
DEFAULT_TRAIN_THREADS = 4  # the model file records it: a fixed default keeps the sha256 machine-independent
DEFAULT_SEED = 0


def _both_directions(split) -> bool:
    """Every example a->b has its mirror b->a (prepare's default): then the source sides alone hold
    every sentence exactly once."""
    d = split.directions
    for k, v in d.items():
        a, _, b = k.partition("-")
        r = d.get(f"{b}-{a}")
        if r is None or r.n != v.n or r.src_bytes != v.tgt_bytes:
            return False
    return bool(d)


def iter_train_sentences(shard_dir: str | Path, max_sentences: int = DEFAULT_SENTENCES, seed: int = DEFAULT_SEED,
                         split: str = "train") -> Iterator[str]:
    """Sentences of ``split`` (both sides of every direction; each pair once when the shards hold
    both directions), at most ``max_sentences`` of them chosen uniformly with ``seed``, streamed
    block by block in manifest order (memory: the chosen indices, not the corpus)."""
    m = load_manifest(shard_dir)
    info = m.split(split)
    src_only = _both_directions(info)
    sides = 1 if src_only else 2
    total = info.n_examples * sides
    if max_sentences < 1:
        raise ScaletrainError(f"the sentence sample size must be >= 1 (got {max_sentences})")
    chosen = None
    if total > max_sentences:
        chosen = np.sort(np.random.default_rng([seed, 0x5E7]).choice(total, size=max_sentences, replace=False))
    base = 0  # global index of the current block's first sentence
    for sh in info.shards:
        for b in sh.blocks:
            n = b.n * sides
            if chosen is not None:
                lo, hi = np.searchsorted(chosen, [base, base + n])
                want = (chosen[lo:hi] - base).tolist()
            else:
                want = range(n)
            base += n
            if not len(want):
                continue
            blk = read_block(shard_dir, sh, b)
            so, to = blk.src_off, blk.tgt_off
            for j in want:
                i, side = divmod(j, sides)
                raw = blk.src_data[so[i]:so[i + 1]] if side == 0 else blk.tgt_data[to[i]:to[i + 1]]
                if raw:
                    yield raw.decode("utf-8", "replace")


def check_spm_args(vocab_size: int, max_sentences: int, character_coverage: float, num_threads: int,
                   prefix: str = "--") -> None:
    """Reject bad SentencePiece settings before any work (messages name the command-line flag)."""
    if vocab_size < 4 + 256 + 1:
        raise ScaletrainError(f"{prefix}vocab-size {vocab_size} is too small: it must hold 4 specials, the 256 byte "
                              "pieces and the characters of the corpus (>= 261; a few thousand for many scripts)")
    if max_sentences < 1:
        raise ScaletrainError(f"{prefix}sentences must be >= 1 (got {max_sentences})")
    if not 0.98 <= character_coverage <= 1.0:
        raise ScaletrainError(f"SentencePiece needs {prefix}character-coverage in [0.98, 1], got {character_coverage}")
    if num_threads < 1:
        raise ScaletrainError(f"{prefix}threads must be >= 1 (got {num_threads})")


def train_spm_bytes(sentences: Iterable[str], vocab_size: int, *, character_coverage: float = DEFAULT_COVERAGE,
                    num_threads: int = DEFAULT_TRAIN_THREADS, flag_prefix: str = "--spm-") -> bytes:
    """Train a SentencePiece BPE model (scaletrain's settings, see module doc); returns the model bytes.

    Deterministic: the same sentences in the same order and settings give the same bytes (BPE has
    no sampling; the sentence sample is drawn by ``iter_train_sentences`` with its own seed)."""
    check_spm_args(vocab_size, 1, character_coverage, num_threads, prefix=flag_prefix)
    spm = sentencepiece_module()
    f = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=f, vocab_size=vocab_size, model_type="bpe",
            character_coverage=character_coverage, byte_fallback=True,
            pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK,
            pad_piece=SPECIALS[PAD], bos_piece=SPECIALS[BOS], eos_piece=SPECIALS[EOS], unk_piece=SPECIALS[UNK],
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            split_digits=False, num_threads=num_threads, shuffle_input_sentence=False,
            input_sentence_size=0, max_sentence_length=1 << 16, minloglevel=2,
        )
    except RuntimeError as e:
        msg = str(e)
        if "Vocabulary size is smaller than required_chars" in msg:
            need = msg.rsplit("vs", 1)[-1].strip(" .").split(".")[0].strip()
            raise ScaletrainError(
                f"{flag_prefix}vocab-size {vocab_size} cannot hold the specials, 256 byte pieces and the characters "
                f"the corpus needs at character_coverage {character_coverage} ({need} needed): raise "
                f"{flag_prefix}vocab-size or lower {flag_prefix}character-coverage (>= 0.98)"
            ) from None
        if "Vocabulary size too high" in msg:
            raise ScaletrainError(f"{flag_prefix}vocab-size {vocab_size} is larger than the corpus supports "
                                  f"({msg.strip()}); lower it") from None
        raise ScaletrainError(f"SentencePiece training failed: {msg.strip()}") from None
    return f.getvalue()


def write_token_lengths(shard_dir: str | Path, manifest, vocab: SubwordVocab, split: str,
                        progress: bool = False) -> dict:
    """Tokenize every example of ``split`` once and store the (source, target) token lengths as an
    [n, 2] array in manifest order (``spm<N>.<split>.lengths.npy``, written through a memory map
    and renamed: constant memory). The stream plans every slot's batches from it, so a rank
    tokenizes only its own examples. Returns the manifest record {file, sha256, n, dtype}."""
    shard_dir = Path(shard_dir)
    info = manifest.split(split)
    longest = 0
    for sh in info.shards:  # headers only: token count <= byte count + 1 (a piece covers >= 1 byte, but
        for b in sh.blocks:  # the dummy-prefix mark may stand alone)
            h = read_block(shard_dir, sh, b, lengths_only=True)
            if len(h):
                longest = max(longest, int(h.src_len.max()), int(h.tgt_len.max()))
    dtype = np.uint16 if longest + 1 < 65536 else np.uint32
    name = lengths_file_name(vocab.spm_size, split)
    tmp = temp_path(shard_dir / name)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(info.n_examples, 2))
    bar = None
    if progress:
        bar = tqdm(total=info.n_examples, desc=f"{name}", unit="ex")
    pos = 0
    for sh in info.shards:
        for b in sh.blocks:
            blk = read_block(shard_dir, sh, b)
            n = len(blk)
            so, to = blk.src_off.tolist(), blk.tgt_off.tolist()
            texts = ([blk.src_data[so[i]:so[i + 1]] for i in range(n)]
                     + [blk.tgt_data[to[i]:to[i + 1]] for i in range(n)])
            _, lens = vocab.encode_flat(texts)
            out[pos:pos + n, 0] = lens[:n]
            out[pos:pos + n, 1] = lens[n:]
            pos += n
            if bar is not None:
                bar.update(n)
    if bar is not None:
        bar.close()
    out.flush()
    del out
    replace_synced(tmp, shard_dir / name)
    return {"file": name, "sha256": sha256_file(shard_dir / name), "n": info.n_examples, "dtype": np.dtype(dtype).name}


def add_spm_model(shard_dir: str | Path, vocab_size: int, *, max_sentences: int = DEFAULT_SENTENCES,
                  character_coverage: float = DEFAULT_COVERAGE, num_threads: int = DEFAULT_TRAIN_THREADS,
                  seed: int = DEFAULT_SEED, overwrite: bool = False, progress: bool = False,
                  flag_prefix: str = "--spm-", encode_threads: int = 0) -> dict:
    """Train a BPE model on the train split of ``shard_dir``, write ``spm<N>.model`` atomically and
    record it in the manifest (rewritten atomically). Returns the manifest entry.

    Then every split is tokenized once to store its token lengths (``write_token_lengths``, with
    ``encode_threads`` threads; 0 = the CPU count). An existing entry of the same size is kept as it
    is (returned) unless ``overwrite``; then the model is retrained and replaced."""
    shard_dir = Path(shard_dir)
    m = load_manifest(shard_dir)
    name = spm_file_name(vocab_size)
    old = [t for t in spm_entries(m) if int(t.get("vocab_size", -1)) == vocab_size]
    if old and not overwrite:
        p = shard_dir / old[0]["file"]
        if p.is_file() and sha256_file(p) == old[0]["sha256"]:
            return old[0]
    encode_threads = encode_threads or (os.cpu_count() or 1)
    sentences = iter_train_sentences(shard_dir, max_sentences, seed)
    if progress:
        sentences = tqdm(sentences, desc=f"spm{vocab_size} sentences", unit="sent")
    data = train_spm_bytes(sentences, vocab_size, character_coverage=character_coverage,
                           num_threads=num_threads, flag_prefix=flag_prefix)
    atomic_write_bytes(shard_dir / name, data)
    vocab = SubwordVocab(m.languages, model_proto=data, num_threads=encode_threads)
    lengths = {split: write_token_lengths(shard_dir, m, vocab, split, progress) for split in m.splits}
    entry = {
        "type": SPM_TYPE,
        "file": name,
        "vocab_size": vocab_size,
        "sha256": sha256_bytes(data),
        "params": {"model_type": "bpe", "byte_fallback": True, "character_coverage": character_coverage,
                   "normalization": "identity", "split": "train", "max_sentences": max_sentences, "seed": seed,
                   "num_threads": num_threads},
        "lengths": lengths,
    }
    m.tokenizers = [t for t in (m.tokenizers or []) if not (t.get("type") == SPM_TYPE
                                                          and int(t.get("vocab_size", -1)) == vocab_size)]
    m.tokenizers.append(entry)
    m.tokenizers.sort(key=lambda t: (t.get("type", ""), int(t.get("vocab_size", 0))))
    write_manifest(shard_dir, m)
    return entry
