"""The traces shipped in the package are intact and, where copied, identical to ../shared."""

from __future__ import annotations

import hashlib
import json

import pytest
from helpers import REPO, SHARED

DATA = REPO / "xopt/parity/data"
MANIFEST = json.loads((DATA / "MANIFEST.json").read_text())


def test_manifest_lists_exactly_the_bundled_files():
    on_disk = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*.*")
               if p.name != "MANIFEST.json"}
    assert on_disk == set(MANIFEST["files"])


@pytest.mark.parametrize("rel", sorted(MANIFEST["files"]))
def test_bundled_file_matches_its_checksum(rel):
    entry = MANIFEST["files"][rel]
    assert hashlib.sha256((DATA / rel).read_bytes()).hexdigest() == entry["sha256"]


SHARED_COPIES = sorted(r for r, e in MANIFEST["files"].items()
                       if e["origin"].startswith("shared/"))


@pytest.mark.skipif(not (SHARED / "parity").is_dir(),
                    reason="../shared is not beside this checkout (users' installs)")
@pytest.mark.parametrize("rel", SHARED_COPIES)
def test_copied_golden_case_is_byte_identical_to_shared(rel):
    origin = MANIFEST["files"][rel]["origin"]
    assert (DATA / rel).read_bytes() == (REPO.parent / origin).read_bytes()
