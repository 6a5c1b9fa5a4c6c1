"""``Example``: one translation pair as the shards store it.

Torch-free: the shards, ``prepare`` and the manifest tools never import torch. The sequence layout
(tags, EOS, padding) and batches are ``scaletrain.data.batch``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    src_lang: int  # index into the manifest's language list
    tgt_lang: int
    src: bytes  # raw UTF-8 bytes, no tags, no EOS
    tgt: bytes
