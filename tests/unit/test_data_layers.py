"""The layers of the data side: offline preparation (``scaletrain.prepare``) sits above what training reads
(``scaletrain.data``), which sits above the id layout (``scaletrain.vocab``). Imports only run downwards,
those inside functions counted too (the import graph of ``test_import_cycles``)."""
from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT
from test_import_cycles import import_graph


def _imports_from(graph: dict, package: str, forbidden: str) -> list[str]:
    """``module -> imported module`` for every import of ``forbidden`` (or below it) by ``package``."""
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return [f"{m} -> {t}" for m, edges in sorted(graph.items()) if inside(m, package)
            for t in sorted(edges) if inside(t, forbidden)]


def test_training_data_never_imports_preparation():
    graph = import_graph(ROOT, "scaletrain")
    assert "scaletrain.prepare.build" in graph and "scaletrain.data.shards" in graph
    assert not _imports_from(graph, "scaletrain.data", "scaletrain.prepare")


def test_the_vocabulary_imports_nothing_above_it():
    """``scaletrain.vocab`` knows the id layout and its tokenizer model, not shard directories or manifests."""
    graph = import_graph(ROOT, "scaletrain")
    allowed = ("scaletrain.vocab", "scaletrain.errors", "scaletrain.fileio")
    above = [f"{m} -> {t}" for m, edges in sorted(graph.items()) if m.startswith("scaletrain.vocab")
             for t in sorted(edges) if not any(t == a or t.startswith(a + ".") for a in allowed)]
    assert not above


def test_the_cli_parser_does_not_load_the_readers():
    """``scaletrain.prepare.args`` (imported to build every command's parser) loads neither the corpus readers
    beyond its gettext constants nor numpy."""
    script = ("import sys\nimport scaletrain.prepare.args\n"
              "print(sorted(m for m in ('numpy', 'scaletrain.prepare.build', 'scaletrain.data') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr


def test_the_data_package_exports_its_api_lazily():
    """``scaletrain.data`` names its public API (``__all__``), each name the object of its module; importing the
    package and using a torch-free name loads neither torch nor the stream."""
    import importlib

    import scaletrain.data as data

    assert {"ShardStream", "ShardLoader", "plan_batches", "decode_batches", "load_shard_vocab"} <= set(data.__all__)
    for name in data.__all__:
        mod = importlib.import_module(f"scaletrain.data.{data._EXPORTS[name]}")
        assert getattr(data, name) is getattr(mod, name), name
    script = ("import sys\nfrom scaletrain.data import load_manifest, open_source, Example\n"
              "print(sorted(m for m in ('torch', 'scaletrain.data.stream', 'scaletrain.data.loader') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr
