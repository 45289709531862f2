"""The weight stream (Launch.stream): its plan table, its shared-memory layout, its build, and the report
of a section that reads other weights than the plan streams to it. The GPU side is in tests/test_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest

from workbench import abi, plan, schedule
from workbench.compiler.assemble import BuildOptions, assemble, smem_bytes, with_fields
from workbench.compiler.compile import compile_cubin, resource_usage
from workbench.model.config import PRESETS, get_config
from workbench.run.runtime import STATUS, StreamMismatch, stream_mismatch

STREAM = BuildOptions(launch=plan.Launch(stream=True))


def test_pieces_split_rows_into_whole_loads_within_a_slot():
    for k in (264, 712, 2048, 3072, 4096, 8192, 9728, 14336, 896, 4864):
        n = schedule.pieces(k)
        assert k % n == 0 and (k // n) % 8 == 0, k
        assert 2 * (k // n) <= schedule.SLOT_BYTES or k // n <= 8, k
        # the fewest: one piece fewer either breaks a row unevenly or overflows the slot
        assert n == 1 or any(cond for cond in (k % (n - 1) != 0, (k // (n - 1)) % 8 != 0,
                                                 2 * (k // (n - 1)) > schedule.SLOT_BYTES)), k
    assert (schedule.pieces(2048), schedule.pieces(8192), schedule.pieces(14336), schedule.pieces(3072)) == (1, 4, 7, 2)


def test_the_streams_are_the_weight_stages_in_decode_order():
    cfg = get_config("llama-3.2-1b")
    s = schedule.streams(cfg)
    # down reads Wdᵀ by columns, not as dot products of whole rows: it keeps the register path (Stage.streamed)
    assert [x.stage for x in s] == ["qkv_rope_append", "o_proj_residual", "gate_up_silu", "lm_head"]
    assert [(x.buffer, x.rows, x.k) for x in s] == [("wqkv", 2, 2048), ("wo", 1, 2048), ("wgu", 2, 2048),
                                                    ("lm_head", 1, 2048)]
    # every block's items together are every row piece of the matrix, once
    launch = plan.Launch(stream=True)
    for x in s:
        assert sum(x.items(launch, b) for b in range(launch.grid)) == x.units * x.rows * x.pieces
        assert schedule.stream_stage(cfg, x.stage) == x
    assert schedule.stream_stage(cfg, "attention_decode") is None
    # the streamed bytes are the plan's weight bytes but down's (read by its section) and the embedding row's
    per_token = sum(x.units * x.rows * x.k * 2 * (cfg.n_layers if x.scope == "layer" else 1) for x in s)
    assert per_token == cfg.weight_bytes_per_token() - cfg.n_layers * schedule.stage_weight_bytes(cfg, "down_residual")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_ring_fits_beside_every_stage(name):
    cfg = get_config(name)
    launch = plan.Launch(stream=True)
    pages = schedule.ring_slots(cfg, launch)
    assert 1 <= pages <= schedule.MAX_RING_SLOTS
    assert smem_bytes(cfg, STREAM) + schedule.STATIC_SMEM <= schedule.SMEM_LIMIT
    # the partials hold a float per item of the largest stage whose units span several items
    assert schedule.partial_floats(cfg, launch) >= max(x.max_items(launch) for x in schedule.streams(cfg) if x.combines)
    # without the stream, nothing of it is laid out
    assert schedule.partial_floats(cfg, plan.Launch()) == 0 and schedule.ring_slots(cfg, plan.Launch()) == 0
    assert smem_bytes(cfg, BuildOptions()) == 4 * schedule.smem_floats(cfg)


def test_too_many_threads_for_the_ring_is_one_clear_error():
    wide = dataclasses.replace(get_config("tiny"), intermediate=30000)      # 117 KB of activations in one stage
    assert schedule.ring_slots(wide, plan.Launch(threads=256, stream=True)) >= 1
    with pytest.raises(ValueError, match="1024 threads leave no room for the weight ring: 31 consumer warps"):
        schedule.ring_slots(wide, plan.Launch(threads=1024, stream=True))


def test_a_unit_that_is_not_whole_adjacent_rows_is_refused(monkeypatch):
    odd = plan.Use("wo", rows=lambda c, r: ((2 * r * c.q_dim, (2 * r + 1) * c.q_dim),))   # every other row
    patched = tuple(dataclasses.replace(s, reads=(plan.Use("o"), odd, plan.Use("x"))) if s.name == "o_proj_residual"
                    else s for s in plan.STAGES)
    monkeypatch.setattr(plan, "STAGES", patched)
    with pytest.raises(ValueError, match="o_proj_residual: a unit of wo must be whole adjacent rows"):
        schedule.streams(get_config("tiny"))


@pytest.mark.parametrize("name,attn_warps,slot", [("tiny", 1, 4096), ("llama-3.2-1b", 1, 4096),
                                                  ("llama-3.2-1b", 4, 4096), ("llama-3.2-1b", 1, 2048)])
def test_the_stream_build_compiles_without_spills(name, attn_warps, slot):
    """With attention given more warps' K/V rings (stream_attn_warps), the weight ring keeps fewer pages; with
    smaller slots (slot_bytes), each row is cut into more pieces and the ring holds more, smaller pages."""
    opt = with_fields(STREAM, stream_attn_warps=attn_warps, slot_bytes=slot)
    cfg = get_config(name)
    assert opt.launch.attn_warps(cfg) == attn_warps
    if attn_warps > 1:
        assert schedule.ring_slots(cfg, opt.launch) < schedule.ring_slots(cfg, STREAM.launch)
    if slot < schedule.SLOT_BYTES:
        assert schedule.ring_slots(cfg, opt.launch) > schedule.ring_slots(cfg, STREAM.launch)
        assert all(x.pieces == 2 * y.pieces for x, y in zip(schedule.streams(cfg, opt.launch),
                                                            schedule.streams(cfg, STREAM.launch)))
    asm = assemble(cfg, opt)
    assert f"WB_ATTN_WARPS = {attn_warps}," in asm.source and f"WB_SLOT_BYTES = {slot}," in asm.source
    assert "wb_stream_step" in asm.source and "static_assert(wb_pieces(" in asm.source
    (r,) = resource_usage(compile_cubin(asm)[0])
    assert r.kernel == "wb_generate" and r.stack == 0, r
    assert r.registers <= 128


def test_register_stages_of_a_stream_build_are_left_out_of_the_stream():
    """Launch.register_stages (stream_register as text): those stages read their weights straight to registers,
    so the streamer skips them and the header's stage mask leaves them out; a name that is not a streaming stage,
    or register stages without a stream build, is one clear error before anything compiles. The metered build
    compiles without spills on the 1B."""
    cfg = get_config("llama-3.2-1b")
    opt = with_fields(STREAM, stream_register="qkv_rope_append+o_proj_residual",
                      defines=(("WB_STREAM_AHEAD", "1"), ("WB_STREAM_INFLIGHT", "1")))
    names = [x.stage for x in schedule.streams(cfg, opt.launch)]
    assert names == [x.stage for x in schedule.streams(cfg, STREAM.launch)
                     if x.stage not in ("qkv_rope_append", "o_proj_residual")]
    asm = assemble(cfg, opt)
    mask = sum(1 << plan.STAGE_NAMES.index(n) for n in names)
    assert f"WB_STREAMED_STAGES = {hex(mask)}ull;" in asm.source and "WB_STREAM_REGISTER_STAGES = true;" in asm.source
    assert "st.stream<" in asm.source and "ST_O_PROJ_RESIDUAL, layer, P->wo" not in asm.source.split("wb_stream_step")[-1]
    (r,) = resource_usage(compile_cubin(asm)[0])
    assert r.stack == 0 and r.registers <= 128, r
    with pytest.raises(ValueError, match="attention_decode: not a stage that streams weights"):
        assemble(cfg, with_fields(STREAM, stream_register="attention_decode"))
    with pytest.raises(ValueError, match="every streaming stage is named"):     # the streamer would have nothing
        assemble(cfg, with_fields(STREAM, stream_register="+".join(x.stage for x in schedule.streams(cfg))))
    with pytest.raises(ValueError, match="set stream too"):
        with_fields(stream_register="o_proj_residual")


def test_the_stage_lead_meter_counts_the_stages_every_block_enters():
    """WB_STREAM_LEAD: a stream's pages wait for the consumers' entry into the stage that many before its own,
    counted over the stages every block enters (header.grid_entries: block 0's embedding, sampler and publish are
    not among them). Each stream's call names its stage's entry in the step, from the same list, and the build
    compiles without spills on the 1B; without the meter the counter is not compiled in."""
    from workbench.compiler.header import grid_entries
    cfg = get_config("llama-3.2-1b")
    entries = grid_entries(cfg)
    assert entries[0] == ("qkv_rope_append", 0) and entries[-1] == ("lm_head", -1)
    assert len(entries) == 5 * cfg.n_layers + 1 and ("embedding", -1) not in entries
    asm = assemble(cfg, with_fields(STREAM, defines=(("WB_STREAM_LEAD", "1"),)))
    assert f"WB_GRID_ENTRIES_A_STEP = {len(entries)};" in asm.source
    step = asm.source.split("bool wb_stream_step(")[-1]
    per_layer = 5
    for x in schedule.streams(cfg, STREAM.launch):
        want = (f"{entries.index((x.stage, 0))} + layer * {per_layer}, " if x.scope == "layer"
                else f"{entries.index((x.stage, -1))}, ")
        line = next(ln for ln in step.splitlines() if f"ST_{x.stage.upper()}," in ln)
        assert want in line, (x.stage, line)
    (r,) = resource_usage(compile_cubin(asm)[0])
    assert r.stack == 0 and r.registers <= 128, r
    plain_stream = assemble(cfg, STREAM)
    assert "wb_grid_entered" in plain_stream.source               # the library's text, but compiled out:
    assert compile_cubin(plain_stream)[0] != compile_cubin(asm)[0]


def test_the_exit_meter_holds_back_only_the_stream_after_a_stage_that_reads_no_weight():
    """WB_STREAM_EXIT: a stream whose stage follows one that reads no weight (attention) waits until the consumers
    have left that stage. Only o_proj's stream is marked so, in every preset (the stage before qkv is the last
    layer's down, which reads its weights, or none in the first layer); the build with both meters compiles without
    spills on the 1B, and without the exit meter its counter is not compiled in."""
    from workbench.compiler.header import after_quiet
    from workbench.model.config import PRESETS
    for name, c in PRESETS.items():
        quiet = {x.stage for x in schedule.streams(c, STREAM.launch) if after_quiet(c, x)}
        assert quiet == {"o_proj_residual"}, (name, quiet)
    cfg = get_config("llama-3.2-1b")
    asm = assemble(cfg, with_fields(STREAM, defines=(("WB_STREAM_LEAD", "1"), ("WB_STREAM_EXIT", "1"))))
    step = asm.source.split("bool wb_stream_step(")[-1]
    for x in schedule.streams(cfg, STREAM.launch):
        line = next(ln for ln in step.splitlines() if f"ST_{x.stage.upper()}," in ln)
        assert f", {str(x.stage == 'o_proj_residual').lower()})) return true;" in line, line
    cubin = compile_cubin(asm)[0]
    (r,) = resource_usage(cubin)
    assert r.stack == 0 and r.registers <= 128, r
    lead = compile_cubin(assemble(cfg, with_fields(STREAM, defines=(("WB_STREAM_LEAD", "1"),))))[0]
    # the counter is a shared variable of the cubin's symbol table with the meter, absent without it
    assert b"wb_grid_exited" in cubin and b"wb_grid_exited" not in lead and b"wb_grid_entered" in lead


def test_the_plain_build_has_no_stream():
    asm = assemble(get_config("tiny"))
    assert "#define WB_STREAM 0" in asm.source
    assert "if (st.stream<" not in asm.source


def _status(cfg, stage, layer, step, block, want, got):
    st = [0] * abi.STATUS_LEN
    idx = plan.STAGE_NAMES.index(stage)
    st[STATUS["code"]] = abi.ERRORS.index("stream")
    st[STATUS["stage"]], st[STATUS["layer"]], st[STATUS["step"]], st[STATUS["block"]] = idx, layer, step, block
    st[STATUS["stream_want"]], st[STATUS["stream_got"]] = want, got
    return st


def test_a_stream_report_names_the_stage_and_what_it_found():
    cfg = get_config("llama-3.2-1b")
    launch = plan.Launch(stream=True)
    want = abi.where(plan.STAGE_NAMES.index("o_proj_residual"), 3, 15)
    got = abi.where(plan.STAGE_NAMES.index("o_proj_residual"), 3, 0)
    e = stream_mismatch(cfg, launch, _status(cfg, "o_proj_residual", 3, 7, 5, want, got))
    assert isinstance(e, StreamMismatch) and e.where == ("o_proj_residual", 3, 7)
    text = str(e)
    assert text.startswith("weight stream: o_proj_residual of layer 3 at step 7, block 5: ")
    assert "its item 15" in text and "found item 0 of o_proj_residual of layer 3" in text
    assert "the plan streams it 2,048 units of 1 row(s) of wo (2048 wide)" in text
    never = stream_mismatch(cfg, launch, _status(cfg, "lm_head", -1, 2, 0, abi.where(6, -1, 30), -1))
    assert "its item 30 never arrived in the ring" in str(never) and never.where == ("lm_head", -1, 2)
