"""bench/train_step.py's refresh schedule is each method's own.

The benchmark times refresh steps apart from ordinary ones and amortises them over a
refresh interval, so a step it calls a refresh must be the step where the method
decomposes, redraws, resamples or merges. Here that step is found from the method itself:
on the tiny decoder (CPU), the steps at which state that changes rarely (projections,
seeds, CompAct's cached draw, POET's merged weights and permutations) changes.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import REPO, has_torch

pytestmark = pytest.mark.skipif(not has_torch, reason="needs torch")


@pytest.fixture(scope="module")
def train_step():
    spec = importlib.util.spec_from_file_location("bench_train_step",
                                                  REPO / "bench" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _snapshot(model, opt) -> dict[str, object]:
    import torch

    seen: dict[str, object] = {f"buffer {n}": b for n, b in model.named_buffers()}
    seen.update({f"frozen {n}": p for n, p in model.named_parameters() if not p.requires_grad})
    for i, st in enumerate(opt.state.values()):
        seen.update({f"state {i} {k}": v for k, v in st.items()})
    for n, m in model.named_modules():  # CompAct's layers keep their current draw's key
        cache = getattr(m, "_proj_cache", None)
        if cache is not None:
            seen[f"draw {n}"] = cache[0]
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else repr(v)
            for k, v in seen.items()}


def _same(a: object, b: object) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _rare_change_steps(train_step, name: str) -> list[int]:
    """The steps (0-based, from 1 on: step 0 creates the state) at which some entry that
    changes at most at 3 of them changes."""
    import torch

    d, layers, heads, ff, vocab, seq, batch = train_step.SIZES["tiny"]
    steps = 2 * train_step.GAP + 2
    torch.manual_seed(0)
    model = train_step.Llama(d, layers, heads, ff, vocab, seq)
    opt = train_step.METHODS[name](model, steps)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    takes_loss = isinstance(opt, (train_step.xt.SmallFCLOpt, train_step.xt.VeLO))
    before, changed = _snapshot(model, opt), []
    for _ in range(steps):
        loss = model(ids)
        loss.backward()
        opt.step(loss=loss.detach()) if takes_loss else opt.step()
        opt.zero_grad(set_to_none=True)
        after = _snapshot(model, opt)
        changed.append({k for k in after if k not in before or not _same(before[k], after[k])})
        before = after
    later = changed[1:]
    rare = {k for k in set().union(*later) if sum(k in c for c in later) <= 3}
    return [k for k in range(1, steps) if changed[k] & rare]


#: the learned optimizers refresh nothing (every entry of their state moves at every step);
#: left out for their plain path's CPU time (a minute each on 2 cores)
NO_REFRESH = ("small_fc_lopt", "VeLO")


def test_every_method_refreshes_where_the_benchmark_says(train_step):
    found, declared = {}, {}
    for name in train_step.METHODS:
        if name in NO_REFRESH:
            assert train_step.REFRESH_PHASE.get(name) is None
            continue
        found[name] = _rare_change_steps(train_step, name)
        declared[name] = [k for k in range(1, 2 * train_step.GAP + 2)
                          if train_step.refreshes(name, k)]
    assert found == declared
    # the schedule is not vacuous: decompositions, redraws, resampling and merges all occur
    assert {n for n, ks in found.items() if ks} == {
        "GaLore", "COAP", "COAP 8-bit", "PLUMAGE", "CompAct", "Flora momentum", "POET-X fast",
        "POET-X mem", "POET-XQ"}
