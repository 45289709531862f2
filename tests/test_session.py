"""The editing loop without a GPU: section files written atomically with history and undo, the %%section magic,
the compile-error path through a CPU-mode Workbench (NVRTC to cubin), the file watcher, and the stage-by-stage
comparison of taps (workbench.taps) on synthetic data from the reference.

Every test that writes kernel sources works on a copy of kernels/ (the assemble module's folder constants are
pointed at it), so the real section files are never touched."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from workbench import paths
from workbench.build import assemble
from workbench.loop import session
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights, round_bf16
from workbench.check.taps import (TAP_NAMES, TapReference, compare_taps, decode_order, reference_taps, tolerance)


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
    path = kernels / "sections" / "matvec@wide.cuh"
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
    assert set(cpu_wb.cubins) == {"debug", "timed"}
    assert cpu_wb.cubins["debug"][0] != cpu_wb.cubins["timed"][0]       # two builds: taps, timing
    taps = cpu_wb.last_reference
    steps = sorted({s for (_, _, s) in taps})
    assert steps == list(range(cpu_wb.verify_prompt - 1, cpu_wb.verify_prompt + cpu_wb.verify_tokens - 1))
    assert ("q", 1, steps[0]) in taps and ("logits", -1, steps[-1]) in taps
    json.dumps(rec.to_dict())
    assert "no GPU to run" in rec.report()


def test_compile_error_through_the_magic_keeps_the_last_good_build(cpu_wb, shell, capsys):
    good = dict(cpu_wb.cubins)
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
        assert cpu_wb.cubins == good                                       # nothing replaced the good build
        assert session.section_file("down_residual").read_text() == bad    # the text is on disk, not lost

        shell.run_line_magic("wb_undo", "down_residual")
        out = capsys.readouterr().out
        assert cpu_wb.last.status == session.NO_GPU and cpu_wb.last.trigger == "undo"
        assert "✓" in out and cpu_wb.cubins["debug"][0] == good["debug"][0]
    finally:
        cpu_wb.on_record.remove(seen.append)


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


# ---- taps: comparison and reference ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ref():
    cfg = get_config("tiny")
    p = prepare(random_weights(cfg, seed=11, progress=False), progress=False)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab, 9)]
    steps = [3, 6, 8]
    return cfg, p, tokens, steps, reference_taps(p, tokens, steps)


def test_identical_taps_pass(tiny_ref):
    cfg, _, _, steps, ref = tiny_ref
    table = compare_taps({k: v.copy() for k, v in ref.items()}, ref, cfg)
    assert table.passed and table.first_failure is None and table.steps == steps
    assert set(table.cells) == set(decode_order(cfg.n_layers))
    text = table.text()
    assert "PASS" in text and "✗" not in text.split("\n", 1)[1] and "qkv_rope_append" in text
    d = table.to_dict(json_safe=True)
    json.dumps(d)
    assert d["passed"] and d["taps"] == list(TAP_NAMES) and len(d["rel_l2"][0]) == cfg.n_layers


def test_perturbed_q_in_layer_1_is_the_first_failure(tiny_ref):
    cfg, _, _, _, ref = tiny_ref
    k = dict(ref)
    k["q", 1, 6] = ref["q", 1, 6] * (1 + 2e-2)
    for key in [("attn", 1, 6), ("x_attn", 1, 6), ("x_out", 1, 6), ("logits", -1, 6)]:
        k[key] = ref[key] * 1.1                                          # what follows diverges too
    table = compare_taps(k, ref, cfg)
    f = table.first_failure
    assert not table.passed and f.where == ("q", 1) and f.step == 6 and f.stage == "qkv_rope_append"
    assert "q at layer 1 (qkv_rope_append), step 6" in str(f)
    assert not table.cell("q", 1).passed and table.cell("q", 0).passed and table.cell("x_out", 0).passed
    assert table.to_dict()["first_failure"]["tap"] == "q"
    # a failure at an earlier step wins over an earlier stage at a later step
    k["x_attn", 0, 3] = ref["x_attn", 0, 3] * 1.1
    assert compare_taps(k, ref, cfg).first_failure.where == ("x_attn", 0)


def test_nan_inf_and_missing_taps_fail(tiny_ref):
    cfg, _, _, _, ref = tiny_ref
    k = dict(ref)
    k["attn", 0, 8] = np.full_like(ref["attn", 0, 8], np.nan)           # the runtime's poison: never written
    t = compare_taps(k, ref, cfg)
    assert t.first_failure.where == ("attn", 0) and "not written" in t.first_failure.note
    k = dict(ref)
    k["h_mlp", 1, 3] = ref["h_mlp", 1, 3].copy()
    k["h_mlp", 1, 3][7] = np.inf
    assert compare_taps(k, ref, cfg).first_failure.where == ("h_mlp", 1)
    k = dict(ref)
    del k["logits", -1, 8]
    f = compare_taps(k, ref, cfg).first_failure
    assert f.where == ("logits", -1) and "not recorded" in f.note
    k = dict(ref)
    k["v", 0, 3] = ref["v", 0, 3][:-1]
    assert compare_taps(k, ref, cfg).first_failure.where == ("v", 0)


def test_kv_tolerance_admits_rounding_flips_not_wrong_rounding(tiny_ref):
    cfg, _, _, _, ref = tiny_ref
    r = ref["k", 0, 6].astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.abs(r))) - 7)                      # bf16 spacing at each value
    flipped = r.copy()
    flipped[5] += np.sign(r[5]) * ulp[5]                                 # one element rounded the other way
    assert round_bf16(np.float32(flipped[5])) == flipped[5]
    assert compare_taps({**ref, ("k", 0, 6): flipped}, ref, cfg).passed
    # rounding that is wrong by at most an ulp but everywhere (truncating instead of rounding): fails
    trunc = r - np.sign(r) * ulp * (np.arange(r.size) % 2)
    t = compare_taps({**ref, ("k", 0, 6): trunc}, ref, cfg)
    assert t.first_failure.where == ("k", 0) and "bf16 ulp" in t.first_failure.note
    # two ulps off anywhere: fails
    two = r.copy()
    two[3] += 2.5 * np.sign(r[3]) * ulp[3]
    t = compare_taps({**ref, ("v", 0, 6): two * 0 + ref["v", 0, 6], ("k", 0, 6): two}, ref, cfg)
    assert not t.passed and "more than 1 bf16 ulp" in t.first_failure.note


def test_structural_bugs_fail_loudly(tiny_ref):
    """What real bugs do to the taps: far beyond the tolerances."""
    cfg, p, tokens, steps, ref = tiny_ref
    from kernels.sections.qkv_rope_append import rope
    from workbench.check.reference import _rope
    cos, sin = _rope(p.cfg)
    s = steps[1]
    q_unrot = rope(ref["q", 0, s], cos[s], -sin[s])                     # undo the rotation
    for bad, what in ((rope(q_unrot, cos[s], sin[s] * -1), "rope sign"),
                      (rope(q_unrot, cos[s + 1], sin[s + 1]), "position off by one")):
        t = compare_taps({**ref, ("q", 0, s): bad}, ref, cfg)
        assert t.first_failure.where == ("q", 0), what
        assert t.cell("q", 0).rel_l2 > 100 * tolerance("q", 0).rtol, what
    missing_residual = ref["x_attn", 1, s] - ref["x_in", 1, s]
    t = compare_taps({**ref, ("x_attn", 1, s): missing_residual}, ref, cfg)
    assert t.first_failure.where == ("x_attn", 1) and t.cell("x_attn", 1).rel_l2 > 0.1


def test_numpy_and_torch_reference_taps_agree(tiny_ref):
    pytest.importorskip("torch")
    cfg, p, tokens, steps, ref32 = tiny_ref
    a = reference_taps(p, tokens, steps, backend="numpy", dtype=np.float64)
    b = reference_taps(p, tokens, steps, backend="torch", dtype=np.float64)
    assert set(a) == set(b) == set(ref32)
    for key in a:
        assert np.linalg.norm(a[key] - b[key]) <= 1e-5 * np.linalg.norm(a[key]), key
    # in fp32 both sides round k/v to bf16 on their own; the tolerances are made for exactly that
    t = compare_taps(reference_taps(p, tokens, steps, backend="torch"), ref32, cfg)
    assert t.passed, t.text()


def test_tap_reference_caches_and_checks_steps(tiny_ref, monkeypatch):
    cfg, p, tokens, steps, ref = tiny_ref
    r = TapReference(p)
    assert r.backend == "numpy"
    first = r.taps(tokens, steps)
    assert all(np.array_equal(first[k], ref[k]) for k in ref)
    monkeypatch.setattr(r, "_taps_numpy", lambda *a: pytest.fail("recomputed"))
    again = r.taps(tokens + [1, 2], steps)             # tokens after the last step do not matter: cached
    assert again.keys() == first.keys()
    with pytest.raises(ValueError, match="steps must be in"):
        r.taps(tokens[:3], [5])


def test_torch_forward_taps_only_the_chosen_positions():
    torch = pytest.importorskip("torch")
    from workbench.check import reference_torch
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=3, progress=False)
    t = reference_torch.tensors_from_weights(w, "cpu", torch.float64)
    tokens = torch.tensor([5, 9, 2, 7, 1, 4])
    every, some = {}, {}
    logits = reference_torch.forward(cfg, t, tokens, dtype=torch.float64, taps=every)
    again = reference_torch.forward(cfg, t, tokens, dtype=torch.float64, taps=some, tap_positions=[4, 1])
    assert torch.equal(logits, again)
    assert set(every) == set(some) == {(s, l) for s in TAP_NAMES for l in range(cfg.n_layers)} | {("logits", -1)}
    for key in every:
        assert some[key].shape[0] == 2 and torch.equal(some[key], every[key][[4, 1]]), key
    assert torch.equal(every["logits", -1], logits)
    assert every["q", 0].shape == (6, cfg.q_dim) and every["h_mlp", 1].shape == (6, cfg.intermediate)
    with pytest.raises(ValueError, match="tap positions"):
        reference_torch.forward(cfg, t, tokens, taps={}, tap_positions=[6])
