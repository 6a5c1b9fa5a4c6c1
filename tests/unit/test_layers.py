"""The package layers: every import inside ``scaletrain`` (module level or inside a function, absolute or
relative) runs from a higher layer to a strictly lower one, in the order declared here and drawn in
docs/DESIGN.md. A new top-level part of ``scaletrain`` must be given a layer before it can land."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "scaletrain"

# low to high; a part may import only parts of lower layers (and itself)
LAYERS: list[set[str]] = [
    {"errors", "recipes"},  # ScaletrainError; the recipes (YAML files)
    {"__init__", "fileio", "safeload", "console", "threads", "oom"},  # primitives: nothing of scaletrain above
    {"vocab", "parallel", "tracking"},  # byte/subword vocabulary; process groups; MLflow and run records
    {"data"},  # what training reads: shards, sources, batching, the resumable stream
    {"models", "prepare"},  # the papers' models; offline corpus preparation (beside the readers it uses)
    {"config"},  # the typed config (its sections use the models' and data's own checks)
    {"engine"},  # DeepSpeed / Accelerate behind one step API, launch, preflight
    {"checkpoint"},  # the checkpoint directory, loading for inference, averaging
    {"eval", "export"},  # decoding and scoring; HF / CTranslate2 exports
    {"train"},  # the training loop
    {"commands"},  # one module per subcommand
    {"cli"},
    {"__main__"},
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str:
    """``scaletrain.data.stream`` -> ``data``; ``scaletrain`` -> ``__init__``."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def _module_of(path: Path, root: Path = PKG) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    bits = list(rel.parts)
    return ".".join(bits[:-1] if bits[-1] == "__init__" else bits)


def imports(path: Path, root: Path = PKG) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import of a scaletrain module in ``path``; ``from scaletrain
    import x`` names ``scaletrain.x``."""
    mod = _module_of(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "scaletrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "scaletrain":
                continue
            if target == "scaletrain":  # from scaletrain import x: the submodule x or a name of __init__
                out += [(node.lineno, f"scaletrain.{a.name}" if (root / a.name).exists()
                         or (root / f"{a.name}.py").exists() else "scaletrain") for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def layer_violations(root: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = _part(_module_of(path, root))
        if src not in LAYER:
            bad.append(f"{path.relative_to(root.parent)}: '{src}' has no layer in LAYERS")
            continue
        for line, target in imports(path, root):
            dst = _part(target)
            if dst != src and LAYER.get(dst, len(LAYERS)) >= LAYER[src]:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {src} (layer {LAYER[src]}) imports "
                           f"{target} ({dst}, layer {LAYER.get(dst, '?')})")
    return bad


def test_imports_run_from_higher_layers_to_lower_ones():
    assert layer_violations() == []


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.suffix == ".py" else p.name for p in PKG.iterdir()
             if p.suffix == ".py" or (p.is_dir() and any(p.rglob("*.py")))}
    assert parts - set(LAYER) == set()
    assert set(LAYER) - parts == set()  # no stale entry


@pytest.mark.parametrize("stmt", [
    "from scaletrain.train.trainer import Trainer",  # data -> train: upward
    "from ..engine import build_engine",  # relative, upward
    "def f():\n    from scaletrain import cli\n",  # inside a function, from the package
])
def test_the_check_sees_an_upward_import(tmp_path, stmt):
    pkg = tmp_path / "scaletrain"
    for part in ("data", "train", "engine"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("")
    (pkg / "data" / "stream.py").write_text(stmt + "\n")
    found = layer_violations(pkg)
    assert len(found) == 1 and found[0].startswith(f"scaletrain/data/stream.py:{stmt.count(chr(10)) + 1 - stmt.endswith(chr(10))}: data (layer 3) imports"), found


def test_a_downward_import_passes(tmp_path):
    pkg = tmp_path / "scaletrain"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("from scaletrain.errors import ScaletrainError\nfrom . import loop\n")
    (pkg / "train" / "loop.py").write_text("from ..errors import ScaletrainError\n")
    assert layer_violations(pkg) == []
