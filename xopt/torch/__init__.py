"""PyTorch implementations: ``torch.optim.Optimizer`` subclasses and ``nn.Module`` layers.

Importing this package imports torch. Each name loads its module on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"AdamW": "xopt.torch.adamw", "SmallFCLOpt": "xopt.torch.small_fc_lopt",
            "VeLO": "xopt.torch.velo"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'xopt.torch' has no attribute {name!r}")
