"""scaletrain: distributed training of byte-level multilingual NMT models."""

__version__ = "0.1.0"
