"""What an optimizer does when a gradient (or, for learned optimizers, the loss) is NaN or inf.

One policy, the same on both backends, chosen with ``nonfinite=`` when the optimizer is built:

``"ignore"`` (default)
    No check. The non-finite value flows through the arithmetic as in the original code
    (AdamW writes NaN into that parameter; a learned optimizer may spread it). Costs nothing.
``"raise"``
    Every gradient (and the loss) is checked before anything moves; a non-finite one raises
    :class:`xopt.errors.NonFiniteError` naming the tensor, and no parameter or state changes.
    This synchronises the device once per step (torch: a host read; JAX: it needs concrete
    values, so it is refused under ``jit``). ``check_finite=True`` is the older spelling.
``"skip"``
    No synchronisation. If any gradient of the step (or the loss) holds NaN or inf, the whole
    step is skipped: no parameter and no state array changes, except the step's skip counter
    (:data:`SKIP_COUNTER`), which counts skipped steps, as ``torch.amp.GradScaler`` and
    ``optax.apply_if_finite`` do. A skipped step does not advance the optimizer's step count,
    so the next finite step is computed exactly as if the skipped one had never been taken.
"""

from __future__ import annotations

from xopt.errors import HyperparameterError

MODES = ("ignore", "raise", "skip")

#: the state entry that counts skipped steps under ``nonfinite="skip"`` (an integer 0-d array;
#: in torch, one per parameter, so that DCP and FSDP2 see only per-parameter state)
SKIP_COUNTER = "nonfinite_skips"


def resolve(nonfinite: str | None, check_finite: bool | None, where: str) -> str:
    """The policy from the ``nonfinite=`` argument and the older ``check_finite=`` flag.

    ``where`` names the optimizer in the error raised for an unknown mode or a contradiction.
    """
    if nonfinite is None:
        return "raise" if check_finite else "ignore"
    if nonfinite not in MODES:
        raise HyperparameterError(
            f"{where}: nonfinite = {nonfinite!r}; expected one of {', '.join(map(repr, MODES))}")
    if check_finite and nonfinite != "raise":
        raise HyperparameterError(
            f"{where}: check_finite=True contradicts nonfinite={nonfinite!r} (check_finite=True "
            "is the older spelling of nonfinite='raise'; pass one of them)")
    return nonfinite
