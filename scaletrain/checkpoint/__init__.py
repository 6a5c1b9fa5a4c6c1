"""Checkpoints: the one package that decides what is written on disk and reads it back.

* :mod:`~scaletrain.checkpoint.manager`: the checkpoint directory. :class:`CheckpointManager` writes a
  checkpoint atomically (``step-N.partial``, renamed after every rank is done, then ``latest``), with
  ``index.json`` (sha256 and size of every file) verified at resume and a fallback to the newest intact
  checkpoint; ``keep_last`` pruning; the RNG states, the data position and the vocabulary files a
  checkpoint holds.
* :mod:`~scaletrain.checkpoint.engine_state`: the engine's part: ``engine.json`` (layout, LR schedule),
  the model and optimizer state dicts the engine hands over (``model.safetensors``, ``optimizer.bin``) or,
  for DeepSpeed, its own files; read back at resume.
* :mod:`~scaletrain.checkpoint.reshard`: a checkpoint resumed at another world size, ZeRO stage or engine
  (the state made whole by parameter name: ZeRO-1/2/3 partitions joined; handed to ``Engine.load_whole``).
* :mod:`~scaletrain.checkpoint.experts`: expert shards under expert parallelism (save, resume at the same
  or another ``moe.ep_size``, merge for inference).
* :mod:`~scaletrain.checkpoint.deepspeed_files`: DeepSpeed's files, read with and without an engine.
* :mod:`~scaletrain.checkpoint.inference`: a model for evaluate/translate/export from a checkpoint or
  run directory (any engine, any ZeRO stage, expert shards joined) or from an exported file.
* :mod:`~scaletrain.checkpoint.compat`: whether a run may resume a checkpoint (model, vocabulary, corpus
  compared; a refusal in one line before anything is loaded) and the corpus record a checkpoint keeps.
* :mod:`~scaletrain.checkpoint.warm_start`: ``train.init_from``, a fresh run from another run's weights
  (language tags mapped by name).
* :mod:`~scaletrain.checkpoint.average`: ``scaletrain average``.

Layer: above ``engine/`` (the engine hands it state dicts and takes them back), ``models/``,
``parallel/``, ``vocab/``, ``config``, ``safeload``, ``fileio`` and ``errors``; imported by ``train/``,
``eval/``, ``export/`` and ``commands/``, never by the packages below it. Modules of this package
import each other by module (``scaletrain.checkpoint.manager``), never through this ``__init__``.
"""
from scaletrain.checkpoint.average import average_checkpoints, checkpoints_of_run
from scaletrain.checkpoint.engine_state import load_engine_state, save_engine_state, save_safetensors
from scaletrain.checkpoint.inference import (load_checkpoint_vocab, load_exported, load_for_inference,
                                             load_model_weights, resolve_checkpoint)
from scaletrain.checkpoint.manager import (INDEX, TAG_RE, VOCAB_FILE, CheckpointContents, CheckpointManager,
                                           CorruptCheckpoint, copy_vocab_files, latest_tag, rng_state,
                                           save_vocab_files, set_rng_state, tag_for, verify_checkpoint, write_index)

__all__ = [
    "CheckpointContents", "CheckpointManager", "CorruptCheckpoint", "INDEX", "TAG_RE", "VOCAB_FILE",
    "average_checkpoints", "checkpoints_of_run", "copy_vocab_files", "latest_tag", "load_checkpoint_vocab",
    "load_engine_state", "load_exported", "load_for_inference", "load_model_weights", "resolve_checkpoint",
    "rng_state", "save_engine_state", "save_safetensors", "save_vocab_files", "set_rng_state", "tag_for",
    "verify_checkpoint", "write_index",
]
