"""Evaluators and adapters named by import path (``package.module:attr``).

A Spark task's Python worker starts with the built-in registries only.  A name that is an
import path resolves the same way on the driver and on every executor, as long as the
module is installed on both -- the one form of a user evaluator or adapter that the
command line (``--eval``, ``--adapter``) can name.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from adcloud.sim.errors import SimError

#: ``package.module:attr`` (``attr`` may be dotted: ``Class.factory``).
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the shape of ``package.module:attr``."""
    return IMPORT_PATH.match(name) is not None


def import_object(path: str, what: str) -> Any:
    """The callable that ``path`` (``package.module:attr``) names; ``what`` names its role
    in errors (``"evaluator"``, ``"node adapter"``).  Raises :class:`SimError`."""
    if not is_import_path(path):
        raise SimError(f"{what} {path!r}: expected an import path like package.module:attr")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise SimError(
            f"{what} {path!r}: cannot import {module_name} ({err}); the module must be "
            "importable on the driver and on every executor"
        ) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SimError(f"{what} {path!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise SimError(f"{what} {path!r}: {attr} is a {type(obj).__name__}, not a factory")
    return obj
