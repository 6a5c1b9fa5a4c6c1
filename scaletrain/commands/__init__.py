"""Subcommands beyond the core ones.

Each module here defines ``register(subparsers)`` that adds its parser(s) and sets
``func=callable(args) -> int`` as the parser default. `scaletrain.cli` discovers them, so a
feature adds a command without editing the CLI module.
"""
from __future__ import annotations

import importlib
import pkgutil


def register_all(subparsers) -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{mod.name}")
        reg = getattr(module, "register", None)
        if reg is not None:
            reg(subparsers)
    from scaletrain.eval.translate import register as register_translate  # moved out of this package

    register_translate(subparsers)
