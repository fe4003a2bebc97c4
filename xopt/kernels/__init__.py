"""Triton kernels for xopt's hot paths (see DESIGN.md, "Kernels").

Nothing here is imported by ``import xopt``; importing this package imports neither torch
nor triton. The modules load them on first use:

* :mod:`xopt.kernels.lopt_layout`: the tile layout shared by the learned-optimizer kernels
  (metadata tables describing every tensor of a model, so that one launch covers them all);
* :mod:`xopt.kernels.lopt_common`: the statistics passes (Adafactor row/column sums,
  deterministic segmented sums) both learned optimizers share;
* :mod:`xopt.kernels.small_fc_lopt`: small_fc_lopt's feature-statistics and fused update;
* :mod:`xopt.kernels.velo`: VeLO's, with its per-tensor LSTM batched in torch.

Each kernel module has a pure-PyTorch reference (``reference_step``) it is tested against;
the plain path in :mod:`xopt.torch` is the reference of record.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["FP_FUSION", "interpreting", "triton_available"]

#: launch option of every xopt kernel: float32 ``a·b + c`` contracted to one FMA, as the
#: kernels were written, measured and tuned (Triton's default through 3.9; Triton 3.9 warns
#: that 3.10 will turn it off by default, which would change the kernels' rounding and add
#: instructions to their loops: small_fc_lopt's folded fused kernel compiled for sm_90a
#: without it has 779 loop instructions instead of 743 and no FFMA, triton 3.9,
#: ``python bench/sm90_compile.py --no-fp-fusion``)
FP_FUSION = {"enable_fp_fusion": True}


def triton_available() -> bool:
    """Whether ``import triton`` would succeed (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
