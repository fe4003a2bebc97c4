"""Cells of the distributed support matrix that do not work yet, each with its reason.

A cell listed here is marked ``xfail(strict=True, raises=KnownFailure)``: the test passes as
an expected failure only when the cell fails *for the stated reason* (the rank's exception
class and message, or the failing check's text, match); a cell that fails otherwise is a
test failure, and one that starts to work is an XPASS, which strict mode turns into a
failure, so that the entry is removed when the cell is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import pytest

from xopt.torch.launch import RankError


@dataclasses.dataclass(frozen=True)
class Known:
    reason: str
    #: the exception class a rank raises (its name), or None: a check of the result fails
    exc_type: str | None
    #: a regular expression the rank's exception message, or the failing check, matches
    match: str


class KnownFailure(Exception):
    """A cell failed for its stated reason."""


KNOWN: dict[tuple[str, str], Known] = {}


def marks(cell: str, method: str) -> list:
    known = KNOWN.get((cell, method))
    if known is None:
        return []
    return [pytest.mark.xfail(strict=True, raises=KnownFailure, reason=known.reason)]


@contextlib.contextmanager
def expect(cell: str, method: str) -> Iterator[None]:
    """Run a cell: a failure that matches its :data:`KNOWN` entry becomes
    :class:`KnownFailure`; any other failure propagates as it is."""
    known = KNOWN.get((cell, method))
    try:
        yield
    except RankError as e:
        if known is not None and known.exc_type == e.exc_type and re.search(known.match,
                                                                            e.exc_message):
            raise KnownFailure(known.reason) from e
        raise
    except AssertionError as e:
        if known is not None and known.exc_type is None and re.search(known.match, str(e)):
            raise KnownFailure(known.reason) from e
        raise
