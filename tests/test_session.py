"""The editing loop without a GPU: section files written atomically with history and undo, the %%section magic,
the compile-error path through a CPU-mode Workbench (NVRTC to cubin), the file watcher, and the stage-by-stage
comparison of taps (workbench.taps) on synthetic data from the reference.

Every test that writes kernel sources works on a copy of kernels/ (the assemble module's folder constants are
pointed at it), so the real section files are never touched."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from workbench import paths
from workbench.compiler import assemble
from workbench.loop import session
from workbench.model.config import get_config


def copy_kernels(dest: Path, mp: pytest.MonkeyPatch) -> Path:
    """A copy of kernels/ (sources only) that assembly, history and the watcher use instead of the real one."""
    new = dest / "kernels"
    shutil.copytree(paths.kernels_dir(), new, ignore=shutil.ignore_patterns(".history", "__pycache__", "*.pyc"))
    mp.setattr(paths, "_override", new.resolve())
    return new


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_ACTIVE", None)
    return copy_kernels(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def cpu_wb(tmp_path_factory):
    """One CPU-mode Workbench on tiny over a private kernels copy, shared by the module (compiling costs seconds);
    tests put back what they change."""
    mp = pytest.MonkeyPatch()
    try:
        copy_kernels(tmp_path_factory.mktemp("wb"), mp)
        mp.setattr(session, "_ACTIVE", None)
        wb = session.Workbench("tiny", device="cpu")
        assert session.active() is wb
        yield wb
        wb.close()
    finally:
        mp.undo()


def bad_down_residual() -> tuple[str, int]:
    """down_residual.cuh with a line that cannot compile appended (whatever the file holds today), and its line."""
    text = assemble.section_path("down_residual").read_text().rstrip("\n") + "\n"
    line = len(text.splitlines()) + 1
    return text + "__device__ void wb_broken() { undeclared_thing += 1; }\n", line


# ---- section files ------------------------------------------------------------------------------------------------

def test_write_is_atomic_and_undo_walks_back(kernels):
    path = kernels / "sections" / "lm_head.cuh"
    v0 = path.read_text()
    mode = path.stat().st_mode
    e1 = session.write_section("lm_head", v0 + "// one\n")
    e2 = session.write_section("lm_head", v0 + "// two\n")
    assert path.read_text() == v0 + "// two\n" and path.stat().st_mode == mode
    assert e1.read_text() == v0 and e2.read_text() == v0 + "// one\n"
    assert e1.parent == kernels / ".history" / "lm_head" and e1.name < e2.name
    assert session.write_section("lm_head", v0 + "// two\n") is None          # unchanged: no write, no entry
    assert session.section_history("lm_head") == [e1, e2]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]    # no temporary files left

    session.undo_section("lm_head")
    assert path.read_text() == v0 + "// one\n"
    session.undo_section("lm_head")
    assert path.read_text() == v0
    with pytest.raises(LookupError, match="no earlier version"):
        session.undo_section("lm_head")
    undone = sorted(p.read_text() for p in (kernels / ".history" / "lm_head").glob("*.undone.cuh"))
    assert undone == sorted([v0 + "// one\n", v0 + "// two\n"])                # undo loses nothing either


def test_new_variant_is_removed_by_undo(kernels):
    path = kernels / "lib" / "matvec@wide.cuh"                          # a library file: its variant beside it
    session.write_section("matvec", "// a variant\n", variant="wide")
    assert path.read_text() == "// a variant\n"
    assert [p.suffix for p in session.section_history("matvec", "wide")] == [".absent"]
    session.undo_section("matvec", "wide")
    assert not path.exists()


def test_failed_write_keeps_the_old_file(kernels, monkeypatch):
    path = kernels / "sections" / "sampling.cuh"
    before = path.read_text()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        session.write_section("sampling", "// lost?\n")
    assert path.read_text() == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    assert session.section_history("sampling") == []


def test_names_are_checked(kernels):
    with pytest.raises(ValueError, match="unknown section"):
        session.section_file("lm_heads")
    with pytest.raises(ValueError, match="variant names"):
        session.section_file("lm_head", "../../etc")
    with pytest.raises(ValueError, match="no variants"):
        session.section_file("monokernel", "x")
    assert session.section_file("monokernel") == kernels / "monokernel.cuh"


# ---- the magic ----------------------------------------------------------------------------------------------------

@pytest.fixture
def shell():
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")
    return sh


def test_magics_are_registered(shell):
    assert "section" in shell.magics_manager.magics["cell"]
    assert "wb_undo" in shell.magics_manager.magics["line"]


def test_section_magic_writes_without_a_workbench(kernels, shell, capsys):
    path = kernels / "sections" / "embedding.cuh"
    before = path.read_text()
    shell.run_cell_magic("section", "embedding", before + "// from a cell\n")
    out = capsys.readouterr().out
    assert path.read_text() == before + "// from a cell\n"
    assert "wrote kernels/sections/embedding.cuh" in out
    assert "no active Workbench" in out and 'Workbench("llama-3.2-1b")' in out
    shell.run_line_magic("wb_undo", "embedding")
    assert path.read_text() == before
    shell.run_cell_magic("section", "embedding --variant v2 --no-reload", "// v2\n")
    assert (kernels / "sections" / "embedding@v2.cuh").read_text() == "// v2\n"


def test_section_magic_refuses_bad_arguments(kernels, shell, capsys):
    shell.run_cell_magic("section", "no_such_section", "text\n")
    shell.run_cell_magic("section", "", "text\n")
    shell.run_cell_magic("section", "lm_head --bogus", "text\n")
    out = capsys.readouterr().out
    assert out.count("nothing was written") == 3 and "unknown section" in out and "Traceback" not in out


def test_section_magic_failed_write_says_so(kernels, shell, capsys, monkeypatch):
    path = kernels / "sections" / "lm_head.cuh"
    before = path.read_text()
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    shell.run_cell_magic("section", "lm_head", "// my precious edit\n")
    out = capsys.readouterr().out
    assert "could not write kernels/sections/lm_head.cuh" in out and "Permission denied" in out
    assert "unchanged" in out and "still in this cell" in out and "Traceback" not in out
    assert path.read_text() == before


# ---- a CPU-mode workbench: compile errors, the last good build, the watcher ----------------------------------------

def test_cpu_workbench_compiles_and_runs_the_reference(cpu_wb):
    rec = cpu_wb.history[0]
    assert rec.trigger == "initial" and rec.status == session.NO_GPU and rec.ok
    assert rec.resources["registers"] > 0 and rec.compile_s > 0
    cubins = cpu_wb.backend.cubins
    assert set(cubins) == {"debug", "timed"}
    assert cubins["debug"][0] != cubins["timed"][0]                    # two builds: taps, timing
    taps = cpu_wb.backend.last_reference
    assert ("qkv_rope_append", "q", 1) in taps and ("lm_head", "logits", -1) in taps
    json.dumps(rec.to_dict())
    # nothing ran on a GPU, so the record claims no verification: no tick
    assert "not verified" in rec.report() and "✓" not in rec.report() and rec.passed is None


def test_time_to_first_token_needs_a_gpu(cpu_wb):
    """Without a GPU there is no timed kernel to prefill into: nothing is claimed."""
    assert cpu_wb.time_to_first_token(64) is None


def test_compile_error_through_the_magic_keeps_the_last_good_build(cpu_wb, shell, capsys):
    good = dict(cpu_wb.backend.cubins)
    seen = []
    cpu_wb.on_record.append(seen.append)
    try:
        bad, line = bad_down_residual()
        shell.run_cell_magic("section", "down_residual", bad)
        out = capsys.readouterr().out
        rec = cpu_wb.last
        assert rec.status == session.COMPILE_ERROR and rec.trigger == "magic" and rec.section == "down_residual"
        assert seen == [rec]
        assert f"kernels/sections/down_residual.cuh:{line}:" in out and "undeclared_thing" in out
        assert "last good kernel stays" in out and "Traceback" not in out
        assert any(m[0] == "kernels/sections/down_residual.cuh" and m[1] == line for m in rec.messages)
        assert cpu_wb.backend.cubins == good                               # nothing replaced the good build
        assert session.section_file("down_residual").read_text() == bad    # the text is on disk, not lost

        shell.run_line_magic("wb_undo", "down_residual")
        out = capsys.readouterr().out
        assert cpu_wb.last.status == session.NO_GPU and cpu_wb.last.trigger == "undo"
        assert "not verified" in out and cpu_wb.backend.cubins["debug"][0] == good["debug"][0]
    finally:
        cpu_wb.on_record.remove(seen.append)


def test_the_verdict_does_not_wait_for_the_timed_build(cpu_wb):
    """The timed build compiles in the background while the verification build is checked (here: the CPU
    reference, tiny being small): the verdict is told before that compile is waited for, and the record still ends
    with the timed build in place."""
    assert cpu_wb.pipeline and cpu_wb.backend.cpu_reference
    order = []

    def at_verdict(rec):
        order.append(("verdict", cpu_wb.backend._deferred is not None, rec.timed_compile_s, rec.verdict_s))
    finish = cpu_wb.backend.finish

    def finishing():
        order.append(("finish",))
        return finish()
    cpu_wb.on_verdict.append(at_verdict)
    cpu_wb.on_record.append(lambda rec: order.append(("record",)))
    cpu_wb.backend.finish = finishing
    try:
        rec = cpu_wb.reload(trigger="edit", section="lm_head")
    finally:
        del cpu_wb.backend.finish
        cpu_wb.on_verdict.remove(at_verdict)
        cpu_wb.on_record.pop()
    assert [o[0] for o in order] == ["verdict", "finish", "record"]
    _, deferred, timed_then, verdict_s = order[0]
    assert deferred and math.isnan(timed_then)          # the timed build was not yet waited for
    assert 0 < rec.compile_s < verdict_s == rec.verdict_s < rec.total_s
    assert math.isfinite(rec.timed_compile_s) and rec.timed_compile_s > 0
    assert rec.status == session.NO_GPU and rec.resources and rec.resources["registers"] > 0
    assert cpu_wb.backend.key("timed") == cpu_wb.backend.cubins["timed"][0]
    assert "the timed build" in rec.report()
    d = rec.to_dict()
    assert d["verdict_s"] == rec.verdict_s and d["timed_compile_s"] == rec.timed_compile_s


def test_pipeline_off_compiles_both_builds_first(cpu_wb):
    cpu_wb.pipeline = False
    try:
        rec = cpu_wb.reload()
    finally:
        cpu_wb.pipeline = True
    assert rec.status == session.NO_GPU and math.isnan(rec.timed_compile_s) and rec.resources
    assert rec.compile_s < rec.verdict_s < rec.total_s


def test_a_compile_error_in_the_timed_build_alone_puts_both_builds_back(cpu_wb):
    """An edit that compiles in the verification build but not in the timed one (only the timed build sets
    WB_TIMING): the round is a compile error at the user's line once the background compile ends, and neither build
    is replaced."""
    good = dict(cpu_wb.backend.cubins)
    path = session.section_file("lm_head")
    text = path.read_text()
    bad = text.rstrip("\n") + "\n#if WB_TIMING\n__device__ void wb_timed_only() { undeclared_in_timed += 1; }\n#endif\n"
    line = len(bad.splitlines()) - 1
    verdicts = []
    cpu_wb.on_verdict.append(verdicts.append)
    try:
        cpu_wb.edit("lm_head", bad)
        rec = cpu_wb.reload(trigger="edit", section="lm_head")
        assert verdicts == [rec]                           # the verification build got as far as its verdict
        assert rec.status == session.COMPILE_ERROR and "timed build did not compile" in rec.error
        assert f"kernels/sections/lm_head.cuh:{line}:" in rec.error and "undeclared_in_timed" in rec.error
        assert any(m[0] == "kernels/sections/lm_head.cuh" and m[1] == line for m in rec.messages)
        assert cpu_wb.backend.cubins == good                # both builds are the last good ones
        assert cpu_wb.backend._deferred is None
    finally:
        cpu_wb.on_verdict.remove(verdicts.append)
        cpu_wb.undo("lm_head", reload=False)
    assert path.read_text() == text
    rec = cpu_wb.reload(trigger="undo", section="lm_head")
    assert rec.status == session.NO_GPU


def test_loop_builds_leave_out_the_sampler_unless_it_is_edited(cpu_wb):
    assert cpu_wb.history[0].sampler == "greedy"            # the loop decodes greedily: no top-k / top-p code
    assert cpu_wb.options("debug").fast_compile == "min" and cpu_wb.options("timed").fast_compile == "0"
    assert "#define WB_SAMPLER_FULL 0" in assemble.assemble(cpu_wb.cfg, cpu_wb.options("timed")).source
    rec = cpu_wb.reload(trigger="edit", section="sampling")
    assert rec.sampler == "full" and rec.status == session.NO_GPU  # an edit there is compiled whole
    assert cpu_wb.reload(trigger="edit", section="lm_head").sampler == "greedy"
    cpu_wb.build_options["sampler"] = "full"                # or the user asks for it
    try:
        assert cpu_wb.reload().sampler == "full"
    finally:
        del cpu_wb.build_options["sampler"]


def test_assemble_errors_are_records_not_exceptions(cpu_wb):
    rec = cpu_wb.use_variant("lm_head", "missing")
    assert rec.status == session.ASSEMBLE_ERROR and "lm_head@missing.cuh" in rec.error
    rec = cpu_wb.use_variant("lm_head", None)
    assert rec.status == session.NO_GPU


def test_watcher_reloads_when_a_build_file_changes(cpu_wb):
    path = session.section_file("o_proj_residual")
    original = path.read_text()
    n = len(cpu_wb.history)
    watcher = cpu_wb.watch(interval_s=0.05, debounce_s=0.1)
    try:
        assert cpu_wb.watching
        # a change to a file the build does not use (an unselected variant), and a same-text re-save: no reload
        session.section_file("o_proj_residual", "other").write_text("// not in the build\n")
        os.utime(path)
        time.sleep(0.6)
        assert len(cpu_wb.history) == n and watcher.fired >= 1
        path.write_text(original + "// saved from an editor\n")             # a plain write, as an editor does
        deadline = time.monotonic() + 60
        while len(cpu_wb.history) == n and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = cpu_wb.last
        assert len(cpu_wb.history) == n + 1, "the watcher did not reload"
        assert rec.trigger == "watch" and rec.section == "o_proj_residual" and rec.status == session.NO_GPU
        # edits through the workbench do not make the watcher reload a second time
        cpu_wb.edit("o_proj_residual", original)
        time.sleep(0.6)
        assert len(cpu_wb.history) == n + 1
    finally:
        cpu_wb.unwatch()
        path.write_text(original)
        session.section_file("o_proj_residual", "other").unlink(missing_ok=True)
    assert not cpu_wb.watching


def test_watcher_debounces_and_ignores_unchanged_saves(kernels):
    from workbench.loop.watch import Watcher
    calls = []
    w = Watcher(calls.append, interval_s=1, debounce_s=0.5)
    path = kernels / "sections" / "sampling.cuh"
    t = 1000.0
    assert w.poll_once(t) is None
    path.write_text(path.read_text() + "// 1\n")
    assert w.poll_once(t + 0.1) is None                                  # seen, not settled
    path.write_text(path.read_text() + "// 2\n")
    assert w.poll_once(t + 0.5) is None                                  # changed again: the wait starts over
    assert w.poll_once(t + 1.1) == [path] and calls == [[path]]
    os.utime(path, ns=(1, 1))                                           # new mtime, same bytes
    assert w.poll_once(t + 2) is None and w.poll_once(t + 3) is None and len(calls) == 1
    new = kernels / "sections" / "sampling@fast.cuh"
    new.write_text("// new variant\n")
    (kernels / "sections" / ".sampling.cuh.x.tmp").write_text("temp")    # an atomic write's temporary
    assert w.poll_once(t + 4) is None and w.poll_once(t + 5) == [new]


def test_the_loop_compile_time_script_times_each_mode(tmp_path, monkeypatch, capsys):
    """scripts/loop_compile_time.py on tiny: a row per mode, the verdict before the record when the timed build
    compiles beside it, the JSON written, and the checkout's kernels untouched (it edits a private copy)."""
    import importlib.util
    script = Path(__file__).resolve().parent.parent / "scripts" / "loop_compile_time.py"
    spec = importlib.util.spec_from_file_location("loop_compile_time", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = {p: p.read_bytes() for p in paths.kernels_dir().rglob("*.cuh")}
    monkeypatch.setenv("OUT", str(tmp_path))
    assert mod.main(["--model", "tiny", "--edits", "2", "--levels", "max"]) == 0
    out = capsys.readouterr().out.splitlines()
    first, beside = out[2].split(), out[3].split()
    assert first[:2] == ["first", "min"] and beside[:2] == ["beside", "max"]
    assert float(beside[4]) < float(beside[5])                  # edit → verdict before edit → record
    rows = json.loads((tmp_path / "loop_compile_time.json").read_text())
    assert [r["pipeline"] for r in rows] == [False, True] and all(len(r["runs"]) == 2 for r in rows)
    assert {p: p.read_bytes() for p in paths.kernels_dir().rglob("*.cuh")} == before
