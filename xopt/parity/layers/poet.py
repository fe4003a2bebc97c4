"""POET-X's layer traces: run xopt's layers and optimizer on them and compare.

:func:`run` is POET's layer driver (:mod:`xopt.parity.methods.poet`): ``run_parity``
hands it every ``kind: "layer"`` trace of ``poet``. Two kinds of case are recorded from the
authors' ``poet_torch``:

* ``cayley_neumann*``: stateless evaluations of ``get_weight_poet``: upper triangles ``x``
  in, the CNP blocks ``y`` and ``∂⟨y, grad_output⟩/∂x`` out (``aux/Q``: the skew
  matrices). ``*_triton`` cases ran the authors' Triton kernel (the ``"product"``
  formula), the others their PyTorch fallback (``"taylor"``).
* ``linear_*`` and ``train_*``: a ``POETLinear`` with ``POETAdamW``: per step the layer's
  output, input and ``oft_R`` gradients, then the update, then (``train_*``) a merge
  every ``merge_interval`` updates. Permutations are the authors' ``torch.randperm``
  draws: they are injected from ``aux/perm_*`` (and ``aux/new_perm_*`` at merges).

Modes: teacher-forced resets each implementation to the recorded parameters, ``W0``,
optimizer state and permutations before every step and feeds the recorded
``grad_output``; closed loop starts from ``init`` and runs on its own outputs, computing
``grad_output`` of the trace's MSE loss from its own ``y`` where the trace records the
``target`` (``train_*``), else feeding the recorded one. The stateless CNP cases have no
loop: both modes evaluate the same thing.

Implementations: ``xopt.torch`` (``POETLinear`` + ``POETAdamW``; each of the fast and mem
variants; ``impl="triton"`` uses the kernels, on CUDA or under ``TRITON_INTERPRET=1``),
``xopt.jax`` (``POETDense`` + ``poet_adamw``; fast and mem) and the float64 oracle (the
spec's functions under NumPy, with the explicit backward). Rows are labelled
``impl = "<impl>/<variant>"``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from xopt.errors import TraceError
from xopt.parity.compare import closer_to, errors
from xopt.parity.harness import BadRequest, Run, available, backend_label, require_reference
from xopt.parity.layers import (
    LAYER_REQUIRES,
    float32_matmuls,
    integer,
    layer_backends,
    reading_hyperparameters,
)
from xopt.parity.methods import get as get_parity
from xopt.parity.trace import Trace, step_prefix
from xopt.specs import poet as P


def formula_of(trace: Trace) -> str:
    """Which CNP polynomial recorded the trace: the Triton kernel's or the fallback's."""
    src = trace.manifest["source"]
    if "poet::cayley" in src.get("object", "") or "torch.ops.poet.cayley" in src.get("object", ""):
        if "not registered" not in src.get("object", ""):
            return "product"
    triton = str(src.get("versions", {}).get("triton", ""))
    if trace.case.startswith("cayley") or triton.startswith("not importable"):
        return "taylor"
    return "product"


def hyperparams(trace: Trace) -> P.POET:
    """The spec's hyperparameters for a layer trace (the authors' names → xopt's)."""
    with reading_hyperparameters(trace.path):
        return _hyperparams(trace)


def _hyperparams(trace: Trace) -> P.POET:
    h = trace.hyperparameters
    if "POETConfig" not in h:
        return P.POET(block_size=integer(h["block_size"], "block_size"),
                      cayley_formula=formula_of(trace))
    cfg, opt = h["POETConfig"], h.get("POETAdamW", {})
    group = opt.get("oft_R_group", {})
    betas = opt.get("betas", [0.9, 0.999])
    return P.POET(block_size=integer(cfg["block_size"], "POETConfig.block_size"),
                  merge_interval=integer(cfg["merge_interval"], "POETConfig.merge_interval"),
                  lr=float(group.get("lr", cfg["poet_lr"])),
                  poet_scale=float(opt.get("poet_scale", cfg["poet_scale"])),
                  b1=float(betas[0]), b2=float(betas[1]), eps=float(opt.get("eps", 1e-6)),
                  weight_decay=float(group.get("weight_decay", 0.0)),
                  correct_bias=bool(opt.get("correct_bias", True)),
                  cayley_formula=formula_of(trace), variant="fast")


def _is_cnp(trace: Trace) -> bool:
    return "oft_R" not in trace.manifest.get("params", {})


# -- the stateless CNP cases ------------------------------------------------------------------


def _cnp_outputs(trace: Trace, which: str, impl: str, device: str, steps: int,
                 hp: P.POET) -> list[dict[str, np.ndarray]]:
    b = hp.block_size
    out = []
    for t in range(steps):
        pre = step_prefix(t)
        x = trace.array(f"{pre}/x")
        g = trace.array(f"{pre}/grad_output")
        if which == "oracle":
            x64, g64 = x.astype(np.float64), g.astype(np.float64)
            q = P.skew(x64, b)
            y = P.cayley_neumann(q, 3, hp.cayley_formula)
            gi = P.triu_grad(P.cayley_neumann_vjp(q, g64, 3, hp.cayley_formula), b)
        elif which == "torch":
            import torch

            xt = torch.tensor(x, device=device, requires_grad=True)
            if impl == "triton":
                from xopt.kernels import poet_cayley

                q = poet_cayley.skew(xt.detach(), b)
                yt = poet_cayley.cayley_neumann(xt, b, hp.cayley_formula)
            else:
                q = P.skew(xt.detach(), b, xp=torch)
                yt = P.cayley_neumann(P.skew(xt, b, xp=torch), 3, hp.cayley_formula, xp=torch)
            (gt,) = torch.autograd.grad(yt, xt, torch.tensor(g, device=device))
            y, gi, q = yt.detach().cpu().numpy(), gt.cpu().numpy(), q.cpu().numpy()
        else:
            import jax
            import jax.numpy as jnp

            def f(v):
                return P.cayley_neumann(P.skew(v, b, xp=jnp), 3, hp.cayley_formula, xp=jnp)

            y, vjp = jax.vjp(f, jnp.asarray(x))
            (gi,) = vjp(jnp.asarray(g))
            q = P.skew(jnp.asarray(x), b, xp=jnp)
            y, gi, q = np.asarray(y), np.asarray(gi), np.asarray(q)
        out.append({"y": y, "grad_input": gi, "aux/Q": q})
    return out


def _cnp_golden(trace: Trace, steps: int) -> list[dict[str, np.ndarray]]:
    return [{k: trace.array(f"{step_prefix(t)}/{k}") for k in ("y", "grad_input", "aux/Q")}
            for t in range(steps)]


# -- the layer + optimizer cases -----------------------------------------------------------------

_STATE_KEYS = ("oft_R/exp_avg", "oft_R/exp_avg_sq", "oft_R/step", "global_step_counter")


class _Sim:
    """One implementation of the layer and its optimizer, driven step by step."""

    def load(self, params: dict, state: dict | None, perm_in, perm_out) -> None: ...
    def fwd_bwd(self, x, grad_output, target) -> dict[str, np.ndarray]: ...
    def opt_step(self, grad=None) -> None:
        """The optimizer update, from ``grad`` (the trace's) if given, else this
        implementation's own gradient."""
    def merge(self, perm_in, perm_out) -> None: ...
    def read(self) -> dict[str, np.ndarray]: ...


class _OracleSim(_Sim):
    def __init__(self, hp: P.POET, n_in: int, n_out: int):
        self.hp, self.n_in, self.n_out = hp, n_in, n_out
        self.b = hp.block_size
        self.r_out = n_out // self.b

    def load(self, params, state, perm_in, perm_out):
        self.oft = params["oft_R"].astype(np.float64)
        self.w = params["weight"].astype(np.float64)
        self.pin, self.pout = np.asarray(perm_in, np.int64), np.asarray(perm_out, np.int64)
        if state is None:
            self.state = P.init_state(self.hp, {"oft_R": self.oft}, dtype=np.float64)
        else:
            self.state = {"global_step": np.int64(state["global_step_counter"]),
                          "step/oft_R": np.int64(state["oft_R/step"]),
                          "m/oft_R": state["oft_R/exp_avg"].astype(np.float64),
                          "v/oft_R": state["oft_R/exp_avg_sq"].astype(np.float64)}

    def fwd_bwd(self, x, grad_output, target):
        hp = self.hp
        ro, ri = P.rotations(self.oft, self.b, self.r_out, hp.neumann_terms, hp.cayley_formula)
        x = x.astype(np.float64)
        y, y1 = P.layer_forward(x, ro, ri, self.w, None, P.inverse(self.pin), self.pout)
        out = {"y": y}
        if target is not None:
            d = y - target.astype(np.float64)
            out["loss"] = np.asarray((d * d).mean())
            if grad_output is None:
                grad_output = 2.0 * d / d.size
        g = grad_output.astype(np.float64)
        gx, gro, gri, _ = P.layer_backward(x, g, ro, ri, self.w, self.pin, P.inverse(self.pin),
                                           P.inverse(self.pout), y1)
        self.grad = P.rotations_vjp(self.oft, gro, gri, self.b, hp.neumann_terms,
                                    hp.cayley_formula)
        out["grad_input"], out["grad/oft_R"] = gx, self.grad
        return out

    def opt_step(self, grad=None):
        g = self.grad if grad is None else grad.astype(np.float64)
        p, self.state = P.step(self.hp, {"oft_R": self.oft}, self.state, {"oft_R": g})
        self.oft = p["oft_R"]

    def merge(self, perm_in, perm_out):
        hp = self.hp
        ro, ri = P.rotations(self.oft, self.b, self.r_out, hp.neumann_terms, hp.cayley_formula)
        self.w = P.merged_weight(self.w, ro, ri, self.pin, self.pout, P.inverse(perm_in),
                                 P.inverse(perm_out))
        self.pin, self.pout = np.asarray(perm_in, np.int64), np.asarray(perm_out, np.int64)
        self.oft = np.zeros_like(self.oft)

    def read(self):
        s = self.state
        return {"param/oft_R": self.oft, "param/weight": self.w,
                "state/oft_R/exp_avg": s["m/oft_R"], "state/oft_R/exp_avg_sq": s["v/oft_R"],
                "state/oft_R/step": np.int64(s["step/oft_R"]),
                "state/global_step_counter": np.int64(s["global_step"])}


class _TorchSim(_Sim):
    def __init__(self, hp: P.POET, n_in: int, n_out: int, impl: str, device: str):
        import torch

        from xopt.torch.poet import POETAdamW, POETLinear

        self.torch = torch
        self.layer = POETLinear(n_in, n_out, spec=hp, impl=impl, device=device)
        self.opt = POETAdamW([self.layer.oft_R], spec=hp)
        self.device = device

    def load(self, params, state, perm_in, perm_out):
        torch = self.torch
        with torch.no_grad():
            self.layer.oft_R.copy_(torch.as_tensor(params["oft_R"]))
            self.layer.weight.copy_(torch.as_tensor(params["weight"]))
        self.layer.set_permutations(perm_in, perm_out)
        self.opt.state.clear()
        self.opt.global_step_counter = 0
        if state is not None:
            self.opt.global_step_counter = int(state["global_step_counter"])
            self.opt.state[self.layer.oft_R] = {
                "step": int(state["oft_R/step"]),
                "exp_avg": torch.tensor(state["oft_R/exp_avg"], device=self.device),
                "exp_avg_sq": torch.tensor(state["oft_R/exp_avg_sq"], device=self.device)}

    def fwd_bwd(self, x, grad_output, target):
        torch = self.torch
        xt = torch.tensor(x, device=self.device, requires_grad=True)
        self.layer.oft_R.grad = None
        y = self.layer(xt)
        out = {}
        if target is not None:
            loss = torch.nn.functional.mse_loss(y, torch.tensor(target, device=self.device))
            out["loss"] = loss.detach().cpu().numpy()
        if grad_output is None:
            loss.backward()
        else:
            y.backward(torch.tensor(grad_output, device=self.device))
        out.update({"y": y.detach().cpu().numpy(), "grad_input": xt.grad.cpu().numpy(),
                    "grad/oft_R": self.layer.oft_R.grad.cpu().numpy()})
        return out

    def opt_step(self, grad=None):
        if grad is not None:
            self.layer.oft_R.grad = self.torch.tensor(grad, device=self.device)
        self.opt.step()

    def merge(self, perm_in, perm_out):
        self.layer.merge_and_reset(perm_in, perm_out)

    def read(self):
        st = self.opt.state[self.layer.oft_R]
        def arr(t):  # a copy: on the CPU .numpy() shares memory with the live tensor
            return t.detach().cpu().numpy().copy()

        return {"param/oft_R": arr(self.layer.oft_R), "param/weight": arr(self.layer.weight),
                "state/oft_R/exp_avg": arr(st["exp_avg"]),
                "state/oft_R/exp_avg_sq": arr(st["exp_avg_sq"]),
                "state/oft_R/step": np.int64(st["step"]),
                "state/global_step_counter": np.int64(self.opt.global_step_counter)}


class _JaxSim(_Sim):
    def __init__(self, hp: P.POET, n_in: int, n_out: int):
        import jax
        import jax.numpy as jnp

        from xopt.jax import poet as jp

        self.jax, self.jnp, self.jp, self.hp = jax, jnp, jp, hp
        self.model = jp.POETDense(features=n_out, spec=hp, seed=0)
        self.vars = jax.tree.map(np.asarray, self.model.init(jax.random.PRNGKey(0),
                                                             jnp.zeros((1, n_in), jnp.float32)))
        self.tx = jp.poet_adamw(spec=hp)
        model = self.model

        def loss_free(oft, x, poet):
            return model.apply({"params": {"oft_R": oft}, "poet": poet}, x)

        @jax.jit
        def fwd_bwd(oft, x, g, poet):
            y, vjp = jax.vjp(lambda o, xx: loss_free(o, xx, poet), oft, x)
            go, gx = vjp(g)
            return y, go, gx

        @jax.jit
        def fwd(oft, x, poet):
            return loss_free(oft, x, poet)

        @jax.jit
        def update(g, state, oft):
            u, state = self.tx.update({"oft_R": g}, state, {"oft_R": oft})
            return oft + u["oft_R"], state

        self._fwd_bwd, self._fwd, self._update = fwd_bwd, fwd, update

    def load(self, params, state, perm_in, perm_out):
        jnp = self.jnp
        self.oft = jnp.asarray(params["oft_R"])
        poet = dict(self.vars["poet"])
        poet["weight"] = jnp.asarray(params["weight"])
        for name, p in (("perm_in", perm_in), ("perm_out", perm_out)):
            poet[name] = jnp.asarray(np.asarray(p), jnp.int32)
            poet[name + "_inv"] = jnp.asarray(P.inverse(p), jnp.int32)
        self.poet = poet
        if state is None:
            self.state = self.tx.init({"oft_R": self.oft})
        else:
            self.state = self.jp.POETAdamWState(
                count=jnp.asarray(state["global_step_counter"], jnp.int32),
                step={"oft_R": jnp.asarray(state["oft_R/step"], jnp.int32)},
                mu={"oft_R": jnp.asarray(state["oft_R/exp_avg"])},
                nu={"oft_R": jnp.asarray(state["oft_R/exp_avg_sq"])})

    def fwd_bwd(self, x, grad_output, target):
        jnp = self.jnp
        out = {}
        if grad_output is None or target is not None:
            y = np.asarray(self._fwd(self.oft, jnp.asarray(x), self.poet))
            if target is not None:
                d = y - target
                out["loss"] = np.asarray(np.mean(d * d), np.float32)
                if grad_output is None:
                    grad_output = (np.float32(2.0 / d.size) * d).astype(np.float32)
        y, go, gx = self._fwd_bwd(self.oft, jnp.asarray(x), jnp.asarray(grad_output), self.poet)
        self.grad = go
        out.update({"y": np.asarray(y), "grad_input": np.asarray(gx),
                    "grad/oft_R": np.asarray(go)})
        return out

    def opt_step(self, grad=None):
        g = self.grad if grad is None else self.jnp.asarray(grad)
        self.oft, self.state = self._update(g, self.state, self.oft)

    def merge(self, perm_in, perm_out):
        p, q = self.jp.merge_layer({"oft_R": self.oft}, self.poet, self.hp, perm_in, perm_out)
        self.oft, self.poet = p["oft_R"], q

    def read(self):
        s = self.state
        return {"param/oft_R": np.asarray(self.oft),
                "param/weight": np.asarray(self.poet["weight"]),
                "state/oft_R/exp_avg": np.asarray(s.mu["oft_R"]),
                "state/oft_R/exp_avg_sq": np.asarray(s.nu["oft_R"]),
                "state/oft_R/step": np.int64(s.step["oft_R"]),
                "state/global_step_counter": np.int64(s.count)}


def _make_sim(which: str, hp: P.POET, n_in: int, n_out: int, impl: str, device: str) -> _Sim:
    if which == "oracle":
        return _OracleSim(hp, n_in, n_out)
    if which == "torch":
        return _TorchSim(hp, n_in, n_out, impl, device)
    return _JaxSim(hp, n_in, n_out)


def _state_before(trace: Trace, t: int) -> dict | None:
    if t < 0:
        return None
    s = trace.state_after(t)
    missing = [k for k in _STATE_KEYS if k not in s]
    if missing:
        raise TraceError(f"{trace.npz_path}: {step_prefix(t)}/state lacks {', '.join(missing)}")
    return s


def _drive_layer(sim: _Sim, trace: Trace, mode: str, steps: int) -> list[dict[str, np.ndarray]]:
    out = []
    for t in range(steps):
        pre = step_prefix(t)
        aux = trace.aux(t)
        if mode == "teacher_forced" or t == 0:
            params = trace.init_params() if t == 0 else trace.params_after(t - 1)
            sim.load(params, _state_before(trace, t - 1), aux["perm_in"], aux["perm_out"])
        target = trace.array(f"{pre}/target") if trace.has(f"{pre}/target") else None
        if mode == "teacher_forced" or target is None:
            g = trace.array(f"{pre}/grad_output")
        else:
            g = None
        rec = sim.fwd_bwd(trace.array(f"{pre}/x"), g, target)
        # Teacher-forced, the update consumes the recorded gradient: the layer's gradient is
        # compared on its own, and Adam's first step after a reset would otherwise amplify
        # its float32 rounding (see TOLERANCES["closed_loop"] in xopt/parity/methods/poet.py).
        sim.opt_step(trace.array(f"{pre}/grad/oft_R") if mode == "teacher_forced" else None)
        if "merged" in aux and int(aux["merged"]):
            sim.merge(aux["new_perm_in"], aux["new_perm_out"])
        rec.update(sim.read())
        out.append(rec)
    return out


def _layer_golden(trace: Trace, steps: int) -> list[dict[str, np.ndarray]]:
    out = []
    for t in range(steps):
        pre = step_prefix(t)
        rec = {k: trace.array(f"{pre}/{k}") for k in ("y", "grad_input", "grad/oft_R")}
        if trace.has(f"{pre}/loss"):
            rec["loss"] = trace.array(f"{pre}/loss")
        for k, v in trace.params_after(t).items():
            rec[f"param/{k}"] = v
        for k, v in _state_before(trace, t).items():
            rec[f"state/{k}"] = v
        out.append(rec)
    return out


# -- the driver --------------------------------------------------------------------------------


@float32_matmuls
def run(trace: Trace, *, backends: Sequence[str], against: str, modes: Sequence[str],
        impl: str, device: str, max_steps: int | None, notes: list[str],
        explicit_backends: bool = False) -> list[Run]:
    """The comparisons of one POET layer trace (see the module docstring)."""
    parity = get_parity("poet")
    hp = hyperparams(trace)
    steps = trace.steps if max_steps is None else min(max_steps, trace.steps)
    cnp = _is_cnp(trace)
    if impl == "triton":
        if not available(("torch", "triton")):
            raise BadRequest("impl='triton' needs torch and triton")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BadRequest("impl='triton' on the CPU needs TRITON_INTERPRET=1 in the "
                             "environment (set before the kernels are imported)")
    selected = layer_backends(backends, explicit_backends, notes,
                              "poet_torch (the authors' POET-X) is not run live by xopt: its "
                              "recordings are the golden traces")
    if against == "original":
        raise BadRequest("--against original: poet_torch is not run live; use golden")
    if against not in ("golden", "oracle", "torch", "jax"):
        raise BadRequest(f"unknown reference {against!r}")
    require_reference(against, LAYER_REQUIRES)
    if cnp:
        notes.append(f"{trace.name}: stateless CNP evaluations (formula {hp.cayley_formula!r}); "
                     "closed loop evaluates the same as teacher-forced")
    n_in = n_out = 0
    if not cnp:
        n_out, n_in = trace.params["weight"]

    def variants(which: str) -> list[str]:
        return ["fast", "mem"] if (which in ("torch", "jax") and not cnp) else ["-"]

    runs: list[Run] = []
    for mode in modes:
        outputs: dict[tuple[str, str], list[dict[str, np.ndarray]]] = {}
        needed = list(dict.fromkeys([*selected, "oracle"] +
                                    ([against] if against != "golden" else [])))
        for which in needed:
            if which != "oracle" and which not in selected and which != against:
                continue
            for var in variants(which):
                w_impl = impl if which == "torch" else "plain"
                if cnp:
                    outputs[which, var] = _cnp_outputs(trace, which, w_impl, device, steps, hp)
                else:
                    sim = _make_sim(which, hp.replace(variant=var if var != "-" else "fast"),
                                    n_in, n_out, w_impl, device)
                    outputs[which, var] = _drive_layer(sim, trace, mode, steps)
        if against == "golden":
            ref = _cnp_golden(trace, steps) if cnp else _layer_golden(trace, steps)
        else:
            ref = outputs[against, variants(against)[0]]
        oracle = outputs.get(("oracle", "-"))
        for which in selected:
            for var in variants(which):
                if which == against and var == variants(against)[0]:
                    continue
                mine = outputs[which, var]
                per_step = [errors(a, b) for a, b in zip(mine, ref, strict=True)]
                w_impl = impl if which == "torch" else "plain"
                r = Run(trace=trace.name, backend=backend_label(which),
                        impl=w_impl if var == "-" else f"{w_impl}/{var}", against=against,
                        mode=mode, steps=steps, tolerance=parity.tolerance(mode),
                        per_step=per_step)
                if oracle is not None and which != "oracle" and against != "oracle":
                    t, k, _ = r.worst
                    if k:
                        r.oracle_agrees_with = closer_to(oracle[t][k], mine[t][k], ref[t][k])
                runs.append(r)
    return runs
