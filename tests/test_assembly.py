"""Assembly of the sections into one source, #line mapping of compiler messages, and a compile-only build for sm_90
through NVRTC (no GPU needed)."""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from workbench.build.assemble import (PARAMS, SECTIONS, BuildOptions, Params, assemble, defines, section_path,
                                smem_bytes)
from workbench.build.compile import CompileError, compile_cubin, parse_log, resource_usage
from workbench.model.config import PRESETS, get_config


@pytest.fixture(scope="module")
def tiny_asm():
    return assemble(get_config("tiny"))


def test_source_is_self_contained_with_line_markers(tiny_asm):
    src = tiny_asm.source
    assert not re.search(r"^\s*#\s*include", src, re.M)
    for name in SECTIONS:
        assert f'#line 1 "kernels/sections/{name}.cuh"' in src
    assert '#line 1 "kernels/portability.cuh"' in src and '#line 1 "kernels/monokernel.cuh"' in src


def test_shapes_arrive_only_as_defines():
    cfg = get_config("llama-3.2-1b")
    d = defines(cfg, BuildOptions())
    assert d["WB_D"] == "2048" and d["WB_VOCAB"] == "128256" and d["WB_FF"] == "8192"
    src = assemble(cfg).source
    body = src.split('#line 1 "kernels/portability.cuh"', 1)[1]
    for shape in ("2048", "8192", "128256"):
        assert not re.search(rf"\b{shape}\b", body), f"literal {shape} in the kernel sources"


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
    assert [f[0] for f in Params._fields_] == [p[0] for p in PARAMS]


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
    k = next(i for i, l in enumerate(lines) if "P->hmlp[j] =" in l)
    lines[k] = lines[k] + " undeclared_symbol += 1;"
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(get_config("tiny"), overrides={"gate_up_silu": "\n".join(lines)}))
    err = e.value
    assert any(m[0] == "kernels/sections/gate_up_silu.cuh" and m[1] == k + 1 and "undeclared_symbol" in m[4]
               for m in err.messages), err.messages
    assert f"kernels/sections/gate_up_silu.cuh:{k + 1}: error" in str(err)


def test_parse_log_ignores_noise():
    log = 'kernels/sections/matvec.cuh(12): warning #177-D: variable "x" was declared but never referenced\nnoise\n'
    (m,) = parse_log(log)
    assert m[:3] == ("kernels/sections/matvec.cuh", 12, "warning")


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b"])
@pytest.mark.parametrize("timing", [False, True])
def test_sm90_build_has_no_spills(name, timing):
    cubin, _ = compile_cubin(assemble(get_config(name), BuildOptions(timing=timing)))
    (r,) = resource_usage(cubin)
    assert r.kernel == "wb_generate"
    assert r.stack == 0, f"{name}: {r.stack} B of local memory (spills)"
    assert 32 <= r.registers <= 128                  # 512 threads, one block per SM: at most 128 registers
    assert smem_bytes(get_config(name), 512) <= 227 * 1024


def test_timing_switch_compiles_away():
    plain = assemble(get_config("tiny")).source
    assert "#define WB_TIMING 0" in plain
    # the stamps exist only under #if WB_TIMING; with it off the kernel has no globaltimer read outside the barrier
    cubin0, _ = compile_cubin(assemble(get_config("tiny")))
    cubin1, _ = compile_cubin(assemble(get_config("tiny"), BuildOptions(timing=True)))
    from workbench.build.compile import disassemble
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
        for s in range(S):
            if s == 0 and i > 0:
                continue                                        # the kernel stamps the first embedding once
            for b in range(G):
                t[i, s, b] = (now + 400 + 100 * b, now + 1000)     # block b works 400+100b ns, all leave at 1000
            now += 1000
    rows = {r.stage: r for r in stage_table(cfg, t)}
    assert rows["qkv_rope_append"].us_per_token == pytest.approx(cfg.n_layers * 1.0)
    assert rows["lm_head"].work_us == pytest.approx(0.5) and rows["lm_head"].wait_us == pytest.approx(0.5)


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
    from workbench.build.assemble import option_from_text
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
        assert smem_bytes(cfg, 512) <= 227 * 1024


def test_compiling_leaves_python_bytes_alone():
    # NVRTC writes its log and cubin into the buffers we hand it; a cached one-byte bytes object must never be one
    compile_cubin(assemble(get_config("tiny")))
    assert b" "[0] == 0x20 and bytes(1)[0] == 0


def test_timing_slots_agree_with_slot_names():
    from workbench.build.assemble import timing_slots
    from workbench.measure.timing import slot_names
    for cfg in PRESETS.values():
        assert len(slot_names(cfg)) == timing_slots(cfg) == int(defines(cfg, BuildOptions())["WB_SLOTS"])
