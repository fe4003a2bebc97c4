"""COAP as a ``torch.optim.Optimizer``: :mod:`xopt.specs.coap`'s update, per parameter.

Each update calls :func:`xopt.specs.coap.param_step` with ``xp=torch``: the same function the
float64 oracle runs, so there is one definition of the arithmetic. This module adds what a
torch optimizer needs around it (see :class:`xopt.torch._lowrank.LowRankOptimizer`): param
groups, validation naming the parameter, the finiteness check, decompositions that raise
:class:`~xopt.errors.DecompositionError` naming the parameter instead of writing NaN into
``P``, low-precision parameters with float32 state, and state dicts of tensors only.

State per parameter (``optimizer.state[p]``, the spec's ``"xopt.torch"`` naming):
``step`` (int64 CPU tensor), ``exp_avg`` (M; absent for Adafactor with ``b1=None``),
``exp_avg_sq`` (AdamW v; Adafactor v of tensors with fewer than 2 dims),
``exp_avg_sq_row``/``exp_avg_sq_col`` (Adafactor, factored), ``RMS`` (Adafactor),
``ortho_matrix`` (P, projected matrices; a kernel's U₀), ``ortho_matrix_in`` (a Tucker-2
kernel's U₁), ``ortho_matrix_grad``/``ortho_matrix_in_grad`` (a kernel's carried Eqn-6
gradients, ``carry_factor_grad``). The authors keep ``P`` inside a projector object
(``state["projector"].ortho_matrix``); xopt keeps the tensor itself, so ``state_dict()``
loads with ``torch.load(..., weights_only=True)``.

With ``state_bits=8`` the moments are ``exp_avg_codes``/``exp_avg_sq_codes`` (uint8, the
moment's shape) and ``exp_avg_absmax``/``exp_avg_sq_absmax`` (float32, one per block of
4096). The authors keep bitsandbytes' ``(codes, QuantState)`` tuples; plain uint8 and
float32 tensors instead load with ``weights_only=True`` and go through ``state_dict``,
DTensor and DCP like any other state tensor (a tensor subclass, as torchao's, needs its own
DTensor and DCP support), and the JAX backend quantises to the same bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from xopt.kernels import triton_available
from xopt.registry import register
from xopt.specs import arrays
from xopt.specs import coap as _spec
from xopt.torch._lowrank import LowRankOptimizer, chunks, converted, stack_as
from xopt.torch._optim import Item
from xopt.torch.distributed import Layout, decompose_once, is_dtensor, local, place_as, whole

__all__ = ["COAP"]

# canonical state variable -> this optimizer's state key
_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "v_row": "exp_avg_sq_row",
         "v_col": "exp_avg_sq_col", "rms": "RMS", "P": "ortho_matrix",
         "P_in": "ortho_matrix_in", "P_grad": "ortho_matrix_grad",
         "P_in_grad": "ortho_matrix_in_grad", "m_q": "exp_avg_codes",
         "m_absmax": "exp_avg_absmax", "v_q": "exp_avg_sq_codes",
         "v_absmax": "exp_avg_sq_absmax"}


class COAP(LowRankOptimizer):
    r"""COAP (Xiao et al., CVPR 2025): AdamW or Adafactor on low-rank projected gradients,
    the projection moved by one SGD step on Eqn 6 every ``update_interval`` updates and
    recomputed by Eqn 7 every ``update_interval × reproject_factor``.

    Args:
      params: parameters, or param groups (dicts) that override any field of
        :class:`xopt.specs.coap.COAP` by keyword or with their own ``"spec"``. A group with
        ``project=False`` takes the base update unprojected (the authors' groups without
        ``proj_method``); with ``project="auto"`` (default) a matrix is projected unless
        ``rank ≥ min(shape)``; with ``project=True`` every matrix is, and a rank larger than
        a matrix is an error naming it. Only matrices are projected.
      spec: a :class:`xopt.specs.coap.COAP` (instead of keywords).
      preset: ``"adamw"`` (the authors' ``CoapAdamW`` defaults, also the class defaults) or
        ``"adafactor"`` (``CoapAdafactor``'s, with ``b1=None``).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``.
      svd_driver: how refreshes decompose (:data:`xopt.torch._lowrank.SVD_DRIVERS`; None:
        ``torch.linalg.svd``'s default, as the spec).
      **hyperparameters: fields of :class:`xopt.specs.coap.COAP` (``lr``, ``rank``,
        ``rank_ratio``, ``update_interval``, ``reproject_factor``, ``proj_dtype``, ...).

    Precision: state is float32 (float64 for float64 parameters). ``proj_dtype="state"``
    (default) computes the whole step there and rounds it into the parameter once. With
    ``proj_dtype="param"`` (AdamW only) a bfloat16/float16 matrix's ordinary step is the
    authors' ``CoapAdamW``'s: ``P`` (kept in float32) rounded to the parameter's dtype, both
    products there, ``p.add_(U, alpha=-step_size)`` there; the moments and the projection
    events stay float32 (:mod:`xopt.specs.coap`). Float32 and float64 parameters, kernels
    and unprojected tensors step alike under both.

    ``step(closure=None, *, inject=None)``: ``inject={param: {"ortho_matrix": P}}`` makes
    an update that decomposes (the first, and every Eqn-7 one) use ``P`` instead; the
    parity harness feeds the original's recorded projections this way.

    Example::

        opt = xopt.torch.COAP([{"params": matrices}, {"params": others, "project": False}],
                              lr=1e-3, rank=128, update_interval=32, reproject_factor=5)
        opt = xopt.torch.COAP(model.parameters(), preset="adafactor", lr=1e-2, b1=0.9,
                              rank_ratio=4)
    """

    hyperparams_cls = _spec.COAP
    spec = _spec.SPEC
    state_keys = _KEYS
    step_kind = torch.int64

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *,
                 spec: _spec.COAP | None = None, preset: str | None = None,
                 nonfinite: str | None = None, check_finite: bool | None = None,
                 **hyperparameters: Any) -> None:
        super().__init__(params, spec=spec, preset=preset, nonfinite=nonfinite,
                         check_finite=check_finite, **hyperparameters)

    def _check_param(self, p: Tensor, hp: _spec.COAP, where: str) -> None:
        _spec.check_param(tuple(p.shape), hp, where)

    def _prepare(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.COAP,
                 name: str, inject: Mapping[str, Tensor] | None) -> Any:
        """``{"ortho_matrix": P}``: the new projection when this update decomposes (the
        first update and every Eqn-7 one; :func:`xopt.specs.coap.decompose`), else None."""
        shape = tuple(p.shape)
        if not _spec.is_projected(shape, hp):
            return None
        t = int(state["step"]) if "step" in state else 0
        ev = _spec.event(t, hp)
        if ev not in (_spec.INITIAL, _spec.EQN7):
            return None
        dtype = self.state_dtype(p)
        if inject is not None and "ortho_matrix" in inject:
            return {k: inject[k].to(device=p.device, dtype=dtype)
                    for k in ("ortho_matrix", "ortho_matrix_in") if k in inject}
        if is_dtensor(g) and _spec.side_of(shape) == "tucker":
            # a kernel's whole HOOI on one owner rank: its sweeps contract and unfold the
            # sharded channel dimension, which DTensor refuses to flatten (torch 2.11)
            ranks = _spec.tucker_ranks(shape, hp)
            factors = decompose_once(
                self, self._grad32(g).to(dtype),
                lambda w: _spec.partial_tucker(torch, w, ranks,
                                               svd=lambda a: self.svd(a, name)),
                [((shape[k], r), dtype) for k, r in enumerate(ranks)])
            return dict(zip(("ortho_matrix", "ortho_matrix_in"), factors, strict=False))
        p_new = _spec.new_projection(
            torch, hp, shape, self._grad32(g).to(dtype),
            state.get("ortho_matrix"), ev,
            omega=lambda: _spec.initial_omega(hp, shape, backend="torch",
                                              device=p.device).to(dtype),
            qr=lambda a: self.qr(a, name), svd=lambda a: self.svd(a, name))
        if isinstance(p_new, tuple):  # a kernel's Tucker factors
            return dict(zip(("ortho_matrix", "ortho_matrix_in"), p_new, strict=False))
        return {"ortho_matrix": p_new}

    # -- the batched step: the AdamW variant's matrices and unprojected tensors, same-shaped
    # matrices at the same update together. Events 1 and 3 (Eqn 7) decompose in
    # _prepare_batch: one batched product, QR and SVD per run of same-shaped matrices (the
    # spec's orthogonal_basis on a stack); event 2 (Eqn 6) and the moments' restoration
    # evaluate the spec's functions over the stack (torch.func.vmap: one batched kernel
    # sequence, the per-parameter arithmetic); then one AdamW step as GaLore's
    # (LowRankOptimizer._hf_adam_batch). Adafactor, kernels (Tucker), injected projections
    # and DTensors take param_step per parameter.
    # 8-bit moments are dequantised and quantised for the whole run at once: each tensor's
    # blocks of 4096, zero-padded, laid end to end are the blocks the spec's quantize makes
    # of each tensor alone, so the codes and absmax are the per-parameter step's bytes
    def _batchable(self, it: Item, hp: _spec.COAP, inject: Mapping[str, Tensor] | None) -> bool:
        if hp.optimizer != "adamw" or inject or is_dtensor(it.param):
            return False
        shape = tuple(it.param.shape)
        return not (_spec.is_projected(shape, hp) and _spec.side_of(shape) == "tucker")

    def _event_runs(self, items: list[Item], hps: Mapping[int, _spec.COAP],
                    events: tuple[int, ...]) -> list[tuple[tuple[Any, ...], list[Item]]]:
        """The projected items whose update has one of ``events``, grouped by (group, update,
        state dtype, device, shape) and split into runs of at most BATCH_ELEMENTS."""
        groups: dict[Any, list[Item]] = {}
        for it in items:
            p, hp, state = it.param, hps[it.gi], self.state[it.param]
            shape = tuple(p.shape)
            t = int(state["step"]) if "step" in state else 0
            if _spec.is_projected(shape, hp) and _spec.event(t, hp) in events:
                key = (it.gi, t, self.state_dtype(p), p.device, shape)
                groups.setdefault(key, []).append(it)
        return [(key, run) for key, its in groups.items() for run in chunks(its, key[-1])]

    def _prepare_batch(self, items: list[Item], hps: Mapping[int, _spec.COAP]
                       ) -> dict[int, Tensor]:
        """The new ``P`` of every item whose update decomposes (events 1 and 3), by Eqn 7:
        ``Q = QR(A Ω)``, ``Z`` of ``SVD(Qᵀ A)`` (:func:`xopt.specs.coap.orthogonal_basis`
        on the stack; Ω drawn once per run at event 1, each old ``P`` at event 3)."""
        out: dict[int, Tensor] = {}
        for (gi, t, sdt, device, shape), run in self._event_runs(
                items, hps, (_spec.INITIAL, _spec.EQN7)):
            hp, side = hps[gi], _spec.side_of(shape)
            g = stack_as([it.grad for it in run], sdt)
            a = g if side == "right" else g.mT
            if _spec.event(t, hp) == _spec.INITIAL:
                omega = _spec.initial_omega(hp, shape, backend="torch", device=device).to(sdt)
            else:
                old = torch.stack([self.state[it.param][_KEYS["P"]] for it in run])
                omega = torch.vmap(functools.partial(_spec.warm_omega, side=side))(old)
            names = [self.param_name(it.gi, it.i) for it in run]
            q = self.qr_stacked(torch.matmul(a, omega), names)
            z = self.svd_stacked(torch.matmul(q.mT, a), names)[2]
            new = z if side == "right" else z.mT
            for j, it in enumerate(run):
                out[id(it.param)] = new[j]
        return out

    def _update_batch(self, items: list[Item], hps: Mapping[int, _spec.COAP],
                      prepared: dict[int, Tensor]) -> None:
        for it in items:
            if "step" not in self.state[it.param]:
                self._init_state(it.param, self.state[it.param], hps[it.gi])
        for (gi, t, sdt, _, shape), run in self._event_runs(
                items, hps, (_spec.INITIAL, _spec.EQN6, _spec.EQN7)):
            self._event_run(run, hps[gi], _spec.event(t, hps[gi]), sdt, shape, prepared)
        self._hf_adam_batch(items, hps, self._side, _KEYS["m"], _KEYS["v"], _KEYS["P"])

    def _event_run(self, run: list[Item], hp: _spec.COAP, ev: int, sdt: torch.dtype,
                   shape: tuple[int, ...], prepared: dict[int, Tensor]) -> None:
        """The projection event ``ev`` of a run (param_step's before the AdamW step): the
        new ``P`` (Eqn 6 here, Eqn 7 from ``prepared``), the moments restored into its
        subspace (``restore_state``), ``P`` stored."""
        side = _spec.side_of(shape)
        states = [self.state[it.param] for it in run]
        p_old = torch.stack([st[_KEYS["P"]] for st in states])
        moves = ev in (_spec.EQN6, _spec.EQN7)
        ms = vs = None
        if ev == _spec.EQN6 or (moves and hp.restore_state):
            ms, vs = self._batch_moments(states, hp, _KEYS["m"], _KEYS["v"], sdt)
        if ev == _spec.EQN6:
            def eqn6(p: Tensor, m: Tensor, g: Tensor) -> Tensor:
                m6 = _spec.eqn6_moment(torch, hp, m, g, p, side)
                return _spec.eqn6_step(torch, p, m6, g, side, hp.proj_lr, hp.proj_max_norm)

            new = torch.vmap(eqn6)(p_old, torch.stack(ms),
                                   stack_as([it.grad for it in run], sdt))
        else:
            new = torch.stack([prepared[id(it.param)] for it in run])
        if moves and hp.restore_state:
            def restore(m: Tensor, v: Tensor, po: Tensor, pn: Tensor) -> tuple[Tensor, Tensor]:
                return _spec.restore_moments(torch, hp, m, v, po, pn, side)

            m2, v2 = torch.vmap(restore)(torch.stack(ms), torch.stack(vs), p_old, new)
            m2, v2 = list(m2.unbind(0)), list(v2.unbind(0))
            if hp.state_bits == 8:  # stored quantised; the AdamW step reads them back
                self._batch_store(states, hp, m2, v2)
            else:
                torch._foreach_copy_(ms, m2)
                torch._foreach_copy_(vs, v2)
        torch._foreach_copy_([st[_KEYS["P"]] for st in states], list(new.unbind(0)))

    @staticmethod
    def _batch_moments(states: list[dict[str, Any]], hp: _spec.COAP, m_key: str, v_key: str,
                       dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
        if hp.state_bits != 8:
            return LowRankOptimizer._batch_moments(states, hp, m_key, v_key, dtype)
        # dequantised in float32, widened (exactly) to a float64 parameter's working dtype
        return tuple([x.to(dtype) for x in _dequantize_many([st[_KEYS[q]] for st in states],
                                                            [st[_KEYS[a]] for st in states])]
                     for q, a in (("m_q", "m_absmax"), ("v_q", "v_absmax")))

    @staticmethod
    def _batch_store(states: list[dict[str, Any]], hp: _spec.COAP, ms: list[Tensor],
                     vs: list[Tensor]) -> None:
        if hp.state_bits != 8:
            return
        for x, q, a in ((ms, "m_q", "m_absmax"), (vs, "v_q", "v_absmax")):
            codes, absmax = _quantize_many(x, hp.quant_rounding)
            torch._foreach_copy_([st[_KEYS[q]] for st in states], codes)
            torch._foreach_copy_([st[_KEYS[a]] for st in states], absmax)

    def _batch_adam_fused(self, states: list[dict[str, Any]], hp: _spec.COAP, r: Tensor | None,
                          rs: list[Tensor], sdt: torch.dtype, keys: tuple[str, str]
                          ) -> Tensor | list[Tensor] | None:
        """8-bit moments where xopt.kernels.quant8 runs (``XOPT_QUANT8=auto``: CUDA tensors):
        its one pass per shape (dequantise, update, direction, requantise: the torch path's
        bytes) instead of the torch ops; float32 moments: the base's fused pass."""
        if hp.state_bits != 8:
            return super()._batch_adam_fused(states, hp, r, rs, sdt, keys)
        if sdt != torch.float32:
            return None
        kernel = _quant8(rs[0].device)
        if kernel is None:
            return None
        if r is not None:
            r = r.to(sdt)  # exact
            rs = list(r.unbind(0))
        else:
            rs = converted(rs, sdt)
        if r is not None:
            return _adam8(kernel, states, hp, r)
        out: list[Any] = [None] * len(rs)
        for _, idx in _by_shape(rs).items():
            n = _adam8(kernel, [states[i] for i in idx], hp, torch.stack([rs[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = n[j]
        return out

    @staticmethod
    def _side(p: Tensor, hp: _spec.COAP) -> str | None:
        shape = tuple(p.shape)
        return _spec.side_of(shape) if _spec.is_projected(shape, hp) else None

    def _init_state(self, p: Tensor, state: dict[str, Any], hp: _spec.COAP) -> None:
        """The state before the first update: step 0, zeros (``P`` is set at update 0)."""
        shape, dtype = tuple(p.shape), self.state_dtype(p)
        state["step"] = torch.tensor(0, dtype=torch.int64)
        for v in _spec.STATE.vars:
            if v.scope == "param" and v.exists_for(shape, hp):
                vdt = dtype if v.dtype == "state" else getattr(torch, v.dtype)
                state[_KEYS[v.name]] = place_as(p, torch.zeros(
                    v.shape(shape, hp), dtype=vdt, device=local(p).device))

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], hp: _spec.COAP,
                name: str, inject: Mapping[str, Tensor] | None, prepared: Any) -> None:
        dtype = self.state_dtype(p)
        if "step" not in state:
            self._init_state(p, state, hp)
        t = int(state["step"])
        st = {var: state[key] for var, key in _KEYS.items() if key in state}

        def no_decomposition(a: Tensor) -> Any:  # every decomposition is _prepare's
            raise AssertionError(f"COAP: {name}: a decomposition outside _prepare")

        # a projected kernel under FSDP2 steps whole on every rank (its gradient gathered;
        # kernels are small): Tucker's mode products and unfoldings flatten the sharded
        # channel dimension, a view DTensor refuses (torch 2.11 on CUDA)
        gathered = is_dtensor(p) and self._side(p, hp) == "tucker"
        if gathered:
            p0, g0, st = whole(p.detach()).to(dtype), whole(g), {k: whole(v) for k, v in st.items()}
        else:  # proj_dtype="param": a projected matrix steps in its own dtype (param_step)
            low = _spec.low_dtype(tuple(p.shape), hp, p.dtype, dtype) is not None
            p0, g0 = (p.detach() if low else p.detach().to(dtype)), g
        new_p, st = _spec.param_step(
            torch, hp, p0, g0.to(dtype), st, t,
            inject=prepared,
            qr=no_decomposition, svd=no_decomposition,
            codec=_SHARDED_CODEC if is_dtensor(p) and not gathered else None)
        for var, value in st.items():
            state[_KEYS[var]] = (place_as(p, value) if gathered and isinstance(value, Tensor)
                                 else value)
        state["step"] = torch.tensor(t + 1, dtype=torch.int64)
        if gathered:
            new_p = place_as(p, new_p)
        self.write(p, new_p)


def _by_shape(xs: list[Tensor]) -> dict[tuple[int, ...], list[int]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(xs):
        out.setdefault(tuple(x.shape), []).append(i)
    return out


def _quant8(device: torch.device) -> Any:
    """:mod:`xopt.kernels.quant8` where its fused step runs on ``device`` (its ``BACKEND``,
    ``XOPT_QUANT8``), else None (the torch ops)."""
    if not triton_available():
        return None
    from xopt.kernels import quant8

    return quant8 if quant8.runs_on(device) else None


def _adam8(kernel: Any, states: list[dict[str, Any]], hp: _spec.COAP, r: Tensor) -> Tensor:
    """The fused 8-bit AdamW moment step of the same-shaped moments of ``states`` with the
    stacked gradients ``r``: the directions, stacked; the codes and absmax written back."""
    keys = [_KEYS[k] for k in ("m_q", "m_absmax", "v_q", "v_absmax")]
    if len(states) == 1 and all(states[0][k].is_contiguous() for k in keys):  # in place
        bufs = [states[0][k].view(1, -1) for k in keys]
    else:
        bufs = [torch.stack([st[k].reshape(-1) for st in states]) for k in keys]
    n = kernel.adam_step(bufs[0], bufs[1], bufs[2], bufs[3], r, hp.b1, hp.b2, hp.eps,
                         hp.quant_rounding)
    if len(states) > 1:
        for k, buf in zip(keys, bufs, strict=True):
            torch._foreach_copy_([st[k] for st in states],
                                 [x.view(st[k].shape) for x, st in zip(buf.unbind(0), states,
                                                                        strict=True)])
    return n


def _dequantize_many(codes: list[Tensor], absmax: list[Tensor]) -> list[Tensor]:
    """:func:`xopt.specs.coap.dequantize` of each tensor: one pass per shape."""
    out: list[Any] = [None] * len(codes)
    code = torch.as_tensor(_spec.dynamic_code(), device=codes[0].device)
    for shape, idx in _by_shape(codes).items():
        n = math.prod(shape)
        q = torch.stack([codes[i].reshape(-1) for i in idx]).to(torch.int64)     # (B, n)
        scale = torch.stack([absmax[i] for i in idx]).repeat_interleave(
            _spec.QUANT_BLOCK, dim=1)[:, :n]
        vals = code.take(q) * scale
        for j, i in enumerate(idx):
            out[i] = vals[j].view(shape)
    return out


def _quantize_many(xs: list[Tensor], rounding: str) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`xopt.specs.coap.quantize` of each tensor, one pass per shape: each tensor
    zero-padded to whole blocks, the blocks laid end to end, are the blocks quantize makes
    of it alone (it pads the last one with zeros too), so the bytes are the same. Its
    steps on the (B·nb, 4096) blocks, the code of each entry by :func:`_encode`."""
    codes: list[Any] = [None] * len(xs)
    absmax: list[Any] = [None] * len(xs)
    for shape, idx in _by_shape(xs).items():
        n, nb = math.prod(shape), _spec.num_blocks(shape)
        flat = torch.stack([xs[i].reshape(-1) for i in idx]).to(torch.float32)
        blocks = torch.nn.functional.pad(flat, (0, nb * _spec.QUANT_BLOCK - n)).view(
            -1, _spec.QUANT_BLOCK)
        a = blocks.abs().amax(dim=1)
        nonzero = a > 0
        inv = arrays.divide(torch, 1.0, torch.where(nonzero, a, torch.ones_like(a)))
        q = _encode(blocks * inv[:, None], rounding)
        q = torch.where(nonzero[:, None], q, torch.zeros_like(q)).to(torch.uint8)
        q, a = q.view(len(idx), -1)[:, :n], a.view(len(idx), nb)
        for j, i in enumerate(idx):
            codes[i], absmax[i] = q[j].view(shape), a[j]
    return codes, absmax


def _encode(y: Tensor, rounding: str) -> Tensor:
    """:func:`xopt.specs.coap.encode` of ``y``, by a table instead of the search's ~60
    operations. The code the spec picks depends only on comparisons of ``y`` with code
    book entries and with midpoints of pairs of them, so it is constant at each such
    threshold and between neighbouring thresholds; :func:`_encode_table` holds, for the
    sorted thresholds ``T``, the spec's code between ``T[i-1]`` and ``T[i]`` at ``2i`` and
    at ``T[i]`` at ``2i + 1``, read at ``#(T < y) + #(T ≤ y)``. NaN takes the spec's code
    for NaN."""
    if rounding != "cuda":  # bitsandbytes' CPU table: a few operations already
        return _spec.encode(torch, y, rounding)
    thresholds, table, nan_code = _encode_table(y.device)
    pos = torch.searchsorted(thresholds, y) + torch.searchsorted(thresholds, y, right=True)
    q = table.take(pos)
    return torch.where(y.isnan(), nan_code, q)


@functools.cache
def _encode_table(device: torch.device) -> tuple[Tensor, Tensor, int]:
    """``(T, table, code of NaN)`` of :func:`_encode` (``rounding="cuda"``), from the spec's
    encode itself: every code and every float32 midpoint of two codes as candidate
    thresholds, the spec evaluated at each and just above each, and the thresholds where
    nothing changes dropped."""
    import numpy as np

    code = _spec.dynamic_code()
    mids = ((code[:, None] + code[None, :]) * np.float32(0.5)).astype(np.float32)
    cand = np.unique(np.concatenate([code, mids.reshape(-1)]))
    above = np.nextafter(cand, np.float32(np.inf))
    below = np.nextafter(cand[:1], np.float32(-np.inf))
    pts = torch.from_numpy(np.concatenate([below, np.stack([cand, above], 1).reshape(-1),
                                           np.float32([np.nan])]))
    f = _spec.encode(torch, pts, "cuda").numpy()
    between = np.concatenate([f[:1], f[2:-1:2]])     # below T[0], then above each T[i]
    at = f[1:-1:2]
    keep = (at != between[:-1]) | (at != between[1:])  # a change at T[i]
    table = np.stack([between[:-1][keep], at[keep]], 1).reshape(-1)
    table = np.concatenate([table, between[-1:]])
    return (torch.as_tensor(cand[keep], device=device),
            torch.as_tensor(table.astype(np.int64), device=device), int(f[-1]))


# -- 8-bit moments under FSDP2 --------------------------------------------------------------
# The blocks are the whole moment's (row-major, 4096 entries), as in one process: each rank
# takes the global flat index of its local entries, the blocks' absmax is completed by one
# all-reduce (max) of num_blocks floats, and every entry is encoded alone (spec.encode), so
# the codes and absmax are one process's, byte for byte. The codes are placed as the moment
# (a rank holds its rows' codes); absmax, one float per block of the whole moment, is
# replicated. DTensor's own ops would flatten the moment, which it refuses for uneven shards.


def _block_of(lay: Layout, device: torch.device) -> Tensor:
    """The block (global row-major index // 4096) of each local entry of ``lay``."""
    idx = torch.zeros(lay.local_shape, dtype=torch.int64, device=device)
    for d, (off, n) in enumerate(zip(lay.offsets, lay.local_shape, strict=True)):
        shape = [1] * len(lay.shape)
        shape[d] = n
        stride = math.prod(lay.shape[d + 1:])
        idx = idx + (torch.arange(off, off + n, device=device) * stride).view(shape)
    return idx // _spec.QUANT_BLOCK


def _replicated_like(lay: Layout, x: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    if lay.mesh is None:
        return x
    return DTensor.from_local(x, lay.mesh, [Replicate()] * lay.mesh.ndim, run_check=False)


def _sharded_quantize(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    """:func:`xopt.specs.coap.quantize` of a DTensor moment, on its shards."""
    import torch.distributed as dist

    lay = Layout.of(x)
    xl = local(x).to(torch.float32)
    block = _block_of(lay, xl.device)
    absmax = torch.zeros(_spec.num_blocks(lay.shape), dtype=torch.float32, device=xl.device)
    absmax.scatter_reduce_(0, block.reshape(-1), xl.abs().reshape(-1), "amax")
    for i in sorted({i for dims in lay.sharded.values() for i in dims}):
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=lay.mesh.get_group(i))
    nonzero = absmax > 0
    inv = arrays.divide(torch, 1.0, torch.where(nonzero, absmax, torch.ones_like(absmax)))
    q = _spec.encode(torch, xl * inv[block], rounding)
    q = torch.where(nonzero[block], q, torch.zeros_like(q))
    return lay.wrap(q.to(torch.uint8)), _replicated_like(lay, absmax)


def _sharded_dequantize(codes: Tensor, absmax: Tensor) -> Tensor:
    """:func:`xopt.specs.coap.dequantize` of a DTensor's codes, on its shards."""
    lay = Layout.of(codes)
    ql = local(codes)
    am = absmax.full_tensor() if is_dtensor(absmax) else absmax
    code = torch.as_tensor(_spec.dynamic_code(), device=ql.device)
    return lay.wrap(code.take(ql.to(torch.int64)) * am.to(ql.device)[_block_of(lay, ql.device)])


_SHARDED_CODEC = (_sharded_quantize, _sharded_dequantize)


register("coap", "torch", COAP)
