"""CompAct's layer parity driver: the authors' traces replayed through xopt's layers and optimizer.

``run_parity`` hands every ``kind: "layer"`` trace of ``compact`` to :func:`run`. Two kinds of
case are bundled (``xopt/parity/data/compact/``):

* a single linear layer (``modules.linear.SmallLinear``, with a bias or without one, as
  LLaMA's are): per step the recorded input ``x`` and ``∂L/∂y`` go through the forward and
  backward, then one optimizer update; compared: ``y``, ``grad_input``, ``grad/bias`` (with
  a bias), the compressed gradient ``compact_grad/weight``
  (the trace's ``aux/small_grad``), the saved activation ``z`` (``aux/xP``), the
  parameters and Adam's moments ``state/m/*``, ``state/v/*``;
* a two-block LLaMA (the authors' ``peft_pretraining.modeling_llama``, converted by their
  ``replace_parameters``): per step the token ids go through the model and the next-token
  loss, backward, and one update; compared: ``loss``, the full gradients of the unwrapped
  parameters, ``compact_grad/*`` of the wrapped ones, parameters and moments.

``against="golden"`` injects the authors' projections (``aux/P``, drawn by torch's generator)
into every runner; ``against`` a backend (``"torch"``, ``"jax"``, ``"oracle"``) compares
runs that all draw P with :mod:`xopt.random`. The float64 oracle (the spec under NumPy)
exists for the linear case; the LLaMA case's model is not part of the spec, so there the
oracle is not run (a note says so). The authors' code cannot run live here (their
``setup.py`` builds a CUDA extension whose sources are not in the repository), so
``"original"`` gives a note too.

The LLaMA is :mod:`xopt.parity.layers.llama`, written once for both frameworks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xopt.errors import TraceError
from xopt.parity.compare import closer_to, errors
from xopt.parity.harness import BadRequest, Run, available, backend_label, require_reference
from xopt.parity.layers import (
    LAYER_REQUIRES,
    float32_matmuls,
    integer,
    layer_backends,
    llama,
    reading_hyperparameters,
)
from xopt.parity.methods import get as get_parity
from xopt.parity.trace import Trace, step_prefix
from xopt.specs import compact as _spec

# -- reading the cases ---------------------------------------------------------------------------


class CompActCase:
    """What a trace asks for, read from its manifest."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        with reading_hyperparameters(trace.path):
            self._read(trace.hyperparameters)

    def _read(self, hyp: dict[str, Any]) -> None:
        trace = self.trace
        if "LlamaConfig" in hyp:
            self.kind = "llama"
            rp = hyp["replace_parameters"]
            self.config = dict(hyp["LlamaConfig"])
            for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "max_position_embeddings"):
                if integer(self.config[f], f"LlamaConfig.{f}") < 1:
                    raise ValueError(f"LlamaConfig.{f} = {self.config[f]} must be >= 1")
            if self.config["hidden_size"] % self.config["num_attention_heads"]:
                raise ValueError("LlamaConfig.hidden_size must be a multiple of "
                                 "num_attention_heads")
            self.config["rms_norm_eps"] = float(self.config["rms_norm_eps"])
            adam = hyp["SmallAdamW"]
            self.layers = {}
            for i, (name, lay) in enumerate(hyp["wrapped_layers"].items()):
                self.layers[name] = dict(lay, index=i)
            self.hp = _spec.CompAct(
                lr=adam["lr"], b1=adam["betas"][0], b2=adam["betas"][1], eps=adam["eps"],
                weight_decay=adam["weight_decay"], correct_bias=adam["correct_bias"],
                rank=rp["rank"], proj_type=rp["proj_type"], scale=rp["scale"],
                scale_o_proj=rp["scale_o_proj"], gap=rp["update_proj_gap"] or 0)
        elif "SmallLinear.like" in hyp:
            self.kind = "linear"
            lin, pr, adam = hyp["nn.Linear"], hyp["Projector"], hyp["SmallAdamW"]
            self.in_features = integer(lin["in_features"], "nn.Linear.in_features")
            self.out_features = integer(lin["out_features"], "nn.Linear.out_features")
            if min(self.in_features, self.out_features) < 1:
                raise ValueError("nn.Linear's in_features and out_features must be >= 1")
            if not isinstance(lin["bias"], bool):
                raise TypeError(f"nn.Linear.bias = {lin['bias']!r} is not a bool")
            self.bias = lin["bias"]
            self.hp = _spec.CompAct(
                lr=adam["lr"], b1=adam["betas"][0], b2=adam["betas"][1], eps=adam["eps"],
                weight_decay=adam["weight_decay"], correct_bias=adam["correct_bias"],
                rank=pr["rank"], proj_type=pr["proj_type"], scale=pr["scale"],
                gap=pr["gap"] or 0)
            self.layers = {"weight": dict(proj_type=pr["proj_type"], rank=pr["rank"],
                                          scale=pr["scale"], gap=pr["gap"],
                                          seed_initial=hyp["Projector.seed_initial"], index=0)}
        else:
            raise TraceError(f"{trace.path}: not a CompAct case this driver knows (neither a "
                             "SmallLinear nor a LlamaConfig in its hyperparameters)")
        if self.hp.proj_type != "gaussian":
            raise TraceError(f"{trace.path}: proj_type {self.hp.proj_type!r}; only gaussian "
                             "traces are known")

    # projection settings of each wrapped weight, with xopt's own seed for the layer
    def projections(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, _spec.Projection]:
        out = {}
        with reading_hyperparameters(self.trace.path):
            for name, lay in self.layers.items():
                m, n = shapes[name]
                ident = lay["proj_type"] == "id"
                out[name] = _spec.Projection(
                    kind="identity" if ident else "gaussian", in_features=n,
                    rank=n if ident else _spec.rank_of(n, lay["rank"]),
                    scale=float(lay["scale"]), seed=_spec.layer_seed(self.hp.seed, lay["index"]),
                    gap=integer(lay["gap"] or 0, f"{name}.gap"))
        return out

    def injected(self, t: int) -> dict[str, np.ndarray]:
        """The authors' P of step t per wrapped weight (identity layers have none)."""
        aux = self.trace.aux(t)
        if self.kind == "linear":
            return {"weight": aux["P"]}
        return {k[: -len("/P")]: v for k, v in aux.items() if k.endswith("/P")}

    def recorded_grads(self, t: int) -> dict[str, np.ndarray]:
        """What the authors' optimizer consumed at step t: Ĝ (``aux/small_grad``) for the
        wrapped weights, the full gradient for the others."""
        pre = step_prefix(t)
        aux = self.trace.aux(t)
        if self.kind == "linear":
            out = {"weight": aux["small_grad"]}
            if self.bias:
                out["bias"] = self.trace.array(f"{pre}/grad/bias")
            return out
        return {k: (aux[f"{k}/small_grad"] if k in self.layers
                    else self.trace.array(f"{pre}/grad/{k}")) for k in self.trace.params}

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        pre = step_prefix(t)
        if self.kind == "linear":
            return {"x": self.trace.array(f"{pre}/x"),
                    "grad_output": self.trace.array(f"{pre}/grad_output")}
        return {"x": self.trace.array(f"{pre}/x")}

    def state(self, t: int) -> dict[str, np.ndarray] | None:
        """Canonical state after update t (t = -1: None, the trace sets none)."""
        if t < 0:
            return None
        flat = self.trace.state_after(t)
        out: dict[str, Any] = {}
        for name in self.trace.params:
            out[f"m/{name}"] = flat[f"{name}/exp_avg"]
            out[f"v/{name}"] = flat[f"{name}/exp_avg_sq"]
        out["step"] = np.int64(flat["step"] if "step" in flat
                               else flat[f"{next(iter(self.trace.params))}/step"])
        return out

    def params(self, t: int) -> dict[str, np.ndarray]:
        return self.trace.init_params() if t < 0 else self.trace.params_after(t)

    def golden(self, t: int) -> dict[str, np.ndarray]:
        pre = step_prefix(t)
        tr = self.trace
        out: dict[str, np.ndarray] = {}
        aux = tr.aux(t)
        if self.kind == "linear":
            out["y"] = tr.array(f"{pre}/y")
            out["grad_input"] = tr.array(f"{pre}/grad_input")
            if self.bias:
                out["grad/bias"] = tr.array(f"{pre}/grad/bias")
            out["compact_grad/weight"] = aux["small_grad"]
            out["z"] = aux["xP"]
        else:
            out["loss"] = tr.array(f"{pre}/loss")
            for name in tr.params:
                if name in self.layers:
                    out[f"compact_grad/{name}"] = aux[f"{name}/small_grad"]
                else:
                    out[f"grad/{name}"] = tr.array(f"{pre}/grad/{name}")
        for k, v in tr.params_after(t).items():
            out[f"param/{k}"] = v
        st = self.state(t)
        for k, v in st.items():
            if k != "step":
                out[f"state/{k}"] = v
        return out


# -- runners -------------------------------------------------------------------------------------


class _TorchRunner:
    def __init__(self, case: CompActCase, device: str) -> None:
        import torch

        from xopt.torch.compact import CompActAdamW, CompActLinear, compact_model

        self.torch, self.case, self.device = torch, case, device
        hp = case.hp
        shapes = {k: tuple(v) for k, v in case.trace.params.items()}
        self.projections = case.projections(shapes)
        if case.kind == "linear":
            proj = self.projections["weight"]
            self.model = CompActLinear(case.in_features, case.out_features, bias=case.bias,
                                       rank=hp.rank, proj_type="gaussian", scale=proj.scale,
                                       seed=proj.seed, gap=proj.gap, device=device)
            self.layers = {"weight": self.model}
            # the authors' groups: [{'params': [bias] or []}, {'params': [weight]}]
            self.named = {"weight": self.model.weight}
            groups = [{"params": [self.model.weight]}]
            if case.bias:
                self.named["bias"] = self.model.bias
                groups.insert(0, {"params": [self.model.bias]})
        else:
            self.model = llama.torch_llama(case.config).to(device)
            converted = compact_model(self.model, rank=hp.rank, proj_type="gaussian",
                                      scale=hp.scale, scale_o_proj=hp.scale_o_proj, gap=hp.gap,
                                      seed=hp.seed)
            self.layers = {f"{n.replace('.', '/')}/weight": m for n, m in converted.items()}
            self.named = {n.replace(".", "/"): p for n, p in self.model.named_parameters()}
            small = [self.named[k] for k in self.layers]
            regular = [p for k, p in self.named.items() if k not in self.layers]
            groups = [{"params": regular}, {"params": small}]
        missing = set(case.trace.params) ^ set(self.named)
        if missing:
            raise TraceError(f"{case.trace.path}: parameters {sorted(missing)} do not match "
                             "the torch model's")
        for k, lay in self.layers.items():
            if lay.proj != self.projections[k]:
                raise TraceError(f"{case.trace.path}: layer {k}: {lay.proj} != "
                                 f"{self.projections[k]}")
        self.opt = CompActAdamW(groups, spec=hp.replace(seed=0))

    def _t(self, a: np.ndarray) -> Any:
        return self.torch.as_tensor(np.asarray(a)).to(self.device)

    def reset(self, params: dict[str, np.ndarray], state: dict[str, Any] | None, t: int) -> None:
        torch = self.torch
        with torch.no_grad():
            for k, v in params.items():
                self.named[k].copy_(self._t(v))
        for lay in self.layers.values():
            lay.set_proj_step(t)
        self.opt.state.clear()
        if state is not None:
            for k, p in self.named.items():
                s = {"step": torch.tensor(int(state["step"]), dtype=torch.int64),
                     "exp_avg": self._t(state[f"m/{k}"]).clone(),
                     "exp_avg_sq": self._t(state[f"v/{k}"]).clone()}
                if k in self.layers:
                    s["seed"] = self.layers[k].proj.seed
                self.opt.state[p] = s

    def step(self, t: int, inputs: dict[str, np.ndarray], inject: dict[str, np.ndarray] | None,
             feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        torch = self.torch
        for k, lay in self.layers.items():
            lay.__dict__.pop("projection", None)
            if inject is not None and k in inject:
                lay.projection = _fixed_projection(self._t(inject[k]))
        out: dict[str, np.ndarray] = {}
        if self.case.kind == "linear":
            x = self._t(inputs["x"]).requires_grad_(True)
            y = self.model(x)
            y.backward(self._t(inputs["grad_output"]))
            with torch.no_grad():
                z = x.detach() @ self.model.projection()
            out.update(y=y.detach(), grad_input=x.grad, z=z)
            if self.case.bias:
                out["grad/bias"] = self.model.bias.grad
            out["compact_grad/weight"] = self.model.weight.compact_grad
        else:
            loss = self.model(self._t(inputs["x"]))
            loss.backward()
            out["loss"] = loss.detach()
            for k, p in self.named.items():
                if k in self.layers:
                    out[f"compact_grad/{k}"] = p.compact_grad
                else:
                    out[f"grad/{k}"] = p.grad
        out = {k: v.detach().cpu().clone() for k, v in out.items()}
        if feed is not None:  # teacher forcing of the gradients: the recorded ones
            for k, p in self.named.items():
                if k in self.layers:
                    p.compact_grad = self._t(feed[k]).clone()
                else:
                    p.grad = self._t(feed[k]).clone()
        self.opt.step()
        self.opt.zero_grad()
        for k, p in self.named.items():
            out[f"param/{k}"] = p.detach().cpu().clone()
            st = self.opt.state[p]
            out[f"state/m/{k}"] = st["exp_avg"].cpu().clone()
            out[f"state/v/{k}"] = st["exp_avg_sq"].cpu().clone()
        return {k: v.numpy() for k, v in out.items()}


def _fixed_projection(p: Any) -> Callable[..., Any]:
    def projection(refresh: int | None = None, *, device: Any = None, dtype: Any = None) -> Any:
        return p if dtype is None else p.to(dtype)

    return projection


class _JaxRunner:
    def __init__(self, case: CompActCase) -> None:
        import jax
        import jax.numpy as jnp

        from xopt.jax.compact import CompActDense, compact_adamw, draw_projection

        self.jax, self.jnp, self.case = jax, jnp, case
        hp = case.hp
        shapes = {k: tuple(v) for k, v in case.trace.params.items()}
        self.projections = case.projections(shapes)
        if case.kind == "linear":
            proj = self.projections["weight"]
            self.module = CompActDense(case.out_features, use_bias=case.bias, rank=hp.rank,
                                       scale=proj.scale, seed=proj.seed, gap=proj.gap)
            x0 = jnp.zeros((1, case.in_features), jnp.float32)
            variables = self.module.init(jax.random.PRNGKey(0), x0)
            self.compact = variables["compact"]
            self.carrier = {"weight": "compact_grad"}

            def apply(params, x, step, p):
                return self.module.apply({"params": params, "compact": self.compact}, x,
                                         step=step, projection=p)

            def fwd_bwd(params, x, g, step, p):
                y, vjp = jax.vjp(lambda prm, xx: apply(prm, xx, step, p), params, x)
                gp, gx = vjp(g)
                return y, gp, gx

            self.fwd_bwd = jax.jit(fwd_bwd)
            self.draw = jax.jit(lambda step: draw_projection(
                proj, step // proj.gap if proj.gap else 0))
        else:
            self.carrier = {w: w[: -len("weight")] + "compact_grad" for w in self.projections}
            cfg = case.config
            projections = self.projections

            def loss_fn(params, ids, step, ps):
                return jax_llama_loss(params, ids, cfg, projections, step, ps)

            self.value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
        self.tx = compact_adamw(spec=hp, projections=self.projections)
        self.update = jax.jit(self.tx.update)

    def reset(self, params: dict[str, np.ndarray], state: dict[str, Any] | None, t: int) -> None:
        from xopt.jax.compact import CompActAdamState

        jnp = self.jnp
        p = {k: jnp.asarray(v) for k, v in params.items()}
        for w, c in self.carrier.items():
            m = params[w].shape[0]
            p[c] = jnp.zeros((m, self.projections[w].rank), jnp.float32)
        self.params = p
        self.t = t
        if state is None:
            self.opt_state = self.tx.init(p)
        else:
            names = list(params)
            self.opt_state = CompActAdamState(
                count=jnp.asarray(int(state["step"]), jnp.int32),
                mu={k: jnp.asarray(state[f"m/{k}"]) for k in names},
                nu={k: jnp.asarray(state[f"v/{k}"]) for k in names})

    def step(self, t: int, inputs: dict[str, np.ndarray], inject: dict[str, np.ndarray] | None,
             feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        jnp = self.jnp
        assert t == self.t
        step = jnp.asarray(t, jnp.int32)
        out: dict[str, Any] = {}
        ps = {w: (jnp.asarray(inject[w]) if inject is not None and w in inject else None)
              for w in self.projections}
        if self.case.kind == "linear":
            x = jnp.asarray(inputs["x"])
            y, gp, gx = self.fwd_bwd(self.params, x, jnp.asarray(inputs["grad_output"]), step,
                                     ps["weight"])
            pm = ps["weight"] if ps["weight"] is not None else self.draw(step)
            out.update(y=y, grad_input=gx, z=x @ pm)
            if self.case.bias:
                out["grad/bias"] = gp["bias"]
            out["compact_grad/weight"] = gp["compact_grad"]
        else:
            loss, gp = self.value_and_grad(self.params, jnp.asarray(inputs["x"]), step, ps)
            out["loss"] = loss
            for k in self.case.trace.params:
                if k in self.projections:
                    out[f"compact_grad/{k}"] = gp[self.carrier[k]]
                else:
                    out[f"grad/{k}"] = gp[k]
        if feed is not None:  # teacher forcing of the gradients: the recorded ones
            gp = dict(gp)
            for k, v in feed.items():
                gp[self.carrier.get(k, k)] = jnp.asarray(v)
        inj = {w: v for w, v in ps.items() if v is not None}
        updates, self.opt_state = self.update(gp, self.opt_state, self.params, inject=inj)
        self.params = {k: self.params[k] + updates[k] for k in self.params}
        self.t += 1
        for k in self.case.trace.params:
            out[f"param/{k}"] = self.params[k]
            out[f"state/m/{k}"] = self.opt_state.mu[k]
            out[f"state/v/{k}"] = self.opt_state.nu[k]
        return {k: np.asarray(v) for k, v in out.items()}


class _OracleRunner:
    """The spec in NumPy float64 (linear case only); P is float32 (drawn or recorded) and
    then widened, since it is an input, not a result."""

    def __init__(self, case: CompActCase) -> None:
        self.case = case
        shapes = {k: tuple(v) for k, v in case.trace.params.items()}
        self.projections = case.projections(shapes)

    def reset(self, params: dict[str, np.ndarray], state: dict[str, Any] | None, t: int) -> None:
        self.params = {k: np.asarray(v, np.float64) for k, v in params.items()}
        if state is None:
            self.state = _spec.init_state(self.case.hp, self.params, xp=np, dtype=np.float64,
                                          projections=self.projections)
        else:
            self.state = {k: (np.asarray(v, np.float64) if k != "step" else v)
                          for k, v in state.items()}
        self.t = t

    def step(self, t: int, inputs: dict[str, np.ndarray], inject: dict[str, np.ndarray] | None,
             feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        proj = self.projections["weight"]
        if inject is not None:
            p = np.asarray(inject["weight"], np.float64)
        else:
            p = np.asarray(_spec.projection(proj, proj.refresh(t)), np.float64)
        x = np.asarray(inputs["x"], np.float64)
        g = np.asarray(inputs["grad_output"], np.float64)
        w, b = self.params["weight"], self.params.get("bias")
        y, z = _spec.linear_forward(x, w, b, p, xp=np)
        gx, g_hat, gb = _spec.linear_backward(g, z, w, b is not None, xp=np)
        grads = {"weight": g_hat} if b is None else {"weight": g_hat, "bias": gb}
        if feed is not None:
            grads = {k: np.asarray(v, np.float64) for k, v in feed.items()}
        self.params, self.state = _spec.step(self.case.hp, self.params, self.state, grads,
                                             xp=np, projections=self.projections,
                                             inject={"weight": {"P": p}})
        out = {"y": y, "grad_input": gx, "z": z, "compact_grad/weight": g_hat}
        if b is not None:
            out["grad/bias"] = gb
        for k, v in self.params.items():
            out[f"param/{k}"] = v
            out[f"state/m/{k}"] = self.state[f"m/{k}"]
            out[f"state/v/{k}"] = self.state[f"v/{k}"]
        return out


# -- the LLaMA case's loss in JAX ------------------------------------------------------------------


def jax_llama_loss(params: dict[str, Any], ids: Any, cfg: dict[str, Any],
                   projections: dict[str, _spec.Projection], step: Any,
                   injected: dict[str, Any]) -> Any:
    """:func:`xopt.parity.layers.llama.loss` in jax.numpy; CompAct weights
    (``projections``) go through :func:`xopt.jax.compact.compact_linear` with their carriers
    ``<layer>/compact_grad``, with the injected P where given, else xopt's draw."""
    import jax

    from xopt.jax.compact import compact_linear, draw_projections

    drawn = draw_projections({k: v for k, v in projections.items()
                              if injected.get(k) is None}, step)

    def linear(x: Any, name: str) -> Any:
        w = params[name]
        if name not in projections:
            return x @ w.T
        p = injected.get(name)
        p = drawn.get(name) if p is None else p
        p = None if p is None else jax.lax.stop_gradient(p)
        return compact_linear(x, w, None, params[name[: -len("weight")] + "compact_grad"], p)

    return llama.loss(cfg, ids, ops=llama.jax_ops(), weight=params.__getitem__, linear=linear)


# -- the driver ----------------------------------------------------------------------------------


def _runner(which: str, case: CompActCase, device: str) -> Any:
    if which == "torch":
        return _TorchRunner(case, device)
    if which == "jax":
        return _JaxRunner(case)
    return _OracleRunner(case)


@float32_matmuls
def _drive(runner: Any, case: CompActCase, mode: str, steps: int, inject: bool
           ) -> list[dict[str, np.ndarray]]:
    out = []
    if mode == "closed_loop":
        runner.reset(case.params(-1), case.state(-1), 0)
    for t in range(steps):
        if mode == "teacher_forced":
            runner.reset(case.params(t - 1), case.state(t - 1), t)
        feed = case.recorded_grads(t) if mode == "teacher_forced" and inject else None
        out.append(runner.step(t, case.inputs(t), case.injected(t) if inject else None, feed))
    return out


@float32_matmuls
def run(trace: Trace, *, backends: Sequence[str], against: str, modes: Sequence[str],
        impl: str = "plain", device: str = "cpu", max_steps: int | None = None,
        notes: list[str], explicit_backends: bool = False) -> list[Run]:
    """Run CompAct's comparisons on one layer trace; see the module docstring."""
    parity = get_parity("compact")
    case = CompActCase(trace)
    steps = trace.steps if max_steps is None else min(max_steps, trace.steps)
    def skip(b: str) -> str | None:
        if b == "oracle" and case.kind != "linear":
            return (f"oracle not run on {trace.name}: the LLaMA model's forward is not "
                    "part of the spec (the oracle covers the single-layer case)")
        return None

    selected = layer_backends(
        backends, explicit_backends, notes,
        "the authors' CompAct (github.com/NitzanHod/compact) not run live: it does not "
        "install (its setup.py builds the CUDA extension lomem._C from sources absent from "
        "the repository); its recordings are the golden traces", skip)
    if against == "original":
        raise BadRequest("--against original: the authors' CompAct cannot run here (see the "
                         "note); compare against golden, torch, jax or oracle")
    if against in ("torch", "jax", "oracle"):
        if against == "oracle" and case.kind != "linear":
            raise BadRequest(f"--against oracle: no oracle for {trace.name}")
        require_reference(against, LAYER_REQUIRES)
    inject = against == "golden"
    if inject:
        notes.append("compact: against golden, every runner uses the authors' recorded "
                     "projections (aux/P); against a backend, P comes from xopt.random")
    needed = list(dict.fromkeys(selected + ([against] if against != "golden" else [])))
    with_oracle = case.kind == "linear" and "oracle" not in needed and available(())
    runs: list[Run] = []
    runners: dict[str, Any] = {}  # reused across modes: jax compiles each step function once
    for mode in modes:
        outputs: dict[str, list[dict[str, np.ndarray]]] = {}
        for which in needed + (["oracle"] if with_oracle else []):
            if which not in runners:
                runners[which] = _runner(which, case, device)
            outputs[which] = _drive(runners[which], case, mode, steps, inject)
        outputs["golden"] = [case.golden(t) for t in range(steps)]
        for which in selected:
            if which == against:
                continue
            a, b = outputs[which], outputs[against]
            per_step = [errors(x, y) for x, y in zip(a, b, strict=True)]
            r = Run(trace=trace.name, backend=backend_label(which), impl="plain",
                    against=backend_label(against), mode=mode, steps=steps,
                    tolerance=parity.tolerance(mode), per_step=per_step)
            if "oracle" in outputs and "oracle" not in (which, against):
                t, k, _ = r.worst
                if k:
                    r.oracle_agrees_with = closer_to(outputs["oracle"][t][k], a[t][k], b[t][k])
            runs.append(r)
    return runs
