"""The shape of the code base itself: short functions, no hidden globals, self-contained docs.

The rules: ``Trainer.fit`` and every other function stay readable (about
80 lines at most), nothing hands state to builders through context variables, nothing the project
ships points at files outside the repository, and README's layout table names paths that exist.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "scaletrain"
MAX_FUNCTION_LINES = 80


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_function_is_longer_than_the_limit():
    long = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions longer than %d lines:\n%s" % (MAX_FUNCTION_LINES, "\n".join(long))


def test_no_context_variables_or_process_global_modes():
    found = [f"{p.relative_to(ROOT)}" for p in _sources() if "ContextVar" in p.read_text()]
    assert not found, f"ContextVar used in {found}: pass what builders need as arguments"


def test_nothing_points_outside_the_repository():
    pattern = re.compile(r"\.\./shared|shared/reference|shared/papers|shared/DESIGN")
    files = [*_sources(), *PKG.rglob("*.yaml"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "benchmarks").rglob("*.py"), ROOT / "launch.sh"]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if pattern.search(line)]
    assert not bad, f"references to files outside the repository: {bad}"


_TEST_PATH = re.compile(r"\btests/[\w/.-]+?\.py\b")


def test_every_test_file_cited_in_the_package_exists():
    """A docstring or comment that names a test as the evidence for a claim names one that exists."""
    files = [p for p in PKG.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".md", ".txt")
             and "__pycache__" not in p.parts]
    bad = [f"{p.relative_to(ROOT)}:{i}: {m}" for p in files
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           for m in _TEST_PATH.findall(line) if not (ROOT / m).is_file()]
    assert not bad, f"test files cited that do not exist: {bad}"


def test_every_models_md_citation_names_the_projects_own_doc():
    assert (ROOT / "docs" / "MODELS.md").is_file()
    bad = []
    for p in [*_sources(), *PKG.rglob("*.yaml"), *(ROOT / "tests").rglob("*.py")]:
        if p.resolve() == Path(__file__).resolve():
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if "MODELS.md" in line and "docs/MODELS.md" not in line:
                bad.append(f"{p.relative_to(ROOT)}:{i}")
    assert not bad, f"MODELS.md cited without its path docs/MODELS.md: {bad}"


def test_readme_layout_table_matches_the_tree():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\| `([^`]+)`", section, flags=re.M)
    assert paths, "README has no layout table"
    named = set()
    for cell in re.findall(r"^\| (.+?) \|", section, flags=re.M):
        for p in re.findall(r"`([^`]+)`", cell):
            named.add(p)
            if "*" in p:
                assert list(ROOT.glob(p)), f"README layout: {p} matches nothing"
            elif p not in ("shards/",):  # generated, never committed
                assert (ROOT / p).exists(), f"README layout names {p}, which does not exist"
    # every top-level part of the package is in the table
    for child in sorted(PKG.iterdir()):
        if child.name.startswith("__") or child.suffix not in ("", ".py") or child.name == "recipes":
            continue
        rel = f"scaletrain/{child.name}" + ("/" if child.is_dir() else "")
        assert any(n == rel or n.startswith(rel) for n in named), f"README layout table does not mention {rel}"


def test_only_the_engine_package_imports_deepspeed():
    """DeepSpeed is the engine's; the checkpoint package reads DeepSpeed's files in one module of its own."""
    outside = []
    for p in _sources():
        if (PKG / "engine") in p.parents or p == PKG / "checkpoint" / "deepspeed_files.py":
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "deepspeed" or n.startswith("deepspeed.") for n in names):
                outside.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not outside, f"DeepSpeed imported outside scaletrain/engine/ (and checkpoint/deepspeed_files.py): {outside}"


def _unit(dotted: str) -> str:
    """The package (or top-level module) of ``scaletrain`` a dotted module name belongs to."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_private_name_is_imported_from_another_package():
    """A name shared between packages is public (with a docstring); ``_private`` names stay in their package."""
    found = []
    for p in _sources():
        rel = p.relative_to(ROOT).with_suffix("")
        importer = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        base = importer if rel.name == "__init__" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = node.module or ""
            if node.level:  # relative: resolve against the importing package
                up = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join([*up, *([source] if source else [])])
            if source.split(".")[0] != "scaletrain" or _unit(source) == _unit(importer):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {source}")
    assert not found, "private names imported across packages (make them public or move the code):\n" + "\n".join(found)


PROCESS_GROUP_MAKERS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_process_group",
                        "init_distributed", "DeviceMesh", "init_device_mesh"}


def _is_moe_section(node: ast.AST) -> bool:
    """``moe`` or ``<anything>.moe``: the run config's MoE section."""
    return (isinstance(node, ast.Name) and node.id == "moe") or (isinstance(node, ast.Attribute) and node.attr == "moe")


def _config_ep_size_reads(tree: ast.AST) -> list[int]:
    """Lines reading the configured expert-parallel size: ``moe.ep_size``, ``cfg.moe.ep_size``,
    ``getattr(cfg.moe, "ep_size", ...)`` (a parallel context's ``ctx.ep_size`` is not the config's)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "ep_size" and _is_moe_section(node.value):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "ep_size"
              and _is_moe_section(node.args[0])):
            lines.append(node.lineno)
    return lines


def test_only_engine_and_parallel_make_process_groups_or_read_the_ep_size():
    """One parallel object: the engine builds it (``scaletrain.parallel``) from ``moe.ep_size``, read in
    exactly one place, and hands it down; no other module makes process groups or reads the size."""
    outside, reads = [], []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        home = (PKG / "engine") in p.parents or (PKG / "parallel") in p.parents
        reads += [f"{p.relative_to(ROOT)}:{n}" for n in _config_ep_size_reads(tree)]
        if home:
            continue
        outside += [f"{p.relative_to(ROOT)}:{n} reads the config's ep_size" for n in _config_ep_size_reads(tree)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in PROCESS_GROUP_MAKERS:
                    outside.append(f"{p.relative_to(ROOT)}:{node.lineno} makes a process group ({name})")
    assert not outside, "outside scaletrain/engine/ and scaletrain/parallel/:\n" + "\n".join(outside)
    assert len(reads) == 1, f"moe.ep_size is read from the config in {len(reads)} places, not one: {reads}"
