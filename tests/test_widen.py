"""bf16 weights widened in one pass (workbench/model/widen.py): the numba loops and the numpy passes give the bits the
plain numpy expressions give, for every bf16 value (signed zeros, subnormals, infinities, quiet and signalling NaNs),
any row order and shapes that are no multiple of the transpose's tile; the reference's weight view, and a
forward pass through it, are the same bits whichever engine widened them."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.model import widen
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights, to_f32
from workbench.reference import PreparedView, forward

ENGINES = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(not widen.numba_available(),
                                                                   reason="numba (the dev extra)"))]
SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
                    0x7F81, 0xFF81, 0x7FFF, 0x3F80, 0xBF80], np.uint16)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _plain(a, dtype):
    with np.errstate(invalid="ignore"):                  # a signalling NaN's cast says so
        return to_f32(a).astype(dtype)


def _matrix(shape, seed=0) -> np.ndarray:
    a = np.random.default_rng(seed).integers(0, 1 << 16, shape, dtype=np.uint16)
    n = min(a.size, SPECIAL.size)
    a.reshape(-1)[:n] = SPECIAL[:n]
    return a


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(130, 70), (64, 64), (1, 3), (257, 129)])
def test_every_engine_gives_the_plain_expressions_bits(engine, dtype, shape):
    a = _matrix(shape)
    order = np.random.default_rng(1).permutation(shape[0])
    for index in (None, order, order[: max(1, shape[0] // 3)], np.zeros(2, np.int64)):
        got = widen.rows(a, index, dtype, engine=engine)
        want = _plain(a, dtype) if index is None else _plain(a, dtype)[index]
        assert got.dtype == dtype and got.flags.c_contiguous
        np.testing.assert_array_equal(_bits(got), _bits(want))
    got = widen.transposed(a, dtype, engine=engine)
    assert got.shape == shape[::-1] and got.flags.c_contiguous
    np.testing.assert_array_equal(_bits(got), _bits(np.ascontiguousarray(_plain(a, dtype).T)))


def test_every_bf16_value_widens_as_numpys_cast():
    """The 65,536 bf16 values, fp64 through the lookup table and fp32 through the shift: numpy's own cast's bits."""
    a = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    for dtype in (np.float32, np.float64):
        for engine in ("numpy", "numba") if widen.numba_available() else ("numpy",):
            np.testing.assert_array_equal(_bits(widen.rows(a, None, dtype, engine=engine)), _bits(_plain(a, dtype)))


def test_floats_and_bad_engines():
    f = np.random.default_rng(2).standard_normal((5, 4))                  # weights already in floats: as before
    np.testing.assert_array_equal(widen.rows(f, [4, 0], np.float64), f.astype(np.float32).astype(np.float64)[[4, 0]])
    np.testing.assert_array_equal(widen.transposed(f, np.float32), f.astype(np.float32).T)
    with pytest.raises(ValueError, match="engine 'fast'"):
        widen.rows(_matrix((2, 2)), engine="fast")
    with pytest.raises(TypeError, match="bf16 bits"):
        widen.rows(f, engine="numba")


@pytest.fixture(scope="module")
def tiny_p():
    return prepare(random_weights(get_config("tiny"), seed=5, progress=False), progress=False)


@pytest.mark.skipif(not widen.numba_available(), reason="numba (the dev extra)")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_weight_view_and_a_forward_pass_are_the_same_bits_with_numba(tiny_p, dtype, monkeypatch):
    """The tiny preset's layers are below the size numba is used for on its own; here it is made to widen them."""
    names = ("wq", "wk", "wv", "wo", "wg", "wu", "wd")
    plain = PreparedView(tiny_p, dtype)
    want = {(n, layer): plain.layer(n, layer).copy() for layer in range(tiny_p.cfg.n_layers) for n in names}
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = forward(PreparedView(tiny_p, dtype), tokens, dtype=dtype)
    monkeypatch.setattr(widen, "NUMBA_MIN_ELEMENTS", 0)
    jitted = PreparedView(tiny_p, dtype)
    for (n, layer), w in want.items():
        got = jitted.layer(n, layer)
        assert got.shape == w.shape and got.flags.c_contiguous == w.flags.c_contiguous
        np.testing.assert_array_equal(_bits(np.ascontiguousarray(got)), _bits(np.ascontiguousarray(w)))
    np.testing.assert_array_equal(_bits(forward(PreparedView(tiny_p, dtype), tokens, dtype=dtype)), _bits(logits))


def test_without_numba_numpy_widens_and_numba_asked_for_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "numba", None)                    # as if it were not installed
    monkeypatch.setattr(widen, "NUMBA_MIN_ELEMENTS", 0)                # even where numba would be used
    a = _matrix((70, 130))
    assert not widen.numba_available()
    np.testing.assert_array_equal(_bits(widen.transposed(a, np.float64)),
                                  _bits(np.ascontiguousarray(_plain(a, np.float64).T)))
    with pytest.raises(ImportError, match="pip install numba"):
        widen.rows(a, engine="numba")
