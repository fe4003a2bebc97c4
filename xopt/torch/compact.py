"""CompAct in PyTorch: a linear layer that saves ``x P`` instead of ``x``, and its Adam.

* :class:`CompActFunction` (``torch.autograd.Function``): the forward saves the compressed
  activation ``z = x P``; the backward returns the exact ``∂L/∂x`` and ``∂L/∂b`` and leaves
  the compressed weight gradient ``Ĝ = gᵀ z`` (out × r) in ``weight.compact_grad``
  (``weight.grad`` stays None: torch requires a gradient of the parameter's shape, and a
  full-size one would give back the memory CompAct saves). Backward calls before one
  optimizer step accumulate, as ``.grad`` does.
* :class:`CompActLinear` (``nn.Module``): ``weight`` (out × in) and ``bias`` (out), as
  ``nn.Linear``; :meth:`CompActLinear.from_linear` wraps an existing layer, sharing its
  parameters. P is redrawn from ``(seed, proj_step // gap)`` on every forward and never
  stored; ``proj_step`` (a buffer) counts the optimizer updates applied to the layer.
* :func:`compact_model`: converts a model's chosen linear layers in place, as the authors'
  ``torchrun_main._replace_linear_with_custom`` does for LLaMA (q, k, v, gate, up, down
  projected; o_proj with the identity projector and scale ``scale_o_proj · scale``).
* :class:`CompActAdamW` (``torch.optim.Optimizer``): Adam on ``compact_grad`` for CompAct
  weights, projected back with the *same* P (redrawn from the seed and refresh index the
  forward used, checked) and scaled by α; the same Adam on ``.grad`` for every other
  parameter. The arithmetic is the authors' ``SmallAdamW``; see :mod:`xopt.specs.compact`.

Design note: the projection key travels with the gradient. The backward stores the
(seed, refresh) it projected with in ``weight.compact_key``; the optimizer redraws P from
that key only after checking it against its own state (the seed it first saw, and
``step // gap``), so a forward and an update that would use different projections (a
changed seed, a state dict from another model, gradient accumulation across a refresh)
raise an error naming the layer instead of silently mixing subspaces.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xopt.errors import HyperparameterError, StateError, XoptError
from xopt.registry import register
from xopt.specs import compact as _spec
from xopt.torch._optim import FLOATING, Item, Layout, Optimizer, grad_problem
from xopt.torch.distributed import Layout as DistLayout
from xopt.torch.distributed import is_dtensor, local, prepare

__all__ = ["CompActAdamW", "CompActFunction", "CompActLinear", "compact_grad_of", "LayerError",
           "compact_model", "LLAMA_LAYERS"]

#: The LLaMA linear layers the authors convert (``--layer_filter all``), by name.
LLAMA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GENERATORS = ("xopt", "torch")


class LayerError(XoptError, TypeError):
    """A module given to the CompAct converter is not an ``nn.Linear`` (the message names it),
    or a named layer does not exist."""


_TORCH_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    """One reusable ``torch.Generator`` per device (creating one per draw costs host time
    on every forward and update; each use reseeds it)."""
    gen = _TORCH_GENERATORS.get(device)
    if gen is None:
        gen = _TORCH_GENERATORS[device] = torch.Generator(device=device)
    return gen


@functools.lru_cache(maxsize=4096)
def _torch_seed(layer_seed: int, refresh: int) -> int:
    """torch's generator seed of a refresh (xopt.random's fold_in, in Python: memoized, as
    every forward and update of a layer asks for the same one until the next refresh)."""
    return _spec.projection_seed(layer_seed, refresh) & (2**63 - 1)


def _draw(proj: _spec.Projection, refresh: int, device: torch.device, dtype: torch.dtype,
          generator: str) -> torch.Tensor | None:
    """P (n × r) of ``proj`` at ``refresh`` on ``device`` in ``dtype``; None for identity."""
    if proj.kind == "identity":
        return None
    if generator == "xopt":
        p = _spec.projection(proj, refresh, backend="torch", device=device, dtype="float32")
        return p if dtype == torch.float32 else p.to(dtype)
    # "torch": torch's own generator, seeded from the same (seed, refresh): fast on GPUs,
    # not portable (JAX cannot reproduce it).
    seed = _torch_seed(proj.seed, refresh)
    gen = _generator(device)
    gen.manual_seed(seed)  # resets the whole state: the draw depends on the seed alone
    if proj.kind == "gaussian":
        p = torch.randn(proj.in_features, proj.rank, device=device, dtype=torch.float32,
                        generator=gen)
        p.mul_(1.0 / math.sqrt(proj.rank))
    else:
        s = min(proj.jl_nnz, proj.rank)
        bounds = [(j * proj.rank) // s for j in range(s + 1)]
        lo = torch.tensor(bounds[:-1], device=device)
        size = torch.tensor(bounds[1:], device=device) - lo
        u = torch.rand(proj.in_features, s, device=device, generator=gen)
        cols = lo + (u * size).long().clamp_max(size - 1)
        signs = torch.randint(0, 2, (proj.in_features, s), device=device, generator=gen)
        vals = (1.0 - 2.0 * signs.float()) * (1.0 / math.sqrt(s))
        p = torch.zeros(proj.in_features, proj.rank, device=device).scatter_(1, cols, vals)
    return p if dtype == torch.float32 else p.to(dtype)


class CompActFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` saving ``z = x P`` (paper Algorithms 1-2).

    ``apply(x, weight, bias, p, key, holder=None)``: ``x (..., n)``, ``weight (m, n)``,
    ``bias (m,)`` or None, ``p (n, r)`` or None (identity: ``z = x``), all of one floating
    dtype; ``key`` is the ``(seed, refresh)`` P was drawn from, stored with the gradient.
    Returns ``y (..., m)``. Backward: ``∂L/∂x = g W``, ``∂L/∂b = Σ g``, and ``Ĝ = Σ gᵀ z``
    (m × r) added to ``holder.compact_grad`` (created if None); ``holder.compact_key =
    key``. ``holder`` defaults to ``weight``; under FSDP2 the layer passes itself, since
    ``weight`` is then FSDP2's temporary unsharded copy (see :func:`compact_grad_of`).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                p: torch.Tensor | None, key: tuple[int, int], holder: Any = None
                ) -> torch.Tensor:
        y, z = _spec.linear_forward(x, weight, bias, p, xp=torch)
        ctx.save_for_backward(z, weight)
        ctx.has_bias = bias is not None
        ctx.key = key
        ctx.holder = holder
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        z, weight = ctx.saved_tensors
        if grad_output.ndim > 1 and not ctx.has_bias:
            # Ĝ as one 2-D product over all leading dimensions, ``gᵀ z`` with the same
            # operand layout as nn.Linear's weight gradient (torch.einsum routes the 3-D
            # contraction through a batched product with extra permutes/copies).
            grad_x = grad_output @ weight
            g_hat = grad_output.reshape(-1, grad_output.shape[-1]).T @ \
                z.reshape(-1, z.shape[-1])
            grad_b = None
        else:
            grad_x, g_hat, grad_b = _spec.linear_backward(grad_output, z, weight,
                                                          ctx.has_bias, xp=torch)
        if not ctx.needs_input_grad[0]:
            grad_x = None
        if ctx.needs_input_grad[1]:
            holder = weight if ctx.holder is None else ctx.holder
            old = getattr(holder, "compact_grad", None)
            if old is None:
                holder.compact_grad = g_hat
                holder.compact_key = ctx.key
            elif getattr(holder, "compact_key", None) is None:  # zeroed, not cleared
                old.add_(g_hat)
                holder.compact_key = ctx.key
            else:
                if holder.compact_key != ctx.key:
                    raise StateError(
                        f"{_name_of(weight if ctx.holder is None else ctx.holder.weight)}: "
                        f"gradients projected with (seed, refresh) {holder.compact_key} and "
                        f"{ctx.key} cannot be accumulated; call the optimizer (or zero_grad) "
                        "before the projection changes")
                old.add_(g_hat)
        return grad_x, None, grad_b, None, None, None


def _name_of(weight: torch.Tensor) -> str:
    layer = _layer_of(weight)
    name = getattr(layer, "compact_name", None) if layer is not None else None
    return f"CompAct layer {name!r}" if name else "a CompAct layer"


class CompActLinear(nn.Module):
    """A linear layer whose backward keeps only a random projection of its input.

    Parameters ``weight`` (out × in) and ``bias`` (out, optional) as ``nn.Linear``; the
    forward is exact, ``y = x Wᵀ + b`` for ``x`` of shape ``(..., in)`` (any float dtype),
    and saves ``z = x P`` of shape ``(..., r)``, ``r = round(in · rank)``. Without
    autograd (``no_grad``, or nothing requiring a gradient) it is a plain linear layer.

    Args:
      in_features, out_features, bias, device, dtype: as ``nn.Linear``.
      rank: r as a fraction of ``in_features``, in (0, 1].
      proj_type: ``"gaussian"``, ``"sparse_jl"`` or ``"identity"`` (no compression).
      scale: α, applied by :class:`CompActAdamW` to this layer's projected-back step.
      seed: this layer's seed, an int in [0, 2⁶⁴) (:func:`compact_model` gives layer i the
        seed ``fold_in(seed, i)``).
      gap: T, draw a new P every T optimizer updates (0: never).
      jl_nnz: non-zeros per row of a sparse JL projection.
      generator: ``"xopt"`` (:mod:`xopt.random`, the same bits in JAX; the default) or
        ``"torch"`` (torch's generator seeded from the same seed: much faster on GPUs,
        not reproducible across frameworks).
      cache_projection: keep the float32 P of the current refresh on the layer (n × r,
        drawn on the device) for the forwards and the optimizer's updates until the next
        refresh, instead of redrawing it at every forward and update (the authors' choice:
        no memory held between steps, one draw per call). The same values either way;
        also the attribute of that name.

    State: the buffer ``proj_step`` (int64, number of updates the optimizer applied) and
    the projection settings in ``get_extra_state`` (plain Python values), so a state dict
    restores the projection exactly and loads with ``torch.load(weights_only=True)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rank: float = 0.5, proj_type: str = "gaussian", scale: float = 1.0,
                 seed: int = 0, gap: int = 0, jl_nnz: int = 4, generator: str = "xopt",
                 cache_projection: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self.register_buffer("proj_step", torch.zeros((), dtype=torch.int64, device=device))
        self._step = 0  # proj_step as a Python int: reading the buffer would sync the GPU
        self.compact_name = ""
        self.cache_projection = bool(cache_projection)
        self._proj_cache: tuple[Any, torch.Tensor] | None = None
        self.configure(rank=rank, proj_type=proj_type, scale=scale, seed=seed, gap=gap,
                       jl_nnz=jl_nnz, generator=generator)

    def configure(self, *, rank: float, proj_type: str, scale: float, seed: int, gap: int,
                  jl_nnz: int, generator: str) -> None:
        """Validate and set the projection settings (errors name the layer and field)."""
        where = f"CompActLinear{f' {self.compact_name!r}' if self.compact_name else ''}"
        if proj_type not in _spec.KINDS:
            raise HyperparameterError(f"{where}.proj_type = {proj_type!r}: must be one of "
                                      f"{', '.join(map(repr, _spec.KINDS))}")
        if generator not in GENERATORS:
            raise HyperparameterError(f"{where}.generator = {generator!r}: must be 'xopt' "
                                      "or 'torch'")
        if proj_type == "identity":
            r = self.in_features
        else:
            r = _spec.rank_of(self.in_features, rank, where=f"{where}.rank")
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise HyperparameterError(f"{where}.seed = {seed!r}: must be an int in [0, 2**64)")
        if not isinstance(gap, int) or gap < 0:
            raise HyperparameterError(f"{where}.gap = {gap!r}: must be an int ≥ 0")
        self.rank, self.proj_type, self.generator = float(rank), proj_type, generator
        self.proj = _spec.Projection(kind=proj_type, in_features=self.in_features, rank=r,
                                     scale=float(scale), seed=seed, gap=gap, jl_nnz=jl_nnz)
        self.weight._compact_layer = weakref.ref(self)
        _LAYERS.add(self)

    @property
    def seed(self) -> int:
        return self.proj.seed

    @property
    def r(self) -> int:
        """The projection width r."""
        return self.proj.rank

    @classmethod
    def from_linear(cls, layer: nn.Module, *, name: str = "", **kwargs: Any) -> CompActLinear:
        """A CompActLinear sharing ``layer``'s ``weight`` and ``bias`` (the same Parameter
        objects, like the authors' ``SmallLinear.like``). ``kwargs``: the projection
        settings of :class:`CompActLinear`. ``layer`` must be an ``nn.Linear``."""
        if not isinstance(layer, nn.Linear):
            raise LayerError(
                f"CompActLinear.from_linear: layer {name or type(layer).__name__!r} is a "
                f"{type(layer).__module__}.{type(layer).__name__}, not a torch.nn.Linear")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight = layer.weight
        new.bias = layer.bias
        new.register_buffer("proj_step", torch.zeros((), dtype=torch.int64,
                                                     device=layer.weight.device))
        new._step = 0
        new.compact_name = name
        new.cache_projection = bool(kwargs.pop("cache_projection", True))
        new._proj_cache = None
        defaults = dict(rank=0.5, proj_type="gaussian", scale=1.0, seed=0, gap=0, jl_nnz=4,
                        generator="xopt")
        unknown = sorted(set(kwargs) - set(defaults))
        if unknown:
            raise HyperparameterError(f"CompActLinear.from_linear: unknown argument(s) "
                                      f"{', '.join(map(repr, unknown))}")
        new.configure(**{**defaults, **kwargs})
        return new

    def refresh(self) -> int:
        """The refresh number the next forward uses: ``proj_step // gap``."""
        return self.proj.refresh(self._step)

    def set_proj_step(self, step: int) -> None:
        """Set the number of updates applied (the optimizer calls this after each one)."""
        self._step = int(step)
        self.proj_step.fill_(self._step)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (deepcopy, pickle) makes new Parameter objects without Python attributes:
        # link the copied weight to the copied layer again
        super().__setstate__(state)
        self.weight._compact_layer = weakref.ref(self)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._step = int(self.proj_step)

    def projection(self, refresh: int | None = None, *, device: Any = None,
                   dtype: Any = None) -> torch.Tensor | None:
        """P (n × r) at ``refresh`` (default: the current one), drawn from the seed, or the
        float32 draw kept for this refresh (``cache_projection``) cast to ``dtype``: the
        same values (a draw in another dtype is the float32 one rounded)."""
        refresh = self.refresh() if refresh is None else refresh
        device = torch.device(device or self.weight.device)
        dtype = dtype or self.weight.dtype
        if self.proj.kind == "identity":
            return None
        key = (self.proj, self.generator, refresh, device)
        cached = getattr(self, "_proj_cache", None)  # (absent in a layer pickled before)
        if cached is not None and cached[0] == key:
            p = cached[1]
        else:
            self._proj_cache = None  # the old refresh's P is not needed again
            p = _draw(self.proj, refresh, device, torch.float32, self.generator)
            if getattr(self, "cache_projection", True):
                self._proj_cache = (key, p)
        return p if dtype == torch.float32 else p.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            y = x @ self.weight.T
            return y + self.bias if self.bias is not None else y
        return self._compressed(x)

    @torch.compiler.disable(reason=(
        "CompActLinear draws its projection on the host at every forward (xopt.random, from "
        "the layer's refresh counter) and leaves the compressed gradient on the weight"))
    def _compressed(self, x: torch.Tensor) -> torch.Tensor:
        """The training forward (saves ``x P``); excluded from dynamo: under torch.compile
        the model breaks its graph around this layer, which runs eagerly."""
        refresh = self.refresh()
        p = self.projection(refresh, dtype=x.dtype)
        w = self.weight
        # a weight not linked to this layer is FSDP2's temporary unsharded copy of the
        # sharded one (or a weight assigned since): the compressed gradient is then kept on
        # the layer, where the optimizer finds it (compact_grad_of)
        ref = getattr(w, "_compact_layer", None)
        holder = None if ref is not None and ref() is self else self
        return CompActFunction.apply(x, w, self.bias, p, (self.proj.seed, refresh), holder)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, r={self.r}, proj_type={self.proj_type!r}, "
                f"scale={self.proj.scale}, gap={self.proj.gap}, seed={self.proj.seed}")

    def get_extra_state(self) -> dict[str, Any]:
        return {"rank": self.rank, "proj_type": self.proj_type, "scale": self.proj.scale,
                "seed": self.proj.seed, "gap": self.proj.gap, "jl_nnz": self.proj.jl_nnz,
                "generator": self.generator}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.configure(**state)


def compact_model(model: nn.Module, *, rank: float = 0.5, proj_type: str = "gaussian",
                  scale: float = 1.0, scale_o_proj: float = 1.0, gap: int = 0, seed: int = 0,
                  jl_nnz: int = 4, generator: str = "xopt", cache_projection: bool = True,
                  layers: Sequence[str] = LLAMA_LAYERS, identity: Sequence[str] = ("o_proj",),
                  spec: _spec.CompAct | None = None) -> dict[str, CompActLinear]:
    """Replace ``model``'s chosen linear layers by :class:`CompActLinear`, in place.

    A module is converted when the last part of its name is in ``layers`` (LLaMA's
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
    ``down_proj`` by default) or its full dotted name is; those whose last part is in
    ``identity`` get the identity projection with scale ``scale_o_proj · scale`` (the
    authors' treatment of ``o_proj``), the others ``proj_type`` with rank ratio ``rank``
    and scale α = ``scale``. Layers are numbered in ``named_modules`` order and layer i
    gets the seed ``fold_in(seed, i)``. ``spec`` (a :class:`xopt.specs.compact.CompAct`)
    supplies rank, proj_type, scale, scale_o_proj, gap, seed and jl_nnz instead.
    ``generator`` and ``cache_projection``: as :class:`CompActLinear`'s.

    Returns ``{name: layer}`` of the converted layers. Raises :class:`LayerError` naming
    the module when a selected module is not an ``nn.Linear`` or a full name in ``layers``
    matches nothing, and :class:`HyperparameterError` for a rank ratio outside (0, 1].
    """
    if spec is not None:
        rank, proj_type, scale, scale_o_proj = spec.rank, spec.proj_type, spec.scale, \
            spec.scale_o_proj
        gap, seed, jl_nnz = spec.gap, spec.seed, spec.jl_nnz
    _spec.check_rank(rank, "compact_model: rank")
    chosen = []
    found_full = set()
    for name, module in model.named_modules():
        if not name:
            continue
        last = name.rsplit(".", 1)[-1]
        if last in layers or name in layers:
            if name in layers:
                found_full.add(name)
            if isinstance(module, CompActLinear):
                raise LayerError(f"compact_model: layer {name!r} is already a CompActLinear")
            if not isinstance(module, nn.Linear):
                raise LayerError(
                    f"compact_model: layer {name!r} is a {type(module).__module__}."
                    f"{type(module).__name__}, not a torch.nn.Linear; CompAct converts "
                    "linear layers only")
            chosen.append((name, last, module))
    missing = [n for n in layers if "." in n and n not in found_full]
    if missing:
        raise LayerError(f"compact_model: no module named {', '.join(map(repr, missing))}")
    out: dict[str, CompActLinear] = {}
    for i, (name, last, module) in enumerate(chosen):
        is_id = last in identity
        new = CompActLinear.from_linear(
            module, name=name, rank=rank if not is_id else 1.0,
            proj_type="identity" if is_id else proj_type,
            scale=scale_o_proj * scale if is_id else scale,
            seed=_spec.layer_seed(seed, i), gap=gap, jl_nnz=jl_nnz, generator=generator,
            cache_projection=cache_projection)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, last, new)
        out[name] = new
    return out


class CompActAdamW(Optimizer):
    """Adam on CompAct's compressed gradients (paper Algorithm 3), plain Adam elsewhere.

    For a CompAct weight (one with a ``compact_grad``) the moments are (out × r); the step
    redraws the P of the forward from its key, projects ``N = M/(√V + ε)`` back as
    ``α (N Pᵀ)`` and applies ``W ← W − s_t·α N Pᵀ`` with ``s_t = η √(1−β₂ᵗ)/(1−β₁ᵗ)``,
    then ``W ← W − ηλW``; it then advances the layer's ``proj_step``. Other parameters get
    the same update on ``.grad`` with P = I, α = 1. float32 parameters follow the
    authors' ``SmallAdamW`` op for op; bfloat16/float16 parameters keep float32 moments
    and are updated in float32 and rounded once.

    Args:
      params: parameters or param groups (CompAct weights and others may be mixed).
      lr, b1, b2, eps, weight_decay, correct_bias: as :class:`xopt.specs.compact.CompAct`
        (``betas=(b1, b2)`` is accepted too, as in torch.optim).
      spec: a :class:`xopt.specs.compact.CompAct` to take these from instead.
      foreach: update all tensors of a group with ``torch._foreach_*`` kernels (the moments
        of every parameter at once, one projection back per CompAct layer) instead of one
        tensor at a time; the arithmetic is the same op for op, so the result is bitwise
        that of the per-tensor loop (``foreach=False``, the reference). None (default):
        foreach when the parameters are on a GPU.
      moment_dtype: dtype of ``exp_avg``/``exp_avg_sq``. None (default): float32 for
        bfloat16/float16 parameters, else the parameter's dtype. ``torch.bfloat16`` on
        bfloat16 parameters keeps them as ``torch.optim.AdamW`` does (half the state
        memory; the update is then computed in that dtype).
      nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"`` (:mod:`xopt.nonfinite`);
        ``check_finite=True`` is the older spelling of ``"raise"``. A step drives the
        layers' projection schedule (``proj_step``, read by the next forward), so
        ``"skip"`` reads its flag on the host within the step.

    State per parameter: ``step`` (int64 tensor), ``exp_avg``, ``exp_avg_sq`` (the names of
    the authors' optimizer) and, for CompAct weights, ``seed`` (Python int): a state dict
    loads with ``weights_only=True``.

    The step reads its counter on the host (the step size and the layer's refresh index),
    so it is excluded from torch.compile's dynamo (a compiled training step breaks once at
    ``step()``).

    Raises:
      StateError: the forward projected with another seed than the optimizer's state holds,
        or with a refresh number other than ``step // gap`` (names the layer); checked for
        every layer before any parameter moves.
    """

    _skip_syncs = True

    def __init__(self, params: Iterable[Any], lr: float | None = None, *,
                 b1: float | None = None, b2: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, correct_bias: bool | None = None,
                 spec: _spec.CompAct | None = None, foreach: bool | None = None,
                 moment_dtype: torch.dtype | None = None, nonfinite: str | None = None,
                 check_finite: bool | None = None) -> None:
        given = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                     correct_bias=correct_bias)
        if betas is not None:
            if b1 is not None or b2 is not None:
                raise HyperparameterError("CompActAdamW: give betas or b1/b2, not both")
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise HyperparameterError(f"CompActAdamW.betas = {betas!r}: must be a pair")
            given["b1"], given["b2"] = betas
        given = {k: v for k, v in given.items() if v is not None}
        if spec is not None:
            if given:
                raise HyperparameterError(
                    f"CompActAdamW: spec= given together with {', '.join(sorted(given))}")
            hp = spec
        else:
            hp = _spec.CompAct(**given)
        self.hp = hp
        if moment_dtype is not None and moment_dtype not in FLOATING:
            raise HyperparameterError(f"CompActAdamW.moment_dtype = {moment_dtype!r}: must "
                                      "be a floating torch.dtype or None")
        self.foreach, self.moment_dtype = foreach, moment_dtype
        defaults = dict(lr=hp.lr, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                        weight_decay=hp.weight_decay, correct_bias=hp.correct_bias)
        super().__init__(params, defaults, nonfinite=nonfinite, check_finite=check_finite)

    def _group_hp(self, group: dict[str, Any]) -> _spec.CompAct:
        lr = group["lr"]
        return self.hp.replace(lr=float(lr) if isinstance(lr, torch.Tensor) else lr,
                               b1=group["b1"], b2=group["b2"], eps=group["eps"],
                               weight_decay=group["weight_decay"],
                               correct_bias=group["correct_bias"])

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        self._group_hp(group)

    # -- gradients and state ------------------------------------------------------------------
    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        g_hat = compact_grad_of(p)[0]
        return g_hat if g_hat is not None else p.grad

    def _grad_problem(self, p: torch.Tensor, g: torch.Tensor) -> str | None:
        if g is compact_grad_of(p)[0]:
            layer = _layer_of(p)
            want = (p.shape[0], layer.r) if layer is not None else tuple(g.shape)
            return grad_problem(g.new_empty(want, dtype=p.dtype, device="meta"), g)
        return grad_problem(p, g)

    def _moment_dtype(self, p: torch.Tensor) -> torch.dtype:
        dt = self.moment_dtype
        if dt is None:
            dt = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype
        return dt

    def _state_layout(self, p: torch.Tensor, group: Any) -> dict[str, Layout]:
        layer = _layer_of(p)
        shape = (p.shape[0], layer.r) if layer is not None else tuple(p.shape)
        dt = self._moment_dtype(p)
        out = {"step": Layout((), torch.int64, "cpu"), "exp_avg": Layout(tuple(shape), dt),
               "exp_avg_sq": Layout(tuple(shape), dt)}
        if layer is not None:
            out["seed"] = Layout((), int)
        return out

    def _host_snapshot(self) -> Any:
        return [(layer, layer._step) for layer in self._layers()]

    def _host_restore(self, snapshot: Any) -> None:
        for layer, step in snapshot:
            layer.set_proj_step(step)

    def _layers(self) -> list[CompActLinear]:
        return [layer for group in self.param_groups for p in group["params"]
                if (layer := _layer_of(p)) is not None]

    # -- the step -----------------------------------------------------------------------------
    @torch.compiler.disable(reason=(
        "CompActAdamW.step reads its step counters on the host and drives its layers' "
        "projection schedule"))
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._closure_loss(closure)
        items = self._step_items()  # every layer's plan checked first (_check_items)
        plans = [self._plan(it) for it in items]
        items = self._project_dense(items, plans)
        items = self._data_parallel_mean(items, plans)
        self._run_step(items, lambda: self._update(items, plans))
        return loss

    def _check_items(self, items: list[Item]) -> None:
        for it in items:  # every layer checked before anything moves, with the other ranks
            self._plan(it)

    def _project_dense(self, items: list[Item],
                       plans: list[tuple[CompActLinear | None, int]]) -> list[Item]:
        """``Ĝ = G P`` for the CompAct weights that carry a dense gradient ``G``."""
        out = list(items)
        for k, (it, (layer, refresh)) in enumerate(zip(items, plans, strict=True)):
            if layer is None or it.grad is compact_grad_of(it.param)[0]:
                continue
            proj = layer.projection(refresh, device=it.grad.device, dtype=it.grad.dtype)
            if proj is None:
                continue
            if is_dtensor(it.grad):  # FSDP2: this rank's rows of G P, placed as the rows of W
                g_hat = _rows_layout(it.param, proj.shape[1]).wrap(local(it.grad) @ proj)
            else:
                g_hat = it.grad @ proj
            out[k] = it._replace(grad=g_hat)
        return out

    def _data_parallel_mean(self, items: list[Item],
                            plans: list[tuple[CompActLinear | None, int]]) -> list[Item]:
        """The ranks' mean of every ``compact_grad`` (DDP's hooks and FSDP2 reduce ``.grad``
        only): under DDP in one all-reduce; under FSDP2 in one reduce-scatter, each rank
        receiving the rows of ``Ĝ`` (out × r) that match its rows of the sharded weight, as
        a DTensor placed as the weight. New tensors, so that a retried step reduces the
        ranks' own gradients again."""
        ranks = prepare(self)
        low = [k for k, (layer, _) in enumerate(plans) if layer is not None]
        if ranks is None or ranks.size == 1 or not low:
            return items
        sharded = [k for k in low if is_dtensor(items[k].param)]
        if sharded:
            return self._reduce_scatter(items, [k for k in sharded
                                                if not is_dtensor(items[k].grad)])
        flat = torch.cat([items[k].grad.reshape(-1).float() for k in low])
        ranks.all_reduce(flat)
        flat /= ranks.size
        out, pos = list(items), 0
        for k in low:
            g = items[k].grad
            out[k] = items[k]._replace(grad=flat[pos:pos + g.numel()].view_as(g).to(g.dtype))
            pos += g.numel()
        return out

    def _reduce_scatter(self, items: list[Item], todo: list[int]) -> list[Item]:
        """FSDP2: each weight's whole local ``Ĝ`` (out × r, this rank's batch) reduced over
        the mesh and scattered by rows, as FSDP2 reduce-scatters ``.grad``: padded to a
        multiple of the world size per weight (``torch.chunk``'s split, DTensor's), one
        ``reduce_scatter_tensor`` for all of them, then divided by the world size."""
        if not todo:
            return items
        layouts = [_rows_layout(items[k].param, items[k].grad.shape[1]) for k in todo]
        group = layouts[0].mesh.get_group(0)
        world = dist.get_world_size(group)
        blocks = []
        for k in todo:
            g = items[k].grad.float()
            c = -(-g.shape[0] // world)
            padded = g.new_zeros((world * c, g.shape[1]))
            padded[:g.shape[0]] = g
            blocks.append(padded.reshape(world, -1))
        send = torch.cat(blocks, dim=1).reshape(-1)
        recv = send.new_empty(send.numel() // world)
        dist.reduce_scatter_tensor(recv, send, group=group)
        recv /= world
        out, pos = list(items), 0
        for k, lay, block in zip(todo, layouts, blocks, strict=True):
            n = block.shape[1]
            rows = recv[pos:pos + n].view(-1, lay.shape[1])[:lay.local_shape[0]]
            pos += n
            g = items[k].grad
            out[k] = items[k]._replace(grad=lay.wrap(rows.to(g.dtype).contiguous()))
        return out

    def _plan(self, it: Item) -> tuple[CompActLinear | None, int]:
        """``(layer, refresh)`` of a CompAct weight's update (``(None, 0)`` for another
        parameter), after checking its projection key and moments against the state."""
        p, g = it.param, it.grad
        state = dict.get(self.state, p) or {}
        compact, key = compact_grad_of(p)
        if g is not compact and _layer_of(p) is not None:
            # a dense gradient of a CompAct weight (DCP's state-creating step gives zeros):
            # projected with the layer's projection of this update, Ĝ = G P, as its
            # backward would have (:meth:`_project_dense`)
            layer = _layer_of(p)
            return layer, layer.proj.refresh(int(state["step"]) if "step" in state else 0)
        if "exp_avg" in state and tuple(state["exp_avg"].shape) != tuple(g.shape):
            raise StateError(f"CompActAdamW: moments of shape {tuple(state['exp_avg'].shape)} "
                             f"do not fit the gradient of {self.param_name(it.gi, it.i)} "
                             f"(shape {tuple(g.shape)})")
        if g is not compact:
            return None, 0
        layer = _layer_of(p)
        if layer is None:
            raise StateError("CompActAdamW: a parameter has a compact_grad but no CompAct "
                             "layer (was the layer deleted?)")
        seed = state.get("seed", layer.proj.seed)
        t = int(state["step"]) if "step" in state else 0
        if key is None or key[0] != seed:
            raise StateError(
                f"{_name_of(p)}: the forward projected with seed "
                f"{None if key is None else key[0]}, but the optimizer's state for this weight "
                f"holds seed {seed}; P must be drawn from the same seed in the forward and "
                "the update (a state dict from another model, or a changed layer seed?)")
        expected = layer.proj.refresh(t)
        if key[1] != expected:
            raise StateError(
                f"{_name_of(p)}: the forward used projection refresh {key[1]}, but this is "
                f"update {t} of the optimizer, which uses refresh {t} // gap = {expected}; the "
                f"layer's proj_step ({layer._step}) and the optimizer's step ({t}) "
                "disagree")
        return layer, key[1]

    def _update(self, items: list[Item], plans: list[tuple[CompActLinear | None, int]]) -> None:
        by_group: dict[int, list] = {}
        for it, (layer, refresh) in zip(items, plans, strict=True):
            state = self._state(it.param, it.grad)
            if layer is not None:
                state.setdefault("seed", layer.proj.seed)
            if is_dtensor(it.param):
                # FSDP2: every operation is elementwise or acts on rows (the projection
                # back, N Pᵀ), so each rank updates its own rows, on local views
                state = {**state, "exp_avg": local(state["exp_avg"]),
                         "exp_avg_sq": local(state["exp_avg_sq"])}
            by_group.setdefault(it.gi, []).append(
                (local(it.param), local(it.grad), state, layer, refresh))
        for gi, todo in by_group.items():
            hp = self._group_hp(self.param_groups[gi])
            foreach = self.foreach
            if foreach is None:
                foreach = all(p.device.type == "cuda" for p, *_ in todo)
            if foreach:
                self._step_foreach(hp, todo)
                continue
            for p, g, state, layer, refresh in todo:
                if layer is None:
                    self._apply(hp, p, g, state, None, 1.0)
                else:
                    proj = layer.projection(refresh, device=p.device,
                                            dtype=state["exp_avg"].dtype)
                    self._apply(hp, p, g, state, proj, layer.proj.scale)
                    layer.set_proj_step(int(state["step"]))

    def _step_foreach(self, hp: _spec.CompAct, items: list[tuple]) -> None:
        """The per-tensor update of :meth:`_apply`, op for op, on lists of tensors."""
        by_count: dict[int, list] = {}
        for it in items:  # the step size depends on the update count
            by_count.setdefault(int(it[2]["step"]) + 1, []).append(it)
        for count, its in by_count.items():
            ms = [st["exp_avg"] for _, _, st, _, _ in its]
            vs = [st["exp_avg_sq"] for _, _, st, _, _ in its]
            gs = [g.to(m.dtype) for (_, g, _, _, _), m in zip(its, ms, strict=True)]
            torch._foreach_mul_(ms, hp.b1)
            torch._foreach_add_(ms, gs, alpha=1.0 - hp.b1)
            torch._foreach_mul_(vs, hp.b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1.0 - hp.b2)
            del gs
            denoms = torch._foreach_sqrt(vs)
            torch._foreach_add_(denoms, hp.eps)
            ns = torch._foreach_div(ms, denoms)
            del denoms
            s = _spec.step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
            decay = -hp.lr * hp.weight_decay
            same_p, same_n, low_p, low_n = [], [], [], []
            for (p, _, _, layer, refresh), n in zip(its, ns, strict=True):
                if layer is not None:
                    # One layer at a time: the full-size update exists for one layer only.
                    proj = layer.projection(refresh, device=p.device, dtype=n.dtype)
                    n = _spec.project_back(n, proj, layer.proj.scale)
                    if p.dtype == n.dtype:
                        p.add_(n, alpha=-s)
                        if hp.weight_decay > 0.0:
                            p.add_(p, alpha=decay)
                    else:
                        w = p.float().add_(n, alpha=-s)
                        if hp.weight_decay > 0.0:
                            w.add_(w, alpha=decay)
                        p.copy_(w)
                elif p.dtype == n.dtype:
                    same_p.append(p)
                    same_n.append(n)
                else:
                    low_p.append(p)
                    low_n.append(n)
            del ns
            if same_p:
                torch._foreach_add_(same_p, same_n, alpha=-s)
                if hp.weight_decay > 0.0:
                    torch._foreach_add_(same_p, same_p, alpha=decay)
            if low_p:
                ws = [p.float() for p in low_p]
                torch._foreach_add_(ws, low_n, alpha=-s)
                if hp.weight_decay > 0.0:
                    torch._foreach_add_(ws, ws, alpha=decay)
                torch._foreach_copy_(low_p, ws)
            for _, _, st, layer, _ in its:
                st["step"] += 1
                if layer is not None:
                    layer.set_proj_step(count)

    def _state(self, p: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
        """``p``'s state, created at its first update: moments of the gradient's shape, and
        its placement under FSDP2 (DCP saves and reshards them)."""
        state = self.state[p]
        if "step" not in state:
            dt = self._moment_dtype(p)
            state["step"] = torch.zeros((), dtype=torch.int64)
            if is_dtensor(g):
                state["exp_avg"] = torch.zeros_like(g, dtype=dt)
                state["exp_avg_sq"] = torch.zeros_like(g, dtype=dt)
            else:
                state["exp_avg"] = torch.zeros(g.shape, dtype=dt, device=p.device)
                state["exp_avg_sq"] = torch.zeros(g.shape, dtype=dt, device=p.device)
        return state

    def _apply(self, hp: _spec.CompAct, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any],
               proj: torch.Tensor | None, scale: float) -> None:
        count = int(state["step"]) + 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = g.to(m.dtype)
        # The authors' in-place sequence (optimizers/adamw.py), for bitwise parity.
        m.mul_(hp.b1).add_(g, alpha=1.0 - hp.b1)
        v.mul_(hp.b2).addcmul_(g, g, value=1.0 - hp.b2)
        denom = v.sqrt().add_(hp.eps)
        s = _spec.step_size(hp.lr, hp.b1, hp.b2, count, hp.correct_bias)
        n = m / denom
        if proj is not None or scale != 1.0:
            n = _spec.project_back(n, proj, scale)
        if p.dtype == m.dtype:
            p.add_(n, alpha=-s)
            if hp.weight_decay > 0.0:
                p.add_(p, alpha=-hp.lr * hp.weight_decay)
        else:
            w = p.float().add_(n, alpha=-s)
            if hp.weight_decay > 0.0:
                w.add_(w, alpha=-hp.lr * hp.weight_decay)
            p.copy_(w)
        state["step"] += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                holder = _holder_of(p)
                if getattr(holder, "compact_grad", None) is not None:
                    if set_to_none:
                        holder.compact_grad = None
                    else:
                        holder.compact_grad.zero_()
                    holder.compact_key = None


#: every CompActLinear, to find the layer of a weight FSDP2 replaced by a sharded copy
_LAYERS: weakref.WeakSet[CompActLinear] = weakref.WeakSet()


def _no_layer() -> None:
    return None


def _layer_of(p: torch.Tensor) -> CompActLinear | None:
    """The CompAct layer of weight ``p``: linked when the layer was made; a weight
    registered on a layer since (FSDP2's sharded DTensor copy, or one assigned) is found
    among the layers once, and linked."""
    ref = getattr(p, "_compact_layer", None)
    if ref is None:
        ref = _no_layer
        for layer in list(_LAYERS):
            if layer._parameters.get("weight") is p:
                ref = weakref.ref(layer)
                break
        p._compact_layer = ref
    return ref() if ref is not None else None


def _holder_of(p: torch.Tensor) -> Any:
    """Where the backward left ``p``'s compressed gradient: ``p``, or its layer when the
    forward ran on another tensor than ``p`` (FSDP2's unsharded copy; see
    :meth:`CompActLinear._compressed`)."""
    layer = _layer_of(p)
    if layer is not None and getattr(layer, "compact_grad", None) is not None:
        return layer
    return p


def compact_grad_of(weight: torch.Tensor) -> tuple[torch.Tensor | None, Any]:
    """``(Ĝ, key)``: the compressed gradient the backward passes left for a CompAct weight
    since the last ``zero_grad`` (out × r, None when there is none) and the ``(seed,
    refresh)`` it was projected with. On one process and under DDP it is
    ``weight.compact_grad`` (this rank's, not yet averaged under DDP); under FSDP2, where
    ``weight`` is the sharded DTensor and the forward runs on a temporary unsharded copy,
    it is kept on the layer, whole and of this rank's batch, and :class:`CompActAdamW`
    reduce-scatters it onto the weight's rows at its step."""
    holder = _holder_of(weight)
    return getattr(holder, "compact_grad", None), getattr(holder, "compact_key", None)


def _rows_layout(p: torch.Tensor, r: int) -> DistLayout:
    """The layout of an (out × r) tensor split by rows as the sharded weight ``p``
    (out × in) is: FSDP2's ``Shard(0)`` on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    lay = DistLayout.of(p)
    if (lay.mesh is None or lay.mesh.ndim != 1 or not isinstance(lay.placements[0], Shard)
            or lay.placements[0].dim % 2 != 0):
        raise NotImplementedError(
            f"CompActAdamW: {_name_of(p)}'s weight is placed {lay.placements} on a "
            f"{getattr(lay.mesh, 'ndim', 0)}-D mesh; its compressed gradient is reduce-"
            "scattered by rows only (FSDP2's Shard(0) on a 1-D mesh)")
    return dataclasses.replace(lay, shape=(lay.shape[0], r),
                               local_shape=(lay.local_shape[0], r),
                               offsets=(lay.offsets[0], 0))


register("compact", "torch", CompActAdamW)
