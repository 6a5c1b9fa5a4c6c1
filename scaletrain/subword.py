"""The subword baseline's vocabulary: a SentencePiece BPE model trained on the shards.

Id layout (the same interface as ``scaletrain.vocab.ByteVocab``)::

    0..3                  specials: pad, bos, eos, unk (the SentencePiece model is trained with
                          pad_id=0, bos_id=1, eos_id=2, unk_id=3, so its ids ARE ours)
    4..259                the 256 byte-fallback pieces <0x00>..<0xFF> (SentencePiece puts them
                          right after the specials: the same ids ByteVocab gives the bytes)
    260..S-1              the learned pieces (characters, then merges), S = SentencePiece size
    S..S+L-1              language tags ``__xx__`` in manifest order (``lang_offset = S``)

The shards keep raw UTF-8; the model lives next to them (``spm<N>.model``, recorded in the
manifest's ``tokenizers`` list with its sha256) and the stream tokenizes on the fly.

Training choices (``train_spm``): ``model_type=bpe``; ``byte_fallback=True``, so no input ever
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
Round trip: ``decode(encode(text)) == text`` for any text, with two exceptions SentencePiece
imposes: U+2581 itself (its whitespace mark) comes back as a space, and invalid UTF-8 (only in
shards prepared with ``--keep-invalid-utf8``) is encoded as U+FFFD.
"""
from __future__ import annotations

import io
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_bytes, replace_synced, sha256_bytes, sha256_file, temp_path
from scaletrain.vocab import BOS, EOS, PAD, SPECIALS, UNK, DecodeResult, LanguageTags, _decode_counting

SPM_TYPE = "spm"
WORD_START = "\u2581"  # SentencePiece's word-start mark
DEFAULT_SENTENCES = 2_000_000
DEFAULT_COVERAGE = 0.9995
DEFAULT_TRAIN_THREADS = 4  # the model file records it: a fixed default keeps the sha256 machine-independent
DEFAULT_SEED = 0


def _spm():
    try:
        import sentencepiece
    except ImportError:  # pragma: no cover - a declared dependency
        raise ScaletrainError("the subword tokenizer needs the sentencepiece package "
                              "(pip install sentencepiece)") from None
    return sentencepiece


def spm_file_name(vocab_size: int) -> str:
    return f"spm{vocab_size}.model"


class SubwordVocab(LanguageTags):
    """SentencePiece BPE pieces with language tags appended in manifest order (see module doc)."""

    kind = "spm"

    def __init__(self, langs: Sequence[str], model_path: str | Path | None = None, *, num_threads: int = 1,
                 model_proto: bytes | None = None):
        self._set_langs(langs)
        if model_proto is None:
            if model_path is None:
                raise ScaletrainError("SubwordVocab needs a SentencePiece model file")
            try:
                model_proto = Path(model_path).read_bytes()
            except OSError as e:
                raise ScaletrainError(f"cannot read the SentencePiece model {model_path}: {e}") from None
        self.model_path = None if model_path is None else Path(model_path)
        self.num_threads = int(num_threads)
        self.sha256 = sha256_bytes(model_proto)
        self._proto = bytes(model_proto)
        sp = _spm().SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(self._proto)
        except (RuntimeError, OSError) as e:
            raise ScaletrainError(f"{model_path or 'model'}: not a SentencePiece model ({e})") from None
        self._sp = sp
        if (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) != (PAD, BOS, EOS, UNK):
            raise ScaletrainError(
                f"{model_path or 'model'}: SentencePiece ids pad/bos/eos/unk are "
                f"{(sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id())}, scaletrain needs (0, 1, 2, 3); "
                "train it with `scaletrain data spm` (or pad_id=0 bos_id=1 eos_id=2 unk_id=3)"
            )
        n = sp.get_piece_size()
        self._spm_size = n
        self._pieces = [sp.id_to_piece(i) for i in range(n)]
        # bytes each id contributes to the decoded text (specials and <unk> contribute none)
        pb: list[bytes] = []
        surface: list[str] = []
        for i, p in enumerate(self._pieces):
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                pb.append(b"")
                surface.append("")
            elif sp.is_byte(i):
                b = int(p[3:5], 16)  # <0xNN>
                pb.append(bytes([b]))
                surface.append(chr(b) if b < 0x80 else "")  # a lone byte >= 0x80 is no character
            else:
                pb.append(p.replace(WORD_START, " ").encode("utf-8"))
                surface.append(p)
        self._piece_bytes = pb
        self._surface = surface
        self.byte_fallback = any(sp.is_byte(i) for i in range(min(n, 4 + 256)))
        self._dummy_prefix = bool(pb and sp.encode("a", out_type=str)[:1] and
                                  sp.encode("a", out_type=str)[0].startswith(WORD_START))

    # ---- pickling (DataLoader workers under spawn) -----------------------------------------------
    def __getstate__(self) -> dict:
        return {"langs": self.langs, "proto": self._proto, "num_threads": self.num_threads,
                "model_path": None if self.model_path is None else str(self.model_path)}

    def __setstate__(self, st: dict) -> None:
        self.__init__(st["langs"], st["model_path"], num_threads=st["num_threads"], model_proto=st["proto"])

    # ---- sizes and ids -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._spm_size + len(self.langs)

    def __len__(self) -> int:
        return self.size

    @property
    def lang_offset(self) -> int:
        """Id of the first language tag (= the SentencePiece model's size)."""
        return self._spm_size

    @property
    def spm_size(self) -> int:
        return self._spm_size


    def token_str(self, i: int) -> str:
        if 0 <= i < len(SPECIALS):
            return SPECIALS[i]
        if 0 <= i < self._spm_size:
            return self._pieces[i]
        if self._spm_size <= i < self.size:
            return f"__{self.langs[i - self._spm_size]}__"
        raise ScaletrainError(f"id {i} is outside the vocabulary (size {self.size})")

    def pieces(self) -> list[str]:
        """Surface string of every id (length ``size``), for a character-aware decoder: the piece
        as SentencePiece spells it (word starts keep U+2581), the ASCII character of a byte piece
        below 0x80, and '' for specials, <unk>, byte pieces >= 0x80 (a lone byte of a multi-byte
        character is no character) and language tags."""
        return list(self._surface) + [""] * len(self.langs)

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_eos:
            ids.append(EOS)
        return ids

    def encode_batch(self, texts: Sequence[bytes | str]) -> list[np.ndarray]:
        """Token ids of each text (int32 arrays, no tags, no EOS), SentencePiece's batch encoder
        with ``num_threads`` threads."""
        if not texts:
            return []
        return self._sp.encode(list(texts), return_type="numpy", num_threads=self.num_threads)

    def encode_flat(self, texts: Sequence[bytes | str]) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` as one concatenated int32 id array and the int64 lengths."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        ids = self._sp.encode(list(texts), num_threads=self.num_threads)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return flat, lengths

    # ---- decoding ------------------------------------------------------------------------------
    def ids_to_bytes(self, ids: Iterable[int]) -> bytes:
        """UTF-8 bytes of the pieces, stopping at the first EOS; specials, <unk> and tags dropped;
        the word-start mark becomes a space and the sentence's leading (dummy-prefix) space goes."""
        out = bytearray()
        pb, n = self._piece_bytes, self._spm_size
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if 0 <= i < n:
                out += pb[i]
        if self._dummy_prefix and out[:1] == b" ":
            del out[0]
        return bytes(out)

    def decode_counting(self, ids: Iterable[int]) -> DecodeResult:
        """Text and the number of malformed UTF-8 sequences (from byte pieces) replaced by U+FFFD."""
        return _decode_counting(self.ids_to_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_counting(ids).text


# ---------------------------------------------------------------------------------------------
# the manifest's record of a shard directory's models
# ---------------------------------------------------------------------------------------------
def spm_entries(manifest) -> list[dict]:
    return [t for t in (manifest.tokenizers or []) if t.get("type") == SPM_TYPE]


def find_spm_model(shard_dir: str | Path, vocab_size: int = 0) -> Path:
    """Path of the SentencePiece model recorded in ``shard_dir``'s manifest (checked by sha256).

    ``vocab_size`` picks one when the directory has several (0 = the only one)."""
    from scaletrain.data.shards import load_manifest

    m = load_manifest(shard_dir)
    found = spm_entries(m)
    if not found:
        raise ScaletrainError(
            f"{shard_dir} has no SentencePiece model (data.tokenizer=spm): create one with "
            f"`scaletrain data spm {shard_dir} --vocab-size N`, or prepare the shards with --spm-vocab-size N"
        )
    if vocab_size:
        pick = [t for t in found if int(t["vocab_size"]) == vocab_size]
        if not pick:
            raise ScaletrainError(
                f"{shard_dir} has no SentencePiece model of size {vocab_size} (data.spm_vocab_size); it has: "
                f"{', '.join(str(t['vocab_size']) for t in found)}; or add one with "
                f"`scaletrain data spm {shard_dir} --vocab-size {vocab_size}`"
            )
        entry = pick[0]
    elif len(found) > 1:
        raise ScaletrainError(
            f"{shard_dir} has several SentencePiece models (sizes {', '.join(str(t['vocab_size']) for t in found)}): "
            "choose one with data.spm_vocab_size"
        )
    else:
        entry = found[0]
    path = Path(shard_dir) / entry["file"]
    if not path.is_file():
        raise ScaletrainError(f"{path}: listed in the manifest but missing; re-create it with "
                              f"`scaletrain data spm {shard_dir} --vocab-size {entry['vocab_size']}`")
    if sha256_file(path) != entry["sha256"]:
        raise ScaletrainError(f"{path}: sha256 differs from the manifest (corrupt or replaced); re-create it with "
                              f"`scaletrain data spm {shard_dir} --vocab-size {entry['vocab_size']} --overwrite`")
    return path


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
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
    from scaletrain.data.shards import load_manifest, read_block

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
    spm = _spm()
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


def lengths_file_name(vocab_size: int, split: str) -> str:
    return f"spm{vocab_size}.{split}.lengths.npy"


def write_token_lengths(shard_dir: str | Path, manifest, vocab: "SubwordVocab", split: str,
                        progress: bool = False) -> dict:
    """Tokenize every example of ``split`` once and store the (source, target) token lengths as an
    [n, 2] array in manifest order (``spm<N>.<split>.lengths.npy``, written through a memory map
    and renamed: constant memory). The stream plans every slot's batches from it, so a rank
    tokenizes only its own examples. Returns the manifest record {file, sha256, n, dtype}."""
    from scaletrain.data.shards import read_block

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
        from tqdm.auto import tqdm

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


def load_token_lengths(shard_dir: str | Path, manifest, vocab: "SubwordVocab", split: str):
    """The [n, 2] token lengths of ``split`` for ``vocab``'s model (memory-mapped), or None when the
    manifest records no lengths file for that model and split."""
    for t in spm_entries(manifest):
        if t.get("sha256") != vocab.sha256:
            continue
        rec = (t.get("lengths") or {}).get(split)
        if not rec:
            return None
        path = Path(shard_dir) / rec["file"]
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ScaletrainError(
                f"{path}: cannot read the token lengths ({e}); re-create them with "
                f"`scaletrain data spm {shard_dir} --vocab-size {t['vocab_size']} --overwrite`"
            ) from None
        n = manifest.split(split).n_examples
        if arr.shape != (n, 2):
            raise ScaletrainError(f"{path}: shape {arr.shape}, the split has {n} examples (expected ({n}, 2)); "
                                  f"re-create it with `scaletrain data spm {shard_dir} --vocab-size "
                                  f"{t['vocab_size']} --overwrite`")
        return arr
    return None


def add_spm_model(shard_dir: str | Path, vocab_size: int, *, max_sentences: int = DEFAULT_SENTENCES,
                  character_coverage: float = DEFAULT_COVERAGE, num_threads: int = DEFAULT_TRAIN_THREADS,
                  seed: int = DEFAULT_SEED, overwrite: bool = False, progress: bool = False,
                  flag_prefix: str = "--spm-", encode_threads: int = 0) -> dict:
    """Train a BPE model on the train split of ``shard_dir``, write ``spm<N>.model`` atomically and
    record it in the manifest (rewritten atomically). Returns the manifest entry.

    Then every split is tokenized once to store its token lengths (``write_token_lengths``, with
    ``encode_threads`` threads; 0 = the CPU count). An existing entry of the same size is kept as it
    is (returned) unless ``overwrite``; then the model is retrained and replaced."""
    from scaletrain.data.shards import load_manifest, write_manifest

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
        from tqdm.auto import tqdm

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
