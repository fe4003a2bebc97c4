"""Atomic, durable writes: build beside the target, fsync, rename over it.

A reader sees the old file (or directory) or the new one, never a partial one; a failed
write leaves the target as it was and no temporary behind; a completed write survives a
power cut (the data, the new name and the directory entry are all fsynced).

Temporaries are named ``.<target name>.<pid>@<host>.<random>.tmp`` in the target's
folder, so the next write to the same target can tell the leftovers of a run that was
killed (its process is gone) from those of a write still in progress, and removes only
the former (:func:`clean_stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32] or "host"
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.[\w-]+"
                   r"\.(?P<kind>tmp|old)$")


def _prefix(final: Path) -> str:
    return f".{final.name}.{os.getpid()}@{_HOST}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a pid we cannot ask about): leave it
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def clean_stale(final: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that interrupted writes to ``final`` left in its folder
    (written by a process of this host that no longer runs). A directory that a killed
    replacement had moved aside (``.old``) is put back where ``final`` is missing. Returns
    the paths handled."""
    final = Path(final)
    removed = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP.match(p.name)
        if (m and m["name"] == final.name and m["host"] == _HOST
                and not _alive(int(m["pid"]))):
            if m["kind"] == "old" and not os.path.lexists(final):
                os.replace(p, final)
            else:
                _remove(p)
            removed.append(p)
    return removed


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    is_dir = os.path.isdir(path)
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0))
    except OSError:
        if is_dir:  # a directory cannot be opened here (Windows): nothing to sync
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; the data is synced
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``root`` (deepest first), then ``root``."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path in ``final``'s folder; write it; on success it is fsynced and
    renamed to ``final`` and the folder fsynced.

    The temporary file gets the permissions a plain ``open`` would (not mkstemp's 0600).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(final), suffix=".tmp", dir=final.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or file system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; on success its whole tree is
    fsynced and it becomes ``final``.

    An existing ``final`` (a directory; the caller decides whether it may be replaced) is
    swapped with the new one in one step where the system can (Linux), else moved aside
    just before the new one is renamed in; then it is deleted. A failure leaves ``final``
    as it was and nothing else.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(final), suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        fsync_tree(tmp)
        if final.is_dir() and not final.is_symlink():
            if _exchange(tmp, final):  # tmp now holds the old directory
                fsync_path(final.parent)
                _remove(tmp)
                return
            old = Path(tempfile.mkdtemp(prefix=_prefix(final), suffix=".old",
                                        dir=final.parent))
            os.rmdir(old)
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            fsync_path(final.parent)
            _remove(old)
        else:
            os.replace(tmp, final)
            fsync_path(final.parent)
    finally:
        if tmp.exists():
            _remove(tmp)
