"""The torch cases of the contract suite: how to build every torch optimizer of every
registered method on a tiny model, and which checks do not apply to it and why.

A method joins the suite by adding its :class:`Case` to :data:`CASES` (a method with several
torch optimizers or layers adds one per optimizer); ``test_torch_optimizers.py`` fails for a
registered method without one. Everything here is small: a few parameters of a few dozen
elements, a few steps, ranks of 2, refresh intervals of 2, so that refreshes, merges and
projection changes happen within the steps the checks take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import xopt.torch as xt
from xopt.nonfinite import SKIP_COUNTER


@dataclasses.dataclass(frozen=True)
class Case:
    """One torch optimizer of one method, on a tiny model.

    Attributes:
      name: the test id (the method's name, or ``method/optimizer``).
      method: the registered method (``xopt.specs.names()``).
      model: ``model(dtype) -> nn.Module``, seeded: the same parameters on every call.
      make: ``make(model, params_or_groups, **kw) -> optimizer`` (``kw``: hyperparameters
        and options such as ``nonfinite=``, overriding the case's).
      lr: the learning rate the case uses (the param-group checks scale it).
      takes_loss: step with ``step(loss=...)`` (the learned optimizers).
      grads: ``grads(model, k, dtype)`` sets the gradients of step ``k`` (default: seeded
        normal ``.grad`` of every trainable parameter).
      decomposes: the step decomposes gradients at refresh steps (SVD/QR), through the
        optimizer's ``svd``/``qr`` methods.
      dtype_options: constructor options that take a torch dtype (each must refuse an
        integer dtype when the optimizer is built).
      not_applicable: ``{check: reason}`` for checks that do not apply, each reason stated
        here and, where it can be, asserted by the check itself.
      float32_state: the state is float32 whatever the parameters' dtype (the learned
        optimizers: their networks were meta-trained in float32 and their modules say so).
    """

    name: str
    method: str
    model: Callable[[torch.dtype], nn.Module]
    make: Callable[..., torch.optim.Optimizer]
    lr: float
    takes_loss: bool = False
    grads: Callable[[nn.Module, int, torch.dtype], None] | None = None
    decomposes: bool = False
    dtype_options: tuple[str, ...] = ()
    not_applicable: Mapping[str, str] = dataclasses.field(default_factory=dict)
    float32_state: bool = False

    def __str__(self) -> str:
        return self.name


# -- models and gradients ----------------------------------------------------------------------


def _seeded(build: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return build().to(dtype)


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Two linear layers: matrices (6, 4) and (3, 6), vectors (6,) and (3,)."""
    return _seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), dtype)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def normal_grads(model: nn.Module, k: int, dtype: torch.dtype | None = None) -> None:
    """Seeded gradients of step ``k`` for every trainable parameter (``.grad``)."""
    for i, p in enumerate(trainable(model)):
        gen = torch.Generator().manual_seed(1000 * k + i)
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _compact_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    def build() -> nn.Module:
        return nn.Sequential(xt.CompActLinear(8, 6, rank=0.5, gap=2, seed=3), nn.Tanh(),
                             nn.Linear(6, 3))

    return _seeded(build, dtype)


def _compact_grads(model: nn.Module, k: int, dtype: torch.dtype | None = None) -> None:
    """CompAct weights get their compressed gradient (out × r) and the key of the projection
    the forward of this update would use; the other parameters ``.grad``."""
    for i, p in enumerate(trainable(model)):
        gen = torch.Generator().manual_seed(1000 * k + i)
        ref = getattr(p, "_compact_layer", None)
        layer = ref() if ref is not None else None
        if layer is None:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        else:
            p.compact_grad = torch.randn(p.shape[0], layer.r, generator=gen).to(p.dtype)
            p.compact_key = (layer.seed, layer.refresh())


def _poet_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    def build() -> nn.Module:
        return nn.Sequential(xt.POETLinear(8, 8, block_size=4, seed=5, impl="plain"),
                             nn.Tanh(), nn.Linear(8, 3))

    return _seeded(build, dtype)


def _poet_xq_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """POET-XQ: the same model with W0 in 8 bits (groups of 16)."""
    def build() -> nn.Module:
        return nn.Sequential(xt.POETLinear(8, 8, block_size=4, seed=5, impl="plain",
                                           variant="mem", weight_bits=8, weight_group_size=16),
                             nn.Tanh(), nn.Linear(8, 3))

    return _seeded(build, dtype)


def _conv_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A linear layer (inputs of width 4, as :func:`mlp`) into a conv kernel (4, 3, 2, 2):
    COAP's Tucker-2 path."""
    return _seeded(lambda: nn.Sequential(nn.Linear(4, 12), nn.Unflatten(1, (3, 2, 2)),
                                         nn.Conv2d(3, 4, 2), nn.Tanh(), nn.Flatten()), dtype)


# -- the cases ------------------------------------------------------------------------------------


def _kw(base: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    return {**base, **kw}


CASES: list[Case] = [
    Case("adamw", "adamw", mlp, lambda m, ps, **kw: xt.AdamW(ps, **_kw(dict(lr=1e-2), kw)),
         lr=1e-2, dtype_options=("state_dtype",)),
    Case("coap", "coap", mlp,
         lambda m, ps, **kw: xt.COAP(ps, **_kw(dict(lr=1e-2, rank=2, update_interval=1,
                                                    reproject_factor=2), kw)),
         lr=1e-2, decomposes=True),
    Case("coap_conv", "coap", _conv_model,
         lambda m, ps, **kw: xt.COAP(ps, **_kw(dict(lr=1e-2, rank=2, rank_ratio_cnn=4.0,
                                                    project=True, update_interval=1,
                                                    reproject_factor=2, restore_state=True),
                                               kw)),
         lr=1e-2, decomposes=True),
    Case("coap_8bit", "coap", mlp,
         lambda m, ps, **kw: xt.COAP(ps, **_kw(dict(lr=1e-2, rank=2, update_interval=1,
                                                    reproject_factor=2, state_bits=8,
                                                    restore_state=True), kw)),
         lr=1e-2, decomposes=True),
    Case("compact", "compact", _compact_model,
         lambda m, ps, **kw: xt.CompActAdamW(ps, **_kw(dict(lr=1e-2), kw)),
         lr=1e-2, grads=_compact_grads, dtype_options=("moment_dtype",)),
    Case("flora", "flora", mlp,
         lambda m, ps, **kw: xt.Flora(ps, **_kw(dict(lr=1e-2, rank=2, beta1=0.9, kappa=2),
                                                kw)),
         lr=1e-2),
    Case("galore", "galore", mlp,
         lambda m, ps, **kw: xt.GaLore(ps, **_kw(dict(lr=1e-2, rank=2, update_proj_gap=2), kw)),
         lr=1e-2, decomposes=True),
    Case("plumage", "plumage", mlp,
         lambda m, ps, **kw: xt.PLUMAGE(ps, **_kw(dict(lr=1e-2, rank=2, update_proj_gap=2,
                                                      resample_interval=3), kw)),
         lr=1e-2, decomposes=True),
    Case("poet", "poet", _poet_model,
         lambda m, ps, **kw: xt.POETAdamW(ps, **_kw(dict(lr=1e-2, merge_interval=2, model=m),
                                                    kw)),
         lr=1e-2),
    Case("poet/xq", "poet", _poet_xq_model,
         lambda m, ps, **kw: xt.POETAdamW(ps, **_kw(dict(lr=1e-2, merge_interval=2, model=m),
                                                    kw)),
         lr=1e-2),
    Case("mulo", "mulo", mlp,
         lambda m, ps, **kw: xt.MuLO(ps, **_kw(dict(num_training_steps=100, lr=1.0), kw)),
         lr=1.0, takes_loss=True, float32_state=True),
    Case("small_fc_lopt", "small_fc_lopt", mlp,
         lambda m, ps, **kw: xt.SmallFCLOpt(ps, **_kw(dict(num_training_steps=100, lr=1.0),
                                                      kw)),
         lr=1.0, takes_loss=True, float32_state=True),
    Case("velo", "velo", mlp,
         lambda m, ps, **kw: xt.VeLO(ps, **_kw(dict(num_training_steps=100, lr=1.0,
                                                    lstm_hidden_size=8, param_inits=4), kw)),
         lr=1.0, takes_loss=True, float32_state=True,
         not_applicable={"groups_independent_over_steps": (
             "VeLO's LSTM normalises its inputs over all tensors (learned_optimization's "
             "HyperV2), so from the second step on one group's lr moves every group's "
             "steps; the groups check compares one step")}),
]


#: the methods' torch layers: ``(name, build(dtype) -> module of input width 8, why its
#: training forward does not compile into one graph (a pattern of dynamo's error), or None)``.
#: Both compile in pieces without recompiling from step to step (the training-step check).
LAYERS = [
    # excluded from dynamo on purpose: the reason given to torch.compiler.disable
    ("compact/CompActLinear", lambda dtype: _compact_model(dtype)[0],
     r"torch.compiler.disable`? \(reason: .*draws its projection on the host at every forward"),
    # the plain path runs eagerly behind torch.compiler.disable (autograd's reference
    # bits): one graph break per call; the Triton path is one operator per call
    # (tests/test_poet_compile.py)
    ("poet/POETLinear", lambda dtype: _poet_model(dtype)[0],
     r"torch.compiler.disable`? \(reason: POETLinear's plain path"),
    ("poet/POETLinear-xq", lambda dtype: _poet_xq_model(dtype)[0],
     r"torch.compiler.disable`? \(reason: POETLinear's plain path"),
]


# -- driving a case -------------------------------------------------------------------------------


def set_grads(case: Case, model: nn.Module, k: int) -> None:
    (case.grads or normal_grads)(model, k, None)


def loss_of(k: int) -> torch.Tensor:
    """The loss a learned optimizer is given at step ``k`` (decreasing, like a loss)."""
    return torch.tensor(2.0 / (k + 1))


def step(case: Case, opt: torch.optim.Optimizer, k: int) -> Any:
    return opt.step(loss=loss_of(k)) if case.takes_loss else opt.step()


def build(case: Case, dtype: torch.dtype = torch.float32, params: Any = None,
          **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = case.model(dtype)
    opt = case.make(model, trainable(model) if params is None else params(model), **kw)
    return model, opt


def run(case: Case, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for k in steps:
        set_grads(case, model, k)
        step(case, opt, k)


# -- comparing everything, bit for bit -----------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _copy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, Mapping):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v)
    return v


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, *,
             drop_counters: bool = False) -> dict[str, Any]:
    """Everything a step or a load may change: the model's state (parameters and buffers),
    the optimizer's state by parameter position, its groups' hyperparameters, and the
    attributes it keeps outside them (POET's step counter)."""
    ids = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for k, st in opt.state.items():
        key = ids.get(id(k), k) if isinstance(k, torch.Tensor) else k
        st = {kk: _copy(v) for kk, v in st.items() if not (drop_counters and kk == SKIP_COUNTER)}
        if st:
            state[key] = st
    return {"model": _copy(model.state_dict()), "state": state,
            "groups": [_copy({k: v for k, v in g.items() if k != "params"})
                       for g in opt.param_groups],
            "extra": {k: getattr(opt, k) for k in ("global_step_counter",) if hasattr(opt, k)}}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` are the same, tensors bit for bit (NaN payloads and signed zeros
    included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, \
            (where, a.dtype, b.dtype, tuple(a.shape), tuple(b.shape))
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), (where, sorted(map(str, a)),
                                                             sorted(map(str, b)))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)
