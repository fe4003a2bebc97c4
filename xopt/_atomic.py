"""Atomic file writes: write beside the target, then rename over it.

A reader sees the old file or the new one, never a partial one, and a failed write leaves
the target as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path in ``final``'s folder; on success rename it to ``final``.

    The temporary file gets the permissions a plain ``open`` would (not mkstemp's 0600).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
