"""Rank-side code of the distributed support matrix (tests/distributed/test_torch_matrix.py).

Every method on a tiny model, data parallel on 2 gloo ranks (DDP, or FSDP2 with DTensor
parameters), against one process on the same global batch:

* teacher-forced: before each step a one-process copy is set to the distributed run's
  parameters, buffers and optimizer state and given the data-parallel gradient the
  distributed optimizer is given (DDP's all-reduced mean, FSDP2's reduce-scattered shards,
  gathered here), the ranks' mean loss, and, for CompAct, the ranks' mean compressed
  gradient; both step, and every tensor is compared: one step's error;
* closed loop: a one-process run on the global batches from the same start, compared after
  every step.

The one-process runs are computed inside each rank, with the same code and thread count.
Each function returns plain values: errors as ``(max relative error, "step: tensor")``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from xopt.parity.compare import tensor_error

METHODS = ("adamw", "small_fc_lopt", "velo", "mulo", "galore", "flora", "coap", "plumage",
           "compact", "poet")
LEARNED = ("small_fc_lopt", "velo", "mulo")
GLOBAL_BATCH = 8
STEPS = 4


# -- models, optimizers, data ---------------------------------------------------------------------


def make_model(method: str, rows: int = 9) -> nn.Module:
    """A tiny MLP (``rows`` hidden units); POET's and CompAct's with their layers."""
    torch.manual_seed(0)
    if method == "poet":
        from xopt.torch.poet import convert

        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        convert(model, block_size=4, exclude_modules=())
        return model
    # 9 hidden rows by default: uneven shards on 2 ranks (5 and 4 rows)
    model = nn.Sequential(nn.Linear(6, rows), nn.Tanh(), nn.Linear(rows, 4))
    if method == "compact":
        from xopt.torch.compact import compact_model

        compact_model(model, rank=0.5, layers=("0", "2"), identity=(), seed=3)
    return model


def sizes(method: str) -> tuple[int, int]:
    return (8, 8) if method == "poet" else (6, 4)


def make_optimizer(method: str, model: nn.Module, *, alone: bool = False
                   ) -> torch.optim.Optimizer:
    """``method``'s optimizer of ``model``; ``alone``: a one-process reference inside a rank
    (its steps span this rank only: no collective, no agreement check)."""
    opt = _make_optimizer(method, model)
    if alone:
        from xopt.torch.distributed import set_process_group

        set_process_group(opt, None)
    return opt


def _make_optimizer(method: str, model: nn.Module) -> torch.optim.Optimizer:
    import xopt.torch as xt

    params = [p for p in model.parameters() if p.requires_grad]
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    if method == "adamw":
        return xt.AdamW(params, lr=1e-2, weight_decay=0.1)
    if method == "small_fc_lopt":
        return xt.SmallFCLOpt(params, num_training_steps=100, impl="plain")
    if method == "mulo":
        return xt.MuLO(params, num_training_steps=100)
    if method == "velo":
        return xt.VeLO(params, num_training_steps=100, impl="plain", lstm_hidden_size=16,
                       param_inits=8)
    if method == "galore":
        return xt.GaLore([{"params": mats, "rank": 2, "update_proj_gap": 2},
                          {"params": rest, "project": False}], lr=1e-2)
    if method == "flora":
        return xt.Flora([{"params": mats}, {"params": rest, "project": False}], lr=1e-2,
                        rank=2, kappa=2, beta1=0.9)
    if method == "coap":
        return xt.COAP([{"params": mats}, {"params": rest, "project": False}], lr=1e-2,
                       rank=2, update_interval=2, reproject_factor=2)
    if method == "plumage":
        return xt.PLUMAGE([{"params": mats, "rank": 2, "update_proj_gap": 2},
                           {"params": rest, "project": False}], lr=1e-2)
    if method == "compact":
        return xt.CompActAdamW(params, lr=1e-2)
    if method == "poet":
        from xopt.torch.poet import POETAdamW, poet_param_groups

        groups = [g for g in poet_param_groups(model, lr=1e-2, poet_lr=1e-2) if g["params"]]
        return POETAdamW(groups, merge_interval=2, model=model)  # (DCP maps one empty group)
    raise ValueError(method)


def batch(method: str, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``t``."""
    g = torch.Generator().manual_seed(1000 + t)
    n_in, n_out = sizes(method)
    return (torch.randn(GLOBAL_BATCH, n_in, generator=g),
            torch.randn(GLOBAL_BATCH, n_out, generator=g))


def my_rows(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def forward_backward(method: str, model: nn.Module, t: int, distributed: bool) -> torch.Tensor:
    """Loss and gradients of step ``t`` (this rank's rows of the batch when distributed)."""
    x, y = batch(method, t)
    if distributed:
        x, y = my_rows(x), my_rows(y)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return loss.detach()


def opt_step(method: str, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    if method in ("small_fc_lopt", "velo", "mulo"):
        opt.step(loss=loss)
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def train_step(method: str, model: nn.Module, opt: torch.optim.Optimizer, t: int,
               distributed: bool) -> None:
    opt_step(method, opt, forward_backward(method, model, t, distributed))


# -- wrapping a model for data parallelism ------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def wrap(mode: str, model: nn.Module) -> nn.Module:
    """DDP, or FSDP2 (each layer with parameters a unit, then the root): parameters become
    DTensors placed ``Shard(0)``."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    for m in model:
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def base(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP wraps the model


# -- reading parameters and state, sharded or not -----------------------------------------------


def _numpy(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v.full_tensor()
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        return (v.float() if v.dtype == torch.bfloat16 else v).numpy().copy()
    return np.asarray(v)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``param/<name>``, ``buffer/<name>``, ``state/<param name or key>/<var>`` and POET's
    counter: whole tensors as NumPy arrays, the same keys on every rank."""
    m = base(model)
    names = {id(p): n for n, p in m.named_parameters()}
    out: dict[str, Any] = {f"param/{n}": _numpy(p) for n, p in m.named_parameters()}
    out.update({f"buffer/{n}": _numpy(b) for n, b in m.named_buffers()})
    for k, st in opt.state.items():
        name = k if isinstance(k, str) else names.get(id(k), "?")
        for kk, v in st.items():
            out[f"state/{name}/{kk}"] = _numpy(v)
    if hasattr(opt, "global_step_counter"):
        out["state/global_step_counter"] = np.asarray(opt.global_step_counter)
    return out


@torch.no_grad()
def load_snapshot(model: nn.Module, opt: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    """Set a one-process model and optimizer to a :func:`snapshot` (teacher forcing)."""
    names = {}
    for n, p in model.named_parameters():
        p.copy_(torch.as_tensor(snap[f"param/{n}"]))
        names[n] = p
    for n, b in model.named_buffers():
        b.copy_(torch.as_tensor(snap[f"buffer/{n}"]))
    state: dict[Any, dict[str, Any]] = {}
    for key, v in snap.items():
        if not key.startswith("state/") or key == "state/global_step_counter":
            continue
        owner, _, var = key[len("state/"):].rpartition("/")
        target = names.get(owner, owner)
        old = opt.state.get(target, {}).get(var)
        if isinstance(old, torch.Tensor) or old is None and isinstance(v, np.ndarray):
            dtype = old.dtype if isinstance(old, torch.Tensor) else None
            t = torch.as_tensor(np.array(v, copy=True))
            state.setdefault(target, {})[var] = t if dtype is None else t.to(dtype)
        else:
            state.setdefault(target, {})[var] = type(old)(v) if old is not None else v.item()
    opt.state.clear()
    for k, st in state.items():
        opt.state[k] = st
    if "state/global_step_counter" in snap:
        opt.global_step_counter = int(snap["state/global_step_counter"])


def data_parallel_grads(model: nn.Module) -> dict[str, Any]:
    """What the distributed optimizer is given, whole: ``.grad`` (DDP's all-reduced mean,
    FSDP2's reduce-scattered shards) and CompAct's ``compact_grad`` averaged over the ranks
    (what the optimizer must use: DDP does not reduce it)."""
    from xopt.torch.compact import compact_grad_of

    out: dict[str, Any] = {}
    for n, p in base(model).named_parameters():
        if p.grad is not None:
            out[n] = torch.as_tensor(_numpy(p.grad))
        cg, key = compact_grad_of(p)  # this rank's (on the weight, or its layer: FSDP2)
        if cg is not None:
            c = cg.detach().clone()
            dist.all_reduce(c)
            out[f"{n}/compact_grad"] = c / dist.get_world_size()
            out[f"{n}/compact_key"] = key
    return out


def set_grads(model: nn.Module, grads: dict[str, Any]) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if n in grads else None
        if f"{n}/compact_grad" in grads:
            p.compact_grad = grads[f"{n}/compact_grad"].clone()
            p.compact_key = grads[f"{n}/compact_key"]


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    y = x.detach().clone().float()
    dist.all_reduce(y)
    return y / dist.get_world_size()


def worst(a: dict[str, Any], ref: dict[str, Any], label: str) -> tuple[float, str]:
    """The largest relative error of ``a`` against ``ref`` and where; a key on one side only,
    or of another shape, counts as inf."""
    for k in sorted(set(a) ^ set(ref)):
        side = "missing" if k in ref else "extra"
        return math.inf, f"{label}: {k} {side} (against one process)"
    worst_e, where = 0.0, f"{label}: -"
    for k, b in ref.items():
        if np.shape(a[k]) != np.shape(b):
            return math.inf, f"{label}: {k} has shape {np.shape(a[k])}, one process {np.shape(b)}"
        e = tensor_error(a[k], b).rel
        if math.isnan(e):
            return math.inf, f"{label}: {k} is NaN"
        if e > worst_e:
            worst_e, where = e, f"{label}: {k}"
    return worst_e, where


def _max(a: tuple[float, str], b: tuple[float, str]) -> tuple[float, str]:
    return b if b[0] > a[0] or a[1].endswith(": -") and not b[1].endswith(": -") else a


def ranks_agree(snap: dict[str, Any]) -> bool:
    """Whether every rank holds the same parameters and state (bit for bit)."""
    h = hashlib.sha256()
    for k in sorted(snap):
        h.update(k.encode())
        h.update(np.ascontiguousarray(snap[k]).tobytes())
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, h.hexdigest())
    return len(set(out)) == 1


# -- the cells ----------------------------------------------------------------------------------


def train(method: str, mode: str, steps: int = STEPS) -> dict[str, Any]:
    """``mode`` ("ddp" or "fsdp2") against one process on the same global batches:
    ``teacher`` and ``closed`` (worst over the steps), ``ranks_agree`` (bit for bit)."""
    closed_model = make_model(method)
    closed_opt = make_optimizer(method, closed_model, alone=True)
    tf_model = make_model(method)
    tf_opt = make_optimizer(method, tf_model, alone=True)
    model = wrap(mode, make_model(method))
    opt = make_optimizer(method, base(model))  # after fully_shard: the DTensor parameters
    teacher = closed = (0.0, "-: -")
    agree = True
    for t in range(steps):
        train_step(method, closed_model, closed_opt, t, distributed=False)
        loss = forward_backward(method, model, t, distributed=True)
        load_snapshot(tf_model, tf_opt, snapshot(model, opt))
        set_grads(tf_model, data_parallel_grads(model))
        opt_step(method, tf_opt, mean_over_ranks(loss))
        opt_step(method, opt, loss)
        now = snapshot(model, opt)
        agree = agree and ranks_agree(now)
        teacher = _max(teacher, worst(now, snapshot(tf_model, tf_opt), f"step {t}"))
        closed = _max(closed, worst(now, snapshot(closed_model, closed_opt), f"step {t}"))
    return {"teacher": teacher, "closed": closed, "ranks_agree": agree}


def _state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _set_state_dicts(model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def dcp_round_trip(method: str, mode: str, root: str) -> dict[str, Any]:
    """DCP with resharding: 2 steps on 2 ranks (``mode``: "fsdp2", state sharded as the
    parameters, or "ddp", state replicated), ``dcp.save``; load on 1 rank (rank 0 alone, a
    plain model), step, save; load on 2 ranks again, step. Each load bit-exact against what
    was saved (``load_at_1``, ``load_at_2``: the worst error, 0 when exact); the steps after
    each load within the closed-loop bound of the uninterrupted one-process run."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    ref_model = make_model(method)
    ref_opt = make_optimizer(method, ref_model, alone=True)
    ref = []
    for t in range(4):
        train_step(method, ref_model, ref_opt, t, distributed=False)
        ref.append(snapshot(ref_model, ref_opt))
    out: dict[str, Any] = {}

    model = wrap(mode, make_model(method))
    opt = make_optimizer(method, base(model))
    for t in range(2):
        train_step(method, model, opt, t, distributed=True)
    saved = snapshot(model, opt)
    dcp.save(_state_dicts(base(model), opt), checkpoint_id=f"{root}/at2")
    out["before_save"] = worst(saved, ref[1], "2 steps on 2 ranks")

    stepped = None
    if rank == 0:
        m1 = make_model(method)
        o1 = make_optimizer(method, m1, alone=True)
        sd = _state_dicts(m1, o1)
        dcp.load(sd, checkpoint_id=f"{root}/at2", no_dist=True)
        _set_state_dicts(m1, o1, sd)
        out["load_at_1"] = worst(snapshot(m1, o1), saved, "loaded on 1 rank")
        train_step(method, m1, o1, 2, distributed=False)
        stepped = snapshot(m1, o1)
        out["step_at_1"] = worst(stepped, ref[2], "step 2 on 1 rank")
        dcp.save(_state_dicts(m1, o1), checkpoint_id=f"{root}/at1", no_dist=True)
    box = [stepped]
    dist.broadcast_object_list(box, src=0)
    stepped = box[0]

    model = wrap(mode, make_model(method))
    opt = make_optimizer(method, base(model))
    sd = _state_dicts(base(model), opt)
    dcp.load(sd, checkpoint_id=f"{root}/at1")
    _set_state_dicts(base(model), opt, sd)
    out["load_at_2"] = worst(snapshot(model, opt), stepped, "loaded on 2 ranks")
    train_step(method, model, opt, 3, distributed=True)
    out["step_at_2"] = worst(snapshot(model, opt), ref[3], "step 3 on 2 ranks")
    return out


#: seconds after which a rank of a bad-input case counts as hung: it prints its stacks and
#: exits, which fails the test (a hang detector only; a correct run takes a second)
HANG_AFTER = 600


def _refused(fn: Any, *args: Any) -> str:
    """``fn(*args)``'s error on this rank, ``"ErrorClass: message"`` ("no error" if none);
    a rank that has not returned after :data:`HANG_AFTER` seconds exits with its stacks."""
    import faulthandler

    faulthandler.dump_traceback_later(HANG_AFTER, exit=True)
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - the message is the result (DCP's
        # CheckpointException derives from BaseException)
        return f"{type(e).__name__}: {e}"
    finally:
        faulthandler.cancel_dump_traceback_later()
    return "no error"


def _load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _state_dicts(model, opt)
    dcp.load(sd, checkpoint_id=path)
    _set_state_dicts(model, opt, sd)


def dcp_from_another_optimizer(root: str, saved: str = "sgd", loaded: str = "adamw") -> str:
    """A checkpoint of optimizer ``saved`` ("sgd": torch's SGD with momentum, else an xopt
    method) loaded into ``loaded`` (both FSDP2, after a step): the error each rank raises."""
    import torch.distributed.checkpoint as dcp

    mlp = "adamw"  # the plain MLP
    model = wrap("fsdp2", make_model(mlp))
    if saved == "sgd":
        first = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        first = make_optimizer(saved, model)
    train_step(saved, model, first, 0, distributed=True)
    dcp.save(_state_dicts(model, first), checkpoint_id=f"{root}/{saved}")
    model = wrap("fsdp2", make_model(mlp))
    opt = make_optimizer(loaded, model)
    train_step(loaded, model, opt, 0, distributed=True)
    return _refused(_load_checkpoint, model, opt, f"{root}/{saved}")


def _model_of(mode: str, method: str, case: str) -> nn.Module:
    """``method``'s model under ``mode``; for ``case`` "params", one layer more on rank 1
    (not wrapped under DDP, which would refuse it)."""
    model = make_model(method)
    if case == "params" and dist.get_rank() == 1:
        model.append(nn.Linear(sizes(method)[1], 2))
    return wrap(mode, model) if case != "params" or mode == "fsdp2" else model


def disagreeing_ranks(mode: str, case: str, method: str = "adamw") -> str:
    """``method``'s optimizer built differently on rank 1 (``case``: "lr", another learning
    rate; "params", one more layer; "invalid", a learning rate of NaN set after
    construction, as a schedule would), under ``mode``: the error each rank raises at the
    first step."""
    odd = dist.get_rank() == 1
    model = _model_of(mode, method, case)
    opt = make_optimizer(method, base(model))
    if odd and case in ("lr", "invalid"):
        opt.param_groups[0]["lr"] = 2e-2 if case == "lr" else math.nan
    for p in base(model).parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return _refused(opt_step, method, opt, torch.tensor(1.0))


def nonfinite_on_one_rank(mode: str, policy: str, method: str = "adamw") -> dict[str, Any]:
    """``method``'s optimizer with ``nonfinite=policy`` under ``mode`` (FSDP2), a NaN in
    rank 1's shard of a gradient only: what each rank does at that step (the error it
    raises, or the skip counters), whether the parameters changed, and whether the ranks
    still agree."""
    model = wrap(mode, make_model(method))
    opt = make_optimizer(method, base(model))
    opt.nonfinite = policy
    forward_backward(method, model, 0, distributed=True)
    from xopt.torch.distributed import local

    first = next(p for p in base(model).parameters() if p.grad is not None)
    if dist.get_rank() == 1:
        with torch.no_grad():
            local(first.grad).view(-1)[0] = math.nan
    before = snapshot(model, opt)
    out: dict[str, Any] = {"error": _refused(opt_step, method, opt, torch.tensor(1.0))}
    after = snapshot(model, opt)
    out["changed"] = any(not np.array_equal(before[k], after[k], equal_nan=True)
                         for k in before if k.startswith("param/"))
    out["skips"] = sorted(int(v) for k, v in after.items() if k.endswith("/nonfinite_skips"))
    out["ranks_agree"] = ranks_agree(after)
    return out
