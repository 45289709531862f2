"""gate_up_silu's epilogue in Python: silu(gate) · up for one row of the MLP, which gate_up_silu@numba.cuh calls
from lane 0 of the warp that reduced the row. numba-cuda compiles it to a device function with the C ABI."""
import math

from numba import float32

from workbench.compiler.numba_sections import export


@export("float(float, float)")
def wb_silu_mul(g, u):
    # float32 throughout: a bare 1.0 is a float64 and would make the result one
    return g / (float32(1.0) + math.exp(-g)) * u
