"""scaletrain: distributed training of byte-level multilingual NMT models.

``lazy_exports``: how a package names its public API without importing its modules up front (PEP 562), so
that importing one light module of a package (or building the CLI parser) does not load the heavy ones."""
from __future__ import annotations

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __all__)`` for ``package``'s ``__init__``: each name of ``exports`` (name -> module
    within the package) is imported from its module on first use."""
    import importlib

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__, sorted(exports)
