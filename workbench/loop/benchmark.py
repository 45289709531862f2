"""Measuring the loop on a GPU (the device suite calls loop_benchmark)."""
from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import plan
from ..compiler.assemble import numba_path
from .records import ReloadRecord
from .sections import _atomic_write, display_path, section_file
from .session import Workbench


def wrong_rope(text: str) -> str:
    """qkv_rope_append.cuh with the sign of the sin term flipped (a rotation by −angle): a deliberate bug that the
    taps must name as q at layer 0."""
    out = text.replace("r[0] * c - r[1] * s", "r[0] * c + r[1] * s").replace("r[1] * c + r[0] * s",
                                                                             "r[1] * c - r[0] * s")
    if out == text:
        raise ValueError("could not find the rope rotation (r[0] * c - r[1] * s) in qkv_rope_append.cuh")
    return out


# the sections the loop benchmark's harmless edits go to, in turn: every stage, and the library's dot products
EDIT_SECTIONS = (*plan.STAGE_NAMES, "matvec")


def timed_edit(wb, name: str, text: str) -> dict:
    """One harmless edit → reload, with the edit → verdict and edit → record times (the write included)."""
    return _timed(wb, name, lambda: wb.edit(name, text))[0]


def _timed(wb, section: str, write) -> tuple[dict, ReloadRecord]:
    """An edit (any write: a .cuh, a numba variant's .py) → reload: the record in brief with edit → verdict and
    edit → record (the write included), and the record."""
    t1 = time.perf_counter()
    write()
    written = time.perf_counter() - t1
    rec = wb.reload(trigger="edit", section=section)
    b = {"section": section, **_brief(rec)}
    b["edit_to_record_s"] = time.perf_counter() - t1
    b["edit_to_verdict_s"] = written + rec.verdict_s if math.isfinite(rec.verdict_s) else None
    return b, rec


LOOP_TIMES = ("compile_s", "timed_compile_s", "verify_s", "verdict_s", "time_s", "total_s", "edit_to_verdict_s",
              "edit_to_record_s")


def medians(runs: list) -> dict:
    return {k: float(np.median([r[k] for r in runs if r[k] is not None] or [math.nan])) for k in LOOP_TIMES}


def loop_benchmark(model: str = "llama-3.2-1b", *, sections: tuple = EDIT_SECTIONS, edits: int = 10,
                   overhead_tokens: int = 256, overhead_repeats: int = 5, fast_compile_levels: tuple = (),
                   level_edits: int = 4, whole: bool = False, **workbench_kw) -> dict:
    """Measure the editing loop on a GPU: `edits` harmless edits (a comment appended, different text each time, so
    every compile is a real one), to `sections` in turn → reload (compile, verify, time), with edit → verdict (the
    verification build's; the timed build compiles beside it) and edit → record (timing included); then
    `level_edits` more at each of `fast_compile_levels` for the verification build built whole (NVRTC -Ofc), and
    with `whole` `edits` more with it built whole at the workbench's level, against the units build (the default,
    workbench.compiler.units); a deliberately wrong edit (wrong_rope, as a variant) → the first failing stage; and
    the tok/s of the plain build against the timing build and the taps build (instrumentation overhead). Restores
    every file it touched; its edit history goes to a temporary folder. Returns a dict (JSON-ready)."""
    out: dict = {"model": model}
    hist = Path(tempfile.mkdtemp(prefix="wb-loop-history-"))
    originals = {name: section_file(name).read_bytes() for name in sections}
    section = sections[0]
    original = originals[section]
    rope_path = section_file("qkv_rope_append")
    rope_original = rope_path.read_bytes()
    variant = "loop_benchmark_wrong_rope"
    wrong_path = section_file("qkv_rope_append", variant)
    if wrong_path.exists():
        raise FileExistsError(f"{display_path(wrong_path)} exists already; remove it first")
    wb = None
    try:
        wb = _opened(model, hist, workbench_kw, out)
        out["parallel_compile"] = wb.parallel_compile
        runs = []
        for i in range(edits):
            name = sections[i % len(sections)]
            text = originals[name].decode() + f"\n// loop_benchmark: harmless edit {i} at {time.time_ns()}\n"
            runs.append(timed_edit(wb, name, text))
        out["edit_runs"] = runs
        out["edit"] = medians(runs)
        out["edit"]["all_passed"] = all(r["passed"] for r in runs)
        # the verification build built whole, at each fast-compile level (its compile is the verdict's; its
        # speed is never read), against the default build in units
        levels = {}
        kept, kept_units = wb.verify_fast_compile, wb.verify_units
        wb.verify_units = False
        for level in fast_compile_levels:
            wb.verify_fast_compile = level
            wb.reload(trigger="manual")                 # the level's first build (CuPy may have it cached)
            lr = [timed_edit(wb, name, originals[name].decode() + f"\n// loop_benchmark: -Ofc={level} edit {i} "
                                                                   f"at {time.time_ns()}\n")
                  for i, name in enumerate(sections[:level_edits])]
            levels[level] = {**medians(lr), "all_passed": all(r["passed"] for r in lr), "runs": lr}
        wb.verify_fast_compile = kept
        if whole:
            wb.reload(trigger="manual")                 # the whole build's first compile
            # as many edits as the default build's, over the sections in turn
            wr = [timed_edit(wb, name, originals[name].decode() + f"\n// loop_benchmark: whole edit {i} "
                                                                   f"at {time.time_ns()}\n")
                  for i, name in ((i, sections[i % len(sections)]) for i in range(edits))]
            levels["whole"] = {**medians(wr), "all_passed": all(r["passed"] for r in wr), "runs": wr}
        wb.verify_units = kept_units
        if levels:
            wb.reload(trigger="manual")
        out["verify_fast_compile"] = {"kept": kept, "levels": levels}
        if runs:
            out["stages_text"] = wb.last.stages.text() if wb.last.stages is not None else None
            out["timing_text"] = wb.last.timing_text
        # the same, compiling the two builds the other way (in parallel threads, or one after the other)
        wb.parallel_compile = not wb.parallel_compile
        wb.edit(section, original.decode() + f"\n// loop_benchmark: harmless edit at {time.time_ns()}\n")
        out["edit_other_compile_mode"] = {**_brief(wb.reload(trigger="edit", section=section)),
                                          "parallel_compile": wb.parallel_compile}
        wb.parallel_compile = not wb.parallel_compile
        # the same reload without compiling anything new (CuPy's cache): what the rest of the loop costs
        rec = wb.reload(trigger="manual")
        out["reload_cached"] = _brief(rec)
        # undo puts the files back; the deliberately wrong variant must be caught as q at layer 0
        for name in sections:
            while wb.section_history(name):
                wb.undo(name, reload=False)
        out["undo_restored"] = all(section_file(n).read_bytes() == o for n, o in originals.items())
        wb.edit("qkv_rope_append", wrong_rope(rope_original.decode()), variant=variant)
        rec = wb.use_variant("qkv_rope_append", variant)
        out["wrong_edit"] = {**_brief(rec), "where": list(rec.failure.where) if rec.failure else None,
                             "caught_as_q_layer0": bool(rec.failure and rec.failure.where == ("qkv_rope_append", 0)
                                                        and rec.failure.buffer == "q")}
        wb.use_variant("qkv_rope_append", None, reload=False)
        # instrumentation overhead: plain vs timing build vs taps build (no taps requested), interleaved
        n = overhead_tokens
        plain = dataclasses.replace(wb.options("timed"), timing=False)
        # every build fully optimised (the loop's own verification build is not: see verify_fast_compile)
        builds = {"plain": plain, "timing": wb.options("timed"), "taps": dataclasses.replace(plain, taps=True),
                  "taps+timing": dataclasses.replace(plain, taps=True, timing=True)}
        tps = wb.backend.overhead(builds, wb.overrides, tokens=n, repeats=overhead_repeats)
        med = {k: float(np.median(v)) for k, v in tps.items()}
        out["overhead"] = {"tokens": n, "repeats": overhead_repeats, "runs": tps,
                           **{f"{k}_tok_s": v for k, v in med.items()},
                           **{f"{k}_overhead_pct": 100 * (med["plain"] / v - 1)
                              for k, v in med.items() if k != "plain"}}
    finally:
        if wb is not None:
            wb.close()
        for name, text in originals.items():
            if section_file(name).read_bytes() != text:
                _atomic_write(section_file(name), text.decode())
        if rope_path.read_bytes() != rope_original:
            _atomic_write(rope_path, rope_original.decode())
        wrong_path.unlink(missing_ok=True)
        shutil.rmtree(hist, ignore_errors=True)
        out["files_restored"] = (all(section_file(n).read_bytes() == o for n, o in originals.items())
                                 and rope_path.read_bytes() == rope_original and not wrong_path.exists())
    return out


def _opened(model: str, hist: Path, workbench_kw: dict, out: dict) -> Workbench:
    """A Workbench on `model` with its history in `hist`, not watching; its set-up time and first verdict go to
    `out`."""
    t0 = time.perf_counter()
    wb = Workbench(model, history_dir=hist, activate=False, watch=False, **workbench_kw)
    out["setup_s"] = time.perf_counter() - t0
    out["initial"] = _brief(wb.last)
    return wb


def _brief(rec: ReloadRecord | None) -> dict | None:
    if rec is None:
        return None
    def num(v):
        return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
    return {"status": rec.status, "passed": rec.passed, "first_failure": rec.first_failure,
            "compile_s": num(rec.compile_s), "verify_s": num(rec.verify_s), "time_s": num(rec.time_s),
            "total_s": num(rec.total_s), "verdict_s": num(rec.verdict_s), "timed_compile_s": num(rec.timed_compile_s),
            "tok_per_s": num(rec.tok_per_s), "error": rec.error,
            "stages_summary": rec.stages.summary() if rec.stages is not None else None,
            # where verify_s went: filling the cache, the taps runs, the stage checks, the end-to-end check
            "verify_parts": dict(rec.stages.seconds) if rec.stages is not None else None}


def numba_loop_benchmark(model: str = "llama-3.2-1b", *, section: str = "gate_up_silu", variant: str = "numba",
                         edits: int = 6, **workbench_kw) -> dict:
    """Measure the loop for a numba variant (workbench.compiler.numba_sections) on its section: the variant
    selected (its first build), then `edits` harmless edits to its .py (a comment line, different each time, so
    each is a real numba compile), interleaved with as many to the C++ original's file with the variant off, so
    the two compile paths' edit → verdict are measured on one machine in one run; then two deliberately wrong .py
    edits: a typing error, which must come back as a compile error at its .py line with the last good kernel still
    loaded, and silu · up off by 1e-4 relative, which the stage check must name as `section` at layer 0; every
    file put back by undo. Returns a dict (JSON-ready)."""
    out: dict = {"model": model, "section": section, "variant": variant}
    hist = Path(tempfile.mkdtemp(prefix="wb-numba-loop-"))
    py_path, cpp_path = numba_path(section, variant), section_file(section)
    py_original, cpp_original = py_path.read_bytes(), cpp_path.read_bytes()
    py_text = py_original.decode()
    ret = [n for n, line in enumerate(py_text.splitlines(), 1) if line.strip().startswith("return ")]
    if len(ret) != 1:
        raise ValueError(f"{display_path(py_path)}: the wrong edits need exactly one return line, found {len(ret)}")
    ret_line = py_text.splitlines()[ret[0] - 1]
    wb = None
    try:
        wb = _opened(model, hist, workbench_kw, out)
        out["select_variant"] = _brief(wb.use_variant(section, variant))
        py_runs, cpp_runs = [], []
        for i in range(edits):
            wb.use_variant(section, variant, reload=False)
            py_runs.append(_timed(wb, section, lambda: wb.edit(
                section, py_text + f"\n# loop_benchmark: harmless edit {i} at {time.time_ns()}\n", variant,
                python=True))[0])
            wb.use_variant(section, None, reload=False)
            cpp_runs.append(timed_edit(wb, section, cpp_original.decode()
                                       + f"\n// loop_benchmark: harmless edit {i} at {time.time_ns()}\n"))
        out["numba_edits"], out["cpp_edits"] = py_runs, cpp_runs
        out["numba_edit"], out["cpp_edit"] = medians(py_runs), medians(cpp_runs)
        for k in ("numba_edit", "cpp_edit"):
            out[k]["all_passed"] = all(r["passed"] for r in (py_runs if k == "numba_edit" else cpp_runs))
        out["compile_added_s"] = out["numba_edit"]["compile_s"] - out["cpp_edit"]["compile_s"]
        out["verdict_added_s"] = out["numba_edit"]["edit_to_verdict_s"] - out["cpp_edit"]["edit_to_verdict_s"]
        # a typing error: a CompileError at the .py's return line, the last good kernel kept
        wb.use_variant(section, variant)
        typo = py_text.replace(ret_line, ret_line + ' + "not a float"', 1)
        brief, rec = _timed(wb, section, lambda: wb.edit(section, typo, variant, python=True))
        out["typing_error"] = {**brief, "messages": [list(m) for m in rec.messages],
                               "at_py_line": any(m[0] == display_path(py_path) and m[1] == ret[0]
                                                 for m in rec.messages),
                               "expected_line": ret[0]}
        # a numeric error 1e-4 relative: the stage check names the section at layer 0
        wrong = py_text.replace(ret_line, ret_line + " * float32(1.0001)", 1)
        brief, rec = _timed(wb, section, lambda: wb.edit(section, wrong, variant, python=True))
        f = rec.failure
        out["wrong_edit"] = {**brief, "where": list(f.where) if f else None,
                             "caught_as_section_layer0": bool(f and tuple(f.where) == (section, 0))}
        for python in (True, False):
            while wb.section_history(section, variant if python else None, python=python):
                wb.undo(section, variant if python else None, reload=False, python=python)
        out["undo_restored"] = py_path.read_bytes() == py_original and cpp_path.read_bytes() == cpp_original
        out["after_undo"] = _brief(wb.reload(trigger="manual"))
    finally:
        if wb is not None:
            wb.close()
        for path, text in ((py_path, py_original), (cpp_path, cpp_original)):
            if path.read_bytes() != text:
                _atomic_write(path, text.decode())
        shutil.rmtree(hist, ignore_errors=True)
        out["files_restored"] = py_path.read_bytes() == py_original and cpp_path.read_bytes() == cpp_original
    return out

