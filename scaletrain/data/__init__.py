"""Readers, shard writer and the training stream."""
