"""docs/parity/torch-vs-optax.md is what `xopt compare --table` generates here.

Every pair of the page is recorded (`xopt.parity.record`, A = torch.optim, to a trace file)
and compared from that file (`xopt.parity.compare`, B = optax), and the fresh page must
match the committed one, tolerant only of what moves between machines: figures at float32
rounding level (within a factor of 4) and a localisation that sits near its threshold
(`xopt.parity.pairs.cells_agree`). Under other torch/jax/optax versions than the page's the
libraries' arithmetic may itself differ: then the rows must still all run, and the
differences are printed.
"""

from __future__ import annotations

import re

import pytest
from helpers import REPO, has_jax, has_torch

PAGE = REPO / "docs" / "parity" / "torch-vs-optax.md"

pytestmark = pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")


def _page_versions(text: str) -> dict[str, str]:
    m = re.search(r"Generated with (.*?) on an", text)
    return dict(item.split(" ", 1) for item in m.group(1).split(", "))


def test_the_published_table_is_what_the_pairs_give_here(tmp_path):
    from xopt.parity import pairs
    from xopt.parity.recorder import versions

    results = pairs.run(record_dir=tmp_path)
    assert len(results) == len(pairs.PAIRS) and len(list(tmp_path.glob("*.npz"))) == len(
        pairs.PAIRS)
    for p, report in results:
        assert [r.mode for r in report.runs] == list(p.modes), p.optimizer
    fresh = pairs.render(results)
    committed = PAGE.read_text()
    diffs = pairs.check_page(PAGE, fresh=fresh)
    print("\n".join(diffs))
    here = versions()
    if all(here.get(k) == v for k, v in _page_versions(committed).items()):
        assert not diffs, "regenerate with `xopt compare --table docs/parity/torch-vs-optax.md`"
    else:
        assert set(pairs.table_rows(fresh)) == set(pairs.table_rows(committed))


def test_cells_tolerate_rounding_figures_only():
    from xopt.parity.pairs import cells_agree

    assert cells_agree("agree · 1.1e-07", "agree · 3.0e-07")        # rounding level
    assert not cells_agree("agree · 1.1e-07", "agree · 9.0e-07")    # beyond 4x
    assert not cells_agree("agree · 6.0e-07", "**diverge** · 1.1e-06")
    assert cells_agree("**diverge** · 6.7e-02", "**diverge** · 6.8e-02")  # two digits
    assert not cells_agree("**diverge** · 6.7e-02", "**diverge** · 7.5e-02")
    loc = "step 0 · `param/mlp/0/bias` · 5× · rounding, optax further from exact"
    assert cells_agree(loc, loc.replace("5×", "7.1×"))
    assert not cells_agree("none", loc)                              # words differ
    assert not cells_agree("none", loc.replace("5×", "93×"), localisation=True)
    assert cells_agree("none", loc, localisation=True)
    assert not cells_agree(loc, loc.replace("step 0", "step 1"))
    assert not cells_agree(loc, loc.replace("optax further", "torch further"))
