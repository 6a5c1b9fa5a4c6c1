"""Readers, shard writer and the training stream.

``decode_webdataset_sample``: the translation pairs of one sample that ``webdataset.WebDataset``
reads from our shards (``scaletrain.data.shards``: the shards are plain WebDataset tars)."""
from scaletrain.data.shards import decode_webdataset_sample

__all__ = ["decode_webdataset_sample"]
