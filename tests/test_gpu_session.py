"""The editing loop on a real GPU (marked gpu: skipped without one): reload → verify every stage → time, a
deliberately wrong edit named by its first failing stage, a compile error that keeps the last good kernel running,
A/B comparison, and loop_benchmark on tiny. Sources are edited in a private copy of kernels/ (or in memory), so the
real section files are never touched. Seeds are printed so a failure can be replayed."""
from __future__ import annotations

import math
import shutil

import pytest
from conftest import fresh_seed

from workbench import paths
from workbench.compiler import assemble
from workbench.loop import benchmark, session

pytestmark = pytest.mark.gpu




@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    new = tmp_path_factory.mktemp("gpu_wb") / "kernels"
    shutil.copytree(paths.kernels_dir(), new, ignore=shutil.ignore_patterns(".history", "__pycache__", "*.pyc"))
    mp.setattr(paths, "_override", new.resolve())
    yield new
    mp.undo()


@pytest.fixture(scope="module")
def wb(kernels):
    w = session.Workbench("tiny", seed=fresh_seed(), activate=False)
    yield w
    w.close()


def test_initial_reload_verifies_and_times(wb):
    rec = wb.history[0]
    print(rec.report())
    print(rec.stages)
    print(rec.timing_text)
    assert wb.device == "gpu" and rec.trigger == "initial"
    assert rec.status == session.OK and rec.passed, rec.report() + "\n" + str(rec.stages)
    assert rec.stages.passed and rec.tokens_ok is not False and rec.end_to_end
    assert max(rec.stages.positions) >= 4096                     # the loop covers the long-position path too
    assert rec.tok_per_s > 0 and rec.timing and {r.stage for r in rec.timing} >= {"lm_head", "gate_up_silu+down_residual"}
    for t in (rec.compile_s, rec.verify_s, rec.time_s, rec.total_s):
        assert math.isfinite(t) and t > 0
    assert rec.total_s >= rec.compile_s + rec.verify_s + rec.time_s - 1e-3
    assert rec.resources["registers"] > 0


def test_edit_reload_undo(wb):
    text = session.section_file("lm_head").read_text()
    wb.edit("lm_head", text + "\n// a harmless edit\n")
    rec = wb.reload(trigger="edit", section="lm_head")
    assert rec.status == session.OK and rec.passed and rec.key != wb.history[0].key
    rec = wb.undo("lm_head")
    assert rec.status == session.OK and rec.key == wb.history[0].key
    assert session.section_file("lm_head").read_text() == text


def test_wrong_rope_variant_is_named_q_at_layer_0(wb):
    base = session.section_file("qkv_rope_append").read_text()
    wb.edit("qkv_rope_append", benchmark.wrong_rope(base), variant="wrong_sin")
    try:
        rec = wb.use_variant("qkv_rope_append", "wrong_sin")
        print(rec.report())
        print(rec.stages)
        assert rec.status == session.VERIFY_FAILED and rec.passed is False
        assert rec.failure.where == ("qkv_rope_append", 0) and rec.failure.buffer == "q"
        assert rec.first_failure.startswith("qkv_rope_append: q at layer 0")
        # stage-local: only the wrong stage fails; attention is checked on the wrong q and passes
        assert not rec.stages.cells["qkv_rope_append", "k_cache", 0].passed
        assert rec.stages.cells["attention_decode", "o", 0].passed
    finally:
        rec = wb.use_variant("qkv_rope_append", None)
    assert rec.status == session.OK and rec.passed


def test_wrong_rope_override_in_memory(wb):
    wb.overrides["qkv_rope_append"] = benchmark.wrong_rope(session.section_file("qkv_rope_append").read_text())
    try:
        rec = wb.reload()
        assert rec.failure is not None and rec.failure.where == ("qkv_rope_append", 0), rec.report()
    finally:
        wb.overrides.clear()
    assert wb.reload().passed


def test_compile_error_keeps_the_last_good_kernel(wb):
    good_key = wb.backend.key("debug")
    text = session.section_file("down_residual").read_text().rstrip("\n") + "\n"
    line = len(text.splitlines()) + 1
    wb.overrides["down_residual"] = text + "__device__ void wb_broken() { float y = nonsense; }\n"
    try:
        rec = wb.reload()
        print(rec.report())
        assert rec.status == session.COMPILE_ERROR and f"kernels/sections/down_residual.cuh:{line}:" in rec.error
        assert "nonsense" in rec.error
        assert wb.backend.key("debug") == good_key                 # the last good kernels stay loaded ...
        v = wb.verify()                                            # ... and runnable
        assert v.passed, v.first_failure
        tm = wb.time_run(steps=8)
        assert len(tm.tokens) == 8 and tm.rows
    finally:
        wb.overrides.clear()
    assert wb.reload().status == session.OK


def test_the_verdict_comes_while_the_timed_build_compiles(wb):
    """The pipelined round in the GPU worker: the verification build is verified while the timed build compiles in
    the worker's background; both end up holding the edit, and a timed-only compile error puts both back."""
    text = session.section_file("lm_head").read_text()
    verdicts = []
    wb.on_verdict.append(verdicts.append)
    try:
        wb.overrides["lm_head"] = text + "\n// pipelined edit\n"
        rec = wb.reload(trigger="edit", section="lm_head")
        print(rec.report())
        assert verdicts == [rec] and rec.status == session.OK and rec.passed
        assert math.isfinite(rec.timed_compile_s) and rec.compile_s < rec.verdict_s < rec.total_s
        assert wb.backend.info["timed"][2]["lm_head"] == wb.overrides["lm_head"]
        good = {n: v[0] for n, v in wb.backend.info.items()}
        wb.overrides["lm_head"] = text + "\n#if WB_TIMING\n__device__ void f() { undeclared_in_timed += 1; }\n#endif\n"
        rec = wb.reload(trigger="edit", section="lm_head")
        print(rec.report())
        assert rec.status == session.COMPILE_ERROR and "timed build did not compile" in rec.error
        assert {n: v[0] for n, v in wb.backend.info.items()} == good
        assert wb.verify().passed                                  # the good kernels stay loaded and runnable
    finally:
        wb.on_verdict.remove(verdicts.append)
        wb.overrides.clear()
    assert wb.reload().status == session.OK


def test_time_to_first_token_is_reported_apart_from_decode(wb):
    """Workbench.time_to_first_token: the batched prefill into the timed build's cache and its first token (or the
    kernel's first step), run in the worker, apart from decode tok/s, with the prefill's time by stage; a prompt
    longer than the context is refused in one line, and the loop goes on."""
    by_prefill = wb.time_to_first_token(1500, repeats=2)
    print(by_prefill)
    assert by_prefill.first == "prefill" and by_prefill.first_step == {} and len(by_prefill.runs) == 2
    # the whole prompt's stages and the token ones: the prefill's last logits choose the first token
    assert {"qkv_rope_append", "attention_decode", "lm_head", "sampling"} <= set(by_prefill.stages)
    assert 0 < by_prefill.prefill_ms <= max(by_prefill.runs)
    ft = wb.time_to_first_token(1500, repeats=2, first="kernel")
    print(ft)
    assert ft.prompt == 1500 and ft.ms > 0 and ft.prefill_ms > 0 and len(ft.runs) == 2 and ft.first == "kernel"
    # the prefill's stages but the token ones: the kernel's first step computes the first token
    assert {"qkv_rope_append", "attention_decode"} <= set(ft.stages) and "lm_head" not in ft.stages
    assert all(v > 0 for v in ft.stages.values())
    # the first step's split: its parts are positive and add up to less than it, and it is what the time to first
    # token has beyond the prefill
    fs = ft.first_step
    assert fs["host prepare"] > 0 and fs["kernel"] > 0 and fs["rest"] >= 0, fs
    assert fs["host prepare"] + fs["kernel"] <= fs["first step"] < ft.ms, (fs, ft.runs)
    # the host's marks in their order, each after the last, and the call inside the step
    assert 0 < fs["checks"] < fs["host prepare"] and fs["status read"] >= 0 and fs["outside the call"] >= 0, fs
    with pytest.raises(ValueError, match="from 2"):
        wb.time_to_first_token(wb.cfg.max_seq + 1)
    rec = wb.reload(trigger="manual")
    assert rec.passed, rec.report()


def test_compare_variants(wb):
    base = session.section_file("qkv_rope_append").read_text()
    wb.edit("qkv_rope_append", benchmark.wrong_rope(base), variant="wrong_ab")
    ab = wb.compare({}, {"qkv_rope_append": "wrong_ab"}, tokens=32, repeats=2)
    print(ab.report())
    assert ab.a_passed is True and ab.b_passed is False and ab.b_failure.startswith("qkv_rope_append: q at layer 0")
    assert ab.a_tok_s > 0 and ab.b_tok_s > 0 and len(ab.a_runs) == 2 and ab.stage_deltas()
    ab.to_dict()
    assert wb.reload().passed                                       # the workbench's own builds are untouched


def test_records_reach_subscribers(wb):
    seen = []
    wb.on_record.append(seen.append)
    try:
        rec = wb.reload()
    finally:
        wb.on_record.remove(seen.append)
    assert seen == [rec]
    d = rec.to_dict()
    assert d["stages"]["passed"] and d["timing"] and d["tok_per_s"] > 0


@pytest.mark.parametrize("name", ["spin-on-flag", "illegal-address"])
def test_a_hang_or_a_fault_is_reported_and_the_loop_lives_on(wb, name):
    """The GPU runs in a worker process: a section that spins forever (outside any barrier, so the kernel's own
    timeouts never fire) or writes through a null pointer is reported by its kind within 5 s, with the block that
    stopped inside its stage named, the worker replaced with the last good kernels, and the next reload passes."""
    from workbench.check.failures import by_name
    inj = by_name(name)
    path = session.section_file(inj.section)
    original = path.read_text()
    wb.edit(inj.section, inj.apply(original))
    try:
        rec = wb.reload(trigger="edit", section=inj.section)
    finally:
        wb.undo(inj.section, reload=False)
    print(rec.report())
    assert path.read_text() == original
    assert rec.status == inj.expect and not rec.passed, rec.report()
    assert rec.detect_s is not None and rec.detect_s < 5, rec.report()
    assert inj.named(rec), rec.block_table()
    nxt = wb.reload(trigger="undo", section=inj.section)
    assert nxt.passed, nxt.report()
    assert wb.backend.restart_s is not None and wb.backend.restart_s < 10


def test_loop_benchmark_restores_files(kernels):
    before = {p: p.read_bytes() for p in kernels.rglob("*.cuh")}
    out = benchmark.loop_benchmark("tiny", edits=2, overhead_tokens=64, overhead_repeats=2, seed=fresh_seed(),
                                   fast_compile_levels=("max",), level_edits=1, whole=True)
    print({k: v for k, v in out.items() if k not in ("stages_text", "timing_text", "edit_runs")})
    assert out["files_restored"]
    assert {p: p.read_bytes() for p in kernels.rglob("*.cuh")} == before
    assert out["edit"]["all_passed"] and out["initial"]["passed"]
    assert 0 < out["edit"]["edit_to_verdict_s"] < out["edit"]["edit_to_record_s"]
    assert out["verify_fast_compile"]["levels"]["max"]["all_passed"]
    assert out["verify_fast_compile"]["kept"] == "min"
    # the default edits were in units (a whole build where nvJitLink is missing); the whole build verified too
    assert out["verify_fast_compile"]["levels"]["whole"]["all_passed"]
    assert out["wrong_edit"]["caught_as_q_layer0"], out["wrong_edit"]
    assert out["overhead"]["plain_tok_s"] > 0
