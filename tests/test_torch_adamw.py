"""xopt.torch.AdamW: torch.optim.AdamW bit for bit under the torch preset (with groups,
schedulers, and state dicts in either), optax's arithmetic under the optax preset, and its
own hyperparameter errors. What every xopt optimizer does (groups, closures, state dicts,
bf16, bad input, nonfinite=) is tests/contract/'s."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers import needs_torch

from xopt.errors import HyperparameterError

pytestmark = needs_torch
torch = pytest.importorskip("torch")

from xopt.specs import adamw as spec  # noqa: E402
from xopt.torch import AdamW  # noqa: E402

SHAPES = [(), (1,), (7,), (5, 3), (2, 3, 4), (3, 3, 4, 8), (33, 17)]


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for s in SHAPES]


def grad_stream(params, steps, seed=1):
    """Gradients spanning seven orders of magnitude, with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        out = []
        for p in params:
            x = torch.randn(p.shape, generator=g, dtype=torch.float64)
            x = x * 10.0 ** torch.randint(-5, 3, p.shape, generator=g)
            x[torch.rand(p.shape, generator=g) < 0.1] = 0.0
            out.append(x.to(p.dtype))
        yield out


def run(opt_cls, kwargs, steps=25, dtype=torch.float32, groups=None):
    params = make_params(dtype)
    opt = opt_cls(groups(params) if groups else params, **kwargs)
    for grads in grad_stream(params, steps):
        for p, g in zip(params, grads, strict=False):
            p.grad = g
        opt.step()
    return params, opt


def assert_bitwise(a_params, a_opt, b_params, b_opt):
    for i, (a, b) in enumerate(zip(a_params, b_params, strict=False)):
        assert torch.equal(a, b), f"param {i} {tuple(a.shape)}"
        sa, sb = a_opt.state[a], b_opt.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype, (i, k)


CONFIGS = [
    {},
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=0.1, weight_decay=0.0),
    dict(amsgrad=True, lr=3e-2, betas=(0.8, 0.99), eps=1e-6),
    dict(maximize=True, weight_decay=0.5),
    dict(betas=(0.0, 0.5)),
    dict(lr=torch.tensor(0.01)),
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: ",".join(k) or "defaults")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_bitwise_equal_to_torch_optim(kwargs, dtype):
    assert_bitwise(*run(torch.optim.AdamW, kwargs, dtype=dtype), *run(AdamW, kwargs, dtype=dtype))


def test_param_groups_bitwise():
    def groups(params):
        return [{"params": params[:3], "lr": 0.05, "weight_decay": 0.0},
                {"params": params[3:], "betas": (0.5, 0.9), "amsgrad": True}]

    a = run(torch.optim.AdamW, dict(lr=1e-3), groups=groups)
    b = run(AdamW, dict(lr=1e-3), groups=groups)
    assert_bitwise(*a, *b)


def _train_with_scheduler(opt_cls, sched_fn, steps=30):
    params = make_params()
    opt = opt_cls(params, lr=0.1)
    sched = sched_fn(opt)
    lrs = []
    for grads in grad_stream(params, steps):
        for p, g in zip(params, grads, strict=False):
            p.grad = g
        opt.step()
        sched.step()
        lrs.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    return params, opt, lrs


@pytest.mark.parametrize("sched_fn", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=30),  # also betas
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30),
], ids=["step", "onecycle", "cosine"])
def test_lr_schedulers_drive_it_like_torch_optim(sched_fn):
    pa, oa, la = _train_with_scheduler(torch.optim.AdamW, sched_fn)
    pb, ob, lb = _train_with_scheduler(AdamW, sched_fn)
    assert la == lb and len({lr for lr, _ in la}) > 1
    assert_bitwise(pa, oa, pb, ob)


def test_state_dicts_interchange_with_torch_optim():
    params, opt = run(torch.optim.AdamW, dict(lr=1e-2), steps=5)
    params2 = [p.detach().clone().requires_grad_() for p in params]
    mine = AdamW(params2, lr=1e-2)
    # deepcopy, as a save and load would: load_state_dict keeps the step tensors by reference
    mine.load_state_dict(copy.deepcopy(opt.state_dict()))
    stream = list(grad_stream(params, 5, seed=3))
    for o, ps in ((opt, params), (mine, params2)):
        for grads in stream:
            for p, g in zip(ps, grads, strict=False):
                p.grad = g
            o.step()
    assert_bitwise(params, opt, params2, mine)


def test_optax_preset_in_torch_matches_the_float64_oracle():
    params = make_params()
    opt = AdamW(params, preset="optax", lr=1e-2, nesterov=True, eps_root=1e-8)
    h = spec.SPEC.make("optax", lr=1e-2, nesterov=True, eps_root=1e-8)
    for t, grads in enumerate(grad_stream(params, 15)):
        before = {i: p.detach().double().numpy() for i, p in enumerate(params)}
        state = {"step": np.int64(t)}
        for i, p in enumerate(params):
            st = opt.state[p]
            state[f"m/{i}"] = st["exp_avg"].double().numpy() if st else np.zeros(p.shape)
            state[f"v/{i}"] = st["exp_avg_sq"].double().numpy() if st else np.zeros(p.shape)
        g64 = {i: g.double().numpy() for i, g in enumerate(grads)}
        oracle, _ = spec.step(h, before, state, g64, xp=np)
        for p, g in zip(params, grads, strict=False):
            p.grad = g
        opt.step()
        for i, p in enumerate(params):
            ref = oracle[i]
            err = np.abs(p.detach().double().numpy() - ref).max() / max(np.abs(ref).max(), 1e-30)
            assert err <= 1e-6, (t, i, err)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(lr=-1.0), r"AdamW\.lr = -1\.0"),
    (dict(betas=(0.9, 1.0)), r"AdamW\.b2 = 1\.0"),
    (dict(betas=(0.9,)), r"AdamW\.betas"),
    (dict(eps=-1e-8), r"AdamW\.eps"),
    (dict(nesterov=True), r"nesterov.*formula='optax'"),
    (dict(preset="keras"), r"unknown preset 'keras'"),
    (dict(spec=spec.AdamW(), lr=0.1), r"either spec= or hyperparameters.*lr"),
])
def test_bad_hyperparameters_are_named(kwargs, pattern):
    with pytest.raises(HyperparameterError, match=pattern):
        AdamW([torch.zeros(2, requires_grad=True)], **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device runs)")
@pytest.mark.parametrize("kwargs", CONFIGS[:4], ids=lambda k: ",".join(k) or "defaults")
def test_cuda_bitwise_equal_to_torch_optim_for_loop(kwargs):
    # On CUDA torch.optim defaults to its foreach kernels; xopt's plain path is the
    # for-loop algorithm, so the bitwise reference is torch.optim with foreach=False.
    def run_cuda(cls, extra):
        params = [p.detach().cuda().requires_grad_() for p in make_params()]
        opt = cls(params, **kwargs, **extra)
        for grads in grad_stream(params, 20):
            for p, g in zip(params, grads, strict=False):
                p.grad = g.cuda()
            opt.step()
        return params, opt

    assert_bitwise(*run_cuda(torch.optim.AdamW, {"foreach": False}), *run_cuda(AdamW, {}))
