"""What training reads: the shard format and the stream of batches made from it.

``example`` (``Example``; torch-free), ``shards`` (block format, manifest with per-block CRC-32, shard
writer and readers), ``sources`` (where shard bytes come from: a directory, ``http(s)://`` Range
requests, ``pipe:`` commands; retries, cache), ``spm_models`` (the manifest's record of the SentencePiece
models and token-length files beside the shards; ``load_shard_vocab``), ``inspect_shards`` (``scaletrain data
stats`` / ``verify``), ``batch`` (``Batch`` and ``collate``), ``batching`` (token-budget batches for training and
decoding), ``stream`` (``ShardStream``: the stateful, exactly resumable stream of a rank's batch slots),
``position`` (the stream's state; moving it to another batch layout: ``states_for_layout``) and ``loader``
(``ShardLoader``: the stream from DataLoader worker processes; ``ShardLoader.for_run(cfg.data, split,
parallel=...)`` builds a run's loaders).

Layer: imports ``scaletrain.vocab`` (the id layout), never the offline preparation
(``scaletrain.prepare``), models, engines or MLflow. ``example``, ``sources``, ``shards`` and
``spm_models`` do not import torch (``tests/unit/test_data_shards.py``).

``decode_webdataset_sample``: the translation pairs of one sample that ``webdataset.WebDataset``
reads from our shards (``scaletrain.data.shards``: the shards are plain WebDataset tars).

The names below are loaded on first use (``from scaletrain.data import ShardLoader``), so importing the
package (or one of its torch-free modules) loads neither torch nor the stream.
"""
from __future__ import annotations

from scaletrain import lazy_exports

_EXPORTS = {
    "Example": "example",
    "Manifest": "shards",
    "SplitWriter": "shards",
    "decode_webdataset_sample": "shards",
    "iter_split": "shards",
    "load_manifest": "shards",
    "read_split": "shards",
    "write_manifest": "shards",
    "FetchOptions": "sources",
    "fetch_options": "sources",
    "open_source": "sources",
    "run_source": "sources",
    "find_spm_model": "spm_models",
    "load_shard_vocab": "spm_models",
    "data_stats": "inspect_shards",
    "verify": "inspect_shards",
    "Batch": "batch",
    "collate": "batch",
    "decode_batches": "batching",
    "plan_batches": "batching",
    "ShardStream": "stream",
    "states_for_layout": "position",
    "ShardLoader": "loader",
    "auto_num_workers": "loader",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
