"""The Python side of a pipe command: read records on stdin, write records on stdout.

A program used with :meth:`BinPipeRDD.pipe` (or as a replay node) reads one BinPipe
stream on standard input and writes one on standard output::

    from adcloud.binpipe.node import run_node

    def double(record):
        topic, stamp, msgtype, data = record
        return (topic, stamp, msgtype, bytes(data) * 2)

    if __name__ == "__main__":
        run_node(double)

META blocks (message definitions) are passed through unchanged.  Logging goes to
standard error, which the caller keeps the tail of for error reports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import BinaryIO

from adcloud.binpipe.codec import BlockKind, Record, StreamReader, StreamWriter, as_message
from adcloud.binpipe.errors import BinpipeError

__all__ = ["NodeFunction", "read_records", "records_from", "run_node"]

#: Maps one input record to nothing (None), one output record (a tuple), or an
#: iterable of output records.
NodeFunction = Callable[[Record], "Record | Iterable[Record] | None"]


def records_from(out: object, fn: Callable[..., object]) -> Iterable[Record]:
    """The records ``fn`` returned as ``out`` when it is not one tuple: none for None, else
    the tuples of an iterable, checked as they come.

    A ``str``, ``bytes`` or ``dict`` is iterable but no iterable of records (iterating it
    would make a record of each character or byte): that, and anything else that is
    not a tuple or an iterable of tuples, is a :class:`BinpipeError` naming ``fn``.
    """
    if out is None:
        return ()
    if isinstance(out, tuple):
        return (out,)
    if isinstance(out, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(
        out, Iterable
    ):
        raise _bad_return(fn, out, "")
    return _tuples(out, fn)


def _tuples(items: Iterable[object], fn: Callable[..., object]) -> Iterator[Record]:
    for item in items:
        if not isinstance(item, tuple):
            raise _bad_return(fn, item, f"a {type(items).__name__} holding ")
        yield item


def _bad_return(fn: Callable[..., object], value: object, holding: str) -> BinpipeError:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BinpipeError(
        f"{name} returned {holding}{type(value).__name__} {shown}; return a record (a tuple, "
        "e.g. (topic, timestamp, msgtype, data)), an iterable of records, or None to drop it"
    )


def read_records(stdin: BinaryIO | None = None) -> Iterator[Record]:
    """Every DATA record of the stream on ``stdin`` (message-shaped ones as :class:`Message`)."""
    source = stdin if stdin is not None else sys.stdin.buffer
    for block in StreamReader(source, name="stdin"):
        if block.kind == BlockKind.DATA:
            for rec in block:
                yield as_message(rec)


def run_node(
    fn: NodeFunction,
    *,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    block_bytes: int = 1 << 20,
) -> int:
    """Run ``fn`` over every input record, writing what it returns; return the output count.

    Output is flushed block by block, so a downstream reader sees records while the
    input is still arriving.  The output stream is closed (END block) only when the
    input ended cleanly; on an exception no END is written, so the caller sees a
    truncated stream and the exception's traceback on stderr.
    """
    source = stdin if stdin is not None else sys.stdin.buffer
    sink = stdout if stdout is not None else sys.stdout.buffer
    writer = StreamWriter(sink, block_bytes=block_bytes)
    for block in StreamReader(source, name="stdin"):
        if block.kind == BlockKind.META:
            writer.write_block(block.raw)
            continue
        for rec in block:
            out = fn(as_message(rec))
            if isinstance(out, tuple):
                writer.write(out)
            else:
                for item in records_from(out, fn):
                    writer.write(item)
        writer.flush_block()
        sink.flush()
    writer.close()
    sink.flush()
    return writer.record_count
