"""VeLO's folded kernels (xopt.kernels.velo, ``FOLD``): the row and column features folded.

For factored tensors the 12 features that depend on one axis only (``v_row``, ``v_col`` and
their rsqrt's, features 15-26) are computed per row and per column: their first-layer
terms per axis position, their sums of squares in the statistics pass as Σ over a tile's
positions on that axis times the tile's extent on the other axis, and the row and column
factors of ``fac_g`` and ``m·row_factor·col_factor`` per position. These tests check the
statistics against the spec's float64 ``feature_sq_mean``, the step against the spec's
step in float64 and the state against plain, the carried sums of the accumulators and
determinism, on shapes that exercise both orientations of the tile (which axis indexes
``v_row``), rectangular tensors with several tiles per axis (TA = TB = 64) and a partial
last tile on both axes, batch axes (rank 3 and 4) and unfactored tensors (rank 0 and 1:
the unfolded kernel in the same step).

As tests/test_kernels_lopt.py, the checks run in a child process (this file with
``--worker``): on a CUDA GPU when there is one, else on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` set in the child only); the child prints one JSON object.
"""

from __future__ import annotations

import json
import sys

import pytest
from helpers import (
    has_torch,
    has_triton,
    max_rel,
    rounding_sensitivity,
    velo_sharing_theta,
    worker_results,
)

pytestmark = pytest.mark.skipif(not (has_torch and has_triton), reason="needs torch and triton")

EXACT = 1e-6
#: (65, 66) and (66, 65): 2 × 2 tiles, the last on each axis partial (1 or 2 rows: a partial
#: sub-tile), either axis contiguous (A_IS_D0 0 and 1). No third tile along an axis: it is
#: summed and finalized as the second, and the interpreter's time grows with rows × tiles
#: along b ((70, 130) and (130, 70) cost 470 where these cost 262). Batch axes (rank 3, 4):
#: two tiles along a after a batch offset in (2, 65, 3), two batch axes of different sizes
#: (3 × 2: swapping them moves elements) in (3, 2, 9, 5), one partial tile a batch;
#: unfactored tensors (rank 0, 1) in the same launches
SHAPES = [(65, 66), (66, 65), (3, 2, 9, 5), (2, 65, 3), (9, 1, 4), (7, 3), (5,), ()]


def _worker() -> dict:
    import copy

    import torch

    from xopt.kernels import lopt_common as C
    from xopt.kernels import velo as kv
    from xopt.specs import velo as sv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict = {"device": dev}

    rel = max_rel

    def tensors(seed, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g).to(dtype).to(dev) for s in SHAPES]

    make_velo = velo_sharing_theta(num_training_steps=100, seed=3)  # θ drawn once

    def make(params, impl):
        return make_velo(params, impl=impl)

    # a shared state after two plain steps
    params = [torch.nn.Parameter(x) for x in tensors(0)]
    opt = make(params, "plain")
    for t in range(2):
        for p, g in zip(params, tensors(100 + t), strict=True):
            p.grad = g
        opt.step(loss=torch.tensor(2.0 - 0.1 * t))
    sd = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in params]
    g32 = tensors(102)
    loss = torch.tensor(1.8)

    # the statistics kernel's launches: their FOLD flags and the first launch's per-program
    # sums (on a GPU the step is then recorded into a CUDA graph: launched again, not run)
    captured: dict = {"fold": []}

    class Spy:
        def __init__(self, kern):
            self.kern = kern

        def __getitem__(self, grid):
            def launch(*args, **kw):
                self.kern[grid](*args, **kw)
                captured["fold"].append(bool(kw["FOLD"]))
                captured.setdefault("part", args[15])

            return launch

    def one_step(impl, fold, spy=False):
        """One step from the shared state, float64 parameters (the step is then exact)."""
        ps = [torch.nn.Parameter(b.double()) for b in before]
        o = make(ps, impl)
        o.load_state_dict(copy.deepcopy(sd))
        for p, g in zip(ps, g32, strict=True):
            p.grad = g.double()
        saved = kv.FOLD, kv.velo_stats_kernel
        kv.FOLD = fold if fold is not None else kv.FOLD
        if spy:
            kv.velo_stats_kernel = Spy(saved[1])
        try:
            o.step(loss=loss)
        finally:
            kv.FOLD, kv.velo_stats_kernel = saved
        return [b.double() - p.detach() for b, p in zip(before, ps, strict=True)], o

    d_fold, o_fold = one_step("triton", True, spy=True)
    d_unf, _ = one_step("triton", False)
    d_plain, o_plain = one_step("plain", None)
    out["launches"] = captured["fold"]

    # the float64 reference: the spec's step on float64 copies of every input
    lr = opt.param_groups[0]["lr"]
    meta = {k: v.double() for k, v in opt.meta_on(torch.device(dev)).items()}
    st = [{k: v.double() for k, v in opt.state[p].items()} for p in params]
    gs = opt.state["global"]
    p64 = [b.double() for b in before]
    g64 = [g.double() for g in g32]
    lfeat = sv.loss_buffer_step(torch, gs["loss_means"].double().to(dev),
                                gs["loss_running_min"].double().to(dev),
                                gs["loss_decays"].double().to(dev),
                                int(gs["loss_iteration"]), loss.double().to(dev))[3]
    frac = torch.tensor(int(gs["iteration"]) / int(gs["num_steps"]), dtype=torch.float64,
                        device=dev)

    def ref(pl, gl, sl):
        hidden = torch.stack([s["lstm_hidden"] for s in sl])
        cell = torch.stack([s["lstm_cell"] for s in sl])
        return kv.reference_step(opt.hp, pl, gl, sl, meta, hidden, cell, frac, lfeat)[0]

    s64 = [lr * s for s in ref(p64, g64, st)]
    sens = rounding_sensitivity(ref, p64, g64, st, s64, lr)  # inputs rounded once more
    out["step_vs_f64"] = {
        "fold": max(rel(a, b) for a, b in zip(d_fold, s64, strict=True)),
        "unfolded": max(rel(a, b) for a, b in zip(d_unf, s64, strict=True)),
        "plain": max(rel(a, b) for a, b in zip(d_plain, s64, strict=True)),
        "fold_vs_unfolded": max(rel(a, b) for a, b in zip(d_fold, d_unf, strict=True)),
        "sensitivity": sens}
    pf, pp_ = o_fold.param_groups[0]["params"], o_plain.param_groups[0]["params"]
    out["state_vs_plain"] = max(rel(o_fold.state[a][k], o_plain.state[b][k])
                                for a, b in zip(pf, pp_, strict=True)
                                for k in ("m", "rms", "v_row", "v_col", "v_diag"))

    # the statistics pass: Σ feature² per tensor against the spec's float64 feature_sq_mean
    # (the features do not depend on the MLP's weights: zero controls)
    lay = o_fold._triton._layout
    if dev == "cuda":  # (the eager step ran on a side stream)
        torch.cuda.synchronize()
    sums = C.seg_sum(captured["part"], lay)[:, :30]
    decays = tuple(sv._as_array(torch, d, meta["lstm/init_hidden"])
                   for d in sv.decay_arrays(opt.hp))
    zero = torch.zeros_like(st[0]["lstm_hidden"][:0])  # (dtype, device)
    worst_sq, worst_axis = 0.0, 0.0
    for i, (p, g, s_) in enumerate(zip(p64, g64, st, strict=True)):
        aux: dict = {}
        controls = zero.new_zeros((int(opt.hp.param_inits),))
        sv.update_tensor(torch, opt.hp, p, g, *(s_[v] for v in ("m", "rms", "v_row", "v_col",
                                                                 "v_diag")),
                         controls, zero.new_ones(()), meta, decays, aux=aux)
        mean = sums[i].double() / max(1, p.numel())
        worst_sq = max(worst_sq, rel(mean, aux["feature_sq_mean"]))
        if len(SHAPES[i]) >= 2:  # the folded features alone
            worst_axis = max(worst_axis, rel(mean[15:27], aux["feature_sq_mean"][15:27]))
    out["feature_sq_mean_vs_f64"] = worst_sq
    out["axis_feature_sq_mean_vs_f64"] = worst_axis

    # the sums of the new accumulators carried by the folded fused pass: the same bits as
    # summing them anew (velo_mom_sums_kernel, every program)
    carried = o_fold._triton._mpart.clone()
    fresh = o_fold._triton.mom_partials()
    out["carry_bitwise"] = bool(torch.equal(carried.view(torch.int64),
                                            fresh.view(torch.int64)))

    # two runs (float32, two steps, folded): the same bits (the second step sums the
    # accumulators carried from the first)
    runs = []
    for _ in range(2):
        ps = [torch.nn.Parameter(b.clone()) for b in before]
        o = make(ps, "triton")
        o.load_state_dict(copy.deepcopy(sd))
        for t in range(2):
            for p, g in zip(ps, tensors(200 + t), strict=True):
                p.grad = g
            o.step(loss=torch.tensor(1.7 - 0.1 * t))
        runs.append(([p.detach().clone() for p in ps], [o.state[p] for p in ps]))
    (pa, sa), (pb, sb) = runs
    out["bitwise"] = bool(all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True))
                          and all(torch.equal(a[k], b[k]) for a, b in zip(sa, sb, strict=True)
                                  for k in a))
    out["g2_prefetch_same_bits"] = _g2_prefetch_same_bits(dev)
    return out


def _g2_prefetch_same_bits(dev: str) -> bool:
    """A step with the g² pass's prefetch (lopt_common.G2_PREFETCH) on and off: the same
    bits (the pass is shared by both learned optimizers; small_fc_lopt's step is the
    quicker under the interpreter), on tensors with several tiles along either axis,
    partial last tiles (86 = 64 + 22 rows, 22 not a multiple of the sub-tile; a third
    tile along a would start and end as the second) and a batch dimension (two batches:
    a batch offset)."""
    import torch

    import xopt.torch as xt
    from xopt.kernels import lopt_common as C

    def run(prefetch):
        C.G2_PREFETCH = prefetch
        g = torch.Generator().manual_seed(0)
        shapes = [(86, 20), (20, 150), (2, 70, 8), (33,)]
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in shapes]
        opt = xt.SmallFCLOpt(params, impl="triton", num_training_steps=100)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dev)
        opt.step()
        state = [t.clone() for p in params for t in opt.state[p].values()
                 if isinstance(t, torch.Tensor)]
        return [p.detach().clone() for p in params] + state

    default = C.G2_PREFETCH
    try:
        want, got = run(False), run(True)
    finally:
        C.G2_PREFETCH = default
    return len(want) == len(got) > 5 and all(torch.equal(a, b)
                                             for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def results() -> dict:
    return worker_results(__file__)


def test_factored_tensors_take_the_folded_kernel(results):
    """The statistics pass: one folded launch (factored tensors), one unfolded (the
    others); on a GPU twice (the eager first step, then its CUDA graph's recording)."""
    n = len(results["launches"])
    assert n in (2, 4) and results["launches"] == [True, False] * (n // 2), results["launches"]


def test_folded_step_matches_float64(results):
    r = results["step_vs_f64"]
    bound = max(EXACT, r["sensitivity"])
    assert r["fold"] <= bound and r["unfolded"] <= bound, r


def test_state_matches_plain(results):
    assert results["state_vs_plain"] <= EXACT, results["state_vs_plain"]


def test_statistics_match_float64(results):
    # float32 features summed in float64 (per thread in float32 first): a few roundings
    assert results["feature_sq_mean_vs_f64"] <= EXACT, results["feature_sq_mean_vs_f64"]
    assert results["axis_feature_sq_mean_vs_f64"] <= EXACT, results


def test_carried_sums_are_the_sums_anew(results):
    assert results["carry_bitwise"] is True


def test_two_runs_give_the_same_bits(results):
    assert results["bitwise"] is True


def test_g2_prefetch_sums_the_same_sub_tiles(results):
    """The g² pass with the next sub-tile prefetched gives the bits of the plain loop
    (fails when the prefetch skips or repeats a sub-tile)."""
    assert results["g2_prefetch_same_bits"] is True


if __name__ == "__main__" and "--worker" in sys.argv:
    print(json.dumps(_worker()))


def test_glue_compile_failure_runs_eagerly(monkeypatch):
    """A compiled LSTM glue that fails (no compiler, an unsupported op) warns once and the
    step goes on with the eager glue, from then on without trying the compiled one."""
    from xopt.kernels import velo as K

    calls = []
    monkeypatch.setattr(K, "lstm_glue", lambda *a: calls.append(a) or "eager")
    tried = []

    def broken(*a):
        tried.append(a)
        raise RuntimeError("no compiler here")

    glue = K._compiled_or_eager(broken)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert glue(1, 2) == "eager"
    assert glue(3) == "eager"
    assert tried == [(1, 2)] and calls == [(1, 2), (3,)]


def test_glue_not_compiled_inside_a_callers_capture(monkeypatch):
    """While a CUDA stream is being captured and the compiled glue has not run yet, the
    eager glue runs (compiling could synchronize and invalidate the caller's capture);
    once the compiled glue has run outside a capture, captures use it too."""
    import torch

    from xopt.kernels import velo as K

    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(K, "lstm_glue", lambda *a: "eager")
    glue = K._compiled_or_eager(lambda *a: "compiled")
    assert glue(1) == "eager"  # captured, not warm: eager
    capturing[0] = False
    assert glue(2) == "compiled"  # not captured: compiles (here: runs) and is warm
    capturing[0] = True
    assert glue(3) == "compiled"  # captured after warm-up: the compiled glue
