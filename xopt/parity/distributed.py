"""Sharded against unsharded: a method's traces replayed on N ranks (``xopt parity METHOD
--world-size N``).

Each trace is replayed twice in each mode, by the one-process implementation (what ``xopt
parity`` runs) and by the same implementation distributed, and the two are compared like
any other pair of runs (:class:`~xopt.parity.harness.Run`, the same table and JSON):

* **torch**, on ``N`` ranks of one process group (gloo on the CPU, NCCL with ``--device
  cuda``, one GPU per rank; :class:`xopt.torch.launch.Gang`), the parameters held by a
  module wrapped in DDP (``"ddp"``: every rank holds them whole) or FSDP2 (``"fsdp2"``:
  ``fully_shard``, DTensor parameters sharded along their first dimension that divides by
  ``N``; a scalar, or a tensor with no such dimension, is left to the user by FSDP2 and
  kept plain and replicated here, its gradient averaged over the ranks); the optimizer is
  the one ``xopt parity`` builds, given the module's parameters;
* **jax**, on ``N`` devices of one process (host devices on the CPU: the child process is
  started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), the parameters
  placed with ``NamedSharding`` on a one-axis mesh (split along their first dimension that
  divides by ``N``, else replicated), the state placed by :func:`xopt.jax.sharding.init`,
  the update jitted.

**The split.** At update ``t`` every element of the trace's gradient is assigned to one
rank (a fixed pseudo-random draw of ``t`` and the tensor), which is given ``N`` times it,
the other ranks zero; the trace's loss goes, times ``N``, to rank ``t mod N``. Each rank
thus sees a gradient and a loss of its own, and only their mean over the ranks (DDP's
all-reduce, FSDP2's reduce-scatter, XLA's reduction of the per-device gradients, the
optimizers' mean of the ranks' losses) is the trace's: an optimizer that read a rank's own
gradient or loss would be far off. For ``N`` a power of two the mean is the trace's
gradient bit for bit, so what is measured is the distributed optimizer alone.

**Modes.** Teacher-forced: before update ``t`` both sides are reset to the trace's
parameters and state after update ``t - 1`` (the distributed optimizer's state through
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` with a full state
dict, read back through ``get_optimizer_state_dict``; in JAX placed as the parameters);
closed loop: both run from the trace's start on the trace's gradients. A method without a
bundled trace (PLUMAGE: no original exists to record one) runs on a synthetic gradient
stream (:data:`SYNTHETIC`), teacher-forced on the one-process run's own states.

Bounds (issue 25), for every method alike: teacher-forced, max relative error 1e-6 per
tensor and update; closed loop 1e-5. The ranks must also agree bit for bit.

CompAct's and POET-X's traces are layer traces (a module's forward and backward): they are
replayed with the batch's rows split across the torch ranks and the JAX devices by
:mod:`xopt.parity.distributed_layers`, reported here alike (:func:`tolerance` names the one
tensor whose closed-loop bound is the method's own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xopt.parity.compare import TensorError, errors
from xopt.parity.distributed_layers import (
    LAYER_METHODS,
    jax_layer_outputs,
    layer_sources,
    load_layer_case,
    torch_layer_outputs,
)
from xopt.parity.harness import (
    BadRequest,
    Report,
    Run,
    Step,
    hyperparameters_of,
    make_runner,
    original_of,
    trace_state,
)
from xopt.parity.methods import Tolerance
from xopt.parity.methods import get as get_parity
from xopt.parity.trace import load_trace
from xopt.specs import get as get_spec

__all__ = ["LAYER_EXCEPTIONS", "SHARDINGS", "SYNTHETIC", "TOLERANCES", "Case",
           "JaxShardedRunner", "TorchDistributedRunner", "alone", "drive", "jax_outputs",
           "load_case", "run_distributed_parity", "split", "tolerance", "torch_outputs"]

SHARDINGS = ("ddp", "fsdp2")

TOLERANCES = {
    "teacher_forced": Tolerance(
        1e-6, 0.0,
        "issue 25's bound: one update on N ranks against one process, from the same "
        "parameters and state and the same (data-parallel mean) gradient; sums over shards "
        "completed by all-reduces round in another order"),
    "closed_loop": Tolerance(
        1e-5, 0.0,
        "issue 25's bound: the sharded run against the one-process run over the trace, "
        "each on its own outputs"),
}


# -- what is replayed ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """A gradient stream and how to build the method's optimizers for it (from a trace, or
    synthetic). ``before(t)``: the parameters and canonical state to teacher-force update
    ``t`` from (None: the one-process run's own, for a synthetic stream)."""

    method: str
    name: str
    names: list[str]
    hp: Any
    naming: Any
    steps: int
    init_params: dict[str, np.ndarray]
    init_state: dict[str, np.ndarray] | None
    grads: Callable[[int], dict[str, np.ndarray]]
    loss: Callable[[int], float | None]
    inject: Callable[[int], Any]
    meta: dict[str, np.ndarray] | None
    before: Callable[[int], tuple[dict[str, np.ndarray], Any]] | None


def _trace_case(path: str, max_steps: int | None) -> Case:
    trace = load_trace(path)
    if trace.kind != "optimizer":
        raise BadRequest(f"{trace.path}: a {trace.kind} trace; --world-size replays "
                         "optimizer traces (gradient streams) only")
    spec = get_spec(trace.method)
    origin = original_of(spec, trace)
    hp = hyperparameters_of(origin, trace)
    naming = origin.naming_for(hp)
    parity = get_parity(trace.method)
    steps = trace.steps if max_steps is None else min(max_steps, trace.steps)

    def before(t: int) -> tuple[dict[str, np.ndarray], Any]:
        if t == 0:
            return trace.init_params(), trace_state(trace, spec, hp, naming, -1)
        return trace.params_after(t - 1), trace_state(trace, spec, hp, naming, t - 1)

    return Case(
        method=trace.method, name=trace.name, names=list(trace.params), hp=hp, naming=naming,
        steps=steps, init_params=trace.init_params(),
        init_state=trace_state(trace, spec, hp, naming, -1), grads=trace.grads,
        loss=trace.loss,
        inject=(lambda t: parity.inject(trace, t, hp)) if parity.inject else (lambda t: None),
        meta=trace.meta_params() if spec.meta is not None else None, before=before)


def _plumage_stream(max_steps: int | None) -> Case:
    """PLUMAGE on left-, right- and square-projected matrices, a vector and an unprojected
    matrix: SVD refreshes every 4 updates, resamples every 3, weight decay."""
    from xopt.specs import ParamGroups
    from xopt.specs import plumage as P

    shapes = {"a/left": (6, 10), "b/right": (12, 6), "c/square": (8, 8), "d/bias": (6,),
              "e/full": (4, 6)}
    names = sorted(shapes)
    base = P.PLUMAGE(lr=1e-2, rank=3, update_proj_gap=4, resample_interval=3,
                     weight_decay=0.05)
    hp = ParamGroups.of([(names[:4], base), (["e/full"], base.replace(project=False))])
    steps = 9 if max_steps is None else min(max_steps, 9)
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: (rng.standard_normal(s) * np.linspace(1, 3, s[-1])).astype(np.float32)
              for k, s in shapes.items()} for _ in range(steps)]
    return Case(method="plumage", name="plumage/synthetic_seed1", names=names, hp=hp,
                naming=get_spec("plumage").naming_of["torch"], steps=steps,
                init_params=params, init_state=None, grads=lambda t: grads[t],
                loss=lambda t: None, inject=lambda t: None, meta=None, before=None)


#: methods without a bundled trace: a synthetic gradient stream of each
SYNTHETIC: dict[str, Callable[[int | None], Case]] = {"plumage": _plumage_stream}


def load_case(method: str, source: str, max_steps: int | None = None) -> Case:
    """``source``: a trace manifest's path, or ``"synthetic"`` (:data:`SYNTHETIC`)."""
    if source == "synthetic":
        if method not in SYNTHETIC:
            raise BadRequest(f"{method}: no synthetic stream (give a trace)")
        return SYNTHETIC[method](max_steps)
    case = _trace_case(source, max_steps)
    if case.method != method:
        raise BadRequest(f"{source}: trace is for method {case.method!r}, not {method!r}")
    return case


def split(grads: dict[str, np.ndarray], loss: float | None, t: int, n: int, rank: int,
          ) -> tuple[dict[str, np.ndarray], float | None]:
    """Rank ``rank``'s gradient and loss at update ``t`` (see the module docstring): their
    mean over the ``n`` ranks is ``grads`` and ``loss``."""
    out = {}
    for i, (k, g) in enumerate(sorted(grads.items())):
        g = np.asarray(g)
        owner = np.random.default_rng([t, i, n]).integers(0, n, size=g.shape)
        out[k] = np.where(owner == rank, g * g.dtype.type(n), g.dtype.type(0))
    if loss is not None:
        loss = float(np.float32(loss) * np.float32(n)) if t % n == rank else 0.0
    return out, loss


# -- torch on N ranks ---------------------------------------------------------------------------


def alone(factory: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``factory`` whose optimizer steps on this process alone (a one-process reference
    inside a rank: no collective, no agreement check)."""
    from xopt.torch.distributed import set_process_group

    def make(ps: list[Any]) -> Any:
        opt = factory(ps)
        set_process_group(opt, None)
        return opt

    return make


def _holder(arrays: Sequence[np.ndarray], device: str) -> Any:
    """A module holding the trace's tensors as parameters ``p.0``, ``p.1``, … whose forward
    takes one gradient per parameter and returns ``Σ⟨p, g⟩``: its backward gives each
    parameter that gradient exactly."""
    import torch
    from torch import nn

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.ParameterList(
                nn.Parameter(torch.from_numpy(np.array(a, copy=True)).to(device))
                for a in arrays)

        def forward(self, grads: Sequence[Any]) -> Any:
            return sum((p * g).sum() for p, g in zip(self.p, grads, strict=True))

    return Holder()


def _shard_dim(shape: Sequence[int], n: int) -> int | None:
    """The first dimension that divides by ``n`` (None: none does)."""
    return next((d for d, s in enumerate(shape) if s % n == 0 and s >= n), None)


class TorchDistributedRunner:
    """The optimizer of ``factory`` (default: ``base``'s) on the ranks of the default process
    group, its parameters in a module wrapped by ``sharding`` ("ddp" or "fsdp2"); ``base``,
    a :class:`~xopt.parity.runners.TorchRunner` stepping alone, is the one-process mirror
    that state goes through, whole. ``reset``, ``step``, ``read`` as a runner's; ``step`` takes the
    trace's whole gradient and loss and gives this rank its :func:`split` share."""

    def __init__(self, base: Any, sharding: str,
                 factory: Callable[[list[Any]], Any] | None = None) -> None:
        import torch.distributed as dist

        if sharding not in SHARDINGS:
            raise BadRequest(f"sharding {sharding!r}: choose from {', '.join(SHARDINGS)}")
        self.base, self.sharding = base, sharding
        #: the distributed optimizer's factory (the base's own is the one-process mirror's)
        self.factory = factory or base.factory
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.t = 0

    def _wrap(self, module: Any) -> Any:
        if self.sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        dims = {id(p): _shard_dim(p.shape, self.world) for p in module.parameters()}
        mesh = init_device_mesh(str(self.base.device).split(":")[0], (self.world,))
        # FSDP2 manages no scalar, and the learned optimizers' MLP refuses uneven shards
        # (docs/distributed.md): a tensor with no dimension that divides by the ranks stays
        # plain and replicated, its gradient averaged here as FSDP2 averages the others
        # (what a user of fully_shard does with the parameters it ignores)
        self.scalars = [p for p in module.parameters() if dims[id(p)] is None]
        return fully_shard(module, mesh=mesh, shard_placement_fn=lambda p: Shard(dims[id(p)]),
                           ignored_params=set(self.scalars))

    def _module(self) -> Any:
        return getattr(self.model, "module", self.model)

    def reset(self, params: dict[str, np.ndarray], state: Any, t: int = 0) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        b = self.base
        self.t = t
        self.model = self._wrap(_holder([params[n] for n in b.param_names], b.device))
        self.params = list(self._module().parameters())
        self.opt = self.factory(self.params)
        if state is not None:  # the trace's state, whole: through the one-process mirror
            b.reset(params, state)
            local = get_optimizer_state_dict(self._module(), self.opt)  # its fresh layout
            set_optimizer_state_dict(self._module(), self.opt, self._by_name(local),
                                     options=StateDictOptions(full_state_dict=True))

    def _fqns(self) -> list[str]:
        """The holder's parameter names in the order of the mirror's ``state_dict()``
        indices (its parameter groups' order, not the trace's)."""
        b = self.base
        at = {id(p): i for i, p in enumerate(b.params)}
        return [f"p.{at[id(p)]}" for g in b.opt.param_groups for p in g["params"]]

    def _by_name(self, like: dict[str, Any]) -> dict[str, Any]:
        """The mirror's ``state_dict()`` keyed by the holder's parameter names, as DCP's
        are, each value of the type the distributed optimizer keeps (``like``: its own
        state dict; the runners set every state variable as a tensor)."""
        sd = self.base.opt.state_dict()
        fqn = self._fqns()
        state = {}
        for i, st in sd["state"].items():
            mine = like["state"].get(fqn[i], {})
            state[fqn[i]] = {k: _as_type(v, mine.get(k)) for k, v in st.items()}
        groups = [dict(g, params=[fqn[i] for i in g["params"]]) for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def step(self, grads: dict[str, np.ndarray], loss: float | None, inject: Any = None
             ) -> None:
        import torch
        import torch.distributed as dist

        b = self.base
        mine, my_loss = split(grads, loss, self.t, self.world, self.rank)
        gs = [torch.from_numpy(np.array(mine[n], copy=True)).to(b.device)
              for n in b.param_names]
        self.model(gs).backward()
        for p in getattr(self, "scalars", ()):
            dist.all_reduce(p.grad)
            p.grad /= self.world
        kwargs: dict[str, Any] = {}
        if b.pass_loss:
            kwargs["loss"] = torch.tensor(np.float32(0.0 if my_loss is None else my_loss),
                                          device=b.device)
        if inject and b.takes_inject:
            by_name = dict(zip(b.param_names, self.params, strict=True))
            kwargs["inject"] = {
                by_name[n]: {k: torch.from_numpy(np.array(v, copy=True)).to(b.device)
                             for k, v in d.items()} for n, d in inject.items()}
        self.opt.step(**kwargs)
        self.opt.zero_grad(set_to_none=True)
        self.t += 1

    def read(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Parameters and canonical state, whole, on every rank (a collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        b = self.base
        sd = get_optimizer_state_dict(self._module(), self.opt,
                                      options=StateDictOptions(full_state_dict=True))
        params = {}
        for n, p in zip(b.param_names, self.params, strict=True):
            p = p.full_tensor() if isinstance(p, DTensor) else p
            params[n] = p.detach().cpu().numpy().copy()
        b.reset(params, None)  # the one-process mirror, given the state read back
        index = {name: i for i, name in enumerate(self._fqns())}
        b.opt.load_state_dict({
            "state": {index[k]: v for k, v in sd["state"].items()},
            "param_groups": [dict(g, params=[index[k] for k in g["params"]])
                             for g in sd["param_groups"]]})
        return b.read()


def _as_type(v: Any, like: Any) -> Any:
    """``v`` (a tensor) as a Python number where ``like`` is one."""
    if isinstance(like, bool | int | float) and hasattr(v, "item"):
        return type(like)(v.item())
    return v


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()


def drive(runner: Any, case: Case, mode: str, teacher: list[Step] | None) -> list[Step]:
    """The steps of ``runner`` (a harness runner, :class:`TorchDistributedRunner` or
    :class:`JaxShardedRunner`) over ``case`` in ``mode``; teacher-forced from
    ``case.before`` or, for a synthetic stream, from ``teacher`` (the one-process closed
    loop)."""
    out = []
    if mode == "closed_loop":
        runner.reset(case.init_params, case.init_state)
    for t in range(case.steps):
        if mode == "teacher_forced":
            if case.before is not None:
                params, state = case.before(t)
            elif t == 0:
                params, state = case.init_params, case.init_state
            else:
                params, state = teacher[t - 1].params, teacher[t - 1].state
            if isinstance(runner, (TorchDistributedRunner, JaxShardedRunner)):
                runner.reset(params, state, t)
            else:
                runner.reset(params, state)
        runner.step(case.grads(t), case.loss(t), case.inject(t))
        out.append(Step(*runner.read()))
    return out


def torch_outputs(method: str, source: str, sharding: str, modes: Sequence[str],
                  max_steps: int | None = None, impl: str = "plain",
                  device: str = "cpu") -> dict[str, Any]:
    """On every rank of the default process group: ``source`` replayed distributed
    (``sharding``) and, on rank 0, by one process. Returns on rank 0 ``{mode: (one
    process, distributed)}`` (lists of :class:`~xopt.parity.harness.Step`) and on every
    rank ``digests``: per mode, a digest of what this rank read at each update (the ranks
    must agree)."""
    import torch.distributed as dist

    case = load_case(method, source, max_steps)
    spec = get_spec(method)

    def base() -> Any:
        r = make_runner(spec, case.hp, case.names, "torch", impl=impl, device=device,
                        meta=case.meta)
        r.distributed_factory, r.factory = r.factory, alone(r.factory)
        return r

    rank = dist.get_rank()
    reference: dict[str, list[Step]] = {}
    if rank == 0 or case.before is None:
        for mode in ("closed_loop", *[m for m in modes if m != "closed_loop"]):
            reference[mode] = drive(base(), case, mode, reference.get("closed_loop"))
    out: dict[str, Any] = {"digests": {}}
    for mode in modes:
        b = base()
        runner = TorchDistributedRunner(b, sharding, b.distributed_factory)
        dist_steps = drive(runner, case, mode, reference.get("closed_loop"))
        out["digests"][mode] = [_digest(s.tensors()) for s in dist_steps]
        if rank == 0:
            out[mode] = (reference[mode], dist_steps)
    return out


# -- jax on N devices ---------------------------------------------------------------------------


class JaxShardedRunner:
    """The runner ``base`` (a one-process :class:`~xopt.parity.runners.OptaxRunner`) on the
    ``n`` devices of a one-axis mesh: parameters ``NamedSharding``-placed, state placed as
    :func:`xopt.jax.sharding.state_shardings` says, one gradient per device (:func:`split`)
    reduced inside the jitted update."""

    def __init__(self, base: Any, n: int) -> None:
        import jax
        from jax.sharding import Mesh

        devices = jax.devices()
        if len(devices) < n:
            raise BadRequest(f"--world-size {n}: jax sees {len(devices)} device(s)")
        self.base, self.n = base, n
        self.mesh = Mesh(np.array(devices[:n]), ("ranks",))
        self.t = 0
        self._step = None

    def _spec(self, shape: Sequence[int]) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        d = _shard_dim(shape, self.n)
        axes = [None] * len(shape)
        if d is not None:
            axes[d] = "ranks"
        return NamedSharding(self.mesh, PartitionSpec(*axes))

    def reset(self, params: dict[str, np.ndarray], state: Any, t: int = 0) -> None:
        import jax

        from xopt.jax.sharding import state_shardings

        b = self.base
        b.reset(params, state)  # the trace's values, unsharded
        self.t = t
        if self._step is None:  # the placements and the jitted update, once
            self.p_shard = {k: self._spec(np.shape(v)) for k, v in b.params.items()}
            self.params = {k: jax.device_put(v, self.p_shard[k]) for k, v in b.params.items()}
            self.s_shard = state_shardings(b.tx, self.params)
            self._step = self._compile()
        self.params = {k: jax.device_put(v, self.p_shard[k]) for k, v in b.params.items()}
        self.state = jax.device_put(b.state, self.s_shard)

    def _compile(self) -> Callable[..., Any]:
        import jax
        import optax

        b = self.base

        def update(params, state, stacked, losses, inject):
            grads = jax.tree.map(lambda g: g.mean(axis=0), stacked)
            extra = {"value": losses.mean()} if b.pass_loss else {}
            if inject is not None:
                extra["inject"] = inject
            updates, state = b.tx.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state

        return jax.jit(update, out_shardings=(self.p_shard, self.s_shard))

    def step(self, grads: dict[str, np.ndarray], loss: float | None, inject: Any = None
             ) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        b = self.base
        shares = [split(grads, loss, self.t, self.n, r) for r in range(self.n)]
        stacked = {}
        for k in b.param_names:
            spec = self._spec(np.shape(grads[k])).spec
            sharding = NamedSharding(self.mesh, PartitionSpec("ranks", *([None] * len(spec))))
            stacked[k] = jax.device_put(np.stack([s[0][k] for s in shares]), sharding)
        losses = jax.device_put(
            np.array([0.0 if s[1] is None else s[1] for s in shares], np.float32),
            NamedSharding(self.mesh, PartitionSpec("ranks")))
        inj = None
        if inject and b.takes_inject:
            inj = {n: {k: jnp.asarray(v) for k, v in d.items()} for n, d in inject.items()}
        self.params, self.state = self._step(self.params, self.state, stacked, losses, inj)
        self.t += 1

    def read(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        b = self.base
        b.params, b.state = self.params, self.state
        return b.read()


def jax_outputs(method: str, source: str, n: int, modes: Sequence[str],
                max_steps: int | None = None) -> dict[str, Any]:
    """In a process whose JAX sees at least ``n`` devices: ``{mode: (one device, n
    devices)}``."""
    case = load_case(method, source, max_steps)
    spec = get_spec(method)

    # one runner of each kind for both modes: each jits its update once
    one = make_runner(spec, case.hp, case.names, "jax", meta=case.meta)
    sharded = JaxShardedRunner(make_runner(spec, case.hp, case.names, "jax", meta=case.meta),
                               n)
    closed = drive(one, case, "closed_loop", None)
    out = {}
    for mode in modes:
        ref = closed if mode == "closed_loop" else drive(one, case, mode, closed)
        out[mode] = (ref, drive(sharded, case, mode, closed))
    return out


# -- the report ---------------------------------------------------------------------------------


#: layer traces' tensors that a float32 re-evaluation of the gradient moves beyond the
#: closed-loop bound, with the method's own derived bound for them
LAYER_EXCEPTIONS = {"poet": ("param/oft_R",)}

_WHY_LAYER = (
    ". On N ranks the gradient is the ranks' row sums reduced, not one sum over the batch: "
    "a second float32 evaluation of the same gradient (parity_tests/test_distributed.py "
    "shows the N-rank run bit for bit equal to one process accumulating the same "
    "micro-batches, and tests/distributed/test_jax_layers.py the one-device JAX run fed "
    "the devices' gradient within 1e-6 of them, so the difference is that evaluation "
    "alone; teacher-forced, where the update consumes the same gradient, it meets 1e-6). "
    "Measured, 2 ranks against one process: 1.7e-5 (train_in64_out48_b16_merge4, step 0, "
    "the first update); JAX on 2 devices: 1.4e-4 (step 8, the first update after the "
    "second merge).")


def tolerance(method: str, mode: str, layered: bool = False) -> Tolerance:
    """The bound of ``mode`` (:data:`TOLERANCES`); for a layer trace, closed loop, with the
    method's own bound on the tensors :data:`LAYER_EXCEPTIONS` names."""
    base = TOLERANCES[mode]
    if not layered or mode != "closed_loop" or method not in LAYER_EXCEPTIONS:
        return base
    own = get_parity(method).tolerance("closed_loop")
    return dataclasses.replace(base, tensors={
        k: dataclasses.replace(own.for_tensor(k),
                               why=own.for_tensor(k).why.rstrip(".") + _WHY_LAYER)
        for k in LAYER_EXCEPTIONS[method]})


def _run(case_name: str, label: str, against: str, mode: str, ref: list[Step],
         got: list[Step], tol: Tolerance | None = None) -> Run:
    per_step = [errors(g.tensors(), r.tensors()) for g, r in zip(got, ref, strict=True)]
    return Run(trace=case_name, backend=label, impl="plain", against=against, mode=mode,
               steps=len(per_step), tolerance=tol or TOLERANCES[mode], per_step=per_step)


def sources(method: str, traces: Sequence[str] | None = None) -> list[str]:
    """The optimizer traces replayed for ``method``: ``traces`` if given, else the bundled
    optimizer traces, else ``["synthetic"]`` where :data:`SYNTHETIC` has a stream."""
    from xopt.parity import bundled_traces

    if traces:
        return list(traces)
    found = [str(p) for p in bundled_traces(method)
             if load_trace(p, validate=False).kind == "optimizer"]
    if not found and method in SYNTHETIC:
        return ["synthetic"]
    return found


def run_distributed_parity(method: str, traces: Sequence[str] | None = None, *,
                           world_size: int = 2, backends: Sequence[str] = ("torch", "jax"),
                           shardings: Sequence[str] = SHARDINGS,
                           modes: Sequence[str] = ("teacher_forced", "closed_loop"),
                           max_steps: int | None = None, device: str = "cpu",
                           impl: str = "plain", torch_gang: Any = None,
                           jax_gang: Any = None) -> Report:
    """``method``'s traces on ``world_size`` ranks against one process (module docstring).

    ``torch_gang``/``jax_gang``: :class:`xopt.torch.launch.Gang` s to run on (the torch one
    of ``world_size`` ranks, the JAX one of one process seeing ``world_size`` devices);
    started here, and stopped after, when not given."""
    import contextlib

    from xopt.torch.launch import RankError

    if world_size < 2:
        raise BadRequest(f"--world-size {world_size}: at least 2")
    get_parity(method)  # an unknown method: its error, before anything starts
    notes: list[str] = []
    layered = method in LAYER_METHODS
    if layered:  # its traces train a module: xopt.parity.distributed_layers
        srcs = layer_sources(method, traces, notes)
        names = [load_layer_case(method, s, max_steps, device).name for s in srcs]
    else:
        srcs = sources(method, traces)
        names = [load_case(method, s, max_steps).name for s in srcs]  # before a rank
    if not srcs:
        raise BadRequest(f"{method}: no optimizer or layer trace to replay on {world_size} "
                         "ranks; pass --trace FILE")
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        if "torch" in backends:
            gang = torch_gang or stack.enter_context(_torch_gang(world_size, device))
            for shd in shardings:
                for src, name in zip(srcs, names, strict=True):
                    label = f"xopt.torch {shd}x{world_size}"
                    try:
                        if layered:
                            res = gang.run(torch_layer_outputs, method, src, shd,
                                           list(modes), max_steps, device)
                        else:
                            res = gang.run(torch_outputs, method, src, shd, list(modes),
                                           max_steps, impl, device)
                    except RankError as e:  # a failed run is a divergence, named in a note
                        runs += [_failed(name, label, "xopt.torch", m) for m in modes]
                        notes.append(f"{name} {label}: rank {e.rank} failed: "
                                     f"{e.exc_type or 'died'}: {e.exc_message}".rstrip(": "))
                        continue
                    for mode in modes:
                        ref, got = res[0][mode]
                        runs.append(_run(name, label, "xopt.torch", mode, ref, got,
                                         tolerance(method, mode, layered)))
                        if len({tuple(r["digests"][mode]) for r in res}) != 1:
                            runs[-1].per_step[-1]["ranks agree"] = _DISAGREE
                            notes.append(f"{name} {label} {mode}: the ranks disagree")
    with contextlib.ExitStack() as stack:  # the torch ranks (and their GPUs) released first
        if "jax" in backends:
            gang = jax_gang or stack.enter_context(_jax_gang(world_size, device))
            for src, name in zip(srcs, names, strict=True):
                label = f"xopt.jax {world_size} devices"
                try:
                    res = gang.run(jax_layer_outputs if layered else jax_outputs, method, src,
                                   world_size, list(modes), max_steps)
                except RankError as e:
                    runs += [_failed(name, label, "xopt.jax", m) for m in modes]
                    notes.append(f"{name} {label}: failed: {e.exc_type or 'died'}: "
                                 f"{e.exc_message}")
                    continue
                for mode in modes:
                    ref, got = res[0][mode]
                    runs.append(_run(name, label, "xopt.jax", mode, ref, got,
                                     tolerance(method, mode, layered)))
    return Report(method=method, traces=names, runs=runs, notes=notes)


_DISAGREE = TensorError(math.inf, math.inf)


def _failed(case_name: str, label: str, against: str, mode: str) -> Run:
    return Run(trace=case_name, backend=label, impl="plain", against=against, mode=mode,
               steps=0, tolerance=TOLERANCES[mode], per_step=[{"(the run failed)": _DISAGREE}])


def _torch_gang(world_size: int, device: str) -> Any:
    from xopt.torch.launch import Gang

    return Gang(world_size, "nccl" if str(device).startswith("cuda") else "gloo")


def _jax_gang(world_size: int, device: str) -> Any:
    from xopt.torch.launch import Gang

    return Gang(1, None, env=jax_env(world_size, device))


def jax_env(world_size: int, device: str = "cpu") -> dict[str, str]:
    """The environment of a child process whose JAX sees ``world_size`` devices: host
    devices on the CPU; with ``device`` "cuda", its GPUs."""
    if str(device).startswith("cuda"):
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={world_size}",
            "JAX_PLATFORMS": "cpu"}

