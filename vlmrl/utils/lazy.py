"""Lazy package exports: a package `__init__` names what its submodules export and imports a submodule only when one
of its names is first used. The run config imports the packages' config modules, which runs their `__init__`: an
eager `__init__` would import torch (and engines' dependencies) for a config check.

    _LAZY = {"RLDataset": "dataset", "TASKS": "synthetic"}
    __getattr__ = lazy_exports(__name__, _LAZY)
    __all__ = sorted(_LAZY)
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) giving `names[name]`'s attribute `name` of `package`, imported on first use.

    >>> getattr_ = lazy_exports("vlmrl.utils", {"chunks": "sequences"})
    >>> getattr_("chunks")([1, 2, 3], 2)
    [[1, 2], [3]]
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
