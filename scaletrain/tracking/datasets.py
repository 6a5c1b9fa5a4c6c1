"""The corpus as an MLflow dataset: what a training run reads and what an evaluation run scores.

A prepared corpus (a shard directory, URL or ``pipe:`` command with its ``manifest.json``) is one
``mlflow.data`` dataset (:class:`CorpusDataset`, a metadata-only dataset: the shards stay where they are):

* **name**: the corpus (the manifest's source name or package, else the shard directory's name);
* **digest**: the first 12 hex digits of the manifest's sha256 (the run's ``corpus.manifest_sha256`` tag
  holds all of it), so the same shards are the same dataset in every run and prepared-again shards differ;
* **source**: the shard directory (``local``), URL (``http``) or command (``code``);
* **schema**: a sentence pair (source and target language, source and target text);
* **profile**: sentence pairs per split, the languages, the directions per split.

A run logs it as an input with the split it read as the context (``mlflow.data.context``): ``train`` for
the training run, the evaluated split (``test``) for an evaluation run. :func:`corpus_dataset` returns the
dataset as plain JSON (what the tracking journal stores); :func:`dataset_input` makes the MLflow entity to
send. Validation metrics linked to a checkpoint's logged model name this dataset too
(:mod:`scaletrain.tracking.models`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["CONTEXT_TAG", "DIGEST_CHARS", "corpus_dataset", "corpus_name", "dataset_input", "local_corpus_dataset"]

CONTEXT_TAG = "mlflow.data.context"  # mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT
DIGEST_CHARS = 12
MANIFEST = "manifest.json"  # scaletrain.data.shards.MANIFEST (the data layer sits above this one)


def corpus_name(manifest: Mapping[str, Any], shards: str) -> str:
    """The corpus's name: the manifest's source name or package, else the shard directory's (or URL's) last part."""
    src = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    name = src.get("name") or src.get("package")
    if name:
        return str(name)
    spec = str(shards)
    if "://" in spec or spec.startswith("pipe:"):
        return spec.rstrip("/").rsplit("/", 1)[-1] or spec
    return Path(spec).resolve().name


def _profile(manifest: Mapping[str, Any]) -> dict:
    splits = manifest.get("splits") or {}
    counts = {k: int(v.get("n_examples", 0)) for k, v in splits.items()}
    return {"num_rows": sum(counts.values()), "splits": counts, "languages": list(manifest.get("languages") or []),
            "directions": {k: len(v.get("directions") or {}) for k, v in splits.items()}}


def _source(shards: str):
    """The MLflow dataset source of a shard spec: an http(s) URL, a ``pipe:`` command, a local directory
    (``local``) or another URL (s3://, gs://, ...) as MLflow resolves it."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.http_dataset_source import HTTPDatasetSource

    spec = str(shards)
    if spec.startswith(("http://", "https://")):
        return HTTPDatasetSource(url=spec)
    if spec.startswith("pipe:"):
        return CodeDatasetSource(tags={"command": spec[len("pipe:"):].strip(), "kind": "pipe"})
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": MLflow registers "local" twice
        warnings.simplefilter("ignore")
        return resolve_dataset_source(spec if "://" in spec else str(Path(spec).resolve()))


def _dataset_class():
    """:class:`CorpusDataset`, defined when first needed (mlflow is imported inside functions only)."""
    global CorpusDataset
    if CorpusDataset is not None:
        return CorpusDataset
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, DataType, Schema

    class _CorpusDataset(MetaDataset):
        """A prepared corpus as a metadata-only ``mlflow.data`` dataset with a profile (pairs per split)."""

        def __init__(self, source, name: str, digest: str, profile: dict):
            schema = Schema([ColSpec(DataType.string, n) for n in ("src_lang", "tgt_lang", "src", "tgt")])
            self._profile = profile
            super().__init__(source=source, name=name, digest=digest, schema=schema)

        @property
        def profile(self) -> dict:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile)}

    CorpusDataset = _CorpusDataset
    return CorpusDataset


CorpusDataset = None  # the mlflow.data dataset class, made by _dataset_class()


def corpus_dataset(manifest: Mapping[str, Any], manifest_bytes: bytes, shards: str | os.PathLike) -> dict:
    """The corpus as an ``mlflow.data`` dataset, as the JSON of its MLflow entity (``name``, ``digest``,
    ``source_type``, ``source``, ``schema``, ``profile``): ``manifest`` is the parsed manifest,
    ``manifest_bytes`` its file's bytes (the digest), ``shards`` where the shards are."""
    digest = hashlib.sha256(manifest_bytes).hexdigest()[:DIGEST_CHARS]
    ds = _dataset_class()(_source(str(shards)), corpus_name(manifest, str(shards)), digest, _profile(manifest))
    return ds.to_dict()


def local_corpus_dataset(shards: str | os.PathLike) -> dict | None:
    """:func:`corpus_dataset` of a local shard directory, None when it has no readable manifest (a URL or a
    command: the caller names the dataset from elsewhere)."""
    spec = str(shards)
    if "://" in spec or spec.startswith("pipe:"):
        return None
    path = Path(spec) / MANIFEST
    try:
        raw = path.read_bytes()
        manifest = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    return corpus_dataset(manifest, raw, spec)


def dataset_input(dataset: Mapping[str, Any], context: str):
    """The MLflow ``DatasetInput`` of a dataset (:func:`corpus_dataset`'s JSON) read as split ``context``."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    entity = Dataset(name=dataset["name"], digest=dataset["digest"], source_type=dataset["source_type"],
                     source=dataset["source"], schema=dataset.get("schema"), profile=dataset.get("profile"))
    return DatasetInput(entity, tags=[InputTag(CONTEXT_TAG, context)])
