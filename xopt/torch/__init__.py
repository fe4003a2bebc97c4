"""PyTorch implementations: ``torch.optim.Optimizer`` subclasses and ``nn.Module`` layers.

Importing this package is cheap: it imports neither torch nor any method. Each name loads
its module, and with it torch, on first use (``from xopt.torch import AdamW``).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"AdamW": "xopt.torch.adamw", "SmallFCLOpt": "xopt.torch.small_fc_lopt",
            "CompActAdamW": "xopt.torch.compact", "CompActLinear": "xopt.torch.compact",
            "compact_model": "xopt.torch.compact",
            "COAP": "xopt.torch.coap",
            "Flora": "xopt.torch.flora",
            "VeLO": "xopt.torch.velo", "GaLore": "xopt.torch.galore",
            "POETLinear": "xopt.torch.poet", "POETAdamW": "xopt.torch.poet",
            "PLUMAGE": "xopt.torch.plumage",
            "MuLO": "xopt.torch.mulo", "mup_param_groups": "xopt.torch.mulo"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'xopt.torch' has no attribute {name!r}")
