"""How far optax's float32 bias correction 1 − βᵗ is from the exact value.

    python tools/bias_correction_error.py

For each β it evaluates 1 − βᵗ as optax does (``1 - beta**count`` under ``jax.jit``: β and
the power in float32) for t = 1..100 and prints the largest relative error against the
double-precision value torch.optim uses (``1 - beta**t`` with the Python float β), the step
t where it occurs, and the resulting relative change of the Adam step through √v̂ (about
half of it, for β₂). Needs jax; it reads nothing of xopt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

counts = np.arange(1, 101, dtype=np.int32)
print(f"jax {jax.__version__} on {jax.default_backend()}")
print(f"{'beta':>8}  {'max rel err of 1-beta^t':>24}  {'at t':>5}  {'on the step via sqrt':>20}")
for beta in (0.9, 0.99, 0.999, 0.9999):
    f32 = np.asarray(jax.jit(lambda c, b=beta: 1 - b**c)(jnp.asarray(counts)), np.float64)
    exact = 1 - beta ** counts.astype(np.float64)
    rel = np.abs(f32 - exact) / exact
    i = int(rel.argmax())
    step = abs(1 / np.sqrt(f32[i] / exact[i]) - 1)
    print(f"{beta:>8}  {rel[i]:>24.2e}  {counts[i]:>5}  {step:>20.2e}")
