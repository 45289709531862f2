"""The failure-injection suite without a GPU: every injected edit applies where it means to, and each compiles
(the ones meant to fail at run time) or fails to compile with a message naming the file (the one that asks for
more shared memory than a block can have). The compiler hang is not compiled here: that is what it is for."""
from __future__ import annotations

import pytest

from workbench.build.assemble import BuildOptions, assemble, section_path
from workbench.build.compile import CompileError, compile_cubin
from workbench import plan
from workbench.check import failures as suite
from workbench.model.config import get_config


def test_at_least_eight_kinds():
    assert len(suite.INJECTIONS) >= 8
    assert {i.section for i in suite.INJECTIONS} <= set(plan.FILES)
    assert {"hang", "fault", "compile error", "compiler hang or crash"} <= {i.expect for i in suite.INJECTIONS}


@pytest.mark.parametrize("inj", [i for i in suite.INJECTIONS if i.name != "compiler-hangs"], ids=lambda i: i.name)
def test_each_injection_applies_and_builds_as_meant(inj):
    mutated = inj.apply(section_path(inj.section).read_text())
    asm = assemble(get_config("tiny"), BuildOptions(taps=True, fast_compile="min", sampler="greedy"),
                   overrides={inj.section: mutated})
    if inj.expect == "compile error":
        with pytest.raises(CompileError) as e:
            compile_cubin(asm)
        assert "shared" in str(e.value).lower()
    else:
        compile_cubin(asm)
