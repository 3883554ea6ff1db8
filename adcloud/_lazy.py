"""Package namespaces that import their submodules on first use (PEP 562).

A pipe node started once per scenario imports ``adcloud.binpipe.codec`` and its own code;
if the package ``__init__`` imported every submodule (bag readers, fsspec, Spark glue,
plotting), each node start would pay for them -- a quarter of a second per scenario.  The
packages therefore name their public API here and load a submodule only when one of its
names is first looked up; ``from adcloud.sim import run_replay`` works as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``exports`` (submodule name ->
    the names it provides; the package's ``__all__`` lists them again for type checkers)."""
    where = {name: f"{package}.{module}" for module, names in exports.items() for name in names}
    namespace = vars(importlib.import_module(package))

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module-level hook PEP 562 names
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this hook
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
