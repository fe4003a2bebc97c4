"""Every xopt method under FSDP2 against ``torch.optim.AdamW(fused=True)`` under the same FSDP2.

One command on 2 GPUs of one host (NCCL)::

    torchrun --nproc-per-node 2 bench/distributed.py --out-dir DIR
    python bench/distributed.py --out-dir DIR          # the same, launching its 2 ranks

A GPT-2-medium-sized decoder (24 blocks, width 1024, 16 heads, vocabulary 50304, sequence
1024; defined here, nothing downloaded), each block and the root wrapped with
``fully_shard``. Per method and per GPU (rank 0's figures; the ranks hold equal shards):

* ``state_bytes``: the optimizer state this rank holds (local shards);
* ``peak_bytes``: peak allocated memory over the measured training steps;
* ``step_ms``: median time of ``optimizer.step()`` (synchronised), and ``train_ms``, of the
  whole step (forward, backward, step);
* ``step_comm_bytes``: the bytes this rank hands to collectives inside ``optimizer.step()``,
  i.e. beyond FSDP2's own parameter all-gathers and gradient reduce-scatters (which run in
  forward and backward): at the first step (a refresh for the low-rank methods, the ranks'
  agreement check for all) and at a steady step; ``grad_rs_bytes``: the bytes of one
  gradient reduce-scatter's input (every parameter in float32), the yardstick;
* ``max_rel_err``: at small size, the largest relative error of the parameters after 3
  steps sharded on 2 ranks against one process on the same global batches;
* ``refresh`` (GaLore, COAP, PLUMAGE; their projections refreshed every other step): the
  mean time of the refresh steps and of the steps between them, with the owner rule (each
  matrix decomposed once, on its owner rank) and without it
  (``xopt.torch.distributed.owner_rule(False)``: every rank gathers and decomposes every
  matrix), side by side;
* ``one_device`` (the learned optimizers and the baseline): the step time of the same
  model unsharded on rank 0's GPU alone (the other rank waits), each learned optimizer in
  its default implementation (the fused kernels on a GPU) and in ``impl="plain"``, the
  path FSDP2's shards take; so the ratio to fused AdamW on one device and under FSDP2
  come from one run.

``--tiny``: a small model on 2 gloo CPU processes (the test suite runs it; the baseline
there is torch's default AdamW, not the fused one). Prints a table and writes
``DIR/distributed.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

METHODS = ("adamw", "small_fc_lopt", "velo", "mulo", "galore", "flora", "coap", "plumage",
           "compact", "poet")
BASELINE = "torch_adamw_fused"

# budget_s: the timed steps of a method stop once they have taken this long (at least one
# is timed), so that a slow method (a learned optimizer's plain path under FSDP2: seconds a
# step) does not hold up the rows after it
FULL = dict(vocab=50304, width=1024, depth=24, heads=16, seq=1024, batch=4, rank=128,
            warmup=2, steps=5, budget_s=20)
TINY = dict(vocab=64, width=32, depth=2, heads=4, seq=16, batch=2, rank=4, warmup=1,
            steps=2, budget_s=60)
CHECK = dict(vocab=64, width=32, depth=2, heads=4, seq=16, batch=2, rank=4)


def _model(cfg: dict[str, int]) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg["width"]
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            h = cfg["heads"]
            q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in (q, k, v))
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg["width"]
            self.tok, self.pos = nn.Embedding(cfg["vocab"], d), nn.Embedding(cfg["seq"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["depth"]))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, cfg["vocab"], bias=False)

        def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln(x))
            return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return GPT()


def _layers(method: str, model: Any) -> Any:
    """CompAct's and POET-X's own layers in place of the blocks' linears (seeded, so that
    the sharded and the one-process model of ``_check`` get the same ones)."""
    import torch

    torch.manual_seed(1)
    if method == "compact":
        from xopt.torch.compact import compact_model

        compact_model(model, rank=0.5, seed=0)
    elif method == "poet":
        from xopt.torch.poet import convert

        convert(model.blocks, block_size=16)
    return model


def _shard(model: Any, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(method: str, model: Any, rank: int, gap: int | None = None,
               impl: str | None = None) -> Any:
    """``method``'s optimizer; ``gap``: the low-rank methods' refresh interval (default:
    their papers' 200, COAP's 32 × 5); ``impl``: the learned optimizers' (default: theirs)."""
    import torch

    import xopt.torch as xt

    params = list(model.parameters())
    mats = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    seen = {id(p) for p in mats}
    rest = [p for p in params if id(p) not in seen]
    if method == BASELINE:
        # fused on GPUs, the baseline measured; the CPU smoke run (--tiny) keeps torch's
        # default implementation: the fused CPU kernel on DTensor shards is not what this
        # benchmark measures, and no other test runs it
        fused = params[0].device.type == "cuda"
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=fused or None)
    if method == "adamw":
        return xt.AdamW(params, lr=3e-4, weight_decay=0.1)
    if method == "small_fc_lopt":
        return xt.SmallFCLOpt(params, num_training_steps=1000, impl=impl)
    if method == "velo":
        return xt.VeLO(params, num_training_steps=1000, impl=impl)
    if method == "mulo":
        return xt.MuLO(params, num_training_steps=1000)
    if method == "galore":
        return xt.GaLore([{"params": mats, "rank": rank, "update_proj_gap": gap or 200},
                          {"params": rest, "project": False}], lr=1e-3)
    if method == "flora":
        return xt.Flora([{"params": mats}, {"params": rest, "project": False}], lr=1e-3,
                        rank=rank, kappa=1000, beta1=0.9)
    if method == "coap":
        return xt.COAP([{"params": mats}, {"params": rest, "project": False}], lr=1e-3,
                       rank=rank, update_interval=1 if gap else 32,
                       reproject_factor=gap or 5)
    if method == "plumage":
        return xt.PLUMAGE([{"params": mats, "rank": rank, "update_proj_gap": gap or 200},
                           {"params": rest, "project": False}], lr=1e-3)
    if method == "compact":
        return xt.CompActAdamW(params, lr=1e-3, weight_decay=0.1)
    if method == "poet":
        from xopt.torch.poet import POETAdamW, poet_param_groups

        groups = [g for g in poet_param_groups(model, lr=1e-3, poet_lr=1e-3) if g["params"]]
        return POETAdamW(groups, merge_interval=200, model=model)
    raise ValueError(method)


def _step(method: str, opt: Any, loss: Any) -> None:
    if method in ("small_fc_lopt", "velo", "mulo"):
        opt.step(loss=loss)  # the rank's own loss: the optimizer reads the ranks' mean
    else:
        opt.step()


def _batch(cfg: dict[str, int], t: int, rank: int, world: int, device: Any) -> tuple:
    """Rank ``rank``'s rows of step ``t``'s global batch (``world * batch`` sequences)."""
    import torch

    g = torch.Generator().manual_seed(1000 + t)
    n = cfg["batch"] * world
    idx = torch.randint(cfg["vocab"], (n, cfg["seq"] + 1), generator=g)
    rows = idx[rank * cfg["batch"]:(rank + 1) * cfg["batch"]] if rank >= 0 else idx
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(opt: Any) -> int:
    from xopt.torch.distributed import local

    total = 0
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "element_size"):
                t = local(v)
                total += t.numel() * t.element_size()
    return total


def _measure(method: str, cfg: dict[str, int], mesh: Any, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xopt.torch.distributed import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with torch.device(device):
        model = _layers(method, _model(cfg))
    _shard(model, mesh)
    opt = _optimizer(method, model, cfg["rank"])
    n_params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms, train_ms, comm = [], [], {}
    for t in range(cfg["warmup"] + cfg["steps"]):
        _sync(device)
        t0 = time.perf_counter()
        x, y = _batch(cfg, t, rank, world, device)
        loss = model(x, y)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        if t in (0, cfg["warmup"]):
            with CommCounter() as c:
                _step(method, opt, loss.detach())
            comm["first" if t == 0 else "steady"] = {"bytes": c.bytes,
                                                     "by_op": dict(c.bytes_by_op),
                                                     "calls": dict(c.calls_by_op),
                                                     "largest": c.largest}
        else:
            _step(method, opt, loss.detach())
        _sync(device)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if t >= cfg["warmup"]:
            step_ms.append(1e3 * (t2 - t1))
            train_ms.append(1e3 * (t2 - t0))
            # decided together: a rank leaving the loop alone would leave its peer waiting
            # in FSDP2's next all-gather
            over = torch.tensor(float(sum(train_ms) > 1e3 * cfg["budget_s"]), device=device)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if over.item():
                break
    out = {"state_bytes": _state_bytes(opt),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
           else None,
           "step_ms": statistics.median(step_ms), "train_ms": statistics.median(train_ms),
           "step_comm_bytes": comm, "grad_rs_bytes": 4 * n_params, "params": n_params}
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


REFRESHING = ("galore", "coap", "plumage")
LEARNED = ("small_fc_lopt", "velo", "mulo")


def _step_times(method: str, cfg: dict[str, int], model: Any, opt: Any, steps: int,
                device: Any, rank: int, world: int) -> list[float]:
    """The synchronised time of ``optimizer.step()`` at each of ``steps`` training steps."""
    import torch

    out = []
    for t in range(steps):
        x, y = _batch(cfg, t, rank, world, device)
        loss = model(x, y)
        loss.backward()
        _sync(device)
        t0 = time.perf_counter()
        _step(method, opt, loss.detach())
        _sync(device)
        out.append(1e3 * (time.perf_counter() - t0))
        opt.zero_grad(set_to_none=True)
    del x, y, loss
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _refresh(method: str, cfg: dict[str, int], mesh: Any, device: Any) -> dict[str, Any]:
    """Refresh steps (2 and 4; a refresh every other step) against the steps between them
    (1 and 3), with the owner rule and with every rank decomposing every matrix."""
    import torch
    import torch.distributed as dist

    from xopt.torch.distributed import owner_rule

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for label, enabled in (("owner", True), ("every_rank", False)):
        torch.manual_seed(0)
        with torch.device(device):
            model = _model(cfg)
        _shard(model, mesh)
        opt = _optimizer(method, model, cfg["rank"], gap=2)
        with owner_rule(enabled):
            ms = _step_times(method, cfg, model, opt, 5, device, rank, world)
        out[label] = {"refresh_ms": (ms[2] + ms[4]) / 2, "between_ms": (ms[1] + ms[3]) / 2,
                      "steps_ms": ms}
        del model, opt
        gc.collect()
    return out


def _one_device(cfg: dict[str, int], device: Any, methods: Sequence[str]) -> dict[str, Any]:
    """Rank 0 alone: the unsharded model's optimizer step for the baseline and the learned
    optimizers (default implementation and plain), the other ranks waiting."""
    import torch
    import torch.distributed as dist

    from xopt.torch.distributed import set_process_group

    rows: dict[str, Any] = {}
    if dist.get_rank() == 0:
        learned = [m for m in LEARNED if m in methods]
        runs = [(BASELINE, None)] + [(m, None) for m in learned] if learned else []
        if device.type == "cuda":  # on the CPU the default is the plain path already
            runs += [(m, "plain") for m in learned if m != "mulo"]  # μLO: plain only
        for method, impl in runs:
            torch.manual_seed(0)
            with torch.device(device):
                model = _model(cfg)
            opt = _optimizer(method, model, cfg["rank"], impl=impl)
            if method != BASELINE:
                set_process_group(opt, None)
            ms = _step_times(method, cfg, model, opt, cfg["warmup"] + cfg["steps"], device,
                             -1, 1)[cfg["warmup"]:]
            rows[method if impl is None else f"{method}/{impl}"] = {
                "step_ms": statistics.median(ms)}
            del model, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()
    return rows


def _check(method: str, mesh: Any, device: Any, steps: int = 3) -> float:
    """Max relative error of the parameters, sharded against one process (global batch)."""
    import torch
    import torch.distributed as dist

    from xopt.torch.distributed import set_process_group

    rank, world = dist.get_rank(), dist.get_world_size()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        with torch.device(device):
            models.append(_layers(method, _model(CHECK)))
    sharded, alone = _shard(models[0], mesh), models[1]
    opts = [_optimizer(method, m, CHECK["rank"]) for m in (sharded, alone)]
    if method != BASELINE:
        set_process_group(opts[1], None)
    for t in range(steps):
        for m, o, r in ((sharded, opts[0], rank), (alone, opts[1], -1)):
            x, y = _batch(CHECK, t, r, world, device)
            loss = m(x, y)
            loss.backward()
            _step(method, o, loss.detach())
            o.zero_grad(set_to_none=True)
    worst = 0.0
    for a, b in zip(sharded.parameters(), alone.parameters(), strict=True):
        full = a.detach().full_tensor().double()
        ref = b.detach().double()
        err = float((full - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        worst = max(worst, err)
    return worst


def run_rank(options: dict[str, Any]) -> dict[str, Any]:
    """Every method on this rank; rank 0's results (the others return theirs too)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():  # under torchrun
        backend = "nccl" if torch.cuda.is_available() and not options["tiny"] else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    cfg = TINY if options["tiny"] else FULL
    report: dict[str, Any] = {"config": cfg, "world_size": dist.get_world_size(),
                              "device": str(device), "backend": dist.get_backend(),
                              "rows": {}, "one_device": {}}
    start = time.perf_counter()

    def done(what: str) -> None:  # progress, and the report so far (a run cut short keeps it)
        if dist.get_rank() == 0:
            print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)
            _write(report, options["out_dir"])

    for method in (BASELINE, *options["methods"]):
        row = _measure(method, cfg, mesh, device)
        row["max_rel_err"] = _check(method, mesh, device)
        report["rows"][method] = row
        done(f"{method}: step {row['step_ms']:.2f} ms")
        if method in REFRESHING:
            row["refresh"] = _refresh(method, cfg, mesh, device)
            done(f"{method}: refresh steps")
        dist.barrier()
    report["one_device"] = _one_device(cfg, device, options["methods"])
    done("one device")
    return report


def _write(report: dict[str, Any], out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "distributed.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=lambda x: None if isinstance(x, float)
                  and not math.isfinite(x) else str(x))
    os.replace(path + ".tmp", path)
    return path


def _table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    base = rows[BASELINE]
    head = (f"{'method':<18}{'state MiB':>10}{'peak MiB':>10}{'step ms':>10}{'x fused':>9}"
            f"{'comm/step B':>13}{'of RS':>9}{'1st-step B':>12}{'max rel err':>13}")
    lines = [f"FSDP2 on {report['world_size']} ranks ({report['device']}, "
             f"{report['backend']}), per rank", head]
    for m, r in rows.items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        steady = r["step_comm_bytes"]["steady"]["bytes"]
        lines.append(
            f"{m:<18}{r['state_bytes'] / 2**20:>10.1f}{peak:>10}{r['step_ms']:>10.2f}"
            f"{r['step_ms'] / base['step_ms']:>9.2f}{steady:>13}"
            f"{steady / r['grad_rs_bytes']:>9.2%}"
            f"{r['step_comm_bytes']['first']['bytes']:>12}{r['max_rel_err']:>13.2e}")
    lines += ["", "refresh steps (a refresh every other step), ms: owner rule | every rank "
              "decomposing every matrix",
              f"{'method':<18}{'refresh':>10}{'between':>10}{'refresh':>12}{'between':>10}"
              f"{'owner x':>9}"]
    for m, r in rows.items():
        if "refresh" in r:
            o, e = r["refresh"]["owner"], r["refresh"]["every_rank"]
            lines.append(f"{m:<18}{o['refresh_ms']:>10.2f}{o['between_ms']:>10.2f}"
                         f"{e['refresh_ms']:>12.2f}{e['between_ms']:>10.2f}"
                         f"{o['refresh_ms'] / e['refresh_ms']:>9.2f}")
    one = report["one_device"]
    if one:
        lines += ["", "optimizer step, x fused AdamW: one device (unsharded) | FSDP2",
                  f"{'method':<22}{'1 device ms':>12}{'x fused':>9}{'FSDP2 x fused':>15}"]
        for m, r in one.items():
            fsdp = rows.get(m.split("/")[0])
            lines.append(f"{m:<22}{r['step_ms']:>12.2f}"
                         f"{r['step_ms'] / one[BASELINE]['step_ms']:>9.2f}"
                         f"{fsdp['step_ms'] / base['step_ms'] if fsdp else float('nan'):>15.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tiny", action="store_true", help="2 gloo CPU ranks, a small model")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, of {','.join(METHODS)} (default: all)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)} (known: {', '.join(METHODS)})")
    options = {"tiny": args.tiny, "methods": methods, "out_dir": args.out_dir}
    if "RANK" in os.environ:  # torchrun started this process as one rank
        import gc

        import torch.distributed as dist

        report = run_rank(options)
        rank = dist.get_rank()
        gc.collect()  # FSDP2's cyclic objects freed before the group and the interpreter go
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        import torch

        from xopt.torch.launch import Gang

        gpu = torch.cuda.is_available() and not args.tiny
        if gpu and torch.cuda.device_count() < 2:
            print("bench/distributed.py needs 2 GPUs (or --tiny)", file=sys.stderr)
            return 2
        with Gang(2, "nccl" if gpu else "gloo") as gang:
            report = gang.run(run_rank, options)[0]
    path = _write(report, args.out_dir)
    print(_table(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
