"""The learned-optimizer weights (θ) that ship with xopt, for examples and tests.

These are *not* meta-trained optimizers: each is the θ of a golden trace, drawn with the
original code's initialiser (and, for small_fc_lopt, perturbed so that no bias is zero).
They make a learned optimizer runnable on a fresh install; for a trained VeLO or
small_fc_lopt, load a published checkpoint with ``from_pretrained``.

>>> theta, hyperparameters = bundled_meta_params("velo")
>>> opt = xopt.torch.VeLO(params, theta, num_training_steps=1000, **hyperparameters)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from xopt.errors import UnknownMethodError

_DATA = Path(__file__).resolve().parents[1] / "parity" / "data"

# method -> (file under xopt/parity/data, the hyperparameters θ's shapes and scale need)
_BUNDLED: dict[str, tuple[str, dict[str, Any]]] = {
    # learned_optimization's VeLO architecture at its initialisation (key 0)
    "velo": ("velo/meta/velo_key0.npz", {}),
    # AdafacMLPLOpt(hidden_size=32, step_mult=0.01) at its initialisation (key 0), perturbed
    "small_fc_lopt": ("small_fc_lopt/meta/h32_l2_key0_perturbed.npz",
                      {"hidden_size": 32, "hidden_layers": 2, "step_mult": 0.01}),
    # the same θ under μLO (its golden traces' θ: μLO's decay offsets, not its trained MLP)
    "mulo": ("mulo/meta/h32_l2_key0_perturbed.npz",
             {"hidden_size": 32, "hidden_layers": 2, "step_mult": 0.01}),
}


def bundled_methods() -> list[str]:
    """The methods with bundled θ."""
    return sorted(_BUNDLED)


def bundled_meta_params(method: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(θ, hyperparameters)`` of the θ bundled for ``method``.

    θ is a dict of float32 arrays in the original code's naming (every learned optimizer of
    xopt accepts it); ``hyperparameters`` are the constructor arguments that θ's shapes and
    scale were made for (pass them along: θ does not fit the defaults otherwise).
    """
    if method not in _BUNDLED:
        raise UnknownMethodError(
            f"no bundled meta-parameters for {method!r}; bundled: {', '.join(bundled_methods())}")
    file, hyperparameters = _BUNDLED[method]
    with np.load(_DATA / file) as data:
        theta = {k: np.asarray(data[k]) for k in data.files}
    return theta, dict(hyperparameters)
