"""Math shared by the section references (not a section: there is no _common.cuh)."""
import numpy as np

F32 = 4     # bytes of an fp32 activation
BF16 = 2    # bytes of a bf16 weight or KV-cache entry


def rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x²) + eps) * gain, in x's dtype (eps stays a Python float so it does not promote)."""
    return x * (1.0 / np.sqrt(np.mean(x * x) + float(eps))) * gain


def silu(a: np.ndarray) -> np.ndarray:
    """a·sigmoid(a). exp(-a) overflows to inf for very negative a, which correctly gives -0: not worth a warning."""
    with np.errstate(over="ignore"):
        return a / (1.0 + np.exp(-a))


def check_shape(name: str, a: np.ndarray, *shape: int):
    """numpy would broadcast or silently truncate many mismatches; the references refuse them by name."""
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape}")
