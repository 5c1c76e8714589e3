"""Hypothesis strategies shared by the test modules (one place, STYLE §8)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

finite_f32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


def float_matrices(max_rows: int = 8, max_blocks: int = 4, block: int = 32):
    """[rows, blocks*32] float32 matrices with finite entries."""
    return st.tuples(st.integers(1, max_rows), st.integers(1, max_blocks)).flatmap(
        lambda rb: hnp.arrays(np.float32, (rb[0], rb[1] * block), elements=finite_f32)
    )
