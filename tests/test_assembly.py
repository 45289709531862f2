"""Assembly of the sections into one source, #line mapping of compiler messages, and a compile-only build for sm_90
through NVRTC (no GPU needed)."""
from __future__ import annotations

import ctypes
import dataclasses
import re

import numpy as np
import pytest

from workbench import abi, plan, schedule
from workbench.compiler.assemble import BuildOptions, Params, assemble, defines, section_path, smem_bytes
from workbench.compiler.compile import CompileError, compile_cubin, compile_ptx, parse_log, resource_usage
from workbench.model.config import PRESETS, get_config


@pytest.fixture(scope="module")
def tiny_asm():
    return assemble(get_config("tiny"))


def test_source_is_self_contained_with_line_markers(tiny_asm):
    src = tiny_asm.source
    assert not re.search(r"^\s*#\s*include", src, re.M)
    for name in plan.STAGE_NAMES:
        assert f'#line 1 "kernels/sections/{name}.cuh"' in src
    for name in plan.LIBRARY:
        assert f'#line 1 "kernels/lib/{name}.cuh"' in src
    assert '#line 1 "kernels/portability.cuh"' in src and '#line 1 "kernels/monokernel.cuh"' in src
    # the order: portability, the plan's header, the library, the stages in decode order, the decode step, the entry
    order = [m for m in re.findall(r'^#line 1 "([^"]+)"', src, re.M)]
    assert order == (["kernels/portability.cuh", "<generated: plan header>"]
                     + [f"kernels/lib/{n}.cuh" for n in plan.LIBRARY]
                     + [f"kernels/sections/{n}.cuh" for n in plan.STAGE_NAMES]
                     + ["<generated: decode step>", "kernels/monokernel.cuh"])


def test_shapes_arrive_only_as_defines():
    cfg = get_config("llama-3.2-1b")
    d = defines(cfg, BuildOptions())
    assert d["WB_D"] == "2048" and d["WB_VOCAB"] == "128256" and d["WB_FF"] == "8192"
    asm = assemble(cfg)
    for _, path, text in asm.pieces:            # what a person wrote: no shape of any preset appears as a literal
        if path.startswith("<generated"):
            continue
        for shape in ("2048", "8192", "128256", "3072", "14336"):
            assert not re.search(rf"\b{shape}\b", text), f"literal {shape} in {path}"


def test_every_line_maps_back_to_its_file(tiny_asm):
    lines = tiny_asm.source.splitlines()
    for name in ("attention_decode", "sampling"):
        text = section_path(name).read_text().splitlines()
        marker = lines.index(f'#line 1 "kernels/sections/{name}.cuh"') + 1
        for k in (1, 7, len(text)):
            path, n = tiny_asm.locate(marker + k)             # 1-based line of the assembled source
            assert (path, n) == (f"kernels/sections/{name}.cuh", k)
            assert lines[marker + k - 1].strip() == text[k - 1].strip() or "#pragma once" in text[k - 1]


def test_params_struct_matches_ctypes(tiny_asm):
    assert f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}" in tiny_asm.source
    assert [f[0] for f in Params._fields_] == [n for n, _ in abi.params_fields()]


def test_edit_changes_the_cache_key(tiny_asm):
    text = section_path("lm_head").read_text() + "\n// an edit\n"
    assert assemble(get_config("tiny"), overrides={"lm_head": text}).key != tiny_asm.key


def test_include_is_refused():
    with pytest.raises(ValueError, match="pasted, not included"):
        assemble(get_config("tiny"), overrides={"matvec": '#include "other.cuh"\n'})


def test_missing_variant_is_named():
    with pytest.raises(FileNotFoundError, match="lm_head@nope.cuh"):
        assemble(get_config("tiny"), BuildOptions(variants=(("lm_head", "nope"),)))


def test_compile_error_names_section_file_and_line():
    text = section_path("gate_up_silu").read_text()
    lines = text.splitlines()
    k = next(i for i, l in enumerate(lines) if "hmlp[j] =" in l)
    lines[k] = lines[k] + " undeclared_symbol += 1;"
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(get_config("tiny"), overrides={"gate_up_silu": "\n".join(lines)}))
    err = e.value
    assert any(m[0] == "kernels/sections/gate_up_silu.cuh" and m[1] == k + 1 and "undeclared_symbol" in m[4]
               for m in err.messages), err.messages
    assert f"kernels/sections/gate_up_silu.cuh:{k + 1}: error" in str(err)


def test_parse_log_ignores_noise():
    log = 'kernels/lib/matvec.cuh(12): warning #177-D: variable "x" was declared but never referenced\nnoise\n'
    (m,) = parse_log(log)
    assert m[:3] == ("kernels/lib/matvec.cuh", 12, "warning")


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b"])
@pytest.mark.parametrize("timing", [False, True])
def test_sm90_build_has_no_spills(name, timing):
    cubin, _ = compile_cubin(assemble(get_config(name), BuildOptions(timing=timing)))
    (r,) = resource_usage(cubin)
    assert r.kernel == "wb_generate"
    assert r.stack == 0, f"{name}: {r.stack} B of local memory (spills)"
    assert 32 <= r.registers <= 128                  # 512 threads, one block per SM: at most 128 registers
    assert smem_bytes(get_config(name)) <= 227 * 1024


def test_timing_switch_compiles_away():
    plain = assemble(get_config("tiny")).source
    assert "#define WB_TIMING 0" in plain
    # the stamps exist only under #if WB_TIMING; with it off the kernel has no globaltimer read outside the barrier
    cubin0, _ = compile_cubin(assemble(get_config("tiny")))
    cubin1, _ = compile_cubin(assemble(get_config("tiny"), BuildOptions(timing=True)))
    from workbench.compiler.compile import disassemble
    n0 = disassemble(cubin0).count("GLOBALTIMER")
    n1 = disassemble(cubin1).count("GLOBALTIMER")
    assert n1 > n0


def test_timing_table_on_a_synthetic_trace():
    from workbench.measure.timing import slot_names, stage_table
    cfg = get_config("tiny")
    S, G, n = len(slot_names(cfg)), 3, 4
    t = np.zeros((n, S, G, 2), np.uint64)
    now = 1_000_000
    for i in range(n):
        for s in range(S):                                     # every slot of every step is stamped
            for b in range(G):
                t[i, s, b] = (now + 400 + 100 * b, now + 1000)     # block b works 400+100b ns, all leave at 1000
            now += 1000
    rows = {r.stage: r for r in stage_table(cfg, t)}
    assert rows["qkv_rope_append"].us_per_token == pytest.approx(cfg.n_layers * 1.0)
    assert rows["lm_head"].work_us == pytest.approx(0.5) and rows["lm_head"].wait_us == pytest.approx(0.5)



def test_boundary_table_separates_stragglers_from_slow_releases():
    from workbench.measure.timing import boundary_table, format_boundaries, slot_names
    cfg = get_config("tiny")
    names = slot_names(cfg)
    S, G, n = len(names), 4, 3
    t = np.zeros((n, S, G, 2), np.uint64)
    now = 1_000_000
    for i in range(n):
        for s in range(S):
            late = 2000 if names[s][0] == "o_proj_residual" else 0     # one block straggles in o_proj
            slow = 3000 if names[s][0] == "gate_up_silu+down_residual" else 800   # the MLP's barrier releases slowly
            arrivals = [now + 500 + 100 * b + (late if b == G - 1 else 0) for b in range(G)]
            last = max(arrivals)
            for b in range(G):
                t[i, s, b] = (arrivals[b], last + slow - 100 * (G - 1 - b))
            now = last + slow
    rows = {r.stage: r for r in boundary_table(cfg, t)}
    o, mlp, qkv = rows["o_proj_residual"], rows["gate_up_silu+down_residual"], rows["qkv_rope_append"]
    assert o.first_arrival_us == pytest.approx(0.5) and o.last_arrival_us == pytest.approx(2.5 + 0.3)
    assert mlp.last_arrival_us == pytest.approx(0.8) and mlp.last_leave_us == pytest.approx(3.0)
    assert mlp.first_leave_us == pytest.approx(2.7) and qkv.last_leave_us == pytest.approx(0.8)
    assert "first in" in format_boundaries(list(rows.values())).splitlines()[0]


def test_critical_table_names_the_blocks_that_hold_a_barrier_up():
    import statistics
    from workbench.measure.timing import critical_table, format_critical, slot_names
    cfg = get_config("tiny")
    names = slot_names(cfg)
    S, G, n = len(names), 4, 5
    t = np.zeros((n, S, G, 2), np.uint64)
    now = 1_000_000
    att_work, att_wait = [], []                  # attention's spans after the first step, as the table skips it
    for i in range(n):
        for s in range(S):
            # attention: block 1 works 3 µs and arrives last at every barrier; elsewhere the last block rotates
            work = [3000 if (names[s][0] == "attention_decode" and b == 1) else 400 + 10 * ((b + i + s) % G)
                    for b in range(G)]
            arrivals = [now + w for w in work]
            last = max(arrivals)
            for b in range(G):
                t[i, s, b] = (arrivals[b], last + 700)
            if i > 0 and names[s][0] == "attention_decode":
                att_work += work
                att_wait += [last + 700 - a for a in arrivals]
            now = last + 700
    rows = {r.stage: r for r in critical_table(cfg, t)}
    att, qkv = rows["attention_decode"], rows["qkv_rope_append"]
    assert att.last_blocks == ((1, 1.0),) and att.last_work_us == pytest.approx(3.0)
    # the stamps are whole nanoseconds: the table's figures are exact but for float rounding
    assert att.median_work_us == pytest.approx(statistics.median(att_work) / 1e3, rel=1e-12)
    assert att.idle_pct == pytest.approx(100 * sum(att_wait) / (sum(att_wait) + sum(att_work)), rel=1e-12)
    # qkv's last block rotates through all four over the four steps counted: a quarter each
    assert sorted(b for b, _ in qkv.last_blocks) == list(range(G))
    assert all(share == pytest.approx(1 / G) for _, share in qkv.last_blocks)
    assert "last to arrive" in format_critical(list(rows.values())).splitlines()[0]


def test_critical_table_shares_a_tied_barrier_and_refuses_no_steps():
    from workbench.measure.timing import critical_table, slot_names
    cfg = get_config("tiny")
    names = slot_names(cfg)
    t = np.zeros((2, len(names), 4, 2), np.uint64)
    for i in range(2):
        for s in range(len(names)):
            base = 10_000 * (i * len(names) + s + 1)
            t[i, s] = [(base + a, base + 900) for a in (500, 800, 800, 100)]
    rows = critical_table(cfg, t)
    for r in rows:                               # blocks 1 and 2 tie for last at every barrier: half each
        assert r.last_blocks == ((1, 0.5), (2, 0.5))
    one = critical_table(cfg, t[:1])             # one step: nothing to skip, as stage_rows does
    assert [r.last_blocks for r in one] == [r.last_blocks for r in rows]
    with pytest.raises(ValueError, match="no steps"):
        critical_table(cfg, t[:0])


def test_the_recorded_trace_shows_attention_waiting_on_its_kv_head_blocks():
    """The H200 trace at position 0: one block per kv head runs attention (plan: splits at one position = 1), so
    the barrier after attention is held up by those blocks alone, and the rest of the grid idles through it."""
    from workbench.measure.timing import critical_table
    from workbench.measure.trace import load_recorded
    tr = load_recorded(0)
    rows = {r.stage: r for r in critical_table(tr.cfg, tr.stamps[:tr.complete_steps], names=tr.slot_names,
                                               top=tr.stamps.shape[2])}
    att = rows["attention_decode"]
    assert att.last_blocks and all(b < tr.cfg.n_kv_heads for b, _ in att.last_blocks)
    assert sum(share for _, share in att.last_blocks) == pytest.approx(1.0)
    assert att.last_work_us > 4 * att.median_work_us and att.idle_pct > 70
    mlp = rows["gate_up_silu+down_residual"]
    assert mlp.idle_pct < 20 and mlp.last_work_us < 1.1 * mlp.median_work_us


def test_greedy_sampler_build_leaves_the_sampler_out():
    cfg = get_config("tiny")
    full, greedy = assemble(cfg), assemble(cfg, BuildOptions(sampler="greedy"))
    assert "#define WB_SAMPLER_FULL 1" in full.source and "#define WB_SAMPLER_FULL 0" in greedy.source
    assert full.key != greedy.key
    c_full, _ = compile_cubin(full)
    c_greedy, _ = compile_cubin(greedy)
    assert len(c_greedy) < 0.95 * len(c_full)           # the top-k / top-p code is gone, not just skipped
    with pytest.raises(ValueError, match="sampler"):
        assemble(cfg, BuildOptions(sampler="topk"))


def test_ptxas_level_reaches_the_compiler():
    cfg = get_config("tiny")
    o3, o1 = assemble(cfg), assemble(cfg, BuildOptions(ptxas_opt=1))
    assert o3.flags == () and o1.flags == ("--ptxas-options=-O1",)
    assert o3.source == o1.source and o3.key != o1.key    # same text, different build: a different cache key
    assert compile_cubin(o1)[0] != compile_cubin(o3)[0]


def test_build_options_from_text_and_bad_values():
    from workbench.compiler.assemble import option_from_text, with_fields
    assert option_from_text("sampler", "greedy") == "greedy" and option_from_text("fast_compile", "0") == "0"
    assert option_from_text("ptxas_opt", "1") == 1 and option_from_text("timing", "1") is True
    with pytest.raises(ValueError, match="not a BuildOptions field"):
        option_from_text("sampling", "greedy")
    with pytest.raises(ValueError, match="not a BuildOptions field"):
        option_from_text("variants", "x")
    with pytest.raises(ValueError, match="takes an integer"):
        option_from_text("threads", "many")
    with pytest.raises(ValueError, match="ptxas_opt"):
        BuildOptions(ptxas_opt=7)
    with pytest.raises(ValueError, match="attn_bufs must be at least 2"):
        plan.Launch(attn_bufs=1)
    with pytest.raises(ValueError, match="attn_kv_bytes must be a number of bytes"):
        with_fields(attn_kv_bytes=-1)
    assert option_from_text("attn_kv_bytes", "65536") == 65536
    with pytest.raises(ValueError, match="attn_min_chunk must be 0"):
        with_fields(attn_min_chunk=-1)
    with pytest.raises(ValueError, match="attn_single must be a number of chunks"):
        plan.Launch(attn_single=0)
    with pytest.raises(ValueError, match="^threads must be a multiple of 64"):
        with_fields(threads=100)
    with pytest.raises(ValueError, match="^x_parts must be a number of parts from 1 to the grid's 2 blocks"):
        with_fields(grid=2)
    with pytest.raises(ValueError, match="stream_register.*set stream too"):
        with_fields(stream_register="o_proj_residual")
    with pytest.raises(ValueError, match="^early must be a tuple of stage names"):
        plan.Launch(early="o_proj_residual")
    assert option_from_text("early", "o_proj_residual+gate_up_silu") == "o_proj_residual+gate_up_silu"
    assert option_from_text("stream", "1") is True and option_from_text("stream_register", "lm_head") == "lm_head"
    # the launch's fields by the text's names go to the launch; the others stay the options' own
    opt = with_fields(threads=256, early="o_proj_residual+lm_head", stream=True, stream_register="lm_head",
                      sampler="greedy")
    assert opt.launch == plan.Launch(threads=256, early=("o_proj_residual", "lm_head"), stream=True,
                                     register_stages=("lm_head",))
    assert opt.sampler == "greedy" and with_fields(opt, grid=66).launch.grid == 66
    with pytest.raises(ValueError, match="'nope' is neither a BuildOptions field nor a launch's"):
        with_fields(nope=1)


EARLY = ("qkv_rope_append", "o_proj_residual", "gate_up_silu", "lm_head")


def _early(*names, **options) -> BuildOptions:
    return BuildOptions(launch=plan.Launch(early=names), **options)


def test_early_names_weight_stages_after_a_grid_barrier():
    from workbench.compiler.assemble import with_fields
    assert with_fields(early="+".join(EARLY)).launch.early == EARLY
    for bad, why in (("o_proj", "not a stage"), ("attention_decode", "reads no weight by units"),
                     ("sampling", "reads no weight by units")):
        with pytest.raises(ValueError, match=f"^early: {bad}.*{why}"):
            _early(bad)
    # down_residual follows gate_up in one slot (a block barrier): there is no grid barrier to load across
    with pytest.raises(ValueError, match="^early: down_residual: no grid barrier goes before it"):
        assemble(get_config("tiny"), _early("down_residual"))


def test_the_default_early_leaves_out_what_cannot_load_early_and_a_named_one_is_an_error():
    """qkv in a one-layer model follows the step's first barrier, which stays whole; a PTX body reads its weights
    itself and would never wait: the default builds without them, a user who names them is told why."""
    one = get_config("tiny").with_(n_layers=1)
    lines = _step_lines(one, BuildOptions())
    arrives = [l.split("(")[1].split(",")[0] for l in lines if l.startswith("WB_ARRIVE(")]
    assert arrives == ["ST_ATTENTION_DECODE", "ST_O_PROJ_RESIDUAL", "ST_DOWN_RESIDUAL"]   # o_proj, gate_up, lm_head
    with pytest.raises(ValueError, match="^early: qkv_rope_append: no grid barrier goes before it"):
        assemble(one, _early("qkv_rope_append", "gate_up_silu"))
    ptx = BuildOptions(variants=(("o_proj_residual", "ptx"),))
    assert ptx.effective_launch().early == tuple(n for n in EARLY if n != "o_proj_residual")
    assert not [l for l in _step_lines(get_config("tiny"), ptx) if l.startswith("WB_WAIT_OWED(ST_O_PROJ_RESIDUAL")]
    with pytest.raises(ValueError, match="^early: o_proj_residual: a PTX body reads its weights itself"):
        _early("o_proj_residual", variants=(("o_proj_residual", "ptx"),))


def _step_lines(cfg, opt) -> list[str]:
    text = assemble(cfg, opt).source
    return [l.strip() for l in text[text.index("bool wb_decode_step("):].splitlines()]


@pytest.mark.parametrize("model", ["tiny", "llama-3.2-1b"])
def test_early_splits_the_barriers_before_the_named_stages(model):
    """A barrier is only arrived at (WB_ARRIVE) where the stage after it, in the step's order, loads early; the
    step's first barrier stays whole (the stop test reads what it publishes); each early stage is followed by
    the check that its prologue waited. A build without early splits nothing; the default loads all four early."""
    assert BuildOptions().launch.early == EARLY
    cfg = get_config(model)
    plain = _step_lines(cfg, _early())
    assert not any(l.startswith(("WB_ARRIVE", "WB_WAIT_OWED")) or "WB_ARRIVE" in l for l in plain)
    lines = _step_lines(cfg, _early(*EARLY))
    barriers = {l.split("(")[1].split(",")[0]: l.split("(")[0] for l in lines if l.startswith(("WB_SYNC", "WB_ARRIVE"))}
    assert barriers == {"ST_EMBEDDING": "WB_SYNC", "ST_QKV_ROPE_APPEND": "WB_SYNC",
                        "ST_ATTENTION_DECODE": "WB_ARRIVE", "ST_O_PROJ_RESIDUAL": "WB_ARRIVE",
                        "ST_DOWN_RESIDUAL": "WB_ARRIVE", "ST_LM_HEAD": "WB_SYNC"}
    owed = [l for l in lines if l.startswith("WB_WAIT_OWED")]
    assert [l.split("(")[1].split(",")[0] for l in owed] == [f"ST_{n.upper()}" for n in EARLY]
    for l in owed:                                      # right after its stage's call
        assert lines[lines.index(l) - 1].startswith(f"WB_GRID({l.split('(')[1].split(',')[0]},")
    # qkv alone: down_residual's barrier is split before the next layer's qkv, whole before lm_head
    (down,) = [l for l in _step_lines(cfg, _early("qkv_rope_append")) if "ST_DOWN_RESIDUAL, layer, " in l
               and ("WB_SYNC" in l or "WB_ARRIVE" in l)]
    assert down.startswith("if (layer + 1 < WB_LAYERS) WB_ARRIVE(ST_DOWN_RESIDUAL") and "else WB_SYNC(" in down


@pytest.mark.parametrize("model,loads", [(m, n) for n in (8, 16) for m in ("tiny", "llama-3.2-1b", "qwen3-0.6b")] +
                         [("llama-3.1-8b", 8), pytest.param("llama-3.1-8b", 16, marks=pytest.mark.xfail(
                             strict=True, reason="two chunks of the 8B's row pairs (K = 4,096) spill 8 B at the "
                                                 "128-register cap"))])
def test_the_early_region_is_clear_of_the_early_stages_and_builds_without_spills(model, loads):
    cfg = get_config(model)
    opt = _early(*EARLY)
    opt = dataclasses.replace(opt, launch=dataclasses.replace(opt.launch, early_loads=loads))
    off, n = schedule.early_region(cfg, opt.launch)
    assert n == opt.launch.stage_threads * opt.launch.early_loads * 4 and off % 4 == 0
    regions = schedule.smem_regions(cfg, opt.launch)
    for name in EARLY:
        assert all(o + k <= off for o, k in regions[name].values()), name
    assert schedule.smem_floats(cfg, opt.launch) >= off + n
    assert schedule.early_region(cfg, _early().launch) == (0, 0)
    cubin = compile_cubin(assemble(cfg, opt))[0]
    assert resource_usage(cubin)[0].stack == 0


def test_fast_compile_build_reports_only_the_kernel():
    asm = assemble(get_config("tiny"), BuildOptions(fast_compile="min"))
    assert asm.flags == ("-Ofc=min",)
    (r,) = resource_usage(compile_cubin(asm)[0])          # its cubin also lists device functions, without figures
    assert r.kernel == "wb_generate" and r.registers > 0
    with pytest.raises(ValueError, match="fast_compile"):
        assemble(get_config("tiny"), BuildOptions(fast_compile="fast"))


def test_recorded_steps_cover_both_ends():
    from workbench.check.verify import recorded_steps
    r = recorded_steps(4100, 64)
    assert r[0] == 0 and r[-1] == 4099 and len(r) <= 64 and r == sorted(set(r))
    assert recorded_steps(10, 64) == list(range(10))


def test_chi2_survival():
    from workbench.check.verify import chi2_sf
    assert chi2_sf(100.0, 100) == pytest.approx(0.48, abs=0.02)
    assert chi2_sf(200.0, 100) < 1e-6


def test_presets_fit_the_kernel():
    for cfg in PRESETS.values():
        assert smem_bytes(cfg) <= 227 * 1024


def test_compiling_leaves_python_bytes_alone():
    # NVRTC writes its log and cubin into the buffers we hand it; a cached one-byte bytes object must never be one
    compile_cubin(assemble(get_config("tiny")))
    assert b" "[0] == 0x20 and bytes(1)[0] == 0


def test_generated_constants_are_the_plans():
    """What the C++ side is told (the generated header) is what the host reads (the plan)."""
    from workbench.compiler.header import plan_header
    from workbench.measure.timing import slot_names
    for cfg in PRESETS.values():
        launch = plan.Launch()
        text = plan_header(cfg, launch)
        assert f"constexpr int WB_SLOTS = {schedule.n_slots(cfg)};" in text
        assert len(slot_names(cfg)) == schedule.n_slots(cfg) == 4 * cfg.n_layers + 2
        assert f"constexpr int WB_BLOCKS = {launch.grid};" in text
        assert f"WB_TAP_STEP_FLOATS = {schedule.tap_step_floats(cfg, launch)};" in text
        for tp in schedule.taps(cfg, launch):
            assert f"WB_TAP_{tp.stage.upper()}_{tp.buffer.upper()} = {tp.offset}," in text
        for st, regions in schedule.smem_regions(cfg, launch).items():
            for r, (off, n) in regions.items():
                assert f"WB_SMEM_{st.upper()}_{r.upper()} = {off}, WB_SMEM_{st.upper()}_{r.upper()}_FLOATS = {n};" in text
        assert "enum Stage { " + ", ".join(f"ST_{s.upper()}" for s in plan.STAGE_NAMES) in text


def test_a_layout_that_no_longer_fits_fails_at_the_sections_line(monkeypatch):
    """The sections static_assert what they need of the plan's layout: a region made too small is a compile
    error at the section's own line, not a silent overflow."""
    from workbench.compiler import header
    orig = schedule.smem_regions

    def shrunk(cfg, launch=plan.Launch()):
        r = orig(cfg, launch)
        r["attention_decode"]["warps"] = (r["attention_decode"]["warps"][0], 4)
        return r
    monkeypatch.setattr(schedule, "smem_regions", shrunk)
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(get_config("tiny")))
    assert any(m[0] == "kernels/sections/attention_decode.cuh" and "static assertion" in m[3]
               for m in e.value.messages), e.value.messages


def test_the_decode_step_is_generated_from_the_plan():
    """One statement per stage, in plan order, with its buffers; a barrier only where the plan needs one."""
    from workbench.compiler.header import decode_step, stage_call
    cfg = get_config("tiny")
    text = decode_step(cfg, plan.Launch())
    calls = re.findall(r"WB_(GRID|BLOCK0)\(ST_(\w+),", text)
    assert [c[1].lower() for c in calls] == list(plan.STAGE_NAMES)
    # a whole barrier or only its arrival (the stage after it loads early: Launch.early), one per slot's end
    assert text.count("WB_SYNC(") + text.count("WB_ARRIVE(") == len({s.stages[-1][0] for s in schedule.slots(cfg)})
    assert ("stage_o_proj_residual(P->o, P->wo + layer * WB_PER_LAYER_WO, layer, smem, /* → */ P->x /* += */, P->h)"
            in text)
    # the MLP's two stages with a block barrier between them, and no grid barrier
    mlp = text[text.index("WB_GRID(ST_GATE_UP_SILU"):text.index("WB_GRID(ST_DOWN_RESIDUAL")]
    assert "wb_syncthreads();" in mlp and "WB_SYNC(" not in mlp and "WB_TAP_LOCAL_COPIES(wb_tap_f32_units(" in mlp
    # block 0's copy of o_proj's x must be done before the MLP's blocks add into x
    assert "WB_TAP_SYNC(ST_O_PROJ_RESIDUAL, layer);" in text and text.count("WB_TAP_SYNC(") == 1
    assert stage_call(plan.stage("sampling")).startswith("wb_set_value(s.sampled, stage_sampling(P->logits")
    for st in plan.STAGES:
        assert f"// {st.math}" in text


def test_cupys_nvrtc_binding_makes_the_same_kernel():
    """Without cuda-bindings (a GPU machine may have CuPy alone) a build with PTX sections reaches NVRTC through
    CuPy's own binding: the same PTX, and the same log on an error; a cubin it does not make."""
    from workbench.compiler import nvrtc as N
    asm = assemble(get_config("tiny"))
    opts = ["--gpu-architecture=compute_90", *N.NVRTC_OPTIONS]
    a, b = N.nvrtc_program(asm.source, opts, cubin=False), N._nvrtc_cupy(asm.source, opts, cubin=False)
    assert a[0] and b[0] and a[2] == b[2] and ".func" in a[2]
    bad = asm.source + "__device__ void wb_broken() { undeclared_thing += 1; }\n"
    a, b = N.nvrtc_program(bad, opts, cubin=False), N._nvrtc_cupy(bad, opts, cubin=False)
    assert not a[0] and not b[0] and a[1] == b[1] and "undeclared_thing" in a[1]
    with pytest.raises(FileNotFoundError, match="cuda-bindings"):
        N._nvrtc_cupy(asm.source, opts)


def test_an_attention_budget_without_a_ring_is_one_clear_compile_error():
    """attn_kv_bytes too small for one warp's ring on NVIDIA: the build stops at attention's section with the reason,
    not at a fault on the GPU."""
    cfg = get_config("tiny")
    opt = BuildOptions(launch=plan.Launch(attn_kv_bytes=plan.Launch().attn_ring_bytes(cfg) - 1))
    assert opt.launch.attn_warps(cfg) == 0
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(cfg, opt))
    assert "attention_decode.cuh" in str(e.value) and "attn_kv_bytes holds no warp's ring" in str(e.value)


def test_the_carveout_knob_changes_no_code_and_takes_percents():
    """smem_carveout is the driver's L1/shared split, set at launch (runtime._install): the same source, flags and
    cache key as the default build, so an A/B of it measures the split alone; `opt.smem_carveout=100` from text."""
    from workbench.compiler.assemble import option_from_text
    cfg = get_config("tiny")
    base, full = assemble(cfg), assemble(cfg, BuildOptions(smem_carveout=100))
    assert (base.source, base.flags, base.key) == (full.source, full.flags, full.key)
    assert option_from_text("smem_carveout", "100") == 100
    for bad in (101, -2, 50.0, "max"):
        with pytest.raises(ValueError, match="smem_carveout must be a percent"):
            BuildOptions(smem_carveout=bad)


@pytest.mark.parametrize("bad", [0, 4, 12, 72, "16", 16.0])
def test_early_loads_takes_whole_chunks(bad):
    with pytest.raises(ValueError, match="early_loads must be a number of 16-byte pieces a thread, a multiple of 8"):
        plan.Launch(early_loads=bad)


def test_two_chunks_early_take_a_row_pairs_whole_unit_and_the_same_code_otherwise():
    """early_loads=16 doubles the early region; the kernel takes as many whole chunks of a unit as it holds (at most
    the unit's): the 1B's row pairs (K = 2,048: two chunks of four loads a row) come whole, through
    warp_rows_dot_early; at 8 the build is the one it was (the first chunk to registers, warp_rows_dot)."""
    cfg = get_config("llama-3.2-1b")
    eight, sixteen = (dataclasses.replace(_early(*EARLY), launch=plan.Launch(early_loads=n)) for n in (8, 16))
    assert schedule.early_region(cfg, sixteen.launch)[1] == 2 * schedule.early_region(cfg, eight.launch)[1]
    # the two-chunk path is compiled in (its shared-memory reads of the second chunk), not only the larger region
    ptx8, ptx16 = (compile_ptx(assemble(cfg, o))[0] for o in (eight, sixteen))
    assert ptx16.count("ld.shared.v4") > ptx8.count("ld.shared.v4")


def test_an_early_region_that_cannot_fit_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^early_loads=32: the early region \(262,144 B.*lower early_loads"):
        schedule.early_region(get_config("llama-3.2-1b"), plan.Launch(early_loads=32))
