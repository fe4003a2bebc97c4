"""The exceptions xopt raises for bad input.

Every error names what is at fault (the parameter, field, key, file or shape), so a user
can fix the input without reading xopt's source. All derive from :class:`XoptError`; the
CLI turns them into exit code 2.
"""

from __future__ import annotations


class XoptError(Exception):
    """Base class of the errors xopt raises for bad input."""


class HyperparameterError(XoptError, ValueError):
    """A hyperparameter is unknown, of the wrong type, or outside its allowed range."""


class UnknownMethodError(XoptError, KeyError):
    """A method name is not in the specification registry."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class TraceError(XoptError, ValueError):
    """A trace file is missing, malformed, or disagrees with its manifest or the spec."""


class StateError(XoptError, ValueError):
    """Optimizer state is missing a key, has an extra key, or has the wrong shape or dtype."""


class GradientError(XoptError, ValueError):
    """A gradient cannot be used: sparse, complex, of another dtype or shape than its
    parameter (raised before any parameter or state changes; the message names it)."""


class NonFiniteError(XoptError, FloatingPointError):
    """A gradient (or a learned optimizer's loss) holds NaN or inf; raised only under
    ``nonfinite="raise"`` (:mod:`xopt.nonfinite`), before anything changes."""


class MetaParamsError(XoptError, ValueError):
    """Learned-optimizer weights (meta-parameters) have a missing, extra or misshaped key."""


class CheckpointError(XoptError, ValueError):
    """A checkpoint file or directory is missing, corrupt, in no known format, or holds a
    missing, extra or misshaped key; the message names the file (and the key)."""


class DecompositionError(XoptError, ArithmeticError):
    """An SVD or QR of a parameter's gradient did not converge or produced NaN/inf; the
    message names the parameter (the projection it would have refreshed is left as it was)."""
