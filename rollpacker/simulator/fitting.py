"""Least squares with non-negative coefficients: the simulator's calibration and the pricing CPU
model fit per-token costs with it (light: numpy only, so rollpacker.pricing can import it)."""
from __future__ import annotations


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (a cost cannot be negative): the most negative
    column is dropped and the rest refitted, so the fitted rows' residuals still sum to zero
    (clipping alone would leave predicted sums biased). Also the pricing CPU model's fit."""
    import numpy as np

    a, b = np.array(rows, dtype=float), np.array(y, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(x) for x in coef]
