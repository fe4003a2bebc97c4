"""Whole training steps of a LLaMA-style decoder with every xopt method, side by side.

One process, one GPU, one model size: for each method a fresh model (the same seed), a few
warm-up steps, then timed steps. Per method: forward+backward and optimizer-step time (CUDA
events; the step's median is an ordinary step, its maximum a refresh step, its mean over the
timed window, which spans whole refresh intervals, the cost averaged over them), tokens/s,
peak memory, optimizer-state bytes; every ratio is to ``torch.optim.AdamW(fused=True)``
measured in the same run. A method that runs out of memory is a row saying so.

``--refresh-interval K`` reports each method's step averaged over a refresh interval of K:
the timed steps that fall on each method's refresh schedule (every ``GAP``-th step;
GaLore's and PLUMAGE's SVDs, COAP's Eqn-6/7 updates, Flora's resampling, CompAct's redraws,
POET's merges; :data:`REFRESH_PHASE`) are timed apart from the others (the window holds
two: COAP's Eqn-6 and Eqn-7 updates, with ``reproject_factor=2``), and the amortised step
is (ordinary·(K−1) + refresh)/K with refresh their mean, its total against fused AdamW's at
the same K.
``--tf32`` lets float32 matmuls (the optimizers' projections) use TF32; ``--svd-driver``
picks how GaLore, COAP and PLUMAGE decompose (``svd_driver=``, e.g. ``gram``).
``bitsandbytes AdamW8bit`` (the 8-bit baseline of COAP 8-bit and POET-XQ) and the authors'
own code at the settings of the xopt rows of the same names (``GaLore (authors')``:
``galore_torch.GaLoreAdamW``; ``COAP (authors')``: ``coap_torch.CoapAdamW``; ``Flora
(authors')``: ``flora_opt.Flora``; ``CompAct (authors')``: CompAct's ``SmallLinear.like``
layers with their ``Projector``s, ``SmallAdamW`` and the ``Manager`` step counter, as its
``torchrun_main.replace_parameters`` converts LLaMA; ``small_fc_lopt (PyLO)`` and ``VeLO
(PyLO)``: PyLO's pure-torch ``AdafacLO_naive`` and ``VeLO_naive`` with meta-weights of the
xopt rows' shapes read from local Hugging Face folders, ``$PYLO_META_DIR`` or ``meta/``
beside the imported ``pylo``) run only when named in ``--methods``, where their packages
are importable. ``--compile`` compiles the model's forward (``torch.compile``; the
optimizer steps stay eager), ``--compile-mode MODE`` with torch.compile's ``mode``
(``reduce-overhead``: the compiled forward and backward replayed from CUDA graphs, POET-X's
layer calls among them). ``--accum K`` accumulates the gradients of K micro-batches
(``--batch`` sequences of ``--seq`` tokens each) into every optimizer step, as a run at the
papers' tokens per step does on one GPU; forward+backward is then the K micro-batches'
together.

    python3 bench/train_step.py --size 350m --out-dir OUT [--compile] [--deadline-s 500]
    python3 bench/train_step.py --size 350m --methods "torch.optim.AdamW(fused),POET-X fast" \
        --compile --compile-mode reduce-overhead --out-dir OUT
    python3 bench/train_step.py --size 1b --methods GaLore,COAP,PLUMAGE,Flora \
        --refresh-interval 200 --svd-driver gram --out-dir OUT --deadline-s 240
    # LLaMA-1B at GaLore's, COAP's and PLUMAGE's 512 sequences of 256 tokens per step
    python3 bench/train_step.py --size 1b --seq 256 --batch 64 --accum 8 \
        --methods GaLore,COAP,PLUMAGE,Flora --refresh-interval 200 --out-dir OUT
    python3 bench/train_step.py --tiny --out-dir OUT        # the CPU smoke run of CI
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import xopt.torch as xt
from xopt.torch import poet as xpoet

# d_model, layers, heads, SwiGLU width, vocab, sequence length, batch (LLaMA-style shapes of
# GaLore's and COAP's pre-training tables)
SIZES = {
    "tiny": (64, 2, 4, 176, 256, 32, 2),
    "350m": (1024, 24, 16, 2736, 32000, 1024, 8),
    "1b": (2048, 24, 32, 5461, 32000, 1024, 4),
    # LLaMA-3-8B's shapes at POET-X's single-GPU setting (sequence 256; its batch unstated)
    "8b": (4096, 32, 32, 14336, 128256, 256, 8),
}
WARMUP, TIMED, GAP = 2, 10, 5  # two refreshes of every method fall inside the timed window


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.attn_norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        a = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, n, d))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, ff: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm, self.lm_head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the blocks' projection matrices, everything else): the low-rank methods project the
    former, as their papers do; embeddings, norms and the head take plain Adam."""
    mats = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    ids = {id(p) for p in mats}
    return mats, [p for p in model.parameters() if id(p) not in ids]


def _rank(model: nn.Module) -> int:
    """GaLore's ranks for its LLaMA tables (256 at 350M, 512 at 1B), a quarter of d_model."""
    return model.embed.embedding_dim // 4


#: the low-rank methods' ``svd_driver`` (``--svd-driver``; Flora decomposes nothing) and
#: GaLore's, COAP's and PLUMAGE's ``proj_dtype`` (``--proj-dtype``)
SVD_DRIVER: dict[str, str | None] = {"driver": None, "proj_dtype": "state"}


def _lowrank(cls: type, **kw: Any) -> Callable[[nn.Module, int], Any]:
    def make(model: nn.Module, steps: int) -> Any:
        mats, rest = _split(model)
        if cls is not xt.Flora:
            kw["svd_driver"] = SVD_DRIVER["driver"]
            kw["proj_dtype"] = SVD_DRIVER["proj_dtype"]
        return cls([{"params": mats}, {"params": rest, "project": False}], lr=1e-3,
                   rank=_rank(model), **kw)
    return make


def _compact(model: nn.Module, steps: int) -> Any:
    xt.compact_model(model, rank=0.25, scale=0.25, gap=GAP)
    return xt.CompActAdamW(model.parameters(), lr=1e-3)


def _poet(variant: str, **kw: Any) -> Callable[[nn.Module, int], Any]:
    def make(model: nn.Module, steps: int) -> Any:
        block = 256 if model.embed.embedding_dim >= 1024 else 16
        xpoet.convert(model, block_size=block, exclude_modules=("lm_head", "embed"),
                      variant=variant, **kw)
        xpoet.batch_rotations(model)  # one CNP evaluation for all layers, each way
        groups = xpoet.poet_param_groups(model, lr=1e-3, poet_lr=5e-4)
        return xpoet.POETAdamW(groups, model=model, merge_interval=GAP)
    return make


METHODS: dict[str, Callable[[nn.Module, int], Any]] = {
    "torch.optim.AdamW(fused)": lambda m, s: torch.optim.AdamW(
        m.parameters(), lr=1e-3, fused=next(m.parameters()).is_cuda or None),
    "xopt AdamW": lambda m, s: xt.AdamW(m.parameters(), lr=1e-3),
    "GaLore": _lowrank(xt.GaLore, update_proj_gap=GAP, scale=0.25),
    "Flora": _lowrank(xt.Flora, kappa=GAP),  # Adafactor (no first moment), as Flora's default
    "Flora momentum": _lowrank(xt.Flora, kappa=GAP, beta1=0.9),  # the compressed momentum
    "COAP": _lowrank(xt.COAP, update_interval=GAP, reproject_factor=2),
    "COAP 8-bit": _lowrank(xt.COAP, update_interval=GAP, reproject_factor=2, state_bits=8),
    "PLUMAGE": _lowrank(xt.PLUMAGE, update_proj_gap=GAP),
    "small_fc_lopt": lambda m, s: xt.SmallFCLOpt(m.parameters(), num_training_steps=s),
    "VeLO": lambda m, s: xt.VeLO(m.parameters(), num_training_steps=s),
    "CompAct": _compact,
    "POET-X fast": _poet("fast"),
    "POET-X mem": _poet("mem"),
    # W0 in the authors' 8-bit format (groups of 256), dequantised inside each product
    "POET-XQ": _poet("mem", weight_bits=8, weight_group_size=256),
}


def _adamw8bit(model: nn.Module, steps: int) -> Any:
    import bitsandbytes as bnb  # not an xopt dependency: carried onto the GPU machine

    return bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)


def _galore_authors(model: nn.Module, steps: int) -> Any:
    from galore_torch import GaLoreAdamW  # not an xopt dependency: carried onto the GPU machine

    mats, rest = _split(model)
    return GaLoreAdamW([{"params": rest}, {"params": mats, "rank": _rank(model),
                                           "update_proj_gap": GAP, "scale": 0.25,
                                           "proj_type": "std"}], lr=1e-3)


def _coap_authors(model: nn.Module, steps: int) -> Any:
    from coap_torch import CoapAdamW  # not an xopt dependency: carried onto the GPU machine

    mats, rest = _split(model)
    return CoapAdamW(grouped_params_with_proj=[
        {"params": rest}, {"params": mats, "proj_method": "coap", "rank": _rank(model),
                           "update_interval": GAP, "reproject_factor": 2}], lr=1e-3)


def _flora_authors(model: nn.Module, steps: int) -> Any:
    from flora_opt import Flora  # not an xopt dependency: carried onto the GPU machine

    mats, rest = _split(model)
    return Flora([{"params": mats, "rank": _rank(model)}, {"params": rest, "rank": None}],
                 lr=1e-3, kappa=GAP)


class _Wrapped:
    """An optimizer whose own step the loop cannot call as ``opt.step()``: ``after_step``
    runs after each step (CompAct's step counter, advanced by its training loop), and with
    ``takes_loss`` the loop passes the loss (PyLO's VeLO reads it)."""

    def __init__(self, opt: Any, *, after_step: Callable[[], None] | None = None,
                 takes_loss: bool = False) -> None:
        self.opt, self.after_step, self.takes_loss = opt, after_step, takes_loss

    @property
    def state(self) -> Any:
        return self.opt.state

    def step(self, loss: torch.Tensor | None = None) -> None:
        self.opt.step(loss) if self.takes_loss else self.opt.step()
        if self.after_step is not None:
            self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def _compact_authors(model: nn.Module, steps: int) -> Any:
    # not xopt dependencies, carried onto the GPU machine: CompAct's top-level packages
    from modules import SmallLinear
    from optimizers import SmallAdamW
    from random_utils import Manager, Projector

    # torchrun_main.replace_parameters for LLaMA with layer_filter "all": every block's
    # q, k, v, o, gate, up and down projections (the CompAct row's layers); o_proj keeps its
    # whole activation (identity projector scaled by scale_o_proj·scale, scale_o_proj 1 as
    # the row's), the others a Gaussian sketch of rank ratio 0.25 and scale 0.25, drawn
    # from a seed at every use, the seed advanced when the step count is a multiple of GAP
    small = []
    for blk in model.blocks:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"):
            layer = SmallLinear.like(getattr(blk, name), single_gpu=True)
            ident = name == "o_proj"
            layer.weight.projector = Projector(
                rank=1 if ident else 0.25, proj_type="id" if ident else "gaussian", scale=0.25,
                gap=GAP, full_matrices=False, single_gpu=True)
            setattr(blk, name, layer)
            small.append(layer.weight)
    ids = {id(p) for p in small}
    counter = Manager()  # the process's one step counter, read by every projector
    counter.init_iter()
    opt = SmallAdamW([{"params": [p for p in model.parameters() if id(p) not in ids]},
                      {"params": small}], lr=1e-3, no_deprecation_warning=True)
    return _Wrapped(opt, after_step=counter.update_iter)


def _pylo_meta(name: str) -> str:
    """A PyLO Hugging Face folder of meta-weights, read from disk (no hub at run time)."""
    import pylo  # not an xopt dependency: carried onto the GPU machine

    root = Path(os.environ.get("PYLO_META_DIR") or Path(pylo.__file__).parents[1] / "meta")
    if not (root / name / "config.json").is_file():
        raise FileNotFoundError(f"PyLO meta-weights {name!r}: no {root / name}/config.json "
                                "(set PYLO_META_DIR)")
    return str(root / name)


def _small_fc_pylo(model: nn.Module, steps: int) -> Any:
    from pylo.optim.AdafacLO_naive import AdafacLO_naive

    # xt.SmallFCLOpt's defaults: hidden width 4, two hidden layers (PyLO counts the ones
    # after the first), step_mult and exp_mult 0.001, lr 1, decay offsets 0 (its fresh θ's)
    return AdafacLO_naive(model.parameters(), momentum_decays=[0.0] * 3, rms_decays=[0.0],
                          adafactor_decays=[0.0] * 3, lr=1.0, step_mult=0.001, exp_mult=0.001,
                          hidden_size=4, hidden_layers=1, hf_key=_pylo_meta("small_fc_lopt_h4"))


def _velo_pylo(model: nn.Module, steps: int) -> Any:
    from pylo.optim.Velo_naive import VeLO_naive

    # xt.VeLO's: the released VeLO's LSTM (512) and MLP bank (256), lr 1 (PyLO's default is
    # 1e-3), the horizon num_training_steps, no weight decay
    opt = VeLO_naive(model.parameters(), lr=1.0, num_steps=steps,
                     hf_key_rnn=_pylo_meta("velo_perturbed_rnn"),
                     hf_key_mlp=_pylo_meta("velo_perturbed_mlp"))
    return _Wrapped(opt, takes_loss=True)


#: run only when named in ``--methods``: baselines whose packages are not dependencies, and
#: variants of the methods above
OPTIONAL: dict[str, Callable[[nn.Module, int], Any]] = {
    "bitsandbytes AdamW8bit": _adamw8bit,
    "GaLore (authors')": _galore_authors,
    "COAP (authors')": _coap_authors,  # coap_torch.CoapAdamW at the COAP row's settings
    "Flora (authors')": _flora_authors,  # flora_opt.Flora at the Flora row's settings
    "CompAct (authors')": _compact_authors,  # CompAct's layers and SmallAdamW, the row's
    "small_fc_lopt (PyLO)": _small_fc_pylo,  # PyLO's pure-torch ports, the rows' shapes
    "VeLO (PyLO)": _velo_pylo,
    # POET-X's layers with their eager calls replayed from CUDA graphs (xopt.torch.poet_graphs)
    "POET-X fast graphs": _poet("fast", cuda_graphs=True),
    "POET-X mem graphs": _poet("mem", cuda_graphs=True),
}


#: the loop steps (0-based) that refresh, by phase within GAP: GaLore, PLUMAGE and COAP
#: decompose and CompAct redraws its projections in the update that starts a gap's
#: interval; POETAdamW merges and Flora resamples in the update that ends one; the others
#: never refresh. tests/test_bench.py checks this against the steps whose rarely-changing
#: state (projections, seeds, merged weights) changes.
REFRESH_PHASE: dict[str, int | None] = {
    "GaLore": 0, "COAP": 0, "COAP 8-bit": 0, "PLUMAGE": 0, "CompAct": 0,
    # the authors' projectors decompose (COAP's: or update; CompAct's: take a new seed)
    # when their step count is a multiple of the interval, as xopt's; Flora's Adafactor (no
    # momentum) never refreshes
    "GaLore (authors')": 0, "COAP (authors')": 0, "CompAct (authors')": 0,
    "Flora momentum": GAP - 1, "POET-X fast": GAP - 1, "POET-X mem": GAP - 1,
    "POET-XQ": GAP - 1, "POET-X fast graphs": GAP - 1, "POET-X mem graphs": GAP - 1,
}


def refreshes(name: str, k: int) -> bool:
    """Whether loop step ``k`` of method ``name`` is a refresh step (:data:`REFRESH_PHASE`)."""
    phase = REFRESH_PHASE.get(name)
    return phase is not None and k % GAP == phase


def _state_bytes(opt: Any) -> int:
    seen: set[int] = set()
    objects: set[int] = set()

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            if x.untyped_storage().data_ptr() in seen:
                return 0
            seen.add(x.untyped_storage().data_ptr())
            return x.untyped_storage().nbytes()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        # a state object's tensors (GaLore's own projector); never a module's parameters
        if hasattr(x, "__dict__") and not isinstance(x, nn.Module) and id(x) not in objects:
            objects.add(id(x))
            return walk(vars(x))
        return 0

    return walk(dict(opt.state))


class _Timer:
    """Elapsed milliseconds between two points: CUDA events on a GPU, the clock elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def run_method(name: str, size: str, device: torch.device, dtype: torch.dtype,
               compile_model: bool, batch: int | None = None,
               compile_mode: str | None = None, seq: int | None = None,
               accum: int = 1) -> dict[str, Any]:
    d, layers, heads, ff, vocab, size_seq, size_batch = SIZES[size]
    batch, seq = batch or size_batch, seq or size_seq
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: an 8B float32 copy on the host is slow
        model = Llama(d, layers, heads, ff, vocab, seq).to(dtype=dtype)
    steps = WARMUP + TIMED
    opt = {**METHODS, **OPTIONAL}[name](model, steps)
    fwd = torch.compile(model, mode=compile_mode) if compile_model else model
    # reduce-overhead's CUDA graphs: each micro-batch a new iteration (the last one's outputs,
    # read by then, may be overwritten)
    graphs = compile_model and compile_mode == "reduce-overhead"
    takes_loss = isinstance(opt, (xt.SmallFCLOpt, xt.VeLO)) or (
        isinstance(opt, _Wrapped) and opt.takes_loss)
    gen = torch.Generator(device=device).manual_seed(1)
    # the micro-batches of one step (the same ones every step)
    ids = torch.randint(0, vocab, (accum, batch, seq), device=device, generator=gen)
    timer = _Timer(cuda)
    fb, st, losses, refresh = [], [], [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for k in range(steps):
        t0 = timer.mark()
        loss = 0.0
        for micro in ids:
            if graphs:  # each micro-batch's forward and backward a new graph iteration
                torch.compiler.cudagraph_mark_step_begin()
            # each micro-batch's mean loss over the K: the accumulated gradient is the
            # whole step's mean (as without accumulation)
            part = fwd(micro) / accum if accum > 1 else fwd(micro)
            part.backward()
            loss = loss + part.detach()
        t1 = timer.mark()
        opt.step(loss=loss.detach()) if takes_loss else opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = timer.mark()
        if cuda:
            torch.cuda.synchronize()
        losses.append(float(loss.detach()))
        if k >= WARMUP:
            fb.append(timer.ms(t0, t1))
            st.append(timer.ms(t1, t2))
            refresh.append(refreshes(name, k))
    if not all(math.isfinite(v) for v in losses):
        raise FloatingPointError(f"{name}: non-finite loss {losses}")
    total = statistics.mean(a + b for a, b in zip(fb, st, strict=True))
    ordinary = [t for t, r in zip(st, refresh, strict=True) if not r]
    at_refresh = [t for t, r in zip(st, refresh, strict=True) if r]
    return {
        "step_ms_ordinary": statistics.median(ordinary),
        "step_ms_refresh": statistics.mean(at_refresh) if at_refresh else None,
        "fwd_bwd_ms": statistics.median(fb), "step_ms_median": statistics.median(st),
        "step_ms_max": max(st), "step_ms_mean": statistics.mean(st), "total_ms_mean": total,
        "tokens_per_s": accum * batch * seq / (total / 1e3),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "state_bytes": _state_bytes(opt),
        "param_count": sum(p.numel() for p in model.parameters()),
        "loss_first_last": [losses[0], losses[-1]],
    }


def _amortised_table(rows: dict[str, Any], k: int) -> None:
    """Each row's step averaged over a refresh interval of ``k`` (written into the rows)."""
    def amortised(r: dict[str, Any]) -> float:
        ref = r["step_ms_refresh"]
        ordinary = r["step_ms_ordinary"]
        return ordinary if ref is None else (ordinary * (k - 1) + ref) / k

    base = rows.get("torch.optim.AdamW(fused)", {})
    base_total = base["fwd_bwd_ms"] + amortised(base) if "step_ms_ordinary" in base else None
    print(f"\naveraged over a refresh interval of {k} steps\n{'method':26s} {'ordinary':>9s} "
          f"{'refresh':>9s} {'amortised':>9s} {'total':>9s} {'x total':>8s}")
    for name, r in rows.items():
        if "step_ms_ordinary" not in r:
            continue
        a = amortised(r)
        total = r["fwd_bwd_ms"] + a
        x = total / base_total if base_total else math.nan
        r[f"step_ms_amortised_{k}"], r[f"ratio_total_to_fused_adamw_{k}"] = a, x
        ref = r["step_ms_refresh"]
        print(f"{name:26s} {r['step_ms_ordinary']:9.2f} "
              f"{ref if ref is not None else math.nan:9.2f} {a:9.2f} {total:9.2f} {x:8.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--size", default="350m", choices=sorted(SIZES))
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (CI)")
    ap.add_argument("--methods", default="", help="comma-separated subset of the names")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    ap.add_argument("--compile-mode", default=None, metavar="MODE",
                    help="torch.compile's mode with --compile, e.g. reduce-overhead (default: "
                    "torch's default)")
    ap.add_argument("--refresh-interval", type=int, default=None, metavar="K",
                    help="also report the step averaged over a refresh interval of K steps")
    ap.add_argument("--tf32", action="store_true",
                    help="float32 matmuls in TF32 (torch.backends.cuda.matmul.allow_tf32)")
    ap.add_argument("--svd-driver", default=None,
                    choices=("gesvd", "gesvdj", "gesvda", "gram"),
                    help="the low-rank methods' svd_driver (default: torch.linalg.svd's)")
    ap.add_argument("--proj-dtype", default="state", choices=("state", "param"),
                    help="GaLore's, COAP's and PLUMAGE's proj_dtype ('param': the projections "
                    "in the parameters' dtype, as the authors' code)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the "
                    "size's)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the "
                    "size's)")
    ap.add_argument("--accum", type=int, default=1, metavar="K",
                    help="micro-batches whose gradients each optimizer step accumulates")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no method after this many seconds (each skipped one is listed)")
    args = ap.parse_args(argv)
    if args.compile_mode is not None:
        if not args.compile:
            ap.error(f"--compile-mode {args.compile_mode}: needs --compile")
        try:  # torch.compile checks its mode when called (before compiling anything)
            torch.compile(nn.Identity(), mode=args.compile_mode)
        except RuntimeError as e:
            ap.error(f"--compile-mode {args.compile_mode}: {e}")
    for flag, v in (("--accum", args.accum), ("--seq", args.seq), ("--batch", args.batch)):
        if v is not None and v < 1:
            ap.error(f"{flag} {v}: must be at least 1")
    if args.refresh_interval is not None and args.refresh_interval < 1:
        ap.error(f"--refresh-interval {args.refresh_interval}: must be at least 1")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    SVD_DRIVER["driver"] = args.svd_driver
    SVD_DRIVER["proj_dtype"] = args.proj_dtype
    start = time.monotonic()
    size = "tiny" if args.tiny else args.size
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    names = [n.strip() for n in args.methods.split(",") if n.strip()] or list(METHODS)
    unknown = sorted(set(names) - set(METHODS) - set(OPTIONAL))
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join([*METHODS, *OPTIONAL])}")
    # the reference every ratio divides by runs first
    names = ["torch.optim.AdamW(fused)", *[n for n in names if n != "torch.optim.AdamW(fused)"]]
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{dev_name}; {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; size {size} "
          f"{SIZES[size]}; batch {args.batch or SIZES[size][-1]} x "
          f"{args.seq or SIZES[size][-2]} tokens"
          f"{f' x {args.accum} micro-batches' if args.accum > 1 else ''}; {args.dtype}; "
          f"{'compiled' if args.compile else 'eager'}"
          f"{f' ({args.compile_mode})' if args.compile_mode else ''}{'; tf32' if args.tf32 else ''}"
          f"{f'; svd_driver {args.svd_driver}' if args.svd_driver else ''}"
          f"{f'; proj_dtype {args.proj_dtype}' if args.proj_dtype != 'state' else ''}",
          flush=True)
    rows: dict[str, Any] = {}
    for name in names:
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            rows[name] = {"skipped": "deadline"}
            continue
        try:
            rows[name] = run_method(name, size, device, dtype, args.compile, args.batch,
                                    args.compile_mode, args.seq, args.accum)
        except torch.OutOfMemoryError:
            rows[name] = {"error": "OOM"}
        except Exception as e:  # a method's failure is its row, not the end of the run
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {name}: {json.dumps(rows[name])[:400]}", flush=True)
    ref = rows.get("torch.optim.AdamW(fused)", {})
    print(f"\n{'method':26s} {'fwd+bwd ms':>10s} {'step med':>9s} {'step max':>9s} "
          f"{'step mean':>9s} {'x total':>8s} {'tok/s':>9s} {'peak GiB':>8s} {'state GiB':>9s} "
          f"{'x state':>7s}")
    for name, r in rows.items():
        if "total_ms_mean" not in r:
            print(f"{name:26s} {r.get('error') or r.get('skipped')}")
            continue
        rt = r["total_ms_mean"] / ref["total_ms_mean"] if "total_ms_mean" in ref else math.nan
        rs = (r["state_bytes"] / ref["state_bytes"]
              if ref.get("state_bytes") else math.nan)
        r["ratio_total_to_fused_adamw"], r["ratio_state_to_fused_adamw"] = rt, rs
        peak = r["peak_bytes"] / 2**30 if r["peak_bytes"] is not None else math.nan
        print(f"{name:26s} {r['fwd_bwd_ms']:10.2f} {r['step_ms_median']:9.2f} "
              f"{r['step_ms_max']:9.2f} {r['step_ms_mean']:9.2f} {rt:8.2f} "
              f"{r['tokens_per_s']:9.0f} {peak:8.2f} {r['state_bytes'] / 2**30:9.3f} {rs:7.2f}")
    k = args.refresh_interval
    if k is not None:
        _amortised_table(rows, k)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev_name, "date": time.strftime("%Y-%m-%d"), "size": size,
            "shape": SIZES[size], "batch": args.batch or SIZES[size][-1],
            "seq": args.seq or SIZES[size][-2], "accum": args.accum, "dtype": args.dtype,
            "compile": args.compile, "compile_mode": args.compile_mode, "argv": sys.argv,
            "warmup": WARMUP, "timed": TIMED,
            "refresh_interval": GAP, "amortised_over": k, "tf32": args.tf32,
            "svd_driver": args.svd_driver, "proj_dtype": args.proj_dtype}
    mode = f"_{args.compile_mode}" if args.compile_mode else ""
    name = f"train_step_{size}{f'_compiled{mode}' if args.compile else ''}.json"
    (out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all("total_ms_mean" in r or "skipped" in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
