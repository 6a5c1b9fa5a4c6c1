"""What scaletrain imports is what pyproject.toml declares: every third-party module imported anywhere in
scaletrain/ (imports inside functions and ``try`` blocks included) belongs to a distribution named in
``[project] dependencies`` or in an optional extra other than ``dev``; and every runtime dependency is
imported, unless it is listed below with the reason it is needed anyway."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from helpers import ROOT

# import name -> distribution, where they differ (otherwise the distribution is the import name)
DISTRIBUTION = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "google": "protobuf",
                "cv2": "opencv-python", "attr": "attrs", "dateutil": "python-dateutil"}
# declared runtime dependencies scaletrain does not import, and why
NOT_IMPORTED = {
    "django": "the bundled corpus: scaletrain.prepare.gettext reads its .mo catalogs as files (importlib find_spec)",
    "webdataset": "our shards are WebDataset tars; users read them with webdataset.WebDataset and "
                  "scaletrain.data.decode_webdataset_sample (tests/unit/test_data_webdataset.py)",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def imported_modules(package: Path) -> dict[str, set[str]]:
    """Top-level third-party module -> the files of ``package`` importing it (absolute imports only; the
    standard library and the package itself left out)."""
    out: dict[str, set[str]] = {}
    for f in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("__future__", package.name):
                    out.setdefault(top, set()).add(str(f.relative_to(package.parent)))
    return out


def declared() -> tuple[set[str], set[str]]:
    """(runtime dependencies, those of the optional extras other than dev), normalised names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {_requirement_name(r) for name, reqs in project.get("optional-dependencies", {}).items()
              if name != "dev" for r in reqs}
    return {_requirement_name(r) for r in project["dependencies"]}, extras


def test_every_third_party_import_is_declared():
    runtime, extras = declared()
    imports = imported_modules(ROOT / "scaletrain")
    assert "torch" in imports and "numpy" in imports  # the scan sees imports
    undeclared = {mod: sorted(files) for mod, files in imports.items()
                  if _norm(DISTRIBUTION.get(mod, mod)) not in runtime | extras}
    assert not undeclared, f"imported by scaletrain/ but not declared in pyproject.toml: {undeclared}"


def test_every_runtime_dependency_is_imported_or_explained():
    runtime, _ = declared()
    used = {_norm(DISTRIBUTION.get(mod, mod)) for mod in imported_modules(ROOT / "scaletrain")}
    unused = runtime - used - {_norm(n) for n in NOT_IMPORTED}
    assert not unused, f"declared in pyproject.toml but never imported by scaletrain/: {sorted(unused)}"
    assert {_norm(n) for n in NOT_IMPORTED} <= runtime - used  # no stale reasons


def test_the_scan_finds_imports_inside_functions_and_try_blocks(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os\nfrom . import x\ntry:\n    import yaml\nexcept ImportError:\n    pass\n"
                              "def f():\n    from psutil import Process\n    import pkg.other\n")
    assert imported_modules(pkg) == {"yaml": {"pkg/m.py"}, "psutil": {"pkg/m.py"}}
