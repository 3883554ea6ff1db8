"""Typed, frozen settings with layered overrides.

Every settings class is a frozen dataclass.  :func:`load_settings` builds one from,
in increasing precedence: the class defaults, a YAML/JSON file section, environment
variables ``ADCLOUD_<SECTION>_<FIELD>`` and explicit keyword overrides.  The
effective settings are written next to every output with :func:`write_settings`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from adcloud.errors import ConfigError

__all__ = [
    "STORE_SCHEMES",
    "load_settings",
    "names",
    "settings_dict",
    "warn_unknown_variables",
    "write_settings",
]

T = TypeVar("T")

#: URI schemes of adcloud's own stores (:mod:`adcloud.store`), which are no fsspec
#: filesystems: fsspec's own ``local://`` silently means a plain local path, not the tiered
#: store, and it does not know ``alluxio://``.  BinPipe reads and writes them through
#: :class:`adcloud.store.filesystem.StoreFileSystem`; other places written or read
#: through fsspec refuse them.
STORE_SCHEMES = ("local://", "alluxio://")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


log = logging.getLogger(__name__)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert ``value`` (often a string from the environment) to ``typ``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(value, args[0], where)
    if value is None and typ is not float:
        raise ConfigError(
            f"{where}: no value (an empty entry in the file?); give one, or leave the key out "
            "for its default"
        )
    if origin is tuple:
        if isinstance(value, str):
            # "a.bag," or "": blank entries name nothing (a blank path would be the working
            # directory)
            items = [v for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ConfigError(
                f"{where}: expected a list (or one comma-separated string), got "
                f"{type(value).__name__} {value!r}"
            )
        (inner, *_rest) = typing.get_args(typ) or (str,)
        return tuple(_coerce(v.strip() if isinstance(v, str) else v, inner, where) for v in items)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(value)
        if typ is float and value is None:
            return float("nan")  # unset, as settings_dict writes it
        if typ in (int, float) and isinstance(value, bool):
            raise ValueError(value)  # YAML's true/false is no number: int(True) would be 1
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)  # 5.7 steps: never truncate silently
        if typ is str and isinstance(value, (list, tuple, dict)):
            raise ConfigError(
                f"{where}: expected one value, got a {type(value).__name__} {value!r}"
            )
        if typ in (int, float, str):
            return typ(value)
        if typ is Path:
            return Path(value).expanduser()
    except (TypeError, ValueError) as err:
        msg = f"{where}: cannot read {value!r} as {getattr(typ, '__name__', typ)}"
        raise ConfigError(msg) from err
    return value


#: The misspelt variables warned about so far: a process loads a section more than once.
_WARNED: set[str] = set()


def _warn_near_misses(
    given: Sequence[str], known: Sequence[str], say: Callable[[str], str]
) -> None:
    """Log a warning for each name in ``given`` that is not in ``known`` but nearly is (a
    misspelt ``ADCLOUD_HDMAP_RESOLUTOIN`` would otherwise be ignored without a word);
    ``say`` spells a name as the user wrote it.  Names of other sections
    (``ADCLOUD_HDMAP_GRID_...`` beside ``hdmap``) are not near: they differ in length."""
    for name in given:
        if name in known:
            continue
        near = [
            k
            for k in difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if abs(len(k) - len(name)) <= 2
        ]
        if near and say(name) not in _WARNED:
            _WARNED.add(say(name))
            log.warning("%s is not a setting: did you mean %s?", say(name), say(near[0]))


def warn_unknown_variables(
    sections: Mapping[str, type], environ: Mapping[str, str] | None = None
) -> None:
    """Warn about each ``ADCLOUD_`` variable that names no field of ``sections`` (section
    name -> settings class) but nearly names one, across the sections: a typo in the
    section part of a name (``ADCLOUD_HDMAP_LANLET_CONNECT_GAP_M``) is beyond what one
    section's check sees.  For commands that read several sections sharing a prefix."""
    environ = os.environ if environ is None else environ
    known = [
        f"ADCLOUD_{section.upper()}_{f.name.upper()}"
        for section, cls in sections.items()
        for f in dataclasses.fields(cls)
    ]
    prefixes = tuple(f"ADCLOUD_{section.upper()}_" for section in sections)
    given = [name for name in environ if name.startswith(prefixes)]
    _warn_near_misses(given, known, lambda name: name)


def _check_missing_section(path: Path, section: str, loaded: dict[Any, Any], cls: type) -> None:
    """A file without ``section`` is fine (it may hold other sections only), unless what it
    holds was meant for it: a misspelt section name whose keys are all this section's
    fields (``hdmap_labels`` beside ``hdmap_lanelet`` is a real section of its own), or the
    fields written at the top level (whose values, unlike a section's, are not mappings)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    meant = [str(k) for k, v in loaded.items() if isinstance(v, dict) and v and set(v) <= fields]
    near = difflib.get_close_matches(section, meant, n=1, cutoff=0.8)
    if near:
        raise ConfigError(
            f"{path}: no {section!r} section, but a {near[0]!r} one: did you mean {section}?"
        )
    flat = sorted(k for k, v in loaded.items() if k in fields and not isinstance(v, dict))
    if flat:
        raise ConfigError(
            f"{path}: {', '.join(flat)} at the top level are {section} settings: put them "
            f"under a '{section}:' section"
        )


def load_settings(
    cls: type[T],
    section: str,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> T:
    """Build settings ``cls`` from defaults, a file section, ``ADCLOUD_`` env vars and overrides.

    ``section`` names both the file section and the environment prefix: field ``master``
    of section ``spark`` is overridden by ``ADCLOUD_SPARK_MASTER``.  ``defaults`` replace
    the class defaults (the file and the environment still override them); ``overrides``
    win over everything.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(defaults or {})
    sources: dict[str, str] = {}  # setting -> the variable or file that gave its value
    if file is not None:
        path = Path(file)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            # UnicodeDecodeError: not a text file at all (a bag given as --config)
            raise ConfigError(f"{path}: cannot read settings file: {err}") from err
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the file must be a mapping of sections ({section}: ...), not "
                f"{type(loaded).__name__}"
            )
        if section not in loaded:
            _check_missing_section(path, section, loaded, cls)
        part = loaded.get(section)
        if part is None:  # "spark:" with nothing under it, or no such section
            part = {}
        if not isinstance(part, dict):  # "spark: []" and "spark: 0" too: not an empty mapping
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
        odd = [key for key in part if not isinstance(key, str)]
        if odd:  # YAML reads "1: x" as the number 1: no field is named by one
            raise ConfigError(
                f"{path}: {section}.{odd[0]!r} is not a setting name; known: "
                f"{', '.join(sorted(f.name for f in dataclasses.fields(cls)))}"
            )
        values.update(part)
        sources.update(dict.fromkeys(part, str(path)))
    prefix = f"ADCLOUD_{section.upper()}_"
    for field in dataclasses.fields(cls):
        env_name = prefix + field.name.upper()
        if env_name in environ:
            values[field.name] = environ[env_name]
            sources[field.name] = env_name
    fields = [f.name.upper() for f in dataclasses.fields(cls)]
    spare = [n.removeprefix(prefix) for n in environ if n.startswith(prefix)]
    _warn_near_misses(spare, fields, lambda name: prefix + name)
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    for name in given:
        sources.pop(name, None)  # the caller's own value: it knows where it came from
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown {section} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return _build(cls, section, values, hints, dataclasses.fields(cls), defaults)
    except ConfigError as err:
        _name_sources(err, section, sources)
        raise


def _name_sources(err: ConfigError, section: str, sources: Mapping[str, str]) -> None:
    """Make ``err`` say where the value of each setting it names came from (the variable or
    the file), unless it says so already: "hdmap.resolution: cannot read 'abc'" alone
    leaves the user to find which of the environment, a settings file or an
    ``EnvironmentFile`` of a service gave it."""
    text = str(err)
    named = [
        source
        for name, source in sources.items()
        if re.search(rf"(?<![\w.]){re.escape(section)}\.{re.escape(name)}(?!\w)", text)
        and source not in text
    ]
    if named:
        err.args = (f"{text} (from {', '.join(dict.fromkeys(named))})", *err.args[1:])


def _build(
    cls: type[T],
    section: str,
    values: Mapping[str, Any],
    hints: Mapping[str, Any],
    fields: Sequence[dataclasses.Field[Any]],
    defaults: Mapping[str, Any] | None,
) -> T:
    """``cls`` (whose ``fields`` they are) of the layered ``values``, coerced to its field
    types and checked."""
    coerced = {
        name: _coerce(value, hints[name], f"{section}.{name}") for name, value in values.items()
    }
    settings = cls(**coerced)  # its own checks first: they say what range a value must be in
    for field in fields:
        value = coerced.get(field.name)
        if isinstance(value, float) and math.isnan(value) and not _unset_allowed(field, defaults):
            # NaN (or null, how settings_dict writes it) stands for "unset" only where that
            # is the default: elsewhere every comparison with it is false, and a threshold
            # of NaN would switch its check off without a word
            given = values[field.name]
            what = "no value (an empty entry in the file?)" if given is None else f"{given!r}"
            raise ConfigError(
                f"{section}.{field.name}: {what} is not a number; give one, or leave the "
                "key out for its default"
            )
    return settings


def _unset_allowed(field: dataclasses.Field[Any], defaults: Mapping[str, Any] | None) -> bool:
    """Whether ``field`` may be NaN: its default (the class's or the caller's) is."""
    default = (defaults or {}).get(field.name, field.default)
    return isinstance(default, float) and math.isnan(default)


def names(value: Any) -> tuple[str, ...]:
    """A settings field that holds several names (bags, topics) as a tuple of strings: one
    string or path is one name, not its characters (``bags="drive.bag"``)."""
    if isinstance(value, (str, os.PathLike)):
        return (os.fspath(value),)
    return tuple(os.fspath(v) if isinstance(v, os.PathLike) else v for v in value)


def settings_dict(settings: object) -> dict[str, Any]:
    """Plain, JSON-serialisable form of a settings dataclass (paths as strings; a float
    left unset, NaN, as ``None``: JSON has no NaN, and strict readers refuse one)."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        raise TypeError(f"{settings!r} is not a dataclass instance")
    out: dict[str, Any] = {}
    for key, value in dataclasses.asdict(settings).items():
        if isinstance(value, Path):
            out[key] = str(value)
        elif isinstance(value, tuple):
            out[key] = list(value)
        elif isinstance(value, float) and math.isnan(value):
            out[key] = None
        else:
            out[key] = value
    return out


def write_settings(path: str | Path, **sections: object) -> None:
    """Write the effective settings, one section per keyword, as JSON next to an output."""
    data = {name: settings_dict(obj) for name, obj in sections.items()}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
