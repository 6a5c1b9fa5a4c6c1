"""`scaletrain translate`: stream stdin -> translations on stdout, one line out per line in.

    scaletrain translate --checkpoint runs/small --src-lang en --tgt-lang de [--beam 4 --lenpen 1.0] < in.txt

* Input is read as raw bytes (the model is byte-level; nothing is re-encoded). A trailing ``\\r`` is
  dropped (CRLF files). Sources longer than the model's ``max_positions`` allow are truncated, never
  dropped.
* Output: exactly one line per input line, in order. An empty (or whitespace-only) input line gives an empty output line
  without running the model. Newlines the model generates inside a translation are written as spaces so
  the line alignment cannot break; malformed UTF-8 in a translation becomes U+FFFD (counted in the summary
  on stderr).
* Streaming: lines are translated in batches of at most ``--batch-lines``; a batch is started early when
  no more input is ready yet (interactive use answers each line as it comes, a pipe is batched), and
  stdout is flushed after every batch.
* Only translations go to stdout. Everything else that wants fd 1 while the command runs (library logs,
  C-level prints) is sent to stderr.
"""
from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from typing import Callable, Iterable, Iterator

from scaletrain.errors import ScaletrainError

__all__ = ["register", "iter_line_batches", "translate_lines", "translate_stream"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "translate", help="translate stdin to stdout (one line out per line in), batched and streamed",
        description="Translate lines from stdin with a trained checkpoint; one output line per input line.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (uses its latest checkpoint)")
    p.add_argument("--src-lang", required=True, help="language code of the input (one of the model's languages)")
    p.add_argument("--tgt-lang", required=True, help="language code to translate into")
    p.add_argument("--beam", type=int, default=None, help="beam size, 1 = greedy (default: the recipe's eval.beam)")
    p.add_argument("--lenpen", type=float, default=None, help="length penalty (default: the recipe's eval.lenpen)")
    p.add_argument("--max-len-a", type=float, default=None, help="max output bytes = a * src_bytes + b")
    p.add_argument("--max-len-b", type=int, default=None, help="(defaults: the recipe's eval.max_len_a/b)")
    p.add_argument("--batch-lines", type=int, default=64, help="most lines per batch (default 64)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="most beam-expanded padded source tokens per model call (default: eval.batch_tokens)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    p.set_defaults(func=translate_cli)


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


def _iter_object_batches(stream, max_lines: int) -> Iterator[list[bytes]]:
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
    from scaletrain.eval.generate import translate_examples

    s, t = vocab.lang_index(src_lang), vocab.lang_index(tgt_lang)
    todo = [i for i, ln in enumerate(lines) if ln.strip()]
    out = [""] * len(lines)
    if not todo:
        return out, 0
    res = translate_examples(
        model, [Example(s, t, lines[i], b"") for i in todo], vocab, batch_tokens=batch_tokens, beam=beam,
        lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
    )
    for i, text in zip(todo, res.texts):
        out[i] = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return out, res.n_invalid


def translate_stream(model, vocab, batches: Iterable[list[bytes]], write: Callable[[bytes], object],
                     flush: Callable[[], object], src_lang: str, tgt_lang: str, **kw) -> dict:
    """Translate each batch and write it (UTF-8, one line per input line) followed by ``flush()``."""
    vocab.lang_index(src_lang), vocab.lang_index(tgt_lang)  # fail before reading any input
    n_lines = n_invalid = n_batches = 0
    t0 = time.time()
    for batch in batches:
        texts, inv = translate_lines(model, vocab, batch, src_lang, tgt_lang, **kw)
        write("".join(t + "\n" for t in texts).encode("utf-8"))
        flush()
        n_lines += len(batch)
        n_invalid += inv
        n_batches += 1
    return {"lines": n_lines, "batches": n_batches, "invalid_utf8": n_invalid, "seconds": time.time() - t0}


@contextlib.contextmanager
def _stdout_for_translations_only():
    """Yield a binary file on the real stdout; meanwhile fd 1 (and sys.stdout) point at stderr, so logs
    and prints from libraries cannot interleave with the translations."""
    import logging

    try:
        fd1 = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        fd1 = None
    if fd1 is None:  # no real stdout (embedded use): write through the text layer
        buf = getattr(sys.stdout, "buffer", None)
        yield buf if buf is not None else _TextWriter(sys.stdout)
        return
    sys.stdout.flush()
    saved = os.dup(fd1)
    out = os.fdopen(os.dup(fd1), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), fd1)
    moved = []
    for lg in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
                h.setStream(sys.stderr)
                moved.append(h)
    try:
        yield out
    finally:
        out.close()
        sys.stdout.flush()
        os.dup2(saved, fd1)
        os.close(saved)
        for h in moved:
            h.setStream(sys.stdout)


class _TextWriter:
    def __init__(self, f):
        self.f = f

    def write(self, b: bytes):
        self.f.write(b.decode("utf-8"))

    def flush(self):
        self.f.flush()


def translate_cli(args) -> int:
    import torch

    from scaletrain.checkpoint import load_for_inference

    for name in ("beam", "batch_lines", "batch_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ScaletrainError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with _stdout_for_translations_only() as out:
        model, cfg, vocab, _, ckpt = load_for_inference(args.checkpoint, device)
        for flag, code in (("--src-lang", args.src_lang), ("--tgt-lang", args.tgt_lang)):
            if code not in vocab.langs:
                raise ScaletrainError(
                    f"{flag} {code!r} is not a language of checkpoint {ckpt}; it knows: {', '.join(vocab.langs)}"
                )
        ec = cfg.eval
        kw = dict(
            beam=args.beam or ec.beam, lenpen=ec.lenpen if args.lenpen is None else args.lenpen,
            max_len_a=ec.max_len_a if args.max_len_a is None else args.max_len_a,
            max_len_b=ec.max_len_b if args.max_len_b is None else args.max_len_b,
            batch_tokens=args.batch_tokens or ec.batch_tokens,
        )
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        batches = (iter_line_batches(fd, args.batch_lines) if fd is not None
                   else _iter_object_batches(sys.stdin, args.batch_lines))
        stats = translate_stream(model, vocab, batches, out.write, out.flush, args.src_lang, args.tgt_lang, **kw)
    if not args.quiet:
        print(
            f"translated {stats['lines']} lines {args.src_lang}->{args.tgt_lang} in {stats['batches']} batches, "
            f"{stats['seconds']:.1f}s, beam {kw['beam']}; malformed UTF-8 sequences in outputs: {stats['invalid_utf8']}",
            file=sys.stderr,
        )
    return 0
