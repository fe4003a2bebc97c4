"""Layer traces on N ranks: CompAct's and POET-X's traces replayed as data-parallel
training (``xopt parity compact --world-size N``, ``xopt parity poet --world-size N``).

A layer method's trace records a module's inputs as well as its updates: CompAct's linear
layer or two-block LLaMA, POET-X's ``POETLinear`` (and its merges). Here the module and its
optimizer are built on each of ``N`` ranks of one process group, wrapped in DDP or FSDP2
(``fully_shard`` on every submodule that holds parameters, then the root), and each step's
batch is split by rows (its first dimension, in ``N`` equal contiguous chunks): each rank
runs the forward and backward on its rows alone, so only the data-parallel reductions
(DDP's all-reduce, FSDP2's reduce-scatter, CompAct's own reduction of its compressed
gradients ``Ĝ``) make its update the one-process update. A recorded ``∂L/∂y`` goes to
each rank times ``N`` (the ranks' mean is then the whole batch's sum, as a loss's mean of
means is the whole batch's mean), and POET's merges run by owner
(:func:`xopt.torch.distributed.merge_by_owner`) with the trace's permutations.

The one-process run is the same code on one process with the whole batch. Each step,
both report the layer's outputs (``y``, ``grad_input``, the ``loss``, the rows gathered
over the ranks), the data-parallel gradients (``grad/*``, and CompAct's ``compact_grad/*``
as the ranks' mean), the parameters and the optimizer state, whole; the ranks must agree
bit for bit. Teacher-forced: before step ``t`` both are set to the trace's parameters and
state after step ``t - 1`` (the distributed side through DCP's full state dicts); closed
loop: both run from the trace's start on their own outputs. The bounds are
:data:`xopt.parity.distributed.TOLERANCES`. POET's stateless Cayley–Neumann cases have
no batch and no optimizer and are not replayed.

In JAX (:func:`jax_layer_outputs`) the method's Flax layers and optax transformation run
as data-parallel JAX training: one jitted forward and backward of the whole batch with its
rows split over ``N`` devices of a one-axis mesh (``NamedSharding``), the parameters and
POET's ``W0`` split along their first dimension that divides by ``N``, the state placed by
:mod:`xopt.jax.sharding`; XLA reduces the devices' gradients. The one-device run is the
same jitted functions on the whole batch, uncommitted; they are compared alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from xopt.parity.harness import BadRequest
from xopt.parity.trace import Trace, load_trace, step_prefix

__all__ = ["LAYER_METHODS", "LayerCase", "LayerStep", "jax_layer_outputs", "layer_sources",
           "load_layer_case", "torch_layer_outputs"]

#: methods whose traces are layer traces, replayed here
LAYER_METHODS = ("compact", "poet")


def _stateless(trace: Trace) -> bool:
    """POET's Cayley–Neumann evaluations: no module, no batch, no optimizer."""
    return trace.method == "poet" and "oft_R" not in trace.params


def layer_sources(method: str, traces: Sequence[str] | None, notes: list[str]) -> list[str]:
    """The layer traces of ``method`` replayed on N ranks: ``traces`` if given, else the
    bundled ones, leaving out (with a note) those that train no module."""
    from xopt.parity import bundled_traces

    out = []
    for src in traces or [str(p) for p in bundled_traces(method)]:
        trace = load_trace(src, validate=False)
        if trace.kind != "layer":
            raise BadRequest(f"{src}: a {trace.kind} trace; {method}'s are layer traces")
        if _stateless(trace):
            notes.append(f"{trace.name}: stateless Cayley–Neumann evaluations (no batch, "
                         "no optimizer): not replayed on ranks")
            continue
        out.append(src)
    return out


# -- what each method's case builds and reads ------------------------------------------------


class LayerCase:
    """A layer trace as data-parallel training: :meth:`model` and :meth:`optimizer` (the
    same on every rank), :meth:`load` (the trace's parameters and state before a step, into
    a one-process model), :meth:`batch` (the step's inputs, rows first), :meth:`backward`
    (a rank's forward and backward on its rows) and :meth:`after_step`."""

    def __init__(self, trace: Trace, max_steps: int | None, device: str) -> None:
        self.trace, self.device = trace, device
        self.name, self.method = trace.name, trace.method
        self.steps = trace.steps if max_steps is None else min(max_steps, trace.steps)

    def tensor(self, a: Any) -> Any:
        import torch

        return torch.as_tensor(np.array(a, copy=True)).to(self.device)

    def names(self, module: Any) -> dict[str, str]:
        """``{parameter's name in the module: its name in the trace}``."""
        return {n: n.replace(".", "/") for n, _ in module.named_parameters()
                if n.replace(".", "/") in self.trace.params}

    def model(self) -> Any:
        raise NotImplementedError

    def layer_types(self) -> tuple[type, ...]:
        """The method's layer classes (each an FSDP2 unit of its own)."""
        raise NotImplementedError

    def optimizer(self, module: Any) -> Any:
        raise NotImplementedError

    def load(self, module: Any, opt: Any, t: int) -> None:
        raise NotImplementedError

    def batch(self, t: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def backward(self, module: Any, rows: dict[str, np.ndarray], world: int
                 ) -> dict[str, Any]:
        """Forward and backward on ``rows`` (a part of ``world`` of the batch): its outputs
        (``y``, ``grad_input`` as the whole batch's gradient gives it, ``loss``)."""
        raise NotImplementedError

    def prepare(self, module: Any, t: int) -> None:
        """What each rank sets itself before step ``t`` (after a reset)."""

    def after_step(self, module: Any, opt: Any, t: int) -> None:
        """What follows the update of step ``t`` (POET's merges)."""


class _CompAct(LayerCase):
    def __init__(self, trace: Trace, max_steps: int | None, device: str) -> None:
        super().__init__(trace, max_steps, device)
        from xopt.parity.layers.compact import CompActCase

        self.case = CompActCase(trace)
        self.projections = self.case.projections({k: tuple(v)
                                                  for k, v in trace.params.items()})

    def model(self) -> Any:
        from xopt.parity.layers import llama
        from xopt.torch.compact import CompActLinear, compact_model

        case, hp = self.case, self.case.hp
        if case.kind == "linear":
            proj = self.projections["weight"]
            return CompActLinear(case.in_features, case.out_features, bias=case.bias,
                                 rank=hp.rank, proj_type="gaussian", scale=proj.scale,
                                 seed=proj.seed, gap=proj.gap, device=self.device)
        model = llama.torch_llama(case.config).to(self.device)
        compact_model(model, rank=hp.rank, proj_type="gaussian", scale=hp.scale,
                      scale_o_proj=hp.scale_o_proj, gap=hp.gap, seed=hp.seed)
        return model

    def layer_types(self) -> tuple[type, ...]:
        from xopt.torch.compact import CompActLinear

        return (CompActLinear,)

    def _layers(self, module: Any) -> dict[str, Any]:
        from xopt.torch.compact import CompActLinear

        return {(f"{n}.weight" if n else "weight"): m for n, m in module.named_modules()
                if isinstance(m, CompActLinear)}

    def optimizer(self, module: Any) -> Any:
        from xopt.torch.compact import CompActAdamW

        small = self._layers(module)
        params = dict(module.named_parameters())
        # the authors' groups: the other parameters first, then the wrapped weights
        groups = [{"params": [p for n, p in params.items() if n not in small]},
                  {"params": [params[n] for n in small]}]
        return CompActAdamW([g for g in groups if g["params"]],
                            spec=self.case.hp.replace(seed=0))

    def prepare(self, module: Any, t: int) -> None:
        for layer in self._layers(module).values():
            layer.set_proj_step(t)

    def load(self, module: Any, opt: Any, t: int) -> None:
        import torch

        state = self.case.state(t - 1)
        params = self.case.params(t - 1)
        names = self.names(module)
        layers = self._layers(module)
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(self.tensor(params[names[n]]))
        self.prepare(module, t)
        opt.state.clear()
        if state is not None:
            for n, p in module.named_parameters():
                k = names[n]
                s = {"step": torch.tensor(int(state["step"]), dtype=torch.int64),
                     "exp_avg": self.tensor(state[f"m/{k}"]),
                     "exp_avg_sq": self.tensor(state[f"v/{k}"])}
                if n in layers:
                    s["seed"] = layers[n].proj.seed
                opt.state[p] = s

    def batch(self, t: int) -> dict[str, np.ndarray]:
        return self.case.inputs(t)

    def backward(self, module: Any, rows: dict[str, np.ndarray], world: int
                 ) -> dict[str, Any]:
        if self.case.kind == "linear":
            x = self.tensor(rows["x"]).requires_grad_(True)
            y = module(x)
            y.backward(self.tensor(rows["grad_output"]) * world)
            return {"y": y.detach(), "grad_input": x.grad / world}
        loss = module(self.tensor(rows["x"]))
        loss.backward()
        return {"loss": loss.detach()}


class _POET(LayerCase):
    def __init__(self, trace: Trace, max_steps: int | None, device: str) -> None:
        super().__init__(trace, max_steps, device)
        from xopt.parity.layers.poet import hyperparams

        self.hp = hyperparams(trace)
        self.n_out, self.n_in = trace.params["weight"]

    def model(self) -> Any:
        from xopt.torch.poet import POETLinear

        return POETLinear(self.n_in, self.n_out, spec=self.hp, impl="plain",
                          device=self.device)

    def layer_types(self) -> tuple[type, ...]:
        from xopt.torch.poet import POETLinear

        return (POETLinear,)

    def optimizer(self, module: Any) -> Any:
        from xopt.torch.poet import POETAdamW

        return POETAdamW([module.oft_R], spec=self.hp)

    def load(self, module: Any, opt: Any, t: int) -> None:
        import torch

        trace = self.trace
        params = trace.init_params() if t == 0 else trace.params_after(t - 1)
        with torch.no_grad():
            module.oft_R.copy_(self.tensor(params["oft_R"]))
            module.weight.copy_(self.tensor(params["weight"]))
        aux = trace.aux(t)
        module.set_permutations(aux["perm_in"], aux["perm_out"])
        opt.state.clear()
        opt.global_step_counter = 0
        if t > 0:
            s = trace.state_after(t - 1)
            opt.global_step_counter = int(s["global_step_counter"])
            opt.state[module.oft_R] = {"step": int(s["oft_R/step"]),
                                       "exp_avg": self.tensor(s["oft_R/exp_avg"]),
                                       "exp_avg_sq": self.tensor(s["oft_R/exp_avg_sq"])}

    def batch(self, t: int) -> dict[str, np.ndarray]:
        pre = step_prefix(t)
        out = {"x": self.trace.array(f"{pre}/x")}
        if self.trace.has(f"{pre}/target"):  # the trace's MSE loss, of each side's own y
            out["target"] = self.trace.array(f"{pre}/target")
        else:
            out["grad_output"] = self.trace.array(f"{pre}/grad_output")
        return out

    def backward(self, module: Any, rows: dict[str, np.ndarray], world: int
                 ) -> dict[str, Any]:
        import torch

        x = self.tensor(rows["x"]).requires_grad_(True)
        y = module(x)
        out = {}
        if "target" in rows:
            loss = torch.nn.functional.mse_loss(y, self.tensor(rows["target"]))
            loss.backward()
            out["loss"] = loss.detach()
        else:
            y.backward(self.tensor(rows["grad_output"]) * world)
        out.update(y=y.detach(), grad_input=x.grad / world)
        return out

    def after_step(self, module: Any, opt: Any, t: int) -> None:
        from xopt.torch.distributed import data_parallel_ranks, merge_by_owner

        aux = self.trace.aux(t)
        if "merged" in aux and int(aux["merged"]):
            merge_by_owner([module], data_parallel_ranks(opt),
                           perms=[(aux["new_perm_in"], aux["new_perm_out"])])


def load_layer_case(method: str, source: str, max_steps: int | None = None,
                    device: str = "cpu") -> LayerCase:
    trace = load_trace(source)
    if trace.method != method:
        raise BadRequest(f"{source}: trace is for method {trace.method!r}, not {method!r}")
    if method not in LAYER_METHODS or trace.kind != "layer" or _stateless(trace):
        raise BadRequest(f"{source}: not a layer trace that trains a module")
    return (_CompAct if method == "compact" else _POET)(trace, max_steps, device)


# -- one side: one process, or a rank of N ------------------------------------------------------


class _Side:
    """The case's module and optimizer on this process alone (``sharding`` None) or on the
    ranks of the default group, wrapped by ``sharding``. ``micro``: on one process, the
    batch's rows in ``micro`` micro-batches, their gradients accumulated and averaged, as
    ``micro`` ranks would split them (gradient accumulation)."""

    def __init__(self, case: LayerCase, sharding: str | None, micro: int = 1) -> None:
        self.case, self.sharding, self.micro = case, sharding, micro
        if sharding is None:
            self.rank, self.world = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _build(self) -> None:
        from xopt.torch.distributed import set_process_group

        module = self.case.model()
        if self.sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = DistributedDataParallel(module)
        elif self.sharding == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(str(self.case.device).split(":")[0], (self.world,))
            # the method's layers each a unit, the rest (the LLaMA's embedding and norms,
            # whose weights its forward reads without calling their modules) the root's
            for m in reversed(list(module.modules())[1:]):
                if isinstance(m, self.case.layer_types()):
                    fully_shard(m, mesh=mesh)
            self.wrapped = fully_shard(module, mesh=mesh)
        else:
            self.wrapped = module
        self.module = module
        self.opt = self.case.optimizer(module)
        if self.sharding is None:
            set_process_group(self.opt, None)

    def reset(self, t: int) -> None:
        self._build()
        if self.sharding is None:
            self.case.load(self.module, self.opt, t)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        mirror = _Side(self.case, None)  # the trace's values, whole, then DCP's full dicts
        mirror.reset(t)
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, mirror.module.state_dict(), options=full)
        if mirror.opt.state:
            set_optimizer_state_dict(self.module, self.opt,
                                     get_optimizer_state_dict(mirror.module, mirror.opt),
                                     options=full)
        self.case.prepare(self.module, t)

    def _gather_rows(self, x: Any) -> Any:
        import torch
        import torch.distributed as dist

        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def _mean(self, x: Any) -> Any:
        import torch.distributed as dist

        if self.world == 1:
            return x
        x = x.clone()
        dist.all_reduce(x)
        return x / self.world

    def backward(self, t: int) -> dict[str, Any]:
        """Step ``t``'s forward and backward on this rank's rows: the layer's outputs (rows
        gathered, the loss the ranks' mean) and the data-parallel gradients, whole."""
        import torch

        from xopt.torch.compact import compact_grad_of
        from xopt.torch.distributed import is_dtensor

        batch = self.case.batch(t)
        parts = max(self.world, self.micro)
        for k, v in batch.items():
            if v.shape[0] % parts:
                raise BadRequest(f"{self.case.name}: step {t}'s {k} has {v.shape[0]} rows, "
                                 f"which do not split over {parts} ranks")
        if self.micro > 1:  # one process, the ranks' micro-batches one after the other
            outs = [self.case.backward(self.wrapped, _rows(batch, r, self.micro), self.micro)
                    for r in range(self.micro)]
            res = {k: (sum(o[k] for o in outs) / self.micro if k == "loss"
                       else torch.cat([o[k] for o in outs])) for k in outs[0]}
            for p in self.module.parameters():  # the mean over micro-batches, as DDP's
                if p.grad is not None:
                    p.grad /= self.micro
                if getattr(p, "compact_grad", None) is not None:
                    p.compact_grad /= self.micro
        else:
            out = self.case.backward(self.wrapped, _rows(batch, self.rank, self.world),
                                     self.world)
            res = {k: (self._mean(v) if k == "loss" else self._gather_rows(v))
                   for k, v in out.items()}
        names = self.case.names(self.module)
        for n, p in self.module.named_parameters():
            cg, _ = compact_grad_of(p)
            if cg is not None:  # what CompActAdamW steps on (DDP also leaves .grad zeros)
                res[f"compact_grad/{names[n]}"] = self._mean(cg.detach())
            elif p.grad is not None:
                g = p.grad.full_tensor() if is_dtensor(p.grad) else p.grad
                res[f"grad/{names[n]}"] = g.detach().clone()
        return res

    def update(self, t: int, feed: dict[str, Any] | None = None) -> None:
        """The optimizer's update of step ``t`` and what follows it; ``feed`` (one process
        only): the gradients to update from instead of this side's own (``grad/*``,
        ``compact_grad/*`` as :meth:`backward` reports them)."""
        if feed is not None:
            names = self.case.names(self.module)
            for n, p in self.module.named_parameters():
                if f"grad/{names[n]}" in feed:
                    p.grad = feed[f"grad/{names[n]}"].clone()
                if f"compact_grad/{names[n]}" in feed:
                    p.compact_grad = feed[f"compact_grad/{names[n]}"].clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.case.after_step(self.module, self.opt, t)

    def read(self) -> dict[str, np.ndarray]:
        names = self.case.names(self.module)
        out = {}
        for n, p in self.module.named_parameters():
            out[f"param/{names[n]}"] = _numpy(p)
            for var, v in self.opt.state.get(p, {}).items():
                if var != "seed":
                    out[f"state/{names[n]}/{var}"] = _numpy(v)
        for n, b in self.module.named_buffers():
            out[f"buffer/{n}"] = _numpy(b)
        if hasattr(self.opt, "global_step_counter"):
            out["state/global_step_counter"] = np.int64(self.opt.global_step_counter)
        return out


def _rows(batch: dict[str, np.ndarray], r: int, n: int) -> dict[str, np.ndarray]:
    """Part ``r`` of ``n`` of each of ``batch``'s arrays: equal contiguous row chunks."""
    return {k: v[r * (len(v) // n):(r + 1) * (len(v) // n)] for k, v in batch.items()}


def _numpy(v: Any) -> np.ndarray:
    from xopt.torch.distributed import is_dtensor

    if is_dtensor(v):
        v = v.full_tensor()
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy().copy()
    return np.asarray(v)


class LayerStep(dict):
    """What one step reported (``y``, ``grad/*``, ``param/*``, ``state/*``, ...), keyed as
    compared; ``tensors()`` as :class:`~xopt.parity.harness.Step`'s."""

    def tensors(self) -> dict[str, np.ndarray]:
        return dict(self)


def _drive(dist_side: _Side, one: _Side | None, case: LayerCase, mode: str
           ) -> tuple[list[LayerStep], list[LayerStep]]:
    """``(one process, distributed)`` steps of ``case`` in ``mode`` (``one``: None on the
    ranks other than 0). Teacher-forced, the one-process update consumes the distributed
    side's data-parallel gradients (its own are compared, then replaced), so that each
    step's update is the distributed optimizer's against one process's on the same
    gradient, as in tests/distributed/test_torch_matrix.py."""
    got, ref = [], []
    for t in range(case.steps):
        sides = [s for s in (dist_side, one) if s is not None]
        if mode == "teacher_forced" or t == 0:
            for s in sides:
                s.reset(t)
        d = dist_side.backward(t)
        dist_side.update(t)
        got.append(LayerStep({k: _numpy(v) for k, v in d.items()}, **dist_side.read()))
        if one is not None:
            r = one.backward(t)
            one.update(t, d if mode == "teacher_forced" else None)
            ref.append(LayerStep({k: _numpy(v) for k, v in r.items()}, **one.read()))
    return ref, got


def _digest(step: LayerStep) -> str:
    h = hashlib.sha256()
    arrays = step.tensors()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()


def torch_layer_outputs(method: str, source: str, sharding: str, modes: Sequence[str],
                        max_steps: int | None = None, device: str = "cpu",
                        micro_batches: bool = False) -> dict[str, Any]:
    """On every rank of the default process group: the layer trace ``source`` replayed as
    data-parallel training (``sharding``) and, on rank 0, by one process. Returns, as
    :func:`xopt.parity.distributed.torch_outputs` does, ``{mode: (one process,
    distributed)}`` on rank 0 and ``digests`` on every rank. ``micro_batches``: the one
    process accumulates the ranks' micro-batches instead of taking the batch whole (the
    same sums in the same order as the ranks' reductions on 2 ranks)."""
    import torch.distributed as dist

    case = load_layer_case(method, source, max_steps, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"digests": {}}
    for mode in modes:
        one = _Side(case, None, world if micro_batches else 1) if rank == 0 else None
        ref, got = _drive(_Side(case, sharding), one, case, mode)
        out["digests"][mode] = [_digest(s) for s in got]
        if rank == 0:
            out[mode] = (ref, got)
    return out


# -- JAX: the layers on N devices -----------------------------------------------------------------


class _JaxLayer:
    """A layer trace's JAX layers (Flax modules where the method has them) and optax
    transformation, as pure functions of flat dicts: ``params`` (trainable, keyed by the
    trace's names, CompAct's carriers ``<layer>/compact_grad`` among them), ``buffers``
    (POET's frozen ``poet`` collection) and the transformation's state."""

    def __init__(self, case: LayerCase) -> None:
        self.case, self.trace = case, case.trace

    def start(self, t: int) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """``(params, buffers, state)`` before step ``t`` (the trace's), as NumPy and
        Python values (state None: the transformation's init)."""
        raise NotImplementedError

    def forward(self, params: dict[str, Any], buffers: dict[str, Any],
                batch: dict[str, Any], step: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The step's forward and backward on the whole ``batch`` (traced): the layer's
        outputs (``y``, ``grad_input``, ``loss``) and the gradients of ``params``."""
        raise NotImplementedError

    def after_step(self, params: dict[str, Any], buffers: dict[str, Any], t: int
                   ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """What follows the update of step ``t`` (eager: POET's merges): the new
        ``(params, buffers)``, or None when nothing does."""
        return None

    def report(self, grads: dict[str, Any]) -> dict[str, Any]:
        """The gradients compared (keyed as the torch layers' are)."""
        return {f"grad/{k}": v for k, v in grads.items()}


class _JaxCompAct(_JaxLayer):
    def __init__(self, case: _CompAct) -> None:
        super().__init__(case)
        import jax
        import jax.numpy as jnp

        from xopt.jax.compact import CompActDense, compact_adamw

        self.spec, self.projections = case.case, case.projections
        self.carriers = {(w[: -len("weight")] + "compact_grad"): w for w in self.projections}
        hp = self.spec.hp
        if self.spec.kind == "linear":
            proj = self.projections["weight"]
            self.module = CompActDense(self.spec.out_features, use_bias=self.spec.bias,
                                       rank=hp.rank, scale=proj.scale, seed=proj.seed,
                                       gap=proj.gap)
            x0 = jnp.zeros((1, self.spec.in_features), jnp.float32)
            self.collection = self.module.init(jax.random.PRNGKey(0), x0)["compact"]
        self.tx = compact_adamw(spec=hp, projections=self.projections)

    def start(self, t: int) -> tuple[dict[str, Any], dict[str, Any], Any]:
        import jax.numpy as jnp

        from xopt.jax.compact import CompActAdamState

        params = dict(self.spec.params(t - 1))
        for c, w in self.carriers.items():
            params[c] = np.zeros((params[w].shape[0], self.projections[w].rank), np.float32)
        st = self.spec.state(t - 1)
        if st is None:
            return params, {}, None
        names = list(self.trace.params)
        state = CompActAdamState(count=jnp.asarray(int(st["step"]), jnp.int32),
                                 mu={k: np.asarray(st[f"m/{k}"]) for k in names},
                                 nu={k: np.asarray(st[f"v/{k}"]) for k in names})
        return params, {}, state

    def forward(self, params, buffers, batch, step):
        import jax

        if self.spec.kind == "linear":
            def apply(p, x):
                return self.module.apply({"params": p, "compact": self.collection}, x,
                                         step=step)

            y, vjp = jax.vjp(apply, params, batch["x"])
            grads, gx = vjp(batch["grad_output"])
            return {"y": y, "grad_input": gx}, grads
        from xopt.parity.layers.compact import jax_llama_loss

        cfg = self.spec.config

        def loss_fn(p):
            return jax_llama_loss(p, batch["x"], cfg, self.projections, step, {})

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return {"loss": loss}, grads

    def report(self, grads):
        out = {}
        for k, v in grads.items():
            if k in self.carriers:  # what the update reads for a CompAct weight
                out[f"compact_grad/{self.carriers[k]}"] = v
            elif k not in self.projections:  # (a CompAct weight's own cotangent is zeros)
                out[f"grad/{k}"] = v
        return out


class _JaxPOET(_JaxLayer):
    def __init__(self, case: _POET) -> None:
        super().__init__(case)
        import jax
        import jax.numpy as jnp

        from xopt.jax.poet import POETDense, poet_adamw

        self.hp = case.hp
        self.module = POETDense(features=case.n_out, spec=self.hp, seed=0)
        made = self.module.init(jax.random.PRNGKey(0), jnp.zeros((1, case.n_in), jnp.float32))
        self.template = {k: np.asarray(v) for k, v in made["poet"].items()}
        self.tx = poet_adamw(spec=self.hp)

    def start(self, t: int) -> tuple[dict[str, Any], dict[str, Any], Any]:
        from xopt.jax.poet import POETAdamWState
        from xopt.specs import poet as P

        trace = self.trace
        p = trace.init_params() if t == 0 else trace.params_after(t - 1)
        aux = trace.aux(t)
        buffers = dict(self.template, weight=np.asarray(p["weight"]))
        for name in ("perm_in", "perm_out"):
            buffers[name] = np.asarray(aux[name], np.int32)
            buffers[name + "_inv"] = np.asarray(P.inverse(aux[name]), np.int32)
        state = None
        if t > 0:
            s = trace.state_after(t - 1)
            state = POETAdamWState(count=np.int32(s["global_step_counter"]),
                                   step={"oft_R": np.int32(s["oft_R/step"])},
                                   mu={"oft_R": np.asarray(s["oft_R/exp_avg"])},
                                   nu={"oft_R": np.asarray(s["oft_R/exp_avg_sq"])})
        return {"oft_R": np.asarray(p["oft_R"])}, buffers, state

    def forward(self, params, buffers, batch, step):
        import jax
        import jax.numpy as jnp

        def apply(p, x):
            return self.module.apply({"params": p, "poet": buffers}, x)

        if "target" in batch:  # the trace's MSE loss, of each side's own y
            def loss_fn(p, x):
                y = apply(p, x)
                return jnp.mean((y - batch["target"]) ** 2), y

            (loss, y), (grads, gx) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
                params, batch["x"])
            return {"loss": loss, "y": y, "grad_input": gx}, grads
        y, vjp = jax.vjp(apply, params, batch["x"])
        grads, gx = vjp(batch["grad_output"])
        return {"y": y, "grad_input": gx}, grads

    def after_step(self, params, buffers, t):
        from xopt.jax.poet import merge_layer

        aux = self.trace.aux(t)
        if "merged" not in aux or not int(aux["merged"]):
            return None
        return merge_layer(params, buffers, self.hp, aux["new_perm_in"], aux["new_perm_out"])


def _jax_layer(case: LayerCase) -> _JaxLayer:
    return _JaxCompAct(case) if isinstance(case, _CompAct) else _JaxPOET(case)


class _JaxSide:
    """A :class:`_JaxLayer` on one device (``n`` None: the arrays uncommitted on the
    default device) or on the first ``n`` devices: a one-axis mesh, the batch's rows split
    over it, each parameter and floating buffer split along its first dimension that
    divides by ``n`` (else replicated), the state placed by
    :func:`xopt.jax.sharding.state_shardings` (:func:`xopt.jax.sharding.init` at a start
    without state). The forward, backward and update are jitted once each; under ``jit``
    XLA reduces the per-device gradients itself."""

    def __init__(self, layer: _JaxLayer, n: int | None) -> None:
        import jax

        self.layer, self.case, self.n = layer, layer.case, n
        if n is not None:
            from jax.sharding import Mesh

            devices = jax.devices()
            if len(devices) < n:
                raise BadRequest(f"--world-size {n}: jax sees {len(devices)} device(s)")
            self.mesh = Mesh(np.array(devices[:n]), ("ranks",))
        self._forward = jax.jit(layer.forward)
        self._update = None

    def _sharding(self, a: Any, rows: bool = False) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        from xopt.parity.distributed import _shard_dim

        shape = np.shape(a)
        axes: list[Any] = [None] * len(shape)
        d = 0 if rows else (_shard_dim(shape, self.n) if np.issubdtype(
            np.asarray(a).dtype, np.floating) else None)
        if d is not None and len(shape):
            axes[d] = "ranks"
        return NamedSharding(self.mesh, PartitionSpec(*axes))

    def _place(self, tree: dict[str, Any], rows: bool = False) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp

        if self.n is None:
            return {k: jnp.asarray(v) for k, v in tree.items()}
        return {k: jax.device_put(np.asarray(v), self._sharding(v, rows))
                for k, v in tree.items()}

    def reset(self, t: int) -> None:
        import jax
        import jax.numpy as jnp
        import optax

        params, buffers, state = self.layer.start(t)
        self.params, self.buffers = self._place(params), self._place(buffers)
        if self._update is None:
            tx = self.layer.tx

            def update(grads, st, p):
                u, st = tx.update(grads, st, p)
                return optax.apply_updates(p, u), st

            if self.n is None:
                self._update = jax.jit(update)
            else:
                from xopt.jax.sharding import state_shardings

                self.p_shard = {k: v.sharding for k, v in self.params.items()}
                self.s_shard = state_shardings(tx, self.params)
                self._update = jax.jit(update, out_shardings=(self.p_shard, self.s_shard))
        if state is None:
            if self.n is None:
                state = self.layer.tx.init(self.params)
            else:
                from xopt.jax.sharding import init

                state = init(self.layer.tx, self.params)
        elif self.n is None:
            state = jax.tree.map(jnp.asarray, state)
        else:
            state = jax.device_put(state, self.s_shard)
        self.state = state

    def backward(self, t: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Step ``t``'s forward and backward: what is compared (outputs and gradients, as
        NumPy) and the gradients."""
        import jax.numpy as jnp

        batch = self.case.batch(t)
        if self.n is not None:
            for k, v in batch.items():
                if v.shape[0] % self.n:
                    raise BadRequest(f"{self.case.name}: step {t}'s {k} has {v.shape[0]} "
                                     f"rows, which do not split over {self.n} devices")
        placed = self._place(batch, rows=True)
        #: the devices holding the batch's first array and each parameter
        self.devices = {k: len(v.sharding.device_set)
                        for k, v in {"batch": next(iter(placed.values())),
                                     **self.params}.items()}
        out, grads = self._forward(self.params, self.buffers, placed,
                                   jnp.asarray(t, jnp.int32))
        shown = {k: np.asarray(v) for k, v in {**out, **self.layer.report(grads)}.items()}
        return shown, grads

    def update(self, t: int, grads: dict[str, Any]) -> None:
        """The update of step ``t`` from ``grads`` (any placement: placed as the
        parameters), then what follows it."""
        self.params, self.state = self._update(self._place(
            {k: np.asarray(v) for k, v in grads.items()}), self.state, self.params)
        after = self.layer.after_step(self.params, self.buffers, t)
        if after is not None:  # a merge: its results placed as before
            self.params, self.buffers = (self._place({k: np.asarray(v) for k, v in d.items()})
                                         for d in after)

    def read(self) -> dict[str, np.ndarray]:
        import jax

        out = {f"param/{k}": np.asarray(v) for k, v in self.params.items()
               if k in self.case.trace.params}
        for k, v in self.buffers.items():
            key = "param/weight" if k == "weight" else f"buffer/{k}"
            out[key] = np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(self.state)[0]:
            name = "/".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)
            out[f"state/{name}"] = np.asarray(v)
        return out


def _jax_drive(dist_side: _JaxSide, one: _JaxSide, mode: str, steps: int, fed: bool = False
               ) -> tuple[list[LayerStep], list[LayerStep]]:
    """``(one device, n devices)`` steps in ``mode``; teacher-forced (or ``fed``), the
    one-device update consumes the n-device gradients (its own are compared first), as
    :func:`_drive` does for torch."""
    got, ref = [], []
    for t in range(steps):
        if mode == "teacher_forced" or t == 0:
            dist_side.reset(t)
            one.reset(t)
        d, dg = dist_side.backward(t)
        dist_side.update(t, dg)
        got.append(LayerStep(d, **dist_side.read()))
        r, rg = one.backward(t)
        one.update(t, dg if mode == "teacher_forced" or fed else rg)
        ref.append(LayerStep(r, **one.read()))
    return ref, got


def jax_layer_outputs(method: str, source: str, n: int, modes: Sequence[str],
                      max_steps: int | None = None, fed: bool = False) -> dict[str, Any]:
    """In a process whose JAX sees at least ``n`` devices: the layer trace ``source``
    replayed by the method's JAX layers on ``n`` devices (the batch's rows split over
    them) and on one. Returns ``{mode: (one device, n devices)}`` (lists of
    :class:`LayerStep`), and ``"devices"``: how many devices held the batch and each
    parameter on the ``n``-device side. ``fed``: also ``"fed"``, a closed loop whose
    one-device update consumes the n-device gradients (each side's forward and backward on
    its own parameters), which leaves the two gradients' float32 evaluations out of what
    separates the sides."""
    from xopt.parity.layers import float32_matmuls

    case = load_layer_case(method, source, max_steps, "cpu")
    layer = _jax_layer(case)
    sharded, one = _JaxSide(layer, n), _JaxSide(layer, None)  # each jits its steps once

    @float32_matmuls
    def run(mode: str) -> tuple[list[LayerStep], list[LayerStep]]:
        if mode == "fed":
            return _jax_drive(sharded, one, "closed_loop", case.steps, True)
        return _jax_drive(sharded, one, mode, case.steps)

    out: dict[str, Any] = {mode: run(mode) for mode in [*modes, *(["fed"] if fed else [])]}
    out["devices"] = sharded.devices
    return out
