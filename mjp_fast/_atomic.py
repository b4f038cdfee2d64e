"""Writing a file atomically: into a temporary file beside it, flushed to disk, then renamed over it.

Readers, and a run killed while writing, see the old file or the new one, never half of one: ``os.replace`` is
atomic on POSIX. Every file the package writes this way (checkpoints, the demo PNG, result JSON; the benchmarks'
files too) goes through :func:`write_atomically`, so they all get the same permissions as a plain ``open(path,
"w")`` would give them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _existing_mode(path: Path) -> int | None:
    """The permission bits of the file at ``path``, or None when there is none."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o777  # never carry setuid/setgid/sticky over
    except (FileNotFoundError, NotADirectoryError):
        return None


def _create_beside(path: Path) -> tuple[int, Path]:
    """Creates a new empty file ``.<name>.<random>.tmp`` in ``path``'s folder; returns its descriptor and path.

    It is created with mode 0o666, what ``open(path, "w")`` asks for, and the kernel takes the process's umask
    (and the folder's default ACL, where there is one) off it, as for any new file. ``tempfile.mkstemp`` asks
    for 0o600 instead, which made checkpoints private whatever the umask said. Reading the umask to chmod the
    file afterwards is no alternative: ``os.umask`` can only read it by setting it, and between the set and the
    restore another thread (a data loader's, TensorBoard's writer) would create its files with the wrong umask.
    """
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, _CREATE_FLAGS, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {str(path)!r} after 100 tries")


def _fsync_directory(folder: Path) -> None:
    """Makes a rename in ``folder`` durable; not every platform can open a folder, which is harmless."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def write_atomically(path: str | Path, *, text: bool = False) -> Iterator[IO]:
    """Opens a temporary file for writing; when the block ends without an error, it replaces ``path``.

    The file is flushed to disk (fsync) before the rename, and the folder after it. When the block raises, the
    temporary file is removed and ``path`` is left as it was. The folder is created if needed.

    Permissions are those of a plain ``open(path, "w")``: a new file gets 0o666 less the umask; an existing
    file keeps its permission bits, as a plain write (which truncates the file in place) would keep them, so a
    checkpoint someone made private (or group-readable) stays so when the next epoch rewrites it. Its owner
    and group are the writer's, as the file is a new one.

    Args:
        path: the file to write.
        text: open in text mode (UTF-8) instead of binary.

    Yields:
        The open temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept_mode = _existing_mode(path)
    descriptor, temporary = _create_beside(path)
    try:
        with os.fdopen(descriptor, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        if kept_mode is not None:
            os.chmod(temporary, kept_mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
