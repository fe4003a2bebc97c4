"""Train a small language model with FSDP2 on several processes, with any xopt optimizer.

    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp_lm.py --method velo
    python examples/fsdp_lm.py --method galore --nproc 2      # the same, started here
    torchrun --nproc-per-node 8 examples/fsdp_lm.py --method coap --device cuda   # GPUs

A byte-level decoder (2 pre-norm blocks of ``torch.nn.TransformerEncoderLayer`` with a
causal mask, width 64, context 32) on the Python documentation that ships with CPython
(``pydoc_data.topics``). Every block is a ``fully_shard`` unit and the root another, so the
parameters are DTensors, each rank holding a shard; each rank reads its own slice of every
global batch. The optimizer is built on the sharded parameters like any
``torch.optim.Optimizer``; its state is sharded as they are, the learned optimizers read
the ranks' mean loss (``opt.step(loss=loss)`` with this rank's loss) and GaLore, COAP and
PLUMAGE decompose each matrix once, on one rank, at their refresh steps
(docs/distributed.md). On the CPU the ranks talk over gloo, on GPUs over NCCL (one GPU per
rank). Rank 0 prints the loss of the global batch every few steps, and the script exits 1
unless the loss went down.

CompAct and POET-X train through their own layers (``compact_model``, ``convert``), which
FSDP2 shards like any other.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 128, 64, 4, 2, 32
METHODS = ("adamw", "small_fc_lopt", "velo", "mulo", "galore", "flora", "coap", "plumage",
           "compact", "poet")
LEARNED = ("small_fc_lopt", "velo", "mulo")


def corpus() -> np.ndarray:
    """The bytes of ``pydoc_data.topics`` (non-ASCII bytes as ``?``)."""
    from pydoc_data.topics import topics

    data = np.frombuffer("\n".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
    return np.where(data < VOCAB, data, ord("?")).astype(np.int64)


def global_batch(data: np.ndarray, step: int, batch: int) -> np.ndarray:
    """Step ``step``'s ``batch`` windows of ``CONTEXT + 1`` tokens (the same on every rank)."""
    start = np.random.default_rng(step).integers(0, len(data) - CONTEXT - 1, size=batch)
    return np.stack([data[s:s + CONTEXT + 1] for s in start])


def make_model() -> Any:
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0,
                                           batch_first=True, norm_first=True)
                for _ in range(LAYERS))
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens: Any) -> Any:
            x, y = tokens[:, :-1], tokens[:, 1:]
            h = self.embed(x) + self.pos[: x.shape[1]]
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=h.device)
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            logits = self.head(self.norm(h))
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    torch.manual_seed(0)
    return LM()


def make_optimizer(method: str, model: Any, steps: int, lr: float) -> Any:
    """``method``'s optimizer of ``model``: the low-rank methods project the blocks'
    matrices (rank 16), the rest of the parameters take their full-rank update."""
    import xopt.torch as xt

    params = [p for p in model.parameters() if p.requires_grad]
    if method == "adamw":
        return xt.AdamW(params, lr=lr)
    if method == "small_fc_lopt":
        return xt.SmallFCLOpt(params, num_training_steps=steps)
    if method == "velo":
        return xt.VeLO(params, num_training_steps=steps)
    if method == "mulo":
        return xt.MuLO(params, num_training_steps=steps)
    if method == "compact":
        return xt.CompActAdamW(params, lr=lr)
    if method == "poet":
        from xopt.torch.poet import POETAdamW, poet_param_groups

        groups = [g for g in poet_param_groups(model, lr=lr, poet_lr=lr) if g["params"]]
        return POETAdamW(groups, merge_interval=10, model=model)
    mats = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for p in params if all(p is not q for q in mats)]
    groups = [{"params": mats}, {"params": rest, "project": False}]
    gap = max(steps // 4, 1)
    if method == "galore":
        return xt.GaLore(groups, lr=lr, rank=16, update_proj_gap=gap, scale=1.0)
    if method == "flora":
        return xt.Flora(groups, lr=lr, rank=16, kappa=gap, beta1=0.9)
    if method == "coap":
        return xt.COAP(groups, lr=lr, rank=16, update_interval=gap, reproject_factor=2,
                       scale=1.0)
    if method == "plumage":
        return xt.PLUMAGE(groups, lr=lr, rank=16, update_proj_gap=gap)
    raise SystemExit(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def wrap(method: str, model: Any, device: str) -> Any:
    """FSDP2 (each block a unit, then the root)."""
    import torch.distributed as dist

    if method == "compact":
        from xopt.torch.compact import compact_model

        compact_model(model, rank=0.5, seed=0)
    if method == "poet":
        from xopt.torch.poet import convert

        convert(model, block_size=16)
    model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(method: str, steps: int, batch: int, lr: float, device: str) -> list[float]:
    """On every rank of the default process group: train, and return the global batch's
    loss at every step (the ranks' mean)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % world:
        raise SystemExit(f"--batch {batch} must divide by the {world} ranks")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    data = corpus()
    model = wrap(method, make_model(), device)
    opt = make_optimizer(method, getattr(model, "module", model), steps, lr)
    per_rank = batch // world
    losses = []
    for step in range(steps):
        tokens = global_batch(data, step, batch)[rank * per_rank:(rank + 1) * per_rank]
        loss = model(torch.from_numpy(tokens).to(device))
        loss.backward()
        if method in LEARNED:
            opt.step(loss=loss.detach())  # this rank's loss: the optimizer reads the mean
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"{method} step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def lowered(losses: list[float]) -> bool:
    """The mean of the last quarter below that of the first (and every loss finite)."""
    k = max(len(losses) // 4, 1)
    return bool(np.isfinite(losses).all()) and np.mean(losses[-k:]) < np.mean(losses[:k])


def run(args: argparse.Namespace) -> list[float]:
    """One rank's whole run (under torchrun, or a worker of :func:`xopt.torch.launch.launch`)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():  # torchrun: the environment names the group
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        return train(args.method, args.steps, args.batch, args.lr, args.device)
    finally:
        if "LOCAL_RANK" in os.environ:
            import gc

            gc.collect()  # FSDP2's cyclic objects freed before the group and the interpreter go
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="adamw", choices=METHODS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split over ranks)")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="learning rate (the learned optimizers take none)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, a GPU a rank)")
    ap.add_argument("--nproc", type=int, default=2,
                    help="ranks to start when not run under torchrun")
    args = ap.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        losses = run(args)
    else:
        from xopt.torch.launch import launch

        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        losses = launch(run, args.nproc, args, backend=backend)[0]
    if "LOCAL_RANK" in os.environ and os.environ.get("RANK", "0") != "0":
        return 0
    ok = lowered(losses)
    print(f"{args.method}: loss {losses[0]:.4f} -> {losses[-1]:.4f}: "
          + ("lowered" if ok else "NOT lowered"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
