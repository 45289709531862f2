"""The mutation suite without a GPU: the wb:checks blocks that declare the mutants and injections parse (and each
malformed one is one error line naming the file and line), every mutant applies to today's section text exactly
where it means to, and the mutated kernel still compiles (a mutant that failed to compile would be 'caught' for the
wrong reason). Running them and reading the verdicts needs a GPU: scripts/mutation_suite.py."""
from __future__ import annotations

import functools

import pytest

from workbench import paths, plan
from workbench.compiler.assemble import BuildOptions, assemble, read_source, section_path
from workbench.compiler.compile import compile_cubin
from workbench.check.mutants import DECLARED, FAMILY_MODELS, MUTANTS, Mutant, declared, for_model, parse
from workbench.errors import SourceError
from workbench.model.config import get_config

SMALL = """int f(int a) {
    return a + 1;
}
/* wb:checks
mutant plus-two: adds two
-    return a + 1;
+    return a + 2;

mutant spaced [expect=other stage, count=2, needs=qk_norm]: a value with spaces
-a
+b
+c

inject hangs [expect=hang, block=3, alone]: block 3 never returns
-    return a + 1;
*/
"""


def test_a_checks_block_round_trips():
    (k1, m1), (k2, m2), (k3, i3) = parse(SMALL, "lm_head", "t.cuh")
    assert (k1, k2, k3) == ("mutant", "mutant", "inject")
    assert m1 == dict(name="plus-two", section="lm_head", breaks="adds two", find="    return a + 1;",
                      replace="    return a + 2;", expect="lm_head")
    assert m2 == dict(name="spaced", section="lm_head", breaks="a value with spaces", find="a", replace="b\nc",
                      expect="other stage", count=2, needs="qk_norm")
    assert i3 == dict(name="hangs", section="lm_head", what="block 3 never returns", find="    return a + 1;",
                      replace="", expect="hang", block=3, alone=True)
    code, trailer = SMALL.split("/* wb:checks")
    assert Mutant(**m1).apply(SMALL) == code.replace("a + 1", "a + 2") + "/* wb:checks" + trailer
    assert Mutant(**m2).apply(SMALL) == code.replace("a", "b\nc") + "/* wb:checks" + trailer   # 'int' and 'a'


def test_the_text_to_find_is_counted_in_the_code_only():
    (_, m), _, _ = parse(SMALL, "lm_head", "t.cuh")
    assert SMALL.count(m["find"]) == 3                           # twice more in the block, which is a comment
    assert Mutant(**m).apply(SMALL).count("a + 2") == 2          # the code's, and the block's `+` line
    gone = SMALL.replace("return a + 1;\n}", "return a;\n}")
    with pytest.raises(ValueError, match="occurs 0 times"):
        Mutant(**m).apply(gone)
    assert parse("int x;\n", "lm_head", "t.cuh") == []        # no block, no entries


@pytest.mark.parametrize("text,line,why", [
    ("x\n/* wb:checks\nmutant a b: c\n-x\n*/\n", 3, "not an entry's header"),
    ("x\n/* wb:checks\nmutant a: c\n-x\n\nmutant a: d\n-x\n*/\n", 6, "the name is taken (at t.cuh:3)"),
    ("x\n/* wb:checks\nmutant a [colour=red]: c\n-x\n*/\n", 3, "unknown key 'colour'"),
    ("x\n/* wb:checks\nmutant a [count=2, count=3]: c\n-x\n*/\n", 3, "repeated key 'count'"),
    ("x\n/* wb:checks\nmutant a [count=two]: c\n-x\n*/\n", 3, "count=two is not a whole number"),
    ("x\n/* wb:checks\ninject a [expect=hang, alone=1]: c\n-x\n*/\n", 3, "alone is a flag"),
    ("x\n/* wb:checks\nmutant a [needs]: c\n-x\n*/\n", 3, "needs needs a value"),
    ("x\n/* wb:checks\nmutant a: c\n-x */\n*/\n", 4, "`*/` inside an entry"),
    ("x\n/* wb:checks\nmutant a: c\n x\n*/\n", 4, "not a `-` line"),
    ("x\n/* wb:checks\nmutant a: c\n+y\n-x\n*/\n", 5, "the `-` lines first"),
    ("x\n/* wb:checks\nmutant a: c\n+y\n*/\n", 3, "no `-` line"),
    ("x\n/* wb:checks\ninject a: c\n-x\n*/\n", 3, "expect= is required"),
    ("x\n/* wb:checks\nmutant a: c\n-x\n", 2, "no closing `*/`"),
    ("x\n/* wb:checks\nmutant a: c\n-x\n*/\nint y;\n", 6, "must end the file"),
])
def test_a_malformed_block_is_one_line_naming_the_file_and_line(text, line, why):
    with pytest.raises(SourceError) as e:
        parse(text, "lm_head", "t.cuh")
    assert str(e.value).startswith(f"t.cuh:{line}: ") and why in str(e.value) and "\n" not in str(e.value)


def test_a_library_files_mutant_names_its_stage():
    with pytest.raises(SourceError, match=r"^t.cuh:2: .*required in a library file"):
        parse("/* wb:checks\nmutant a: c\n-x\n*/\n", "matvec", "t.cuh", {})
    assert parse("/* wb:checks\nmutant a [expect=lm_head]: c\n-x\n*/\n", "matvec", "t.cuh")[0][1]["expect"] == \
        "lm_head"


def test_a_name_is_taken_across_files(tmp_path):
    import shutil
    shutil.copytree(paths.template_dir(), tmp_path / "k")
    lm = section_path("lm_head", kernels=tmp_path / "k")
    lm.write_text(lm.read_text().replace("mutant logits-last-row:", "mutant silu-1e-4:"))
    with pytest.raises(SourceError, match=r"^kernels/sections/lm_head.cuh:\d+: mutant silu-1e-4: the name is taken "
                                          r"\(at kernels/sections/gate_up_silu.cuh:\d+\)"):
        declared(tmp_path / "k")


@pytest.mark.parametrize("name", plan.FILES)
def test_every_kernel_file_parses(name):
    """Each file's block parses on its own; the shipped ones are what MUTANTS and INJECTIONS hold."""
    entries = parse(read_source(section_path(name)), name, name)
    assert entries == [e for e in DECLARED if e[1]["section"] == name]
    assert name not in plan.STAGE_NAMES or any(kind == "mutant" for kind, _ in entries), name


def test_the_checks_blocks_leave_the_machine_code_as_it_is():
    """The blocks are comments at the ends of their files: the kernel without them compiles to the same cubin."""
    def code(name):
        text = section_path(name).read_text()
        return text[:text.index("/* wb:checks")] if "/* wb:checks" in text else text
    cfg, opt = get_config("tiny"), BuildOptions(taps=True, fast_compile="min")
    bare = {name: code(name) for name in plan.FILES}
    assert bare != {name: section_path(name).read_text() for name in plan.FILES}
    assert compile_cubin(assemble(cfg, opt))[0] == compile_cubin(assemble(cfg, opt, overrides=bare))[0]


def test_the_suite_is_large_and_spread_over_every_stage():
    assert len(MUTANTS) >= 30
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    stages = {m.section for m in MUTANTS}
    assert set(plan.STAGE_NAMES) <= stages, set(plan.STAGE_NAMES) - stages
    for m in MUTANTS:
        assert m.section in plan.FILES and m.expect in plan.STAGE_NAMES, m.name


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_and_compiles(m):
    text = section_path(m.section).read_text()
    mutated = m.apply(text)
    assert mutated != text
    opt = BuildOptions(taps=True, fast_compile="min", sampler="full" if m.section == "sampling" else "greedy")
    cfg = get_config("tiny").with_(**({m.needs: True} if m.needs else {}))   # a family's code compiled in
    compile_cubin(assemble(cfg, opt, overrides={m.section: mutated}))


def test_each_familys_mutants_run_on_a_model_of_that_family():
    for m in MUTANTS:
        if m.needs:
            cfg = get_config(FAMILY_MODELS[m.needs])
            assert getattr(cfg, m.needs) and m in for_model(cfg), m.name
            assert m not in for_model(get_config("llama-3.2-1b")), m.name
        if m.not_with:                                 # compiled away there: not run on that family
            assert m not in for_model(get_config(FAMILY_MODELS[m.not_with])), m.name


@functools.lru_cache(maxsize=None)
def _section_ptx(model: str, section: str, listed: str, sampler: str, text: str) -> str:
    from workbench.compiler.compile import dump_section
    cfg = get_config(model).with_(max_seq=4352)
    opt = BuildOptions(fast_compile="min", sampler=sampler)
    return dump_section(assemble(cfg, opt, overrides={section: text}), "ptx", listed)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_a_mutant_changes_the_code_of_every_model_it_runs_on(m):
    """A mutant whose edit compiles to the same PTX would be scored missed for nothing (or hide a verifier gap):
    on each model it runs on (a Llama, and each family's preset), the mutated section's PTX differs."""
    listed = m.expect if m.section in plan.LIBRARY else m.section
    sampler = "full" if m.section == "sampling" else "greedy"
    text = section_path(m.section).read_text()
    for name in ("tiny", *FAMILY_MODELS.values()):
        if m in for_model(get_config(name)):
            assert (_section_ptx(name, m.section, listed, sampler, text)
                    != _section_ptx(name, m.section, listed, sampler, m.apply(text))), (m.name, name)
