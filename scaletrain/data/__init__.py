"""What training reads: the shard format and the stream of batches made from it.

``example`` (``Example``; torch-free), ``shards`` (block format, manifest with per-block CRC-32, shard
writer and readers), ``sources`` (where shard bytes come from: a directory, ``http(s)://`` Range
requests, ``pipe:`` commands; retries, cache), ``spm_models`` (the manifest's record of the SentencePiece
models and token-length files beside the shards; ``load_shard_vocab``), ``inspect_shards`` (``scaletrain data
stats`` / ``verify``), ``batch`` (``Batch`` and ``collate``), ``batching`` (token-budget batches for training and
decoding), ``stream`` (``ShardStream``: the stateful, exactly resumable stream) and ``loader`` (``ShardLoader``:
the stream from DataLoader worker processes; ``ShardLoader.for_run(cfg.data, split)`` builds a run's loaders).

Layer: imports ``scaletrain.vocab`` (the id layout), never the offline preparation
(``scaletrain.prepare``), models, engines or MLflow. ``example``, ``sources``, ``shards`` and
``spm_models`` do not import torch (``tests/unit/test_data_shards.py``).

``decode_webdataset_sample``: the translation pairs of one sample that ``webdataset.WebDataset``
reads from our shards (``scaletrain.data.shards``: the shards are plain WebDataset tars)."""
from scaletrain.data.shards import decode_webdataset_sample

__all__ = ["decode_webdataset_sample"]
