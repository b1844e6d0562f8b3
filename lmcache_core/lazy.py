"""Import on first use: dotted paths for plugin objects, lazy package exports.

A plugin registers a factory or a command as ``"package.module:attribute"`` and the
core calls :func:`resolve_ref` when it is needed; a plugin package exposes its public
names with :func:`lazy_exports`, so importing the package (which every entry point
does) imports none of its heavy modules.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Mapping

_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_ref(ref: str) -> str:
    """``ref`` when it reads ``package.module:attribute``; else :class:`ValueError`."""
    if not isinstance(ref, str) or not _REF.match(ref):
        raise ValueError(f"{ref!r} is not a dotted path of the form 'package.module:attribute'")
    return ref


def resolve_ref(ref: str) -> Any:
    """Import ``package.module`` and return its ``attribute`` (dots walk attributes)."""
    module, _, attr = check_ref(ref).partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for public names that live
    in its submodules: ``exports`` maps each name to its module, relative (``".backend"``)
    or absolute. The module is imported when the name is first used::

        __getattr__, __dir__ = lazy_exports(__name__, {"DiskBackend": ".backend"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
