"""Checkpoints: writing and resuming them during training, and loading them afterwards.

* :mod:`~scaletrain.checkpoint.manager`: the train-time side. :class:`CheckpointManager` writes a
  checkpoint atomically (``step-N.partial``, renamed after every rank is done, then ``latest``), with
  ``index.json`` (sha256 and size of every file) verified at resume and a fallback to the newest intact
  checkpoint; ``keep_last`` pruning; the RNG states and vocabulary files a checkpoint holds.
* :mod:`~scaletrain.checkpoint.inference`: a model for evaluate/translate/export from a checkpoint or
  run directory (any engine, any ZeRO stage, expert shards joined) or from an exported file.
* :mod:`~scaletrain.checkpoint.average`: ``scaletrain average``.
* :mod:`~scaletrain.checkpoint.single_file`: ``scaletrain export --format safetensors`` (one file that
  :func:`load_for_inference` reads back).

Layer: above ``engine/`` (whose ``deepspeed_driver`` reads DeepSpeed's checkpoint files), ``models/``,
``parallel/``, ``vocab/``, ``config``, ``safeload``, ``fileio`` and ``errors``; imported by ``train/``,
``eval/``, ``export/`` and ``commands/``, never by the packages below it. Modules of this package
import each other by module (``scaletrain.checkpoint.manager``), never through this ``__init__``.
"""
from scaletrain.checkpoint.average import average_checkpoints, checkpoints_of_run
from scaletrain.checkpoint.inference import (load_checkpoint_vocab, load_exported, load_for_inference,
                                             load_model_weights, resolve_checkpoint)
from scaletrain.checkpoint.manager import (INDEX, TAG_RE, VOCAB_FILE, CheckpointManager, CorruptCheckpoint,
                                           copy_vocab_files, latest_tag, rng_state, save_vocab_files, set_rng_state,
                                           tag_for, verify_checkpoint, write_index)
from scaletrain.checkpoint.single_file import DTYPES, export_checkpoint, save_safetensors

__all__ = [
    "CheckpointManager", "CorruptCheckpoint", "DTYPES", "INDEX", "TAG_RE", "VOCAB_FILE", "average_checkpoints",
    "checkpoints_of_run", "copy_vocab_files", "export_checkpoint", "latest_tag", "load_checkpoint_vocab",
    "load_exported", "load_for_inference", "load_model_weights", "resolve_checkpoint", "rng_state",
    "save_safetensors", "save_vocab_files", "set_rng_state", "tag_for", "verify_checkpoint", "write_index",
]
