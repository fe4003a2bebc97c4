"""Reading a torch optimizer's saved ``state_dict`` against the optimizer it is loaded into.

torch's ``Optimizer.load_state_dict`` casts floating-point state to each parameter's dtype,
which would round the float32 state xopt keeps for bfloat16/float16 parameters; xopt's
optimizers therefore restore the saved tensors themselves after torch's load, and need the
map from the saved parameter ids to this optimizer's parameters, checked first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from xopt.errors import StateError


def saved_param_map(optimizer: Any, state_dict: Mapping[str, Any]) -> dict[Any, Tensor]:
    """``{saved parameter id: parameter}`` of ``optimizer`` for ``state_dict``.

    Raises :class:`StateError` naming the optimizer when the saved param groups differ in
    number or size from the optimizer's (nothing is changed).
    """
    name = type(optimizer).__name__
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateError(f"{name}.load_state_dict: {len(saved_groups)} param groups saved, "
                         f"{len(optimizer.param_groups)} in this optimizer")
    id_map: dict[Any, Tensor] = {}
    for sg, g in zip(saved_groups, optimizer.param_groups, strict=True):
        if len(sg["params"]) != len(g["params"]):
            raise StateError(f"{name}.load_state_dict: a param group holds "
                             f"{len(sg['params'])} parameters saved, {len(g['params'])} here")
        id_map.update(zip(sg["params"], g["params"], strict=True))
    return id_map
