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

The translation itself is :mod:`scaletrain.eval.translate`.
"""
from __future__ import annotations

import contextlib
import os
import sys

from scaletrain.errors import ScaletrainError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "translate", help="translate stdin to stdout (one line out per line in), batched and streamed",
        description="Translate lines from stdin with a trained checkpoint; one output line per input line.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, a run dir (uses its latest checkpoint), or "
                   "a .safetensors file written by `scaletrain export`")
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
    p.set_defaults(func=run)


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


def run(args) -> int:
    import torch

    from scaletrain.checkpoint import load_for_inference
    from scaletrain.eval.translate import iter_line_batches, iter_object_batches, translate_stream

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
                   else iter_object_batches(sys.stdin, args.batch_lines))
        stats = translate_stream(model, vocab, batches, out.write, out.flush, args.src_lang, args.tgt_lang, **kw)
    if not args.quiet:
        print(
            f"translated {stats['lines']} lines {args.src_lang}->{args.tgt_lang} in {stats['batches']} batches, "
            f"{stats['seconds']:.1f}s, beam {kw['beam']}; malformed UTF-8 sequences in outputs: {stats['invalid_utf8']}",
            file=sys.stderr,
        )
    return 0
