"""``Example``, one translation pair as the shards store it, and what one example costs in a batch.

Torch-free: the shards, ``prepare`` and the manifest tools never import torch. The sequence layout
itself (tags, EOS, padding) is built in ``scaletrain.data.batch``::

    src     = [__src__] + bytes(x) + [EOS]      len(x) + SRC_EXTRA tokens
    tgt_in  = [__tgt__] + bytes(y)              len(y) + TGT_EXTRA tokens (tgt_out likewise)

A batch costs ``B * (S + T)`` padded tokens (``Batch.padded_tokens``, the stream's budget), so one
example truncated to ``max_bytes`` per side costs at most ``2 * max_bytes + 3``.
"""
from __future__ import annotations

from dataclasses import dataclass

SRC_EXTRA = 2  # the source's language tag and EOS
TGT_EXTRA = 1  # the target's language tag (decoder input) / EOS (decoder output)


@dataclass(frozen=True)
class Example:
    src_lang: int  # index into the manifest's language list
    tgt_lang: int
    src: bytes  # raw UTF-8 bytes, no tags, no EOS
    tgt: bytes


def max_example_tokens(max_bytes: int, pad_to_multiple: int = 1) -> int:
    """Padded tokens of a batch holding one example with both sides at ``max_bytes``:
    ``(max_bytes + 2) + (max_bytes + 1) = 2 * max_bytes + 3``, each side rounded up to a multiple of
    ``pad_to_multiple`` when batches are padded to one (``data.pad_to_multiple``)."""
    m = max(1, pad_to_multiple)
    return -(-(max_bytes + SRC_EXTRA) // m) * m + -(-(max_bytes + TGT_EXTRA) // m) * m


def token_budget_problem(max_tokens: int, max_bytes: int, tokens_key: str = "max_tokens",
                         bytes_key: str = "max_bytes", pad_to_multiple: int = 1) -> str | None:
    """Why a token budget of ``max_tokens`` cannot hold one example truncated to ``max_bytes`` per
    side (the message names the settings as ``tokens_key`` / ``bytes_key``), or None when it can.
    The one copy of this check: the stream and the config validation both call it."""
    need = max_example_tokens(max_bytes, pad_to_multiple)
    if max_tokens >= need:
        return None
    how = (f"2*{bytes_key}+3 = {need}" if pad_to_multiple <= 1 else
           f"{bytes_key}+2 and {bytes_key}+1 rounded up to multiples of {pad_to_multiple}: {need}")
    return (f"{tokens_key}={max_tokens} cannot hold one example of {bytes_key}={max_bytes} "
            f"(needs {how}); raise {tokens_key} or lower {bytes_key}")
