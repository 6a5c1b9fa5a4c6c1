"""Translate raw source lines with a loaded model: the library side of ``scaletrain translate``.

* Input is raw bytes (the model is byte-level; nothing is re-encoded). A trailing ``\\r`` is dropped
  (CRLF files). Sources longer than the model's ``max_positions`` allow are truncated, never dropped.
* Output: exactly one text per input line, in order. An empty (or whitespace-only) input line gives an
  empty text without running the model. Newlines the model generates inside a translation become spaces
  so the line alignment cannot break; malformed UTF-8 in a translation becomes U+FFFD (and is counted).
* Streaming (:func:`iter_line_batches`): lines are cut into batches of at most ``max_lines``; a batch is
  started early when no more input is ready yet (interactive use answers each line as it comes, a pipe is
  batched), and :func:`translate_stream` flushes after every batch.

The command itself (flags, stdout kept for translations only) is :mod:`scaletrain.commands.translate`.
"""
from __future__ import annotations

import os
import select
import time
from typing import Callable, Iterable, Iterator

from scaletrain.errors import ScaletrainError

__all__ = ["iter_line_batches", "iter_object_batches", "translate_lines", "translate_stream"]


# ----------------------------------------------------------------------------------------------
# input


def _ready(fd: int) -> bool:
    """True if a read on ``fd`` would not block (or if that cannot be told: then we just read)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def iter_line_batches(fd: int, max_lines: int, chunk: int = 1 << 16) -> Iterator[list[bytes]]:
    """Yield batches of complete input lines (without ``\\n`` / ``\\r\\n``) read from file descriptor ``fd``.

    A batch has at most ``max_lines`` lines; it is yielded as soon as it is full, or when at least one
    line is pending and no more input is ready. A last line without a newline counts as a line.
    """
    if max_lines < 1:
        raise ScaletrainError(f"--batch-lines must be >= 1, got {max_lines}")
    buf = b""
    pending: list[bytes] = []
    eof = False
    while True:
        while not eof and len(pending) < max_lines:
            if pending and not _ready(fd):
                break
            data = os.read(fd, chunk)
            if not data:
                eof = True
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            pending.extend(lines)
        if eof and buf:
            pending.append(buf)
            buf = b""
        if not pending:
            if eof:
                return
            continue
        batch, pending = pending[:max_lines], pending[max_lines:]
        yield [ln[:-1] if ln.endswith(b"\r") else ln for ln in batch]


def iter_object_batches(stream, max_lines: int) -> Iterator[list[bytes]]:
    """Fallback for a stdin without a file descriptor (e.g. an in-memory stream)."""
    batch: list[bytes] = []
    for line in stream:
        if isinstance(line, str):
            line = line.encode("utf-8")
        line = line[:-1] if line.endswith(b"\n") else line
        batch.append(line[:-1] if line.endswith(b"\r") else line)
        if len(batch) >= max_lines:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# translation


def translate_lines(model, vocab, lines: list[bytes], src_lang: str, tgt_lang: str, *, beam: int, lenpen: float,
                    max_len_a: float, max_len_b: int, batch_tokens: int) -> tuple[list[str], int]:
    """Translate raw source lines; returns (one text per line, malformed UTF-8 sequences in the outputs).

    Empty lines map to empty texts without decoding; texts never contain ``\\n`` or ``\\r``."""
    from scaletrain.data.batch import Example
    from scaletrain.eval.requests import translate_examples

    s, t = vocab.lang_index(src_lang), vocab.lang_index(tgt_lang)
    todo = [i for i, ln in enumerate(lines) if ln.strip()]
    out = [""] * len(lines)
    if not todo:
        return out, 0
    res = translate_examples(
        model, [Example(s, t, lines[i], b"") for i in todo], vocab, batch_tokens=batch_tokens, beam=beam,
        lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b, stage="translate", batch_tokens_key="--batch-tokens",
    )
    for i, text in zip(todo, res.texts):
        out[i] = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return out, res.n_invalid


def translate_stream(model, vocab, batches: Iterable[list[bytes]], write: Callable[[bytes], object],
                     flush: Callable[[], object], src_lang: str, tgt_lang: str, **kw) -> dict:
    """Translate each batch and write it (UTF-8, one line per input line) followed by ``flush()``. Out of
    memory: one line saying how many lines were written before (whole batches only)."""
    from scaletrain.oom import OutOfMemory

    vocab.lang_index(src_lang), vocab.lang_index(tgt_lang)  # fail before reading any input
    n_lines = n_invalid = n_batches = 0
    t0 = time.time()
    for batch in batches:
        try:
            texts, inv = translate_lines(model, vocab, batch, src_lang, tgt_lang, **kw)
        except OutOfMemory as e:
            e.after = (f"stdout holds the translations of the first {n_lines} input lines only (the batch of lines "
                       f"{n_lines + 1}-{n_lines + len(batch)} failed)")
            raise
        write("".join(t + "\n" for t in texts).encode("utf-8"))
        flush()
        n_lines += len(batch)
        n_invalid += inv
        n_batches += 1
    return {"lines": n_lines, "batches": n_batches, "invalid_utf8": n_invalid, "seconds": time.time() - t0}
