"""Argument types the command lines share: a number or an output location checked as it is
parsed, so a bad one is argparse's one-line usage error naming the option, before any work
starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

__all__ = ["local_path", "number", "whole_number", "written_url"]


def whole_number(minimum: int, unit: str = "", maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number of at least ``minimum`` and, when given, at
    most ``maximum`` (``unit``: what it counts, for the message)."""
    counted = f" {unit}" if unit else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: give {minimum} or more{counted}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value}: give at most {maximum}{counted}")
        return value

    return parse


def number(
    what: str, *, minimum: float = 0.0, exclusive: bool = True, maximum: float | None = None
) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number above ``minimum`` (or at least it, unless
    ``exclusive``) and at most ``maximum`` when given; ``what`` names it in the messages
    ("number of seconds", "replay speed")."""
    most = None if maximum is None else f"{maximum:.0f}" if maximum >= 1e6 else f"{maximum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite {what}")
        if value < minimum or (exclusive and value == minimum):
            sign = ">" if exclusive else ">="
            raise argparse.ArgumentTypeError(f"{text!r}: give a {what} {sign} {minimum:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r}: give a {what} of at most {most}")
        return value

    return parse


def local_path(what: str) -> Callable[[str], str]:
    """An argparse ``type`` for ``what`` a command writes to the local disk: a path, or a
    ``file://`` URL given as its path.  Any other URL is refused: taken as a path,
    ``s3://b/x`` would be written below ``./s3:/b/x`` of the working directory.  A leading
    ``~`` is the home directory, as where the shell leaves it (``--out=~/x``)."""

    def parse(text: str) -> str:
        if "://" not in text:
            return str(Path(text).expanduser()) if text.startswith("~") else text
        scheme, rest = text.split("://", 1)
        if scheme.lower() == "file":
            import fsspec  # noqa: PLC0415 - keep --help fast

            return str(fsspec.core.url_to_fs(f"file://{rest}")[1])
        raise argparse.ArgumentTypeError(
            f"{text}: {what} can only be written to the local disk; give a local path or a "
            "file:// URL"
        )

    return parse


def written_url(what: str) -> Callable[[str], str]:
    """An argparse ``type`` for where a command writes ``what``: a path or any URL but
    ``memory://``, which lives inside one process and is gone when the command exits."""

    def parse(text: str) -> str:
        if text.lower().startswith("memory://"):
            raise argparse.ArgumentTypeError(
                f"{text}: memory:// lives inside one process and is gone, {what} with it, when "
                "the command exits; give a path or a file://, local://, alluxio:// or "
                "object-store URL (memory:// is for the Python API)"
            )
        return text

    return parse
