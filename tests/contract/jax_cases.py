"""The JAX half of the contract suite: one case per optax transformation xopt ships.

A method joins by adding a :class:`JaxCase` to :func:`cases`: how to build its
transformation on a tiny pytree and which Flax model it trains; which of its
hyperparameters are injectable floats and which are static integers; which arguments its
settings do not read or refuse as arrays, each with its reason. The ``test_optax_*.py``
files run every check over every case; ``test_optax_transforms.py`` fails when a
registered method (``xopt.specs.names()``), a public transformation or a public Flax module
of ``xopt.jax`` has no case.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class JaxCase:
    """How one transformation joins the suite.

    Attributes:
      id: the test id (the transformation's name).
      method: the registry name of the method it implements.
      factory: the public factory (``xopt.jax.adamw``).
      kwargs: small, fast settings; every injectable hyperparameter is passed explicitly
        (``optax.inject_hyperparams`` injects only the arguments it is given).
      params: the tiny parameters (nested containers, a 0-d leaf).
      injectable: float hyperparameter -> another value (one that changes the update).
      static: integer hyperparameters (fix shapes, control flow or random streams): named
        in ``static_args`` under ``optax.inject_hyperparams``.
      not_arguments: numeric fields of the method's spec that are not arguments of the
        factory, with the reason. The cases of one factory together declare every
        numeric field of the method's spec.
      unread: arguments the case's settings do not read: name -> (a value, the reason);
        injecting the value changes nothing (the suite checks it).
      refused: arguments refused as arrays under the case's settings, with the reason
        (the suite checks that injecting them is a named error).
      loss: ``"required"``: ``update`` needs ``value=``; ``"read"``: optional, checked by
        the nonfinite policy; ``"ignored"``: accepted and unused.
      model: ``() -> (module, variables, trainable)``: a tiny Flax (linen) model this
        transformation trains (``trainable``: the collection it updates).
      modules: the public Flax modules ``model`` trains (each module joins the suite
        through the case of the transformation it is trained with).
      extra: ``(params, variables) -> kwargs`` the factory needs besides ``kwargs``, read
        from the parameters or the model's variables (CompAct: its projections).
      sanitises_nonfinite: the method's own rule for NaN/inf gradients (μLO: NaN -> 0), why
        ``nonfinite="ignore"`` does not pass them through; "" (default): it passes them.
      narrow_leaves: why a bfloat16/float16 leaf does not keep float32 state and a float32
        update (its new value rounded once by ``optax.apply_updates``, as the spec and
        xopt.torch round it); "" (default): it does (``test_cross_backend_bf16.py``).
    """

    id: str
    method: str
    factory: Callable[..., Any]
    kwargs: dict[str, Any]
    params: Callable[[], Any]
    injectable: dict[str, float]
    static: tuple[str, ...] = ()
    not_arguments: dict[str, str] = dataclasses.field(default_factory=dict)
    unread: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    loss: str = "ignored"
    model: Callable[[], tuple[Any, Any, str]] | None = None
    extra: Callable[[Any, Any], dict[str, Any]] | None = None
    modules: tuple[str, ...] = ()
    sanitises_nonfinite: str = ""
    narrow_leaves: str = ""

    def factory_kwargs(self, params: Any = None, variables: Any = None,
                       **overrides: Any) -> dict[str, Any]:
        """Everything the factory is called with for ``params`` (default: the tiny ones)."""
        params = self.params() if params is None else params
        kw = {} if self.extra is None else self.extra(params, variables)
        return {**kw, **self.kwargs, **overrides}

    def build(self, params: Any = None, variables: Any = None, **overrides: Any) -> Any:
        return self.factory(**self.factory_kwargs(params, variables, **overrides))

    def __repr__(self) -> str:
        return self.id


def tiny_params(seed: int = 0) -> dict[str, Any]:
    """A matrix, a vector in a list, a 0-d leaf: every method's shapes in three leaves."""
    r = np.random.default_rng(seed)
    return {"w": jnp.asarray(r.standard_normal((4, 3)), jnp.float32),
            "n": [{"b": jnp.asarray(r.standard_normal(3), jnp.float32)},
                  jnp.asarray(0.75, jnp.float32)]}


def conv_params(seed: int = 0) -> dict[str, Any]:
    """:func:`tiny_params` with a conv kernel (O, I, kh, kw) = (4, 3, 2, 2) added."""
    r = np.random.default_rng(seed + 1)
    return {**tiny_params(seed),
            "k": jnp.asarray(r.standard_normal((4, 3, 2, 2)), jnp.float32)}


def mlp(features: int = 3) -> tuple[Any, Any, str]:
    """A two-layer linen MLP on inputs of width 4 (the model of the plain transforms)."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(features)(jnp.tanh(nn.Dense(4)(x)))

    module = MLP()
    return module, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))), "params"


# -- CompAct: the optimizer reads its projections from the model ---------------------------


def _compact_model() -> tuple[Any, Any, str]:
    import flax.linen as nn

    from xopt.jax.compact import CompActDense

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = CompActDense(4, rank=0.5, seed=7, name="proj")(x)
            return nn.Dense(3, name="head")(jnp.tanh(h))

    module = Model()
    return module, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))), "params"


@functools.cache
def _compact_variables() -> Any:
    return _compact_model()[1]


def _compact_params() -> Any:
    params = jax.tree.map(lambda x: x, _compact_variables()["params"])
    return {"model": params, "extra": [jnp.asarray(0.5, jnp.float32)]}


def _compact_projections(params: Any, variables: Any) -> dict[str, Any]:
    from xopt.jax.compact import projections_from
    from xopt.specs import compact as spec

    if variables is not None:
        return {"projections": projections_from(variables["compact"], params)}

    flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    projections = {
        name: spec.Projection(kind="gaussian", in_features=leaf.shape[1],
                              rank=flat[name[:-len("weight")] + "compact_grad"].shape[1],
                              scale=1.0, seed=7, gap=2, jl_nnz=4)
        for name, leaf in flat.items()
        if name.endswith("/weight") and name[:-len("weight")] + "compact_grad" in flat}
    return {"projections": projections}


# -- POET-X: the optimizer of the rotations -------------------------------------------------


def _poet_model() -> tuple[Any, Any, str]:
    import flax.linen as nn

    from xopt.jax.poet import POETDense

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return POETDense(4, block_size=2, seed=3, name="rot")(x)

    module = Model()
    return module, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))), "params"


def _poet_xq_model() -> tuple[Any, Any, str]:
    """POET-XQ: the rotations over an 8-bit W0 (groups of 8)."""
    import flax.linen as nn

    from xopt.jax.poet import POETDense

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return POETDense(4, block_size=2, seed=3, variant="mem", weight_bits=8,
                             weight_group_size=8, name="rot")(x)

    module = Model()
    return module, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))), "params"


@functools.cache
def cases() -> tuple[JaxCase, ...]:
    import xopt.jax as xj

    return (
        JaxCase(
            id="adamw", method="adamw", factory=xj.adamw, params=tiny_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                        weight_decay=0.1),
            injectable=dict(learning_rate=3e-2, b1=0.5, b2=0.9, eps=0.3, eps_root=0.5,
                            weight_decay=0.7),
            narrow_leaves="xopt.jax.adamw is optax.adamw's arithmetic bit for bit, bfloat16 "
                          "leaves included: moments in the leaf's dtype and the update "
                          "rounded to it (docs/methods/adamw.md)"),
        JaxCase(
            id="galore", method="galore", factory=xj.galore, params=tiny_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, rank=2, update_proj_gap=2, scale=1.0, b1=0.9,
                        b2=0.999, eps=1e-6, weight_decay=0.1),
            injectable=dict(learning_rate=3e-2, scale=0.5, b1=0.5, b2=0.9, eps=0.3,
                            weight_decay=0.7),
            refused=dict(eps_root="the authors' convention has no ε_root (the spec refuses "
                                  "a non-zero one; an array cannot be checked)"),
            static=("rank", "update_proj_gap")),
        JaxCase(
            id="flora", method="flora", factory=xj.flora, params=tiny_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, rank=2, kappa=2, beta1=0.9, weight_decay=0.1,
                        clip_threshold=1.0, decay_rate=-0.8),
            injectable=dict(learning_rate=3e-2, beta1=0.5, weight_decay=0.7,
                            clip_threshold=0.05, decay_rate=-0.3),
            static=("rank", "kappa", "seed")),
        JaxCase(
            id="coap", method="coap", factory=xj.coap, params=tiny_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, rank=2, update_interval=2, reproject_factor=2,
                        scale=1.0, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.1,
                        proj_lr=0.1, proj_max_norm=1.0, eps_sq=1e-30, eps_scale=1e-3,
                        clip_threshold=1.0, decay_rate=-0.8),
            injectable=dict(learning_rate=3e-2, scale=0.5, b1=0.5, b2=0.9, eps=0.3,
                            weight_decay=0.7, proj_lr=0.9, proj_max_norm=1e-3),
            static=("rank", "rank_ratio", "rank_ratio_cnn", "min_conv_size", "state_bits",
                    "update_interval", "reproject_factor", "seed"),
            unread={name: (value, "Adafactor's (optimizer='adafactor', the coap_adafactor "
                                  "case); CoapAdamW does not read it")
                    for name, value in dict(eps_sq=0.5, eps_scale=5.0, clip_threshold=0.05,
                                            decay_rate=-0.3).items()}),
        JaxCase(
            id="coap_conv", method="coap", factory=xj.coap, params=conv_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, rank=2, rank_ratio_cnn=4.0, project=True,
                        update_interval=2, reproject_factor=2, restore_state=True, b1=0.9,
                        b2=0.999, eps=1e-6, weight_decay=0.1, proj_lr=0.1,
                        proj_max_norm=1.0),
            injectable=dict(learning_rate=3e-2, b1=0.5, b2=0.9, eps=0.3, weight_decay=0.7,
                            proj_lr=0.9, proj_max_norm=1e-3),
            static=("rank", "rank_ratio", "rank_ratio_cnn", "min_conv_size", "state_bits",
                    "update_interval", "reproject_factor", "seed")),
        JaxCase(
            id="coap_8bit", method="coap", factory=xj.coap, params=tiny_params, model=mlp,
            kwargs=dict(learning_rate=1e-2, rank=2, update_interval=2, reproject_factor=2,
                        state_bits=8, restore_state=True, b1=0.9, b2=0.999, eps=1e-6,
                        weight_decay=0.1),
            injectable=dict(learning_rate=3e-2, b1=0.5, b2=0.9, eps=0.3, weight_decay=0.7),
            static=("rank", "rank_ratio", "rank_ratio_cnn", "min_conv_size", "state_bits",
                    "update_interval", "reproject_factor", "seed")),
        JaxCase(
            id="coap_adafactor", method="coap", factory=xj.coap, params=tiny_params,
            model=mlp,
            kwargs=dict(preset="adafactor", learning_rate=1e-2, rank=2, update_interval=2,
                        reproject_factor=2, eps_sq=1e-30, eps_scale=1e-3,
                        clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.1),
            injectable=dict(learning_rate=3e-2, eps_sq=0.5, eps_scale=5.0,
                            clip_threshold=0.05, decay_rate=-0.3, weight_decay=0.7),
            static=("rank", "rank_ratio", "rank_ratio_cnn", "min_conv_size", "state_bits",
                    "update_interval", "reproject_factor", "seed")),
        JaxCase(
            id="plumage", method="plumage", factory=xj.plumage, params=tiny_params,
            model=mlp,
            kwargs=dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                        rank=2, update_proj_gap=2, prob_eps=1e-12),
            injectable=dict(learning_rate=3e-2, b1=0.5, b2=0.9, eps=0.3, weight_decay=0.7,
                            prob_eps=10.0),
            static=("rank", "update_proj_gap", "resample_interval", "seed")),
        poet := JaxCase(
            id="poet_adamw", method="poet", factory=xj.poet_adamw, params=tiny_params,
            model=_poet_model, modules=("POETDense",),
            kwargs=dict(learning_rate=1e-2, poet_scale=0.5, b1=0.9, b2=0.999, eps=1e-6,
                        weight_decay=0.1, merge_interval=2),
            injectable=dict(learning_rate=3e-2, poet_scale=0.25, b1=0.5, b2=0.9, eps=0.3,
                            weight_decay=0.7),
            static=("merge_interval",),
            not_arguments={f: "a property of the POETDense layer, not of its optimizer"
                           for f in ("block_size", "neumann_terms", "seed",
                                     "weight_group_size")}),
        # POET-XQ: the same optimizer over a layer holding W0 in 8 bits
        dataclasses.replace(poet, id="poet_adamw/xq", model=_poet_xq_model),
        JaxCase(
            id="compact_adamw", method="compact", factory=xj.compact_adamw,
            params=_compact_params, model=_compact_model, extra=_compact_projections,
            modules=("CompActDense",),
            kwargs=dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.1),
            injectable=dict(learning_rate=3e-2, b1=0.5, b2=0.9, eps=0.3, weight_decay=0.7),
            not_arguments={f: "a property of the CompActDense layer (its projection), which "
                              "the optimizer reads from projections=" for f in
                           ("rank", "scale", "scale_o_proj", "gap", "seed", "jl_nnz")}),
        JaxCase(
            id="small_fc_lopt", method="small_fc_lopt", factory=xj.small_fc_lopt,
            params=tiny_params, model=mlp, loss="read",
            kwargs=dict(num_training_steps=20, learning_rate=1.0, weight_decay=0.1,
                        weight_decay_mode="decoupled", exp_mult=0.001, step_mult=0.01),
            injectable=dict(learning_rate=0.5, weight_decay=0.7, exp_mult=0.5, step_mult=0.1),
            static=("num_training_steps", "max_training_steps", "hidden_size",
                    "hidden_layers", "seed")),
        JaxCase(
            id="mulo", method="mulo", factory=xj.mulo, params=tiny_params, model=mlp,
            loss="read",
            kwargs=dict(num_training_steps=20, learning_rate=1.0, weight_decay=0.1,
                        weight_decay_mode="decoupled", exp_mult=0.001, step_mult=0.01),
            injectable=dict(learning_rate=0.5, weight_decay=0.7, exp_mult=0.5, step_mult=0.1),
            static=("num_training_steps", "max_training_steps", "hidden_size",
                    "hidden_layers", "seed", "clip_grad", "mup_lr"),
            sanitises_nonfinite="μLO replaces NaN by 0 and ±inf by ±float32 max in the "
                                "gradient before its MLP reads it"),
        JaxCase(
            id="velo", method="velo", factory=xj.velo, params=tiny_params, model=mlp,
            loss="required",
            kwargs=dict(num_training_steps=20, learning_rate=1.0, weight_decay=0.1,
                        weight_decay_mode="decoupled", exp_mult=0.001, step_mult=0.01,
                        lstm_hidden_size=8, param_inits=4),
            injectable=dict(learning_rate=0.5, weight_decay=0.7, exp_mult=0.5, step_mult=0.1),
            static=("num_training_steps", "max_training_steps", "lstm_hidden_size",
                    "param_inits", "ff_hidden_size", "ff_hidden_layers", "seed")),
    )


def case(case_id: str) -> JaxCase:
    return next(c for c in cases() if c.id == case_id)


def grads_like(params: Any, step: int) -> Any:
    """Deterministic gradients of the parameters' shapes: a different draw per step."""
    r = np.random.default_rng(1000 + step)
    return jax.tree.map(lambda p: jnp.asarray(r.standard_normal(jnp.shape(p)), p.dtype),
                        params)


def loss_value(step: int) -> jax.Array:
    return jnp.asarray(1.0 + 0.25 * step, jnp.float32)


def update_kwargs(c: JaxCase, step: int) -> dict[str, Any]:
    """``value=`` for the transformations that read the loss."""
    return {} if c.loss == "ignored" else {"value": loss_value(step)}


def run(tx: Any, params: Any, steps: int, *, jit: bool = True, state: Any = None,
        c: JaxCase | None = None, first: int = 0) -> tuple[Any, Any, list[Any]]:
    """``steps`` updates from ``state`` (or ``tx.init``), at fixed parameters:
    ``(params, state, updates)``."""
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params) if state is None else state
    out = []
    for t in range(first, first + steps):
        kw = update_kwargs(c, t) if c is not None else {}
        u, state = update(grads_like(params, t), state, params, **kw)
        out.append(u)
    return params, state, out


# -- running and comparing -----------------------------------------------------------------


def names(tree: Any) -> list[str]:
    """Leaf names as xopt's errors write them (path keys joined by ``/``)."""
    from xopt.jax._contract import path_names

    return path_names(tree)


def _bits(x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "fc":
        return x
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bitwise(a: Any, b: Any, what: str) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for name, x, y in zip(names(a), jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}"
        assert np.array_equal(_bits(x), _bits(y)), f"{what} {name}: {x} vs {y}"


def max_rel(a: Any, b: Any) -> float:
    """The largest ``max|a − b| / max|b|`` over the leaves (float64)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size == 0:
            continue
        d = np.max(np.abs(x - y))
        if d:
            worst = max(worst, d / max(np.max(np.abs(y)), 1e-30))
    return worst


@dataclasses.dataclass
class Prepared:
    """A case's default transformation on its tiny params, run ``steps`` steps under jit
    through one trace-counting jitted update (shared by a test module's checks)."""

    c: JaxCase
    tx: Any
    params: Any
    update: Any
    traces: list[int]
    states: list[Any]  # the state before each step, and after the last
    updates: list[Any]


def prepare(c: JaxCase, steps: int) -> Prepared:
    params = c.params()
    tx = c.build(params)
    traces: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        traces.append(1)  # runs only while tracing
        return tx.update(*args, **kwargs)

    update = jax.jit(counted)
    state = tx.init(params)
    states, updates = [state], []
    for t in range(steps):
        u, state = update(grads_like(params, t), state, params, **update_kwargs(c, t))
        states.append(state)
        updates.append(u)
    return Prepared(c, tx, params, update, traces, states, updates)
