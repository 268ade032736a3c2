"""Arrays as the compiled kernels take them (control's and retrieval's
request rows' numba loops): contiguous,
of one dtype each, so numba compiles each kernel once and never mid-serving
(an int32 or a strided array would be a new signature). No copy when
already so."""

from __future__ import annotations

import numpy as np


def ints(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


def floats(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64)


def flags(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=bool)
