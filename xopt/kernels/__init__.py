"""Triton kernels for xopt's hot paths (the documentation's "Kernels" page, docs/kernels.md).

Nothing here is imported by ``import xopt``; importing this package imports neither torch
nor triton. The modules load them on first use:

* :mod:`xopt.kernels.lopt_layout`: the tile layout shared by the learned-optimizer kernels
  (metadata tables describing every tensor of a model, so that one launch covers them all);
* :mod:`xopt.kernels.lopt_common`: the statistics passes (Adafactor row/column sums,
  deterministic segmented sums) both learned optimizers share;
* :mod:`xopt.kernels.lopt_graph`: a learned optimizer's step recorded into a CUDA graph;
* :mod:`xopt.kernels.small_fc_lopt`: small_fc_lopt's feature-statistics and fused update;
* :mod:`xopt.kernels.velo`: VeLO's, with its per-tensor LSTM batched in torch;
* :mod:`xopt.kernels.poet_cayley`: POET-X's Cayley–Neumann series and its backward;
* :mod:`xopt.kernels.poet_perm`: POET-X's permutations as row gathers and scatters;
* :mod:`xopt.kernels.quant8`: 8-bit COAP's moment step (dequantise, update, requantise);
* :mod:`xopt.kernels.adafactor`: Flora's Adafactor step on stacked matrices, three passes;
* :mod:`xopt.kernels.lowrank_adam`: GaLore's, COAP's and PLUMAGE's AdamW moments, one pass;
* :mod:`xopt.kernels.normal`: :func:`xopt.random.normal_many`'s bits in one launch (Flora's
  projections);
* :mod:`xopt.kernels.poet_adam`: POETAdamW's update of a parameter in one pass;
* :mod:`xopt.kernels.poet_jit`: POET-X's launches through the compiled kernel's launcher.

Each kernel module has a pure-PyTorch reference it is tested against (under
``TRITON_INTERPRET=1`` on the CPU); the plain path in :mod:`xopt.torch` is the reference
of record.

Environment variables (each read once, when the module that uses it is imported or, for
the CUDA graphs, when an optimizer's first Triton step builds its recorder):

| variable | default | other setting |
|---|---|---|
| ``XOPT_LOPT_CUDA_GRAPHS`` | ``1`` | ``0``: the learned optimizers' Triton step runs eagerly |
| ``XOPT_VELO_COMPILE_GLUE`` | ``1`` | ``0``: VeLO's LSTM glue runs eagerly, not compiled |
| ``XOPT_POET_CNP`` | ``bmm`` | ``fused``, ``triton``: POET-X's Cayley–Neumann backends |
| ``XOPT_QUANT8`` | ``auto`` | ``torch``, ``triton``: 8-bit COAP's fused moment step |
| ``XOPT_ADAFACTOR`` | ``auto`` | ``torch``, ``triton``: Flora's fused Adafactor passes |
| ``XOPT_NORMAL`` | ``auto`` | ``torch``, ``triton``: Flora's projections drawn by one kernel |
| ``XOPT_LOWRANK_ADAM`` | ``auto`` | ``torch``, ``triton``: the low-rank AdamW moments' pass |
| ``XOPT_POET_DIRECT_LAUNCH`` | ``1`` | ``0``: POET-X kernels always via ``JITFunction.run`` |
| ``XOPT_POET_FUSED_STEP`` | ``1`` | ``0``: POETAdamW's CUDA step as foreach calls |

``XOPT_LOPT_CUDA_GRAPHS=0`` is for profilers and debugging: every launch is then an
ordinary one, with the same bits. ``XOPT_VELO_COMPILE_GLUE=0`` skips ``torch.compile`` of
the ~90 small torch ops between VeLO's passes (the same numbers; a failed compilation
falls back to eager by itself, with a warning). ``XOPT_POET_CNP`` chooses how POET-X's
Cayley–Neumann series runs: cuBLAS batched products (``bmm``, the default: validated on a
GPU), ``fused`` (two launches each way; opt-in until ``bench/poet_layer.py --check`` has
run it on a GPU) or the fused Triton series (``triton``);
:data:`xopt.kernels.poet_cayley.BACKEND` is the same switch at run time.

Every other setting of the kernels (sub-tile sizes, warps, register caps, prefetching) is
a module constant with its reason beside it.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["FP_FUSION", "NO_FP_FUSION", "interpreting", "triton_available"]

#: launch option of every xopt kernel: float32 ``a·b + c`` contracted to one FMA, as the
#: kernels were written and tuned. Pinned because Triton 3.10 turns it off by default, which
#: would change the kernels' rounding and lengthen their loops.
FP_FUSION = {"enable_fp_fusion": True}

#: launch option of a kernel whose results must be another path's bytes (8-bit COAP's
#: codes): no contraction, every ``a·b`` and ``+ c`` rounded apart as torch's ops round them
NO_FP_FUSION = {"enable_fp_fusion": False}


def triton_available() -> bool:
    """Whether ``import triton`` would succeed (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
