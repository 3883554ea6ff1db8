"""Errors of the BinPipe layer."""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = ["BagError", "BinpipeError", "PipeCommandError"]


class BinpipeError(AdcloudError):
    """A BinPipe stream is malformed, truncated or corrupt, or cannot be written.

    Messages name the byte offset in the stream where the problem was found.
    """


class BagError(BinpipeError):
    """A bag cannot be opened, indexed or read; the message names the file."""


class PipeCommandError(BinpipeError):
    """An external command used by ``BinPipeRDD.pipe`` failed.

    Carries the command line, its exit code and the tail of its standard error.
    """

    def __init__(self, msg: str, *, command: str, returncode: int | None, stderr_tail: str) -> None:
        super().__init__(msg)
        self.command = command
        self.returncode = returncode
        self.stderr_tail = stderr_tail

    def __reduce__(self) -> tuple[object, ...]:
        # Spark ships task exceptions to the driver by pickling them; keyword-only
        # constructor arguments need an explicit reduce to survive that trip.
        return (
            _rebuild_pipe_error,
            (self.args[0], self.command, self.returncode, self.stderr_tail),
        )


def _rebuild_pipe_error(
    msg: str, command: str, returncode: int | None, stderr_tail: str
) -> PipeCommandError:
    return PipeCommandError(msg, command=command, returncode=returncode, stderr_tail=stderr_tail)
