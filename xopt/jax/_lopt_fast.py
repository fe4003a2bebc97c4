"""The fast paths of xopt.jax's learned optimizers: a model's tensors packed by shape.

The plain path (:mod:`xopt.jax.small_fc_lopt`, :mod:`xopt.jax.velo`) evaluates the spec's
per-tensor math once per parameter: a jitted update of GPT-2 medium (292 tensors) holds
292 copies of every feature, normalizer and MLP op, so the program, its compile time and
its kernel launches grow with the number of tensors. Here the tensors are grouped by
shape (:class:`Buckets`: GPT-2 medium's 292 tensors have 8 shapes, ViT-B/16's 152 have 12),
each group is stacked on a leading axis, and the same per-tensor math runs once per group
under ``jax.vmap`` (``impl="packed"``). The program then has a fixed number of ops per
shape, whatever the depth of the model, and every op is the plain path's op with a batch
axis: the same arithmetic, so the results are the plain path's up to the order XLA picks
for a batched reduction (a few float32 ulps; tests/test_kernels_lopt_jax.py holds them to
the plain path, to float64 and to the golden traces).

``impl="pallas"`` adds fused Pallas kernels (:mod:`xopt.jax._lopt_pallas`) for the
per-element pass of the 2-D factored groups, where nearly all elements are: the features,
the MLP and the step in registers instead of XLA's materialized feature matrices and
activations. Those groups are not stacked: the kernels read and write each tensor's own
arrays (a stacked copy of a model's parameters, gradients and state, and the slicing of
the results back into leaves, would move several times the model's bytes per step).
Pallas rather than jax-triton's ``triton_call`` of xopt's own Triton kernels: those
kernels address tensors through a table of raw device pointers built by torch, which a JAX
program cannot hand them without packing every tensor into flat buffers first, and
jax-triton has no CPU interpreter, so CI could not run that path; Pallas kernels run
under ``interpret=True`` on the CPU (CI) and lower to Triton on the GPU.

The state is the plain path's (the same pytrees, shapes and names), so a state written by
one implementation resumes under the other. The default (``impl=None``) is
:data:`GPU_DEFAULT` on a GPU backend (the Pallas path, or the plain one for a configuration
its kernels do not cover), the plain path elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xopt.errors import HyperparameterError

__all__ = ["GPU_DEFAULT", "IMPLS", "Buckets", "resolve_impl", "select"]

#: implementations of the learned optimizers' inner update (``impl=``)
IMPLS = ("plain", "packed", "pallas")
#: precisions of the fused kernels' matrix products (``precision=``): "exact" multiplies
#: float32 on the tensor cores as three TF32 products (operands carried to ~22 bits, as the
#: torch Triton path's exact mode), "fast" as one TF32 product (about 1e-3 relative)
PRECISIONS = ("exact", "fast")
#: the default on a GPU backend, per method: the path measured fastest there side by side
#: with the others (bench/lopt_step_jax.py --plain; bench/RESULTS.md: on an H200 Pallas is
#: 4.7x (small_fc_lopt) and 8.1x (VeLO) faster than plain, its golden cases agreeing there)
GPU_DEFAULT = {"small_fc_lopt": "pallas", "velo": "pallas"}


def resolve_impl(label: str, impl: str | None, precision: str,
                 method_name: str = "small_fc_lopt") -> str:
    """``impl`` checked (None or "auto": :data:`GPU_DEFAULT` when JAX's default backend is a
    GPU, else "plain"); a bad value is a :class:`HyperparameterError` naming it."""
    if impl not in (None, "auto", *IMPLS):
        raise HyperparameterError(f"{label}: impl must be one of {', '.join(IMPLS)} or None "
                                  f"(auto), got {impl!r}")
    if precision not in PRECISIONS:
        raise HyperparameterError(f"{label}: precision must be 'exact' or 'fast', got "
                                  f"{precision!r}")
    if impl in (None, "auto"):
        return GPU_DEFAULT[method_name] if jax.default_backend() == "gpu" else "plain"
    return impl


def select(label: str, method_name: str, plain: Any, impl: str | None,
           precision: str) -> Any:
    """The inner method (:class:`xopt.jax._lopt.InnerMethod`) for ``impl``: ``plain``
    itself, or a fast one that shares its hyperparameters, θ and ``init``."""
    which = resolve_impl(label, impl, precision, method_name)
    if which == "plain":
        return plain
    if which == "pallas" and impl in (None, "auto"):  # the default: pallas where it applies
        from xopt.jax import _lopt_pallas

        check = (_lopt_pallas.unsupported_small_fc if method_name == "small_fc_lopt"
                 else _lopt_pallas.unsupported_velo)
        if check(plain.hp) is not None:  # plain, not packed: packed is the slower of the two
            return plain
    if method_name == "small_fc_lopt":
        return PackedSmallFC(plain, which, precision, label)
    if method_name == "velo":
        return PackedVeLO(plain, which)
    raise ValueError(f"no fast path for {method_name!r}")


def run_stage(name: str, fn: Any, *args: Any) -> Any:
    """How the fast paths run each stage of their update (``fn(*args)``). A benchmark sets
    a method's ``stage`` to a function of the same signature that runs and times each stage
    apart on its real inputs (bench/lopt_step_jax.py ``--breakdown``)."""
    del name
    return fn(*args)


def _in_group(stage: Any, shape: tuple[int, ...]) -> Any:
    """``stage`` with the group's shape appended to every stage name (``"stats@768x768"``)."""
    tag = "x".join(str(d) for d in shape) or "scalar"
    return lambda name, fn, *args: stage(f"{name}@{tag}", fn, *args)


# -- grouping tensors by shape --------------------------------------------------------------


class Buckets:
    """The leaves of a pytree grouped by shape, in order of first appearance.

    ``groups``: ``[(shape, [leaf indices])]``. :meth:`stack` gives one array per group
    (the group's leaves stacked on a new axis 0); :meth:`unstack` inverts it.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(shapes):
            groups.setdefault(tuple(int(d) for d in s), []).append(i)
        self.groups = list(groups.items())
        self.n = len(shapes)
        grouped = self.order()
        #: the row of each leaf in the groups concatenated (``x[rows]``: the leaves' order)
        self.rows = np.argsort(np.asarray(grouped, np.int64)) if grouped else np.zeros(0, int)

    def stack(self, leaves: Sequence[Any], keep: Container[int] = (),
              join: Any = None) -> list[Any]:
        """One array per group; a group of one leaf is that leaf with a leading axis of 1
        (a reshape, no copy). The groups numbered in ``keep`` stay lists of their leaves
        (no copy: the Pallas kernels read each tensor's own arrays). ``join(list)``, if
        given, stacks the others (default ``jnp.stack``)."""
        join = join or jnp.stack
        return [[leaves[i] for i in idx] if k in keep
                else leaves[idx[0]][None] if len(idx) == 1
                else join([leaves[i] for i in idx])
                for k, (_, idx) in enumerate(self.groups)]

    def unstack(self, stacked: Sequence[Any]) -> list[Any]:
        out: list[Any] = [None] * self.n
        for (_, idx), arr in zip(self.groups, stacked, strict=True):
            for j, i in enumerate(idx):
                out[i] = arr[j]
        return out

    def unstack_results(self, results: Sequence[Sequence[Any]],
                        split: Any = None) -> list[list[Any]]:
        """Per group a tuple of outputs, each stacked or a list of the group's leaves →
        per output the leaves' list (each leaf its row of its group's array, or its
        entry). ``split(x)``, if given, hands out the rows of every stacked output but the
        first (the step, which ``apply_updates`` reads: XLA fuses its slices there) as a
        list (:func:`xopt.jax._lopt_pallas.split_rows`, for the Pallas path)."""
        outs: list[list[Any]] = [[None] * self.n for _ in results[0]] if results else []
        for (_, idx), res in zip(self.groups, results, strict=True):
            for k, (out, arr) in enumerate(zip(outs, res, strict=True)):
                if split is not None and k > 0 and not isinstance(arr, list):
                    arr = split(arr)
                for j, i in enumerate(idx):
                    out[i] = arr[j]
        return outs

    def order(self) -> list[int]:
        """The leaf index of each row of the groups concatenated."""
        return [i for _, idx in self.groups for i in idx]


def _kernel_groups(buckets: Buckets, fused: Any) -> frozenset[int]:
    """The groups (numbers) the Pallas kernels ``fused`` (None: none) take."""
    if fused is None:
        return frozenset()
    return frozenset(k for k, (shape, _) in enumerate(buckets.groups) if fused.handles(shape))


def _stack_inputs(buckets: Buckets, keep: Container[int], impl: str, *xs: Any) -> list[Any]:
    """The pack stage: every input (``p``, ``g``, then the state arrays) stacked per
    group, the kernels' groups (``keep``) left as lists. On the Pallas path the state
    arrays (a channel axis last, which XLA's layout for the group's math puts first) are
    stacked by a copy kernel (:func:`xopt.jax._lopt_pallas.stack_rows`: XLA would transpose
    each tensor's in a kernel of its own)."""
    join = None
    if impl == "pallas":
        from xopt.jax import _lopt_pallas

        join = _lopt_pallas.stack_rows
    return [buckets.stack(x, keep, join if k >= 2 else None) for k, x in enumerate(xs)]


def _splitter(impl: str) -> Any:
    """How a fast path hands each tensor its rows of a stacked result that is a result of
    the program (a state array): on the Pallas path a copy kernel for many tensors at once
    (:func:`xopt.jax._lopt_pallas.split_rows`: XLA:GPU would copy each row in a kernel of
    its own), else None (XLA's slices, the packed path's reference)."""
    if impl != "pallas":
        return None
    from xopt.jax import _lopt_pallas

    return lambda x: _lopt_pallas.split_rows(x, tuple(x.shape[1:]))


# -- small_fc_lopt --------------------------------------------------------------------------


class PackedSmallFC:
    """small_fc_lopt's inner update over shape groups (``impl="packed"`` and, for the 2-D
    factored groups, ``impl="pallas"``)."""

    def __init__(self, plain: Any, impl: str, precision: str,
                 label: str = "xopt.jax.small_fc_lopt") -> None:
        self.plain, self.hp, self.meta = plain, plain.hp, plain.meta
        self.impl, self.precision = impl, precision
        #: the stage runner (None: :func:`run_stage`)
        self.stage = None
        if impl == "pallas":
            from xopt.jax import _lopt_pallas

            why = _lopt_pallas.unsupported_small_fc(self.hp)
            if why is not None:
                raise HyperparameterError(f"{label}(impl='pallas'): {why}")

    def init(self, params: Any) -> Any:
        return self.plain.init(params)

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: Any) -> tuple[Any, Any]:
        from xopt.specs import small_fc_lopt as spec

        del loss  # AdafacMLPLOpt does not read the loss
        hp, meta = self.hp, self.meta
        stage = self.stage or run_stage
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(grads)
        names = spec.PARAM_VARS
        accs_in = [treedef.flatten_up_to(getattr(inner, v)) for v in names]
        decays, tf = stage("setup", lambda it: (spec.decays(hp, meta, xp=jnp),
                                                spec.time_features(jnp, it, meta["mlp/b0"])),
                           iteration)
        buckets = Buckets([jnp.shape(p) for p in p_leaves])

        def one(p, g, m, rms, v_row, v_col, v_diag):  # noqa: ANN001, ANN202
            step, accs = spec.compute_step(hp, p, g, m, rms, v_row, v_col, v_diag, tf, meta,
                                           decays, xp=jnp)
            return (step, *accs)

        fused = None
        if self.impl == "pallas":
            from xopt.jax import _lopt_pallas

            fused = _lopt_pallas.SmallFCKernels(hp, meta, self.precision)
        keep = _kernel_groups(buckets, fused)
        stacked = stage("pack", functools.partial(_stack_inputs, buckets, keep, self.impl),
                        p_leaves, g_leaves, *accs_in)
        results = []
        for k, (shape, _) in enumerate(buckets.groups):
            args = [st[k] for st in stacked]
            if k in keep:
                results.append(fused(shape, *args, tf=tf, decays=decays,
                                     stage=_in_group(stage, shape)))
            else:
                results.append(_in_group(stage, shape)("xla", jax.vmap(one), *args))
        split = _splitter(self.impl)
        steps, *accs_out = stage("unpack", lambda r: buckets.unstack_results(r, split),
                                 results)
        new = type(inner)(*(treedef.unflatten(a) for a in accs_out),
                          mom_t=inner.mom_t + 1, rms_t=inner.rms_t + 1)
        return treedef.unflatten(steps), new


# -- VeLO ------------------------------------------------------------------------------------


class PackedVeLO:
    """VeLO's inner update over shape groups (``impl="packed"`` and, for the 2-D factored
    groups, ``impl="pallas"``): the LSTM inputs and the per-tensor MLPs per group, the LSTM
    itself on all tensors at once in the parameters' order, as the plain path."""

    def __init__(self, plain: Any, impl: str = "packed") -> None:
        self.plain, self.hp, self.meta, self.impl = plain, plain.hp, plain.meta, impl
        #: the stage runner (None: :func:`run_stage`)
        self.stage = None
        if impl == "pallas":
            from xopt.jax import _lopt_pallas

            why = _lopt_pallas.unsupported_velo(self.hp)
            if why is not None:
                raise HyperparameterError(f"xopt.jax.velo(impl='pallas'): {why}")

    def init(self, params: Any) -> Any:
        return self.plain.init(params)

    def update(self, params: Any, grads: Any, loss: jax.Array, iteration: jax.Array,
               inner: Any) -> tuple[Any, Any]:
        from xopt.specs import velo as spec

        hp, meta = self.hp, self.meta
        stage = self.stage or run_stage
        acc_vars = ("m", "rms", "v_row", "v_col", "v_diag")
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(grads)
        accs_in = [treedef.flatten_up_to(getattr(inner, v)) for v in acc_vars]
        like = inner.loss_means

        def setup(loss, iteration, means, rmin, ldecays, lit):  # noqa: ANN001, ANN202
            means, rmin, loss_it, lfeat = spec.loss_buffer_step(jnp, means, rmin, ldecays, lit,
                                                                loss)
            # as the plain path: the horizon kept opaque, so that t / N stays a division
            num_steps = jax.lax.optimization_barrier(jnp.asarray(hp.inner_num_steps,
                                                                 jnp.int32))
            frac = spec.fraction_trained(jnp, iteration, num_steps, like)
            return means, rmin, loss_it, lfeat, frac

        means, rmin, loss_it, lfeat, frac = stage(
            "setup", setup, loss, iteration, inner.loss_means, inner.loss_running_min,
            inner.loss_decays, inner.loss_iteration)
        buckets = Buckets([jnp.shape(p) for p in p_leaves])
        n = len(p_leaves)
        fused = None
        if self.impl == "pallas":
            from xopt.jax import _lopt_pallas

            fused = _lopt_pallas.VeLOKernels(hp, meta)
        keep = _kernel_groups(buckets, fused)
        # every input stacked once per group, read by both passes (the kernels' groups: their
        # leaves as they are)
        stacked = stage("pack", functools.partial(_stack_inputs, buckets, keep, self.impl),
                        p_leaves, g_leaves, *accs_in)
        decays = tuple(jnp.asarray(d) for d in spec.decay_arrays(hp))
        # the kernels' groups: their statistics pass before the LSTM, whose inputs it gives
        first = {k: fused.first(shape, *[st[k] for st in stacked], decays=decays,
                                stage=_in_group(stage, shape))
                 for k, (shape, _) in enumerate(buckets.groups) if k in keep}

        def lstm(stacked, parts, hidden, cell, frac, lfeat):  # noqa: ANN001, ANN202
            def features(p, m, rms):  # noqa: ANN001, ANN202
                return spec.lstm_features(jnp, p, m, rms, frac, lfeat)

            rows = [fused.lstm_inputs(buckets.groups[k][0], parts[k], m_, r_, frac, lfeat)
                    if k in keep else jax.vmap(features)(p_, m_, r_)
                    for k, (p_, m_, r_) in enumerate(zip(stacked[0], stacked[2], stacked[3],
                                                         strict=True))]
            # the parameters' order, as the plain path (one gather, not a slice per tensor)
            x = jnp.concatenate(rows)[buckets.rows]
            controls, lr_mult, hidden, cell = spec.lstm_step(jnp, x, jnp.stack(hidden),
                                                             jnp.stack(cell), meta)
            per_group = [(controls[jnp.asarray(idx)], lr_mult[jnp.asarray(idx)])
                         for _, idx in buckets.groups]
            return per_group, hidden, cell

        per_group, hidden, cell = stage("lstm", lstm, stacked,
                                        {k: part for k, (_, part) in first.items()},
                                        treedef.flatten_up_to(inner.lstm_hidden),
                                        treedef.flatten_up_to(inner.lstm_cell), frac, lfeat)

        def one(p, g, m, rms, v_row, v_col, v_diag, c, s):  # noqa: ANN001, ANN202
            step, accs = spec.update_tensor(jnp, hp, p, g, m, rms, v_row, v_col, v_diag, c, s,
                                            meta, decays)
            return (step, *accs)

        results = []
        for k, (shape, _) in enumerate(buckets.groups):
            args = [st[k] for st in stacked]
            if k in keep:
                p_, g_, m_, rms_, _, _, v_diag = args
                results.append(fused.second(shape, *first[k], *per_group[k], p_, g_, m_, rms_,
                                            v_diag, stage=_in_group(stage, shape)))
            else:
                results.append(_in_group(stage, shape)("xla", jax.vmap(one), *args,
                                                       *per_group[k]))

        split = _splitter(self.impl) or (lambda x: [x[i] for i in range(n)])

        def unpack(results, hidden, cell):  # noqa: ANN001, ANN202
            return buckets.unstack_results(results, _splitter(self.impl)), split(hidden), \
                split(cell)

        res, hidden, cell = stage("unpack", unpack, results, hidden, cell)
        new = type(inner)(*(treedef.unflatten(a) for a in res[1:]),
                          lstm_hidden=treedef.unflatten(hidden),
                          lstm_cell=treedef.unflatten(cell),
                          mom_t=inner.mom_t + 1, rms_t=inner.rms_t + 1, loss_means=means,
                          loss_running_min=rmin, loss_decays=inner.loss_decays,
                          loss_iteration=loss_it)
        return treedef.unflatten(res[0]), new
