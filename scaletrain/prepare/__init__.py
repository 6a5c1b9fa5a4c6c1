"""Offline preparation: corpora -> shard directories, and what is added to or read out of them offline.

Readers of corpus formats (``gettext``: .mo catalogs; ``parallel_text``: Moses file pairs and TSV, with the
pair filter; ``opus``: the OPUS-100 layout; ``hf_parquet``: the Hub's Parquet layout), ``build``
(``scaletrain prepare``: a corpus -> shards + manifest, in parallel and resumable), ``args`` (its flags, light
to import so building the CLI parser stays fast), ``spm_train`` (``scaletrain data spm``: a SentencePiece BPE
model and its token-length files beside the shards) and ``export_text`` (``scaletrain data export``: a split as
line-aligned plain text).

Layer: above ``scaletrain.data`` (it writes the shard format of ``data.shards`` and the tokenizer records of
``data.spm_models``) and ``scaletrain.vocab``; nothing that training loads imports this package, and it
never imports torch (``tests/unit/test_data_layers.py``, ``tests/unit/test_data_shards.py``).

The names below are loaded on first use (``from scaletrain.prepare import prepare_gettext``), so importing
``scaletrain.prepare.args`` for the CLI parser does not load the readers, numpy or tqdm.
"""
from __future__ import annotations

from scaletrain import lazy_exports

_EXPORTS = {
    "prepare_from_args": "build",
    "prepare_gettext": "build",
    "prepare_parallel": "build",
    "prepare_opus100": "build",
    "prepare_hf_parquet": "build",
    "add_prepare_arguments": "args",
    "add_spm_arguments": "args",
    "add_spm_model": "spm_train",
    "check_spm_args": "spm_train",
    "export_split": "export_text",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
