"""Writing files so that a crash or a concurrent reader never sees half of one."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, BinaryIO, Literal, overload

from fedge.errors import ConfigError

if sys.platform != "win32":
    import fcntl


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``path`` with what ``write`` writes, all or nothing.

    ``write`` fills a 0600 temporary file in the same directory; it is flushed and fsynced,
    renamed over ``path`` (atomic on POSIX and Windows) and the directory is fsynced, so after
    a crash ``path`` holds either the old content or the new, never a mix. The temporary file
    is removed if anything fails.
    """
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    if sys.platform != "win32":  # a directory cannot be opened for fsync on Windows
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """:func:`write_atomic` of ``data``."""
    write_atomic(path, lambda handle: handle.write(data))


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an advisory exclusive lock on the file ``path`` (created 0600) while the block runs.

    For writers that read, decide and replace (freshness records, published bundles, pulls):
    two of them at once could otherwise both pass a check and the older land last. Windows
    has no ``flock``: there the block runs unlocked (one process at a time is assumed).
    """
    if sys.platform == "win32":
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_regular_file(path: str | Path, *, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Threat model: a path that someone else chose (a config value) may name a device
    (``/dev/zero`` reads without end), a FIFO (opening blocks) or a huge file. The file is
    opened without blocking, checked to be a regular file on the open descriptor (no race
    with a swap after a check) and read up to ``limit`` bytes; anything else is refused.

    Raises
    ------
    ConfigError
        Naming ``what`` and ``path``: missing, unreadable, not a regular file, or larger than ``limit``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist") from None
    except (OSError, ValueError) as exc:  # no permission, a NUL in the path
        raise ConfigError(f"cannot read {what} '{path}': {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"cannot read {what} '{path}': not a regular file (a directory, device or "
                          "pipe); name a file")
    with os.fdopen(fd, "rb") as handle:
        content = handle.read(limit + 1)
    if len(content) > limit:
        raise ConfigError(f"cannot read {what} '{path}': larger than {limit:,} bytes; is it the right file?")
    return content


@overload
def open_private_append(path: Path, *, text: Literal[False] = False) -> BinaryIO: ...
@overload
def open_private_append(path: Path, *, text: Literal[True]) -> IO[str]: ...
def open_private_append(path: Path, *, text: bool = False) -> BinaryIO | IO[str]:
    """Open ``path`` for appending, created (or kept) mode 0600 whatever the umask.

    For logs that may name devices, runs and errors: ``open()`` follows the umask (0666
    under umask 0), and an existing file keeps whatever mode it had.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if sys.platform != "win32":
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8") if text else os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise
