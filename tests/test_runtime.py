"""The runtime's hold on the ABI's control fields (abi.CONTROL): each one filled, and a field it does not know
refused by name. The launch itself runs in tests/test_gpu.py."""
from __future__ import annotations

import pytest

from workbench import abi
from workbench.run import runtime


def test_every_control_field_is_filled_one_way():
    runtime._check_control()
    mapped = {name for name, _ in abi.MAPPED}
    for name, ctype in abi.CONTROL:
        ways = [name in runtime.SCALAR_CONTROL, name in mapped, name in runtime.DEVICE_CONTROL]
        # the where-words alone have two: the mapped block's, or the device's (where_in_device)
        assert sum(ways) == (2 if name == "where" else 1), name
        assert ctype.endswith("*") != ways[0], name


@pytest.mark.parametrize("field", [("flags2", "int*"), ("n_extra", "int"), ("scale", "float")])
def test_a_control_field_the_runtime_does_not_fill_is_refused_by_name(monkeypatch, field):
    monkeypatch.setattr(abi, "CONTROL", abi.CONTROL + (field,))
    with pytest.raises(RuntimeError, match=repr(field[0])):
        runtime._check_control()


def test_device_control_buffers_take_the_dtype_of_their_c_type():
    types = dict(abi.CONTROL)
    for name in runtime.DEVICE_CONTROL:
        assert runtime._dtype(name)().nbytes == {"int": 4, "u32": 4, "float": 4, "u64": 8}[
            types[name].removeprefix("const ").removesuffix("*")], name


def test_a_control_field_retyped_away_from_the_runtime_is_refused(monkeypatch):
    monkeypatch.setattr(abi, "CONTROL", tuple((n, "double*" if n == "timing" else t) for n, t in abi.CONTROL))
    with pytest.raises(RuntimeError, match="'timing'"):
        runtime._check_control()
