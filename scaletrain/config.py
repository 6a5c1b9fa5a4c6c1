"""Typed configuration: a tree of dataclasses loaded from YAML, overridable with dotted keys.

    cfg = load_config("small", ["model.d_model=256", "optim.lr=1e-3"])

Unknown keys and invalid values fail here, before any process starts, with the key named.
Recipes live in ``scaletrain/recipes/*.yaml`` so an installed wheel has them.
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


@dataclass
class DataConfig:
    shards: str = "shards/django"  # a directory written by `scaletrain prepare`, an http(s):// URL or pipe:CMD {name}
    # token budget per micro-batch per rank: padded src + tgt tokens; auto: sized from the accelerator's memory
    # and the model at start-up (scaletrain.models.memory), a fixed 4096 on a CPU; recorded in max_tokens_auto
    max_tokens: int | str = 4096
    max_tokens_auto: str = ""  # written when auto resolves: "<tokens>: <reason>" (informational)
    pad_to_multiple: int = 1  # pad batch lengths to multiples of this (8/16 on GPUs: a bounded set of shapes)
    max_rows: int = 0  # most sentences per batch (0 = only the token budget limits them)
    max_bytes: int = 256  # longer sides are truncated (tags/EOS kept)
    buffer_size: int = 64  # blocks per rank per shuffle window; larger = tighter length buckets (less padding)
    seed: int = 1
    # DataLoader worker processes per rank feeding the stream (0 = in the training process); auto: 2 for remote
    # shards or on an accelerator with >= 4 host cores per rank, 1 on a CPU host with an idle core per rank
    # beside the training threads, else 0 (scaletrain.data.loader.auto_num_workers)
    num_workers: int | str = "auto"
    temperature: float = 1.0  # language-pair sampling p ~ n^(1/T); 1 = natural proportions, larger = flatter
    # byte (default) | spm: the subword baseline, a SentencePiece BPE model stored beside the shards
    # (`prepare --spm-vocab-size N` or `scaletrain data spm DIR --vocab-size N`); with spm, max_bytes
    # caps TOKENS per side and max_tokens counts padded subword tokens
    tokenizer: str = "byte"
    spm_vocab_size: int = 0  # which of the shard directory's SentencePiece models (0 = the only one)
    on_corrupt: str = "stop"  # a block failing its CRC-32 / language check: stop (one line) | skip (logged, counted)
    # URL / pipe: shards (scaletrain.data.sources): retries with backoff, per-request timeout, whole-shard cache
    fetch_retries: int = 8
    fetch_max_seconds: float = 300.0
    fetch_timeout: float = 30.0
    cache_dir: str = ""  # "" = no disk cache (HTTP: a range request per block; pipe: shards in memory)
    cache_max_gb: float = 4.0


@dataclass
class OptimConfig:
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 4000  # inverse-sqrt schedule: linear warmup, then lr * sqrt(warmup / step)
    warmup_init_lr: float = 0.0
    clip_norm: float = 1.0  # 0 disables clipping
    label_smoothing: float = 0.1
    fused: bool = True  # torch's fused AdamW kernel (3.5x faster update on CPU than the per-tensor loop)


@dataclass
class EngineConfig:
    backend: str = "deepspeed"  # deepspeed | accelerate
    ds_config: str = "ds_configs/zero0.json"  # path, or a file name inside the packaged ds_configs
    # auto | fp32 | bf16 | fp16. auto (scaletrain.engine.precision): bf16 on a GPU with bf16 and on a CPU with
    # native bf16 matrix units (amx_bf16/avx512_bf16 AND a GEMM probe measuring bf16 faster), else fp32.
    # Resolved once before the engine starts: the saved config names what ran.
    precision: str = "auto"
    precision_auto: str = ""  # written by the engine when it resolves auto: "<choice>: <reason>" (informational)
    grad_accum: int = 1
    threads: int = 0  # CPU threads per rank; 0 = cores / local ranks
    accelerate: str = "ddp"  # with backend=accelerate: ddp (plain DDP) | deepspeed (DeepSpeed plugin, ds_config)
    activation_checkpointing: bool = False  # recompute each encoder/decoder layer in backward
    # torch.compile the model before the engine wraps it (in place: parameter names unchanged): true | false |
    # auto (on where the model trains on CUDA, off on CPU, where compiling takes longer than it saves)
    compile: bool | str = "auto"
    # torch.compile mode: default | reduce-overhead (CUDA graphs: one capture per batch shape) | max-autotune |
    # max-autotune-no-cudagraphs; recompiles and graph captures are logged (compile/* metrics)
    compile_mode: str = "default"
    compile_backend: str = "inductor"  # torch.compile backend (inductor; aot_eager: no code generation, CPU tests)
    # fp16 with Accelerate: stop with one line when the GradScaler's scale falls below this after an overflow
    # (DeepSpeed stops at its ds_config fp16.min_loss_scale itself, with the same line)
    fp16_min_loss_scale: float = 1.0
    # gloo/NCCL collective timeout: a rank blocked this long on a dead or stuck peer fails instead of waiting
    collective_timeout_minutes: float = 10.0


@dataclass
class TrainConfig:
    out_dir: str = "runs/{name}"  # {name} is replaced by the recipe name
    max_steps: int = 1000
    max_minutes: float = 0.0  # wall-clock budget for the training loop; 0 = none
    log_every: int = 10
    save_every: int = 500
    save_every_minutes: float = 0.0  # also save every N minutes of training-loop time (all sessions; 0 = off)
    keep_last: int = 3
    valid_every: int = 100  # validation loss every N steps (0 = only at the end)
    valid_max_batches: int = 50
    seed: int = 1
    resume: bool = True  # continue from out_dir/latest when it exists
    # a checkpoint file that does not match the checkpoint's index.json (sha256) at resume:
    # fallback = warn and resume from the newest intact earlier checkpoint | stop = fail naming the file
    on_corrupt_checkpoint: str = "fallback"
    # a save that fails (full disk, permissions): stop = fail naming the path and the free space |
    # continue = warn and train on without that checkpoint; the previous checkpoint stays intact either way
    on_save_error: str = "stop"
    # SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary and exit 75; without a step boundary
    # within this many seconds, exit without one (the deepspeed launcher sends SIGKILL 30 s after SIGTERM)
    preempt_grace_seconds: float = 20.0
    # a NaN/inf loss or gradient on any rank: every rank skips that update and the batch's examples are written to
    # OUT/nonfinite/; skip = train on (stop after max_nonfinite such updates in a row) | stop = stop at the first
    nonfinite: str = "skip"
    max_nonfinite: int = 5
    # a batch that runs out of device memory in its forward/backward: stop = fail with one line naming the batch
    # shape and data.max_tokens (the last checkpoint stays) | skip = withhold that update, count it (oom_steps) and
    # train on (a single process only, as fairseq)
    on_oom: str = "stop"
    bleu_every: int = 0  # BLEU/chrF on eval.valid_lines per direction every N steps (0 = off)
    best_metric: str = ""  # keep checkpoints/best by this metric, e.g. valid/nll or valid/chrf_avg/all
    best_mode: str = "max"  # max | min
    patience: int = 0  # early stop after N validations without improvement (0 = off)
    best_min_delta: float = 0.0  # an improvement must beat the best by more than this


@dataclass
class EvalConfig:
    split: str = "test"
    beam: int = 1
    lenpen: float = 1.0
    max_len_a: float = 4.0
    max_len_b: int = 200
    batch_tokens: int = 8192
    pivot: str = "en"
    valid_lines: int = 100  # lines per direction of the fixed validation subset (train.bleu_every)
    groups: dict[str, list[str]] = field(default_factory=dict)
    # end a hypothesis before the first byte that makes it invalid UTF-8 (an untrained model's byte soup
    # otherwise runs to the length limit); false: decode raw bytes to the limit
    stop_invalid_utf8: bool = True


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""  # empty: $MLFLOW_TRACKING_URI, else a local store in the project directory
    experiment: str = "scaletrain"
    run_name: str = ""  # empty: "<recipe> · <out_dir> · <short id>"; "{run_id}" in a name becomes the short id
    end_timeout: float = 30.0  # seconds the end of a job waits for an unreachable server (then: tracking sync)
    peak_tflops: float = 0.0  # MFU peak per device; 0 = the GPU table, or the measured GEMM peak on CPU
    system_metrics: bool = True  # CPU/memory/disk/network/GPU per node (local rank 0 of each node)
    system_metrics_interval: float = 10.0  # seconds between system-metric samples
    progress: bool = True  # live progress line on rank 0 when stdout is a terminal


@dataclass
class Config:
    name: str = "default"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # sparse MoE feed-forward layers, expert parallelism
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def out_dir(self) -> Path:
        return Path(self.train.out_dir.format(name=self.name))


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
    validate(cfg)
    return cfg


def load_config(path_or_name: str, overrides: list[str] | None = None) -> Config:
    data, name = _load_tree(path_or_name)
    data.setdefault("name", name)
    data = apply_overrides(data, overrides or [])
    return from_dict(data)


def _validate_numbers(cfg: Config, bad) -> None:
    """Ranges of the numeric keys of data, optim, train and eval (the model's are in ModelConfig)."""
    for section in ("data", "optim", "engine", "train", "eval"):  # nan/inf never make sense
        for f in dataclasses.fields(getattr(cfg, section)):
            v = getattr(getattr(cfg, section), f.name)
            if isinstance(v, float) and not math.isfinite(v):
                bad(f"{section}.{f.name}", f"must be a finite number, got {v!r}")
    if cfg.data.max_bytes < 1:
        bad("data.max_bytes", "must be >= 1")
    for key in ("data.seed", "train.seed"):
        sec, k = key.split(".")
        if getattr(getattr(cfg, sec), k) < 0:
            bad(key, "must be >= 0")
    if cfg.optim.lr <= 0:
        bad("optim.lr", "must be > 0")
    if not all(0 <= b < 1 for b in cfg.optim.betas):
        bad("optim.betas", f"both must be in [0, 1), got {list(cfg.optim.betas)}")
    if cfg.optim.eps <= 0:
        bad("optim.eps", "must be > 0")
    if cfg.optim.weight_decay < 0:
        bad("optim.weight_decay", "must be >= 0")
    if cfg.optim.warmup_steps < 0:
        bad("optim.warmup_steps", "must be >= 0 (0 = no warm-up)")
    if cfg.optim.warmup_init_lr < 0:
        bad("optim.warmup_init_lr", "must be >= 0")
    if cfg.optim.clip_norm < 0:
        bad("optim.clip_norm", "must be >= 0 (0 = no clipping)")
    for k in ("batch_tokens", "valid_lines"):
        if getattr(cfg.eval, k) < 1:
            bad(f"eval.{k}", "must be >= 1")
    for k in ("max_len_a", "max_len_b"):
        if getattr(cfg.eval, k) < 0:
            bad(f"eval.{k}", "must be >= 0")


def _validate_jobs(cfg: Config, bad) -> None:
    """Long-job keys: time-based saves, the NaN/inf policy, fp16's minimum scale, collective timeouts."""
    if cfg.train.nonfinite not in ("skip", "stop"):
        bad("train.nonfinite", f"must be skip or stop, got {cfg.train.nonfinite!r}")
    if cfg.train.max_nonfinite < 1:
        bad("train.max_nonfinite", "must be >= 1 (consecutive skipped updates before stopping)")
    if cfg.train.save_every_minutes < 0:
        bad("train.save_every_minutes", "must be >= 0 (0 = no time-based saves)")
    if cfg.engine.fp16_min_loss_scale <= 0:
        bad("engine.fp16_min_loss_scale", "must be > 0")
    if cfg.engine.collective_timeout_minutes <= 0:
        bad("engine.collective_timeout_minutes", "must be > 0")


def _validate_batch_shape(cfg: Config, bad) -> None:
    d = cfg.data
    if d.pad_to_multiple < 1:
        bad("data.pad_to_multiple", f"must be >= 1 (1 = no padding beyond the longest row), got {d.pad_to_multiple}")
    if d.max_rows < 0:
        bad("data.max_rows", f"must be >= 0 (0 = no row cap), got {d.max_rows}")
    if d.max_tokens == "auto":  # resolved at start-up (scaletrain.models.memory.apply_max_tokens), checked there
        return
    if isinstance(d.max_tokens, bool) or not isinstance(d.max_tokens, int):
        bad("data.max_tokens", f"must be auto or an integer, got {d.max_tokens!r}")
    if problem := token_budget_problem(d.max_tokens, d.max_bytes, "data.max_tokens", "data.max_bytes",
                                       d.pad_to_multiple):
        bad("data.max_tokens", problem)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _validate_step(cfg: Config, bad) -> None:
    """The training step's keys: compilation, out-of-memory policy."""
    if cfg.engine.compile not in (True, False, "auto"):
        bad("engine.compile", f"must be true, false or auto, got {cfg.engine.compile!r}")
    if cfg.engine.compile_mode not in COMPILE_MODES:
        bad("engine.compile_mode", f"must be one of {', '.join(COMPILE_MODES)}, got {cfg.engine.compile_mode!r}")
    if cfg.train.on_oom not in ("stop", "skip"):
        bad("train.on_oom", f"must be stop or skip, got {cfg.train.on_oom!r}")


def validate(cfg: Config) -> None:
    def bad(key, msg):
        raise ScaletrainError(f"config key '{key}': {msg}")

    if cfg.engine.backend not in ("deepspeed", "accelerate"):
        bad("engine.backend", f"must be deepspeed or accelerate, got {cfg.engine.backend!r}")
    if cfg.engine.precision not in ("auto", "fp32", "bf16", "fp16"):
        bad("engine.precision", f"must be auto, fp32, bf16 or fp16, got {cfg.engine.precision!r}")
    if cfg.engine.grad_accum < 1:
        bad("engine.grad_accum", "must be >= 1")
    if cfg.engine.accelerate not in ("ddp", "deepspeed"):
        bad("engine.accelerate", f"must be ddp or deepspeed, got {cfg.engine.accelerate!r}")
    if cfg.engine.threads < 0:
        bad("engine.threads", "must be >= 0 (0 = cores / local ranks)")
    _validate_step(cfg, bad)
    cfg.model.validate()  # the model rules (scaletrain.models.config)
    cfg.moe.validate(cfg.model)
    if cfg.data.max_bytes + 2 > cfg.model.max_positions:
        bad("data.max_bytes", f"{cfg.data.max_bytes} + 2 (tag, eos) exceeds model.max_positions {cfg.model.max_positions}")
    _validate_batch_shape(cfg, bad)
    nw = cfg.data.num_workers
    if nw != "auto" and (isinstance(nw, bool) or not isinstance(nw, int) or nw < 0):
        bad("data.num_workers", f"must be auto or an integer >= 0, got {nw!r}")
    if cfg.data.temperature <= 0:
        bad("data.temperature", "must be > 0 (1 = proportional sampling)")
    if cfg.data.buffer_size < 1:
        bad("data.buffer_size", "must be >= 1")
    if cfg.data.tokenizer not in ("byte", "spm"):
        bad("data.tokenizer", f"must be byte or spm, got {cfg.data.tokenizer!r}")
    if cfg.data.on_corrupt not in ("stop", "skip"):
        bad("data.on_corrupt", f"must be stop or skip, got {cfg.data.on_corrupt!r}")
    if cfg.data.fetch_retries < 0:
        bad("data.fetch_retries", "must be >= 0")
    for k in ("fetch_max_seconds", "fetch_timeout", "cache_max_gb"):
        if getattr(cfg.data, k) <= 0:
            bad(f"data.{k}", "must be > 0")
    if cfg.data.spm_vocab_size < 0:
        bad("data.spm_vocab_size", "must be >= 0 (0 = the shard directory's only SentencePiece model)")
    if cfg.data.spm_vocab_size and cfg.data.tokenizer != "spm":
        bad("data.spm_vocab_size", f"is set ({cfg.data.spm_vocab_size}) but data.tokenizer is "
            f"{cfg.data.tokenizer!r}; set data.tokenizer=spm")
    _validate_numbers(cfg, bad)
    if not 0 <= cfg.optim.label_smoothing < 1:
        bad("optim.label_smoothing", "must be in [0, 1)")
    if cfg.train.max_steps < 1:
        bad("train.max_steps", "must be >= 1")
    if cfg.train.on_corrupt_checkpoint not in ("fallback", "stop"):
        bad("train.on_corrupt_checkpoint", f"must be fallback or stop, got {cfg.train.on_corrupt_checkpoint!r}")
    if cfg.train.on_save_error not in ("stop", "continue"):
        bad("train.on_save_error", f"must be stop or continue, got {cfg.train.on_save_error!r}")
    _validate_jobs(cfg, bad)
    if cfg.train.best_mode not in ("max", "min"):
        bad("train.best_mode", f"must be max or min, got {cfg.train.best_mode!r}")
    for k in ("bleu_every", "patience", "valid_every", "save_every", "keep_last", "max_minutes",
              "preempt_grace_seconds"):
        if getattr(cfg.train, k) < 0:
            bad(f"train.{k}", "must be >= 0")
    for k in ("log_every", "valid_max_batches"):
        if getattr(cfg.train, k) < 1:
            bad(f"train.{k}", "must be >= 1")
    if cfg.train.best_min_delta < 0:
        bad("train.best_min_delta", "must be >= 0")
    if cfg.train.patience and not cfg.train.best_metric:
        bad("train.patience", "early stopping needs train.best_metric (e.g. valid/nll with best_mode=min)")
    if cfg.eval.beam < 1:
        bad("eval.beam", "must be >= 1")
    if cfg.tracking.peak_tflops < 0:
        bad("tracking.peak_tflops", "must be >= 0 (0 = the GPU table, or the measured GEMM peak on CPU)")
    if cfg.tracking.system_metrics_interval <= 0:
        bad("tracking.system_metrics_interval", "must be > 0 seconds")


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)
