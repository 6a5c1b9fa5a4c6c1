"""Typed configuration: a tree of dataclasses loaded from YAML, overridable with dotted keys.

    cfg = load_config("small", ["model.d_model=256", "optim.lr=1e-3"])

Unknown keys and invalid values fail here, before any process starts, with the key named.
Recipes live in ``scaletrain/recipes/*.yaml`` so an installed wheel has them.

Each section (``DataConfig``, ``OptimConfig``, ..., the model's in :mod:`scaletrain.models.config`) documents
every key in the docstring under its field (meaning, unit, allowed values) and checks its own keys in its
``validate()``; :meth:`Config.validate` calls them and holds only the rules that join two sections.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from scaletrain.data.example import token_budget_problem
from scaletrain.errors import ScaletrainError
from scaletrain.models.config import ModelConfig, MoEConfig


def _bad(key: str, msg: str) -> None:
    raise ScaletrainError(f"config key '{key}': {msg}")


def _check_finite(section: str, cfg) -> None:
    """nan/inf never make sense for a float key of ``section``."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            _bad(f"{section}.{f.name}", f"must be a finite number, got {v!r}")


def _check_min(section: str, cfg, keys: tuple[str, ...], low: float, hint: str = "") -> None:
    for k in keys:
        if getattr(cfg, k) < low:
            _bad(f"{section}.{k}", f"must be >= {low}{hint}")


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        words = [str(a).lower() if isinstance(a, bool) else str(a) for a in allowed]
        _bad(key, f"must be {', '.join(words[:-1])} or {words[-1]}, got {value!r}")


@dataclass
class DataConfig:
    """``data:`` where the training examples come from and how they are batched (scaletrain.data)."""

    shards: str = "shards/django"
    """The shards: a directory written by ``scaletrain prepare``, an ``http(s)://`` URL or ``pipe:CMD {name}``."""
    max_tokens: int | str = 4096
    """Token budget per micro-batch per rank (padded source + target tokens). ``auto``: sized from the
    accelerator's memory and the model at start-up (scaletrain.models.memory), a fixed 4096 on a CPU; the
    choice is recorded in ``max_tokens_auto``; a resume keeps the budget its checkpoint was written with (the
    data stream resumes exactly only with it), with one warning where that exceeds this device's estimate.
    At least ``2 * max_bytes + 3``."""
    max_tokens_auto: str = ""
    """Written when ``max_tokens: auto`` resolves: ``"<tokens>: <reason>"`` (informational, not read)."""
    pad_to_multiple: int = 1
    """Pad batch lengths to a multiple of this (8 or 16 on GPUs: a bounded set of shapes); >= 1, 1 = no padding
    beyond the longest row."""
    max_rows: int = 0
    """Most sentence pairs per batch; 0 = only the token budget limits them."""
    max_bytes: int = 256
    """Longest side kept, in tokens (bytes, or subword tokens with ``tokenizer: spm``); longer sides are
    truncated (language tag and EOS kept). >= 1, and ``max_bytes + 2 <= model.max_positions``."""
    buffer_size: int = 64
    """Blocks per batch slot per shuffle window (>= 1; a rank reads ``engine.grad_accum`` slots); larger = tighter
    length buckets (less padding), more memory."""
    seed: int = 1
    """Seed of the shuffle and the language sampling (>= 0)."""
    num_workers: int | str = "auto"
    """DataLoader worker processes per rank feeding the stream (0 = in the training process). ``auto``: 2 for
    remote shards or on an accelerator with >= 4 host cores per rank, 1 on a CPU host with an idle core per
    rank beside the training threads, else 0 (scaletrain.data.loader.auto_num_workers). The batches do not depend
    on it: a checkpoint resumes with any count."""
    temperature: float = 1.0
    """Language-pair sampling p ~ n^(1/T) (> 0); 1 = natural proportions, larger = flatter."""
    tokenizer: str = "byte"
    """``byte`` (the default) | ``spm``: the subword baseline, a SentencePiece BPE model stored beside the shards
    (``prepare --spm-vocab-size N`` or ``scaletrain data spm DIR --vocab-size N``); with spm, ``max_bytes`` caps
    tokens per side and ``max_tokens`` counts padded subword tokens."""
    spm_vocab_size: int = 0
    """Which of the shard directory's SentencePiece models (``tokenizer: spm`` only); 0 = the only one."""
    on_corrupt: str = "stop"
    """A block failing its CRC-32 / language check: ``stop`` (one line naming it) | ``skip`` (logged, counted)."""
    fetch_retries: int = 8
    """URL / ``pipe:`` shards (scaletrain.data.sources): retries of a failed read, with backoff (>= 0)."""
    fetch_max_seconds: float = 300.0
    """URL / ``pipe:`` shards: seconds a read may keep retrying in all (> 0)."""
    fetch_timeout: float = 30.0
    """URL shards: seconds per request (> 0)."""
    cache_dir: str = ""
    """Directory caching whole remote shards; "" = no disk cache (HTTP: a range request per block; ``pipe:``:
    shards in memory)."""
    cache_max_gb: float = 4.0
    """Size limit of ``cache_dir`` in GB (> 0)."""

    def validate(self) -> None:
        """The data rules that need no other section (``max_bytes`` against ``model.max_positions`` is
        :meth:`Config.validate`'s)."""
        self._validate_batch_shape()
        nw = self.num_workers
        if nw != "auto" and (isinstance(nw, bool) or not isinstance(nw, int) or nw < 0):
            _bad("data.num_workers", f"must be auto or an integer >= 0, got {nw!r}")
        if self.temperature <= 0:
            _bad("data.temperature", "must be > 0 (1 = proportional sampling)")
        _check_min("data", self, ("buffer_size",), 1)
        _check_choice("data.tokenizer", self.tokenizer, ("byte", "spm"))
        _check_choice("data.on_corrupt", self.on_corrupt, ("stop", "skip"))
        _check_min("data", self, ("fetch_retries",), 0)
        for k in ("fetch_max_seconds", "fetch_timeout", "cache_max_gb"):
            if getattr(self, k) <= 0:
                _bad(f"data.{k}", "must be > 0")
        if self.spm_vocab_size < 0:
            _bad("data.spm_vocab_size", "must be >= 0 (0 = the shard directory's only SentencePiece model)")
        if self.spm_vocab_size and self.tokenizer != "spm":
            _bad("data.spm_vocab_size", f"is set ({self.spm_vocab_size}) but data.tokenizer is "
                 f"{self.tokenizer!r}; set data.tokenizer=spm")
        _check_finite("data", self)
        _check_min("data", self, ("max_bytes",), 1)
        _check_min("data", self, ("seed",), 0)

    def _validate_batch_shape(self) -> None:
        if self.pad_to_multiple < 1:
            _bad("data.pad_to_multiple",
                 f"must be >= 1 (1 = no padding beyond the longest row), got {self.pad_to_multiple}")
        if self.max_rows < 0:
            _bad("data.max_rows", f"must be >= 0 (0 = no row cap), got {self.max_rows}")
        if self.max_tokens == "auto":  # resolved at start-up (scaletrain.models.memory.apply_max_tokens), checked there
            return
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            _bad("data.max_tokens", f"must be auto or an integer, got {self.max_tokens!r}")
        if problem := token_budget_problem(self.max_tokens, self.max_bytes, "data.max_tokens", "data.max_bytes",
                                           self.pad_to_multiple):
            _bad("data.max_tokens", problem)


@dataclass
class OptimConfig:
    """``optim:`` AdamW, the inverse-square-root schedule and the loss (scaletrain.engine.optim)."""

    lr: float = 5e-4
    """Peak learning rate, reached at the end of the warm-up (> 0)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW's beta1, beta2 (each in [0, 1))."""
    eps: float = 1e-8
    """AdamW's epsilon (> 0)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (>= 0)."""
    warmup_steps: int = 4000
    """Inverse-sqrt schedule: linear warm-up over this many updates, then ``lr * sqrt(warmup / step)``;
    >= 0, 0 = no warm-up."""
    warmup_init_lr: float = 0.0
    """Learning rate at step 0 of the warm-up (>= 0)."""
    clip_norm: float = 1.0
    """Clip the global gradient norm to this (>= 0); 0 disables clipping."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy, in [0, 1)."""
    fused: bool = True
    """torch's fused AdamW kernel (3.5x faster update on CPU than the per-tensor loop)."""

    def validate(self) -> None:
        _check_finite("optim", self)
        if self.lr <= 0:
            _bad("optim.lr", "must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            _bad("optim.betas", f"both must be in [0, 1), got {list(self.betas)}")
        if self.eps <= 0:
            _bad("optim.eps", "must be > 0")
        _check_min("optim", self, ("weight_decay",), 0)
        _check_min("optim", self, ("warmup_steps",), 0, " (0 = no warm-up)")
        _check_min("optim", self, ("warmup_init_lr",), 0)
        _check_min("optim", self, ("clip_norm",), 0, " (0 = no clipping)")
        if not 0 <= self.label_smoothing < 1:
            _bad("optim.label_smoothing", "must be in [0, 1)")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class EngineConfig:
    """``engine:`` which engine runs the step and how (scaletrain.engine)."""

    backend: str = "deepspeed"
    """``deepspeed`` | ``accelerate``."""
    ds_config: str = "ds_configs/zero0.json"
    """DeepSpeed JSON config: a path, or a file name inside the packaged ds_configs (ZeRO stage, offload)."""
    precision: str = "auto"
    """``auto`` | ``fp32`` | ``bf16`` | ``fp16``. ``auto`` (scaletrain.engine.precision): bf16 on a GPU with bf16
    and on a CPU with native bf16 matrix units (amx_bf16/avx512_bf16 and a GEMM probe measuring bf16 faster),
    else fp32. Resolved once before the engine starts: the saved config names what ran."""
    precision_auto: str = ""
    """Written by the engine when ``precision: auto`` resolves: ``"<choice>: <reason>"`` (informational)."""
    grad_accum: int = 1
    """Micro-batches per update (>= 1). The global batch is data-parallel size x grad_accum batch slots, planned
    alike however they are spread over ranks (docs/DATA.md). A resume at another world size re-derives it to
    keep the run's global batch (``global_batch_slots``); a value other than the one the run was launched
    with changes the global batch, in one log line (scaletrain.train.global_batch)."""
    global_batch_slots: int = 0
    """The global batch in batch slots per update (>= 0), kept at any world size: grad_accum = this / world
    size (the nearest whole number, in one log line, where the world size does not divide it). 0 = the slot
    count of the job's first launch (world size x grad_accum), recorded in every checkpoint, so an elastic
    restart or a re-run on fewer ranks resumes with the same global batch. Set with a contradicting
    grad_accum: this key wins, in one log line."""
    threads: int = 0
    """CPU threads per rank (>= 0); 0 = usable cores / local ranks."""
    accelerate: str = "ddp"
    """With ``backend: accelerate``: ``ddp`` (plain DDP) | ``deepspeed`` (Accelerate's DeepSpeed plugin with
    ``ds_config``)."""
    activation_checkpointing: bool = False
    """Recompute each encoder/decoder layer in the backward pass (less memory, ~1/3 more compute)."""
    compile: bool | str = "auto"
    """torch.compile the model before the engine wraps it (in place: parameter names unchanged): ``true`` |
    ``false`` | ``auto`` (on where the model trains on CUDA, off on CPU, where compiling takes longer than
    it saves)."""
    compile_mode: str = "default"
    """torch.compile mode: ``default`` | ``reduce-overhead`` (CUDA graphs: one capture per batch shape) |
    ``max-autotune`` | ``max-autotune-no-cudagraphs``; recompiles and graph captures are logged (compile/*)."""
    compile_backend: str = "inductor"
    """torch.compile backend (``inductor``; ``aot_eager``: no code generation, CPU tests)."""
    fp16_min_loss_scale: float = 1.0
    """fp16 with Accelerate: stop with one line when the GradScaler's scale falls below this after an overflow
    (> 0; DeepSpeed stops at its ds_config ``fp16.min_loss_scale`` itself, with the same line)."""
    collective_timeout_minutes: float = 10.0
    """gloo/NCCL collective timeout in minutes (> 0): a rank blocked this long on a dead or stuck peer fails
    instead of waiting."""
    peer_timeout_s: float = 60.0
    """A rank whose heartbeat (a counter in the rendezvous store, bumped every few seconds by a thread) has
    not moved this long is lost: every surviving rank stops with one line naming its host and ranks, exit
    code 76 (retry). Catches a host cut off mid-step long before ``collective_timeout_minutes``; 0 = off."""
    rendezvous_timeout_s: float = 60.0
    """The process group must start (every peer connected) within this many seconds of this rank's start of
    it, else the rank stops with one line naming its host, the address it advertised and the variable to set
    (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``), exit 2. Raise it where the hosts of a job are started
    far apart; 0 = no bound (the collective timeout applies)."""

    def validate(self) -> None:
        _check_choice("engine.backend", self.backend, ("deepspeed", "accelerate"))
        _check_choice("engine.precision", self.precision, ("auto", "fp32", "bf16", "fp16"))
        _check_min("engine", self, ("grad_accum",), 1)
        _check_min("engine", self, ("global_batch_slots",), 0, " (0 = the first launch's world size x grad_accum)")
        _check_choice("engine.accelerate", self.accelerate, ("ddp", "deepspeed"))
        _check_min("engine", self, ("threads",), 0, " (0 = cores / local ranks)")
        _check_choice("engine.compile", self.compile, (True, False, "auto"))
        if self.compile_mode not in COMPILE_MODES:
            _bad("engine.compile_mode", f"must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        _check_finite("engine", self)
        if self.fp16_min_loss_scale <= 0:
            _bad("engine.fp16_min_loss_scale", "must be > 0")
        if self.collective_timeout_minutes <= 0:
            _bad("engine.collective_timeout_minutes", "must be > 0")
        if self.peer_timeout_s < 0:
            _bad("engine.peer_timeout_s", "must be >= 0 (0 = no heartbeat)")
        if self.rendezvous_timeout_s < 0:
            _bad("engine.rendezvous_timeout_s", "must be >= 0 (0 = no bound)")


@dataclass
class TrainConfig:
    """``train:`` the training loop: its length, its checkpoints, its policies for faults (scaletrain.train)."""

    out_dir: str = "runs/{name}"
    """Run directory (checkpoints, tracking journal, plots); ``{name}`` is replaced by the recipe name."""
    max_steps: int = 1000
    """Updates to train for, in the whole job (>= 1)."""
    max_minutes: float = 0.0
    """Wall-clock budget in minutes for the training loop, summed over all sessions of the job; 0 = none."""
    log_every: int = 10
    """Log line and train/* metrics every N updates (>= 1)."""
    save_every: int = 500
    """Checkpoint every N updates (>= 0; 0 = only at the end)."""
    save_every_minutes: float = 0.0
    """Also checkpoint every N minutes of training-loop time (all sessions; >= 0, 0 = off)."""
    keep_last: int = 3
    """Checkpoints kept besides the best (>= 0; older ones are removed)."""
    valid_every: int = 100
    """Validation loss every N updates (>= 0; 0 = only at the end)."""
    valid_max_batches: int = 50
    """Batches of the valid split per validation (>= 1)."""
    seed: int = 1
    """Seed of the model's initialisation and dropout (>= 0)."""
    resume: bool = True
    """Continue from ``out_dir``'s latest checkpoint when there is one. A checkpoint of another model, vocabulary
    or corpus is refused with one line naming the keys (scaletrain.checkpoint.compat)."""
    init_from: str = ""
    """Warm start: a checkpoint directory, or a run directory (its latest checkpoint), whose model weights start
    this run; the optimizer, LR schedule, data position and counters start fresh. Same model and tokenizer
    needed; other languages are mapped by tag name (new ones keep their fresh initialisation). Ignored, with a
    log line, when ``out_dir`` has a checkpoint to resume from; "" = off (scaletrain.checkpoint.warm_start)."""
    resume_other_corpus: bool = False
    """Resume a checkpoint trained on another corpus (other shards, same vocabulary): the model, optimizer, LR
    schedule and counters carry on, the data stream starts at the new corpus's beginning. false: such a
    resume is refused with one line."""
    on_corrupt_checkpoint: str = "fallback"
    """A checkpoint file that does not match the checkpoint's index.json (sha256) at resume: ``fallback`` =
    warn and resume from the newest intact earlier checkpoint | ``stop`` = fail naming the file."""
    on_save_error: str = "stop"
    """A save that fails (full disk, permissions): ``stop`` = fail naming the path and the free space |
    ``continue`` = warn and train on without that checkpoint; the previous checkpoint stays intact either way."""
    preempt_grace_seconds: float = 20.0
    """SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary and exit 75; without a step boundary within
    this many seconds, exit without one (the deepspeed launcher sends SIGKILL 30 s after SIGTERM)."""
    nonfinite: str = "skip"
    """A NaN/inf loss or gradient on any rank: every rank skips that update and the batch's examples are
    written to ``OUT/nonfinite/``; ``skip`` = train on (stop after ``max_nonfinite`` such updates in a row) |
    ``stop`` = stop at the first."""
    max_nonfinite: int = 5
    """With ``nonfinite: skip``: consecutive skipped updates before stopping (>= 1)."""
    on_oom: str = "stop"
    """A training or validation batch that runs out of device memory in its forward/backward: ``stop`` = fail
    with one line naming the batch shape and ``data.max_tokens`` (the last checkpoint stays) | ``skip`` = withhold
    that update, count it (oom_steps) and train on; a validation batch is left out of the validation loss and
    counted (valid/oom_batches) (a single process only, as fairseq). The optimizer step always stops."""
    bleu_every: int = 0
    """BLEU/chrF on ``eval.valid_lines`` per direction every N updates (>= 0; 0 = off)."""
    best_metric: str = ""
    """Keep ``checkpoints/best`` by this metric, e.g. ``valid/nll`` or ``valid/chrf_avg/all``; "" = no best."""
    best_mode: str = "max"
    """``max`` | ``min``: whether a larger or a smaller ``best_metric`` is better."""
    patience: int = 0
    """Early stop after N validations without improvement (>= 0; 0 = off; needs ``best_metric``)."""
    best_min_delta: float = 0.0
    """An improvement must beat the best by more than this (>= 0, in the metric's unit)."""

    def validate(self) -> None:
        _check_finite("train", self)
        _check_min("train", self, ("seed",), 0)
        _check_min("train", self, ("max_steps",), 1)
        _check_choice("train.on_corrupt_checkpoint", self.on_corrupt_checkpoint, ("fallback", "stop"))
        if not isinstance(self.init_from, str):
            _bad("train.init_from", f"must be a checkpoint or run directory (a path), got {self.init_from!r}")
        _check_choice("train.resume_other_corpus", self.resume_other_corpus, (True, False))
        _check_choice("train.on_save_error", self.on_save_error, ("stop", "continue"))
        _check_choice("train.nonfinite", self.nonfinite, ("skip", "stop"))
        _check_min("train", self, ("max_nonfinite",), 1, " (consecutive skipped updates before stopping)")
        _check_min("train", self, ("save_every_minutes",), 0, " (0 = no time-based saves)")
        _check_choice("train.on_oom", self.on_oom, ("stop", "skip"))
        _check_choice("train.best_mode", self.best_mode, ("max", "min"))
        _check_min("train", self, ("bleu_every", "patience", "valid_every", "save_every", "keep_last",
                                   "max_minutes", "preempt_grace_seconds"), 0)
        _check_min("train", self, ("log_every", "valid_max_batches"), 1)
        _check_min("train", self, ("best_min_delta",), 0)
        if self.patience and not self.best_metric:
            _bad("train.patience", "early stopping needs train.best_metric (e.g. valid/nll with best_mode=min)")


@dataclass
class EvalConfig:
    """``eval:`` decoding and scoring (scaletrain.eval): ``scaletrain evaluate`` and in-training BLEU."""

    split: str = "test"
    """The shard split ``scaletrain evaluate`` decodes (train | valid | test)."""
    beam: int = 1
    """Beam size (>= 1; 1 = greedy)."""
    lenpen: float = 1.0
    """Length penalty: hypotheses are ranked by score / length^lenpen."""
    max_len_a: float = 4.0
    """Longest hypothesis: ``max_len_a * source length + max_len_b`` tokens (>= 0)."""
    max_len_b: int = 200
    """See ``max_len_a`` (>= 0)."""
    batch_tokens: int = 8192
    """Source tokens per decoding batch (>= 1)."""
    pivot: str = "en"
    """The pivot language of the per-group averages (directions into and out of it)."""
    valid_lines: int = 100
    """Lines per direction of the fixed validation subset (``train.bleu_every``; >= 1)."""
    groups: dict[str, list[str]] = field(default_factory=dict)
    """Language groups reported beside the per-direction scores: ``{name: [lang, ...]}``."""
    stop_invalid_utf8: bool = True
    """End a hypothesis before the first byte that makes it invalid UTF-8 (an untrained model's byte soup
    otherwise runs to the length limit); false: decode raw bytes to the limit."""

    def validate(self) -> None:
        _check_finite("eval", self)
        _check_min("eval", self, ("batch_tokens", "valid_lines"), 1)
        _check_min("eval", self, ("max_len_a", "max_len_b"), 0)
        _check_min("eval", self, ("beam",), 1)


@dataclass
class TrackingConfig:
    """``tracking:`` MLflow and the run's metrics (scaletrain.tracking); only rank 0 talks to the server."""

    enabled: bool = True
    """Track the run in MLflow (and its local journal)."""
    uri: str = ""
    """MLflow tracking URI; "" = ``$MLFLOW_TRACKING_URI``, else a local store in the project directory."""
    experiment: str = "scaletrain"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; "" = ``"<recipe> · <out_dir> · <short id>"``; ``{run_id}`` in a name becomes the short id."""
    end_timeout: float = 30.0
    """Seconds the end of a job waits for an unreachable server (then: ``scaletrain tracking sync``)."""
    peak_tflops: float = 0.0
    """MFU peak per device in TFLOP/s (>= 0); 0 = the GPU table, or the measured GEMM peak on CPU."""
    system_metrics: bool = True
    """CPU/memory/disk/network/GPU metrics per node (sampled by local rank 0 of each node)."""
    system_metrics_interval: float = 10.0
    """Seconds between system-metric samples (> 0)."""
    progress: bool = True
    """A live progress line on rank 0 when stdout is a terminal."""

    def validate(self) -> None:
        if self.peak_tflops < 0:
            _bad("tracking.peak_tflops", "must be >= 0 (0 = the GPU table, or the measured GEMM peak on CPU)")
        if self.system_metrics_interval <= 0:
            _bad("tracking.system_metrics_interval", "must be > 0 seconds")


@dataclass
class Config:
    """The run config: one section per part of the system, each checking its own keys (``validate``)."""

    name: str = "default"
    """The recipe's name (its file name unless set); fills ``{name}`` in ``train.out_dir``."""
    data: DataConfig = field(default_factory=DataConfig)
    """Shards and batching."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (scaletrain.models.config), one sub-section per variant."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Sparse MoE feed-forward layers and expert parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer, schedule, loss."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """DeepSpeed or Accelerate and their settings."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Decoding and scoring."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""

    @property
    def out_dir(self) -> Path:
        return Path(self.train.out_dir.format(name=self.name))

    def validate(self) -> None:
        """Every section's own rules, then the rules that join two sections. Raises ScaletrainError with one
        line naming the key."""
        self.engine.validate()
        self.model.validate()  # the model rules (scaletrain.models.config)
        self.moe.validate(self.model)  # the moe keys, some against the model's layers and arch
        if self.data.max_bytes + 2 > self.model.max_positions:
            _bad("data.max_bytes",
                 f"{self.data.max_bytes} + 2 (tag, eos) exceeds model.max_positions {self.model.max_positions}")
        self.data.validate()
        self.optim.validate()
        self.train.validate()
        self.eval.validate()
        self.tracking.validate()


# ---------------------------------------------------------------------------------------
# dict <-> dataclass with checking


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ScaletrainError(f"config key '{key}' must be a mapping, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for a in args[:-1]:  # the first type that takes the value (int | str: 2 stays an integer)
            try:
                return _coerce(value, a, key)
            except ScaletrainError:
                pass
        return _coerce(value, args[-1], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ScaletrainError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ScaletrainError(f"config key '{key}' must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScaletrainError(f"config key '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ScaletrainError(f"config key '{key}' must be a string, got {value!r}")
        return str(value)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ScaletrainError(f"config key '{key}' must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (a,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ScaletrainError(f"config key '{key}' must be a list, got {value!r}")
        return [_coerce(v, a, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, a = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ScaletrainError(f"config key '{key}' must be a mapping, got {value!r}")
        return {str(k): _coerce(v, a, f"{key}.{k}") for k, v in value.items()}
    return value


def _from_dict(cls, d: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in names]
    renamed = getattr(cls, "RENAMED", {})
    if unknown and unknown[0] in renamed:
        raise ScaletrainError(f"config key '{prefix}{unknown[0]}' is now '{prefix}{renamed[unknown[0]]}'")
    if unknown:
        raise ScaletrainError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys under "
            f"'{prefix.rstrip('.') or 'top level'}': {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in d.items()}
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """Plain dict of a config tree; the model section lists only the variant keys its arch and
    embedding use (``ModelConfig.used_keys``)."""

    def conv(x):
        if isinstance(x, ModelConfig):
            out = {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
            for section, keys in x.used_keys().items():
                out[section] = {k: out[section][k] for k in keys}
                if not keys:
                    del out[section]
            return out
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        if isinstance(x, list):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------
# recipes, YAML, overrides


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("scaletrain.recipes").iterdir() if p.name.endswith(".yaml"))


def _read_yaml(path_or_name: str) -> tuple[dict, str]:
    p = Path(path_or_name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ScaletrainError(f"config file {p} does not exist")
        text, name = p.read_text(encoding="utf-8"), p.stem
    else:
        res = resources.files("scaletrain.recipes") / f"{path_or_name}.yaml"
        if not res.is_file():
            raise ScaletrainError(
                f"unknown recipe '{path_or_name}'; packaged recipes: {', '.join(recipe_names())} "
                "(or give a path to a .yaml file)"
            )
        text, name = res.read_text(encoding="utf-8"), path_or_name
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ScaletrainError(f"config {path_or_name}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ScaletrainError(f"config {path_or_name}: top level must be a mapping")
    return data, name


# mappings that are one value, not a section: a later recipe's replaces the earlier one's as a whole
_VALUE_MAPPINGS = (("eval", "groups"),)


def _merge(base: dict, over: dict, path: tuple = ()) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and path + (k,) not in _VALUE_MAPPINGS:
            out[k] = _merge(out[k], v, path + (k,))
        else:
            out[k] = v
    return out


def _load_tree(path_or_name: str, seen: tuple = ()) -> tuple[dict, str]:
    data, name = _read_yaml(path_or_name)
    base = data.pop("base", None)  # a recipe may extend another recipe, or a list of them merged in order
    bases = [base] if isinstance(base, str) else base or []
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ScaletrainError(f"recipe '{path_or_name}': 'base' must be a recipe name or a list of them, got {base!r}")
    merged: dict = {}
    for b in bases:  # e.g. base: [embeddingless, overlays/catalogs]: the model's recipe, then a data/budget overlay
        if b in seen or b == path_or_name:
            raise ScaletrainError(f"recipe '{path_or_name}': circular 'base: {b}'")
        parent, _ = _load_tree(b, seen + (path_or_name,))
        merged = _merge(merged, parent)
    return _merge(merged, data), name


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ScaletrainError(f"override '{item}' must look like section.key=value (e.g. optim.lr=1e-3)")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _merge({}, data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ScaletrainError(f"override '{item}': '{part}' is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def from_dict(data: dict) -> Config:
    """Config from a mapping as written (a recipe tree with overrides applied, or a checkpoint's
    config.yaml): unknown keys, wrong types, variant keys the model does not use and broken rules
    fail with the key named."""
    cfg = _from_dict(Config, data)
    cfg.model.check_keys_set(data.get("model") or {})
    cfg.validate()
    return cfg


def load_config(path_or_name: str, overrides: list[str] | None = None) -> Config:
    data, name = _load_tree(path_or_name)
    data.setdefault("name", name)
    data = apply_overrides(data, overrides or [])
    return from_dict(data)


def dump_yaml(cfg: Config, docs: bool = False) -> str:
    """The resolved config as YAML; ``docs``: each key preceded by its documentation (the docstring under
    its field) as ``#`` comments. Both read back to the same config."""
    if not docs:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)
    return "".join(_documented(to_dict(cfg), type(cfg), 0))


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of the config dataclass ``cls`` (the string literal after the
    field, as in fairseq2's config sections), read from the class's source without running it."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _documented(tree: dict, cls, depth: int):
    """YAML lines of ``tree`` (a section of ``to_dict``), each key under its field docstring as comments."""
    pad = "  " * depth
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for key, value in tree.items():
        for line in docs.get(key, "").splitlines():
            yield f"{pad}# {line}".rstrip() + "\n"
        if dataclasses.is_dataclass(hints.get(key)) and isinstance(value, dict):
            yield f"{pad}{key}:\n"
            yield from _documented(value, hints[key], depth + 1)
        else:
            text = yaml.safe_dump({key: value}, sort_keys=False, allow_unicode=True, width=10**6)
            yield "".join(pad + line + "\n" for line in text.splitlines())
