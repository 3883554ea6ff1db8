"""Cutting bags into scenarios: whole bags, fixed windows with warm-up, or a scenario file.

A :class:`Scenario` is one unit of replay work -- one Spark task, one result.  It names a
bag by URL and a time range in nanoseconds of *record time*: messages in
``[feed_start, end)`` are fed to the node, and only outputs and truth in
``[start, end)`` are evaluated, so a node gets ``start - feed_start`` of warm-up (filters
converging, trackers starting) before it is judged.  Scenarios are plain descriptions and
pickle cheaply; the bag is opened on the executor.

Scenario files (JSON, or YAML when PyYAML is installed) list time ranges in seconds after
each bag's first message::

    scenarios:
      - {name: left_turn, bag: drive.bag, start: 0.5, end: 2.5, warmup: 0.5}

A relative ``bag`` is resolved against the scenario file's directory, on the driver: a
scenario names its bag by an absolute path or a URL, since executors run in other working
directories.
"""

from __future__ import annotations

import codecs
import difflib
import json
import math
import os
import posixpath
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import fsspec

from adcloud.binpipe import expand_uris, summarize
from adcloud.binpipe.errors import BinpipeError
from adcloud.sim.errors import SimError

__all__ = ["CutMode", "Scenario", "ScenarioCut", "plan_scenarios", "read_scenario_file"]

_NS = 1_000_000_000
#: The most scenarios one plan may have: each is a Spark task and a replay of its own.
MAX_SCENARIOS = 100_000
#: The longest time (s) a cut or scenario file may name: record times are int64 ns.
_MAX_S = (2**63 - 1) // _NS


class CutMode(StrEnum):
    """How bags are cut into scenarios."""

    #: One scenario per bag, all of it.
    BAG = "bag"
    #: Consecutive windows of ``window_s``, each fed ``warmup_s`` of the window before it;
    #: a tail shorter than half a window joins the last full window (a window of a few
    #: milliseconds has no messages to judge a node on).
    WINDOW = "window"
    #: The time ranges listed in a scenario file.
    FILE = "file"


@dataclass(frozen=True)
class Scenario:
    """One replay unit: bag URL and record-time range (ns since the Unix epoch).

    Invariant: ``feed_start <= start <= end``; messages in ``[feed_start, end)`` are
    replayed, ``[start, end)`` is evaluated.
    """

    name: str
    uri: str
    start: int
    end: int
    feed_start: int
    storage_options: tuple[tuple[str, object], ...] = ()

    @property
    def seconds(self) -> float:
        """Length of the evaluated range in seconds."""
        return (self.end - self.start) / _NS


@dataclass(frozen=True)
class ScenarioCut:
    """How to cut bags into scenarios (see :class:`CutMode`); times in seconds."""

    mode: CutMode = CutMode.BAG
    window_s: float = 10.0
    warmup_s: float = 0.0
    file: str | None = None

    def validate(self) -> ScenarioCut:
        """Return ``self`` if usable, else raise :class:`SimError` naming the setting."""
        if self.mode is CutMode.WINDOW and not self.window_s > 0:
            raise SimError(f"window_s must be > 0, not {self.window_s}")
        # windows are whole nanoseconds: one that rounds to 0 ns would never advance
        if self.mode is CutMode.WINDOW and not 1 / _NS <= self.window_s <= _MAX_S:
            raise SimError(
                f"window_s must be at least 1 ns (1e-9) and at most {_MAX_S} s, not {self.window_s}"
            )
        if not 0 <= self.warmup_s <= _MAX_S:
            raise SimError(f"warmup_s must be >= 0 and at most {_MAX_S} s, not {self.warmup_s}")
        if self.mode is CutMode.FILE and not self.file:
            raise SimError("cut mode 'file' needs a scenario file")
        return self


def _stem(uri: str) -> str:
    base = posixpath.basename(uri.rstrip("/")) or "bag"
    return re.sub(r"\.(bag|mcap|db3)$", "", base)


def _bag_names(uris: Sequence[str]) -> list[str]:
    """Unique scenario base names: the bag's stem, qualified with as many parent folders
    as it takes when stems collide (``a/drive``, ``b/drive``); ``~2``, ``~3`` ... for the
    repeats of a URL given more than once."""
    folders = [
        [p for p in re.sub(r"^[A-Za-z][\w+.-]*://", "", uri).split("/") if p][:-1] for uri in uris
    ]
    depth = [0] * len(uris)

    def name(i: int) -> str:
        parents = folders[i][len(folders[i]) - depth[i] :] if depth[i] else []
        return "/".join([*parents, _stem(uris[i])])

    while True:
        names = [name(i) for i in range(len(uris))]
        counts = Counter(names)
        deeper = [i for i, n in enumerate(names) if counts[n] > 1 and depth[i] < len(folders[i])]
        if not deeper:
            break
        for i in deeper:
            depth[i] += 1
    seen: Counter[str] = Counter()
    out = []
    for n in names:
        seen[n] += 1
        out.append(n if seen[n] == 1 else f"{n}~{seen[n]}")
    return out


def _window_starts(first: int, stop: int, window: int) -> list[int]:
    """Window starts over ``[first, stop)``; a tail shorter than half a window is merged
    into the window before it."""
    starts = list(range(first, stop, window))
    if len(starts) > 1 and 2 * (stop - starts[-1]) < window:
        starts.pop()
    return starts


def _bag_range(uri: str, storage_options: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """``[first, last + 1)`` record time of a bag, or None for a bag without messages."""
    try:
        summary = summarize(uri, storage_options=storage_options)
    except BinpipeError as err:
        raise SimError(f"cannot read the index of {uri}: {err}") from err
    if not summary.indexed:
        # no index tells its messages or times (a count of 0 then means "unknown", not
        # "empty"): replaying it as an empty bag would fail every scenario silently
        raise SimError(
            f"{uri}: the bag has no index to plan scenarios from (a recording cut off, or an "
            "MCAP without summary); write an indexed copy (rosbag reindex, `mcap recover`, "
            "or adcloud.binpipe.reindex.reindex_bag for ROS 1) and replay that"
        )
    if not summary.message_count:
        return None
    return summary.start, summary.end  # the summary's end is the last record time + 1 ns


def plan_scenarios(
    bags: str | Sequence[str],
    cut: ScenarioCut | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Scenario]:
    """Cut ``bags`` (URLs, globs, directories) into scenarios, reading only bag indexes.

    Scenarios are named for the bag's file name without extension (``drive``), with
    ``#0000``, ``#0001`` ... per window; bags with the same file name in different folders
    are told apart by their folders (``a/drive``, ``b/drive``).  With windows, a tail
    shorter than half a window is merged into the last full window.  A bag without
    messages still gives one (empty) scenario, so that it shows up as a failed scenario
    in the report rather than disappearing.
    """
    cut = (cut or ScenarioCut()).validate()
    options = tuple(sorted((storage_options or {}).items()))
    if cut.mode is CutMode.FILE:
        assert cut.file is not None
        return read_scenario_file(cut.file, storage_options=storage_options)
    try:
        uris = expand_uris(bags, storage_options)
    except BinpipeError as err:
        raise SimError(str(err)) from err
    out: list[Scenario] = []
    for uri, stem in zip(uris, _bag_names(uris), strict=True):
        span = _bag_range(uri, storage_options)
        if span is None:
            out.append(Scenario(stem, uri, 0, 0, 0, options))
            continue
        first, stop = span
        if cut.mode is CutMode.BAG:
            out.append(Scenario(stem, uri, first, stop, first, options))
            continue
        window = round(cut.window_s * _NS)
        warmup = round(cut.warmup_s * _NS)
        if (stop - first) // window + len(out) > MAX_SCENARIOS:  # before listing them all
            raise SimError(
                f"{cut.window_s:g} s windows cut {uri} ({(stop - first) / _NS:.1f} s) into "
                f"{(stop - first) // window:,} scenarios, over the limit of {MAX_SCENARIOS:,} "
                "(a Spark task each): choose longer windows"
            )
        starts = _window_starts(first, stop, window)
        for k, (t, end) in enumerate(zip(starts, [*starts[1:], stop], strict=True)):
            out.append(Scenario(f"{stem}#{k:04d}", uri, t, end, max(first, t - warmup), options))
    return out


def _load_listing(text: str, url: str) -> Any:
    if url.endswith((".yaml", ".yml")):
        try:
            import yaml  # noqa: PLC0415 - optional, only for YAML scenario files
        except ImportError as err:
            raise SimError(f"{url}: YAML scenario files need PyYAML: pip install pyyaml") from err
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(err, "problem", None) or str(err)
            raise SimError(f"{url}: not valid YAML: {where}{problem}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SimError(f"{url}: not valid JSON: {err}") from err


#: The keys of one scenario in a scenario file.
_KEYS = ("name", "bag", "start", "end", "warmup")


def _check_keys(item: Mapping[str, Any], url: str, index: int) -> None:
    """A misspelt key (``strat``) would judge another time range than meant: refuse it."""
    unknown = [str(key) for key in item if key not in _KEYS]
    if unknown:
        guess = difflib.get_close_matches(unknown[0], _KEYS, n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        raise SimError(
            f"{url}: scenario {item.get('name') or index!r}: unknown key {unknown[0]!r}{hint}; "
            f"the keys are {', '.join(_KEYS)}"
        )


def _seconds(item: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """``item[key]`` as a finite number of seconds (``default`` when absent)."""
    value = item.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SimError(f"{where}: {key} must be a finite number of seconds, not {value!r}")
    if abs(value) > _MAX_S:  # record times are int64 ns
        raise SimError(f"{where}: {key} must be at most {_MAX_S} s, not {value!r}")
    return float(value)


def _absolute(url: str) -> str:
    """``url`` with a local path made absolute as this process resolves it (URLs unchanged)."""
    # abspath, not resolve(): ".." is folded, symlinks (a shared mount) are kept
    return url if "://" in url else os.path.abspath(url)  # noqa: PTH100


def _bag_url(bag: str, listing: str) -> str:
    """The absolute URL of ``bag`` as scenario file ``listing`` (absolute) names it: a
    relative one lies in the listing's directory."""
    if "://" in bag or bag.startswith("/"):
        return _absolute(bag)
    protocol, sep, path = listing.rpartition("://")
    where = posixpath.normpath(posixpath.join(posixpath.dirname(path), bag))
    return f"{protocol}{sep}{where}"


def read_scenario_file(
    url: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[Scenario]:
    """Scenarios listed in a JSON/YAML file (see the module docstring for the layout).

    Each scenario names its bag by an absolute path or URL: a relative ``bag`` is taken
    in the file's directory, and a relative ``url`` in this process's working directory.
    """
    try:
        with fsspec.open(url, "rb", **(storage_options or {})) as src:
            raw: bytes = src.read()
    except FileNotFoundError as err:
        raise SimError(f"scenario file {url} does not exist") from err
    except OSError as err:  # a directory, no permission, a store that fails
        raise SimError(f"cannot read scenario file {url}: {err}") from err
    body = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows editors) is no JSON
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        at = err.start + len(raw) - len(body)
        raise SimError(
            f"{url}: not UTF-8 text (byte {at} is {raw[at]:#04x}): a scenario file is JSON or YAML"
        ) from err
    data = _load_listing(text, url)
    items = data.get("scenarios") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise SimError(f"{url}: expected a non-empty list under 'scenarios'")
    listing = _absolute(url)
    options = tuple(sorted((storage_options or {}).items()))
    spans: dict[str, tuple[int, int] | None] = {}
    out: list[Scenario] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "bag" not in item:
            raise SimError(f"{url}: scenario {i} must be a mapping with at least 'bag'")
        _check_keys(item, url, i)
        given = item.get("name")
        if given is not None and (isinstance(given, bool) or not isinstance(given, str | int)):
            # a list or mapping would become its Python repr in every report
            raise SimError(f"{url}: scenario {i}: name must be text, not {given!r}")
        label = f"{url}: scenario {given or i!r}"
        if not isinstance(item["bag"], str) or not item["bag"].strip():
            # str() of null or a list names a file nobody meant ("None", "['a.bag']")
            raise SimError(f"{label}: bag must be a path or URL, not {item['bag']!r}")
        bag = _bag_url(item["bag"], listing)
        if bag not in spans:
            try:
                spans[bag] = _bag_range(bag, storage_options)
            except SimError as err:
                relative = "://" not in item["bag"] and not item["bag"].startswith("/")
                hint = " (a relative bag lies in the scenario file's directory)" if relative else ""
                raise SimError(f"{label}: bag {item['bag']!r}{hint}: {err}") from err
        span = spans[bag]
        name = str(given or f"{_stem(bag)}#{i:04d}")
        where = f"{url}: scenario {name!r}"
        start_s = _seconds(item, "start", 0.0, where)
        end_s = None if item.get("end") is None else _seconds(item, "end", 0.0, where)
        warmup_s = _seconds(item, "warmup", 0.0, where)
        for key, value in (("start", start_s), ("warmup", warmup_s)):
            if value < 0:
                raise SimError(f"{where}: {key} must be >= 0 s, not {value:g}")
        if end_s is not None and end_s < start_s:
            raise SimError(
                f"{where}: end {end_s:g} s is before start {start_s:g} s; "
                "need 0 <= start <= end (seconds after the bag's first message)"
            )
        if end_s is not None and end_s == start_s:
            # nothing to evaluate: it failed as "no messages on the input topics"
            raise SimError(
                f"{where}: start and end are both {start_s:g} s, a scenario of no time; "
                "give an end after its start"
            )
        if span is None:
            out.append(Scenario(name, bag, 0, 0, 0, options))
            continue
        first, stop = span
        if first + round(start_s * _NS) >= stop:
            raise SimError(
                f"{where}: start {start_s:g} s is past the end of {bag}, whose messages "
                f"span {(stop - first) / _NS:.3f} s"
            )
        start = first + round(start_s * _NS)
        end = stop if end_s is None else min(stop, first + round(end_s * _NS))
        end = max(start, end)
        out.append(
            Scenario(name, bag, start, end, max(first, start - round(warmup_s * _NS)), options)
        )
    twice = [name for name, n in Counter(s.name for s in out).items() if n > 1]
    if twice:
        # a default name (``drive#0003``: the bag's stem and the entry's index) may be one
        # another entry gives explicitly
        raise SimError(
            f"{url}: scenario names must be unique; {', '.join(map(repr, twice))} "
            "is given more than once"
        )
    return out
