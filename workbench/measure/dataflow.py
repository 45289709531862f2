"""Schedules priced block by block: every block runs its own list of items, an item starts once the producer items
it reads from have finished (a hand-off), and a block loads the weights of its next items while it waits.

`workbench.measure.simulate` prices the barrier design slot by slot: every block leaves a barrier together. This
module runs the same costs (`simulate.Costs`, calibrated on the kernel's traces) as events, so that a design in
which blocks wait for a few producers, not the grid, can be priced before it is built (DESIGN.md, the simulator):

* **Items and hand-offs** come from the plan: `worklists.unit_blocks` says which blocks run a stage's units,
  `worklists.handoffs`' rule (the rows a consumer block reads against the rows each producer block wrote) says
  which producer blocks each consumer block waits for. With `handoff="barrier"` every item of a slot waits for
  every block to finish the slot before, and leaves over the trace's spread of departures: the slot simulator's
  model, run as events (the two agree: tests/test_dataflow.py). With "counter", an item waits for its own
  producers and sees them `counter_us` after the last of them finished (plus `merge_us` for a split kv head's
  partials).
* **Deals.** `Design(deal="heads")` prices the deal a dataflow step needs (worklists.head_group): each kv head's q,
  k and v row pairs, its attention and its share of the O-projection (split by heads, `worklists.split_by_heads`)
  on one group of blocks.
* **Memory.** The fluid model of `simulate._share`: the transfers in flight share `hbm_tbps` evenly, each at most
  `sm_gbps`. A block streams its item's bytes after its latency; while it waits for inputs or pays a latency it
  loads the weight bytes of its next items, in order, up to what it may hold (`Design.early_bytes`; None: today's
  early loads, the first chunk of the next early stage behind a barrier). K/V bytes stream only once the item runs.

Write-after-read hazards are not modelled: in the plan's step each is ordered through a chain of reads-after-write
(the next layer's qkv, which overwrites q, waits for down, which waits for everything attention fed).
"""
from __future__ import annotations

import dataclasses

import numpy as np

try:
    import numba
except ImportError:          # optional (the dev extra): without it `run` takes the Python engine, ~10× slower
    numba = None

from .. import plan, schedule
from ..model.config import ModelConfig
from ..worklists import attention_split, fan_in, kv_head_of, reads_cache, split_by_heads, unit_blocks
from .simulate import Costs, Design, _jitter, parse_design, simulate

WAIT, LATENCY, STREAM, DONE = range(4)


@dataclasses.dataclass
class Node:
    """One block's share of one (stage, layer) of one token, or (stage None) the block's arrival at a barrier."""
    key: int                   # token · len(execution) + the entry's index; a barrier: −(its index + 1)
    block: int
    stage: str | None
    latency: float             # µs before its bytes
    weight: float              # bytes it may load ahead
    cache: float               # bytes it streams once it runs
    deps: list                 # [(producer key, set id)]: it waits for those blocks to finish that key
    delay: list                # per dep: µs after the last of them finished that this block sees it


def stages_of(cfg: ModelConfig, design: Design) -> dict[str, plan.Stage]:
    """The plan's stages as the design deals them: with deal "heads", every layer stage whose units each work for
    one kv head goes to that head's group, and a stage that reads a whole activation laid out by heads is split by
    heads first."""
    out = {s.name: s for s in plan.STAGES}
    if design.deal == "today":
        return out
    if design.deal != "heads":
        raise ValueError(f"deal {design.deal!r}: today or heads")
    for s in plan.STAGES:
        if s.scope != "layer" or s.runs_on != "grid":
            continue
        split = split_by_heads(cfg, s)
        if split is not s:
            out[s.name] = split
        elif reads_cache(s) or all(kv_head_of(cfg, s, u) is not None for u in range(s.units(cfg, plan.Launch()))):
            out[s.name] = dataclasses.replace(s, deal="heads")
    return out


class _Graph:
    """Nodes per block in order, and the producer sets they wait on."""

    def __init__(self, cfg, costs, pos, launch, design, tokens):
        self.cfg, self.grid = cfg, launch.grid
        stages = stages_of(cfg, design)
        seq = schedule.execution(cfg)
        self.n_exec = len(seq)
        slots = schedule.slots(cfg)
        slot_of = {st: sl.index for sl in slots for st in sl.stages}
        label_of = {sl.index: sl.label for sl in slots}
        barrier = design.handoff == "barrier"
        # which blocks run each stage, and how many units
        blocks_of: dict = {}
        for name in dict.fromkeys(n for n, _ in seq):
            st = stages[name]
            ub = unit_blocks(cfg, st, launch, pos)
            per, split = {}, {}                  # units per block; a block's place among its unit's blocks
            for blocks in ub:
                for i, b in enumerate(blocks):
                    per[b] = per.get(b, 0) + 1
                    split[b] = i
            blocks_of[name] = (st, per, len(ub), split)
        # fan-in sets: (consumer, buffer) → {consumer block: producer blocks}
        self.sets: list[tuple] = []
        self._set_ids: dict = {}
        fan: dict = {}
        s_att, chunk = attention_split(cfg, launch, pos)
        self.cap = float(design.early_bytes if design.early_bytes is not None
                         else 4 * schedule.early_region(cfg, launch)[1])     # today's early region, in bytes
        self.nodes: list[list[Node]] = [[] for _ in range(self.grid)]
        first_of_slot: dict = {}                 # (token, slot, block) → already charged the slot's latency
        jit = {}
        for sl in slots:
            busy = sorted({b for name, _ in sl.stages for b in blocks_of[name][1]})
            j = _jitter(len(busy), costs.jitter_us.get(sl.label, 0.0), sl.index)
            jit[sl.index] = dict(zip(busy, j))
        for t in range(tokens):
            for e, (name, layer) in enumerate(seq):
                st, per, n_units, split = blocks_of[name]
                key = t * self.n_exec + e
                slot = slot_of[name, layer]
                label = label_of[slot]
                wbytes = schedule.stage_weight_bytes(cfg, name) / max(1, n_units)
                # behind barriers a node waits for the barrier only (_wire_barriers): no fan-in to work out
                deps_by_block = {} if barrier else self._deps(cfg, stages, st, name, layer, t, launch, pos, fan, seq)
                for b, units in per.items():
                    lat = 0.0
                    if (t, slot, b) not in first_of_slot:
                        first_of_slot[t, slot, b] = True
                        lat += max(0.0, costs.fixed_us.get(label, 0.0) + jit[slot].get(b, 0.0))
                    cache = 0.0
                    if reads_cache(st):               # the block's chunk of its kv head's positions
                        positions = max(0, min(chunk, pos + 1 - split[b] * chunk))
                        cache = positions * 4 * cfg.head_dim
                        lat += positions * costs.position_ns / 1e3
                    deps, delay = [], []
                    if not barrier:
                        for pkey, blocks, merge in deps_by_block.get(b, []):
                            deps.append((pkey, self._set(blocks)))
                            delay.append(costs.counter_us + (costs.merge_us if merge else 0.0))
                    self.nodes[b].append(Node(key, b, name, lat, units * wbytes, cache, deps, delay))
                if barrier and (b_slot := schedule.barrier_slot(cfg, name, layer)) is not None:
                    for b in range(self.grid):         # every block's arrival at the barrier
                        self.nodes[b].append(Node(-(t * 10_000 + b_slot + 1), b, None, 0.0, 0.0, 0.0, [], []))
        if barrier:                          # a slot's first node on each block waits for the barrier before it
            # a split kv head's last block folds the partials in before it arrives: the barrier after it waits
            merge = {sl.index: costs.merge_us for sl in slots if s_att > 1 and any(reads_cache(stages[n])
                                                                                   for n, _ in sl.stages)}
            self._wire_barriers(costs, slots, merge, measured=not design.queue)
        self.loadable = [[nd.weight if self._ahead_ok(nd, design, launch) else 0.0 for nd in lst]
                         for lst in self.nodes]
        self.copies = self._copies(cfg, launch, seq, tokens)

    def _copies(self, cfg, launch, seq, tokens) -> list[list[tuple[int, int, float]]]:
        """Launch.ahead's copy, per block in decode order: (the node at which it is posted, the node it is for, its
        bytes). The kernel posts it at the block's arrival at the barrier after `posted_after` (attention's), and
        its issuer's early path sends it at once, in every block, whether or not the block has units of the issuer;
        with counters (no barrier) the block posts it once past its nodes of that slot. It lands in a region of its
        own (not the early loads'); what has not landed when its stage starts streaming, the stage streams itself."""
        out: list = [[] for _ in range(self.grid)]
        a = schedule.ahead(cfg, launch)
        if a is None:
            return out
        per = a.block_bytes(self.grid)
        n_exec = len(seq)
        for b, lst in enumerate(self.nodes):
            index = {nd.key: i for i, nd in enumerate(lst)}
            for t in range(tokens):
                for e, (name, layer) in enumerate(seq):
                    dest = index.get(t * n_exec + e)
                    if name != a.stage or not per[b] or dest is None:
                        continue
                    after = t * n_exec + seq.index((a.posted_after, layer))
                    b_slot = schedule.barrier_slot(cfg, a.posted_after, layer)
                    post = index.get(-(t * 10_000 + b_slot + 1)) if b_slot is not None else None
                    if post is None:                  # no barrier node: the first node past the slot
                        post = next(i for i, nd in enumerate(lst) if nd.stage is not None and nd.key > after)
                    out[b].append((post, dest, float(per[b])))
        return out

    def _ahead_ok(self, nd: Node, design: Design, launch) -> bool:
        if nd.stage is None:
            return False
        return design.early_bytes is not None or nd.stage in launch.early

    def _set(self, blocks) -> int:
        blocks = tuple(sorted(blocks))
        if blocks not in self._set_ids:
            self._set_ids[blocks] = len(self.sets)
            self.sets.append(blocks)
        return self._set_ids[blocks]

    def _deps(self, cfg, stages, st, name, layer, t, launch, pos, fan, seq):
        """{consumer block: [(producer key, producer blocks, merge)]} for (stage, layer) of token t."""
        out: dict = {}
        e_of = {x: i for i, x in enumerate(seq)}
        for use in st.reads:
            if not use.active(cfg) or plan.BUFFERS[use.buffer].kind == "weight":
                continue
            prod = schedule.producer(cfg, use.buffer, name, layer)
            tp = t
            if prod is None:                     # the previous token wrote it
                writers = [x for x in seq if stages[x[0]].writes_buffer(use.buffer)]
                if not writers or t == 0:
                    continue
                prod, tp = writers[-1], t - 1
            p = stages[prod[0]]
            k = (name, use.buffer, prod[0])
            if k not in fan:
                fan[k] = fan_in(cfg, st, use, p, launch, pos)
            merge = reads_cache(p) and attention_split(cfg, launch, pos)[0] > 1
            pkey = tp * self.n_exec + e_of[prod]
            for c, blocks in fan[k].items():
                if blocks:
                    out.setdefault(c, []).append((pkey, blocks, merge))
        return out

    def _wire_barriers(self, costs, slots, merge: dict, measured: bool):
        """Every node after a barrier node waits for every block's arrival there, and leaves at its place in the
        slot's spread of departures (the slot simulator's, block for block); not `measured` (queue=1), every block
        `counter_us` after the last arrival, and the queue it then starts behind is what spreads them."""
        everyone = self._set(range(self.grid))
        spread = {}
        for sl in slots:
            first, end = costs.barrier_us.get(sl.label, (costs.counter_us,) * 2) if measured else (costs.counter_us,) * 2
            spread[sl.index] = merge.get(sl.index, 0.0) + np.random.default_rng(10_000 + sl.index).permutation(
                np.linspace(first, end, self.grid))
        for b in range(self.grid):
            last = None
            for nd in self.nodes[b]:
                if last is not None:
                    nd.deps, nd.delay = [(last.key, everyone)], [float(spread[(-last.key - 1) % 10_000][b])]
                last = nd if nd.stage is None else None


def run(cfg: ModelConfig, costs: Costs, pos: int = 0, launch: plan.Launch = plan.Launch(),
        design: Design = Design(), tokens: int = 2, engine: str | None = None) -> tuple[float, dict]:
    """(µs per token, {(key, block): (start, finish)}): the steady token's time, publish to publish, and every
    node's span. The first token starts cold; the last token's span is the one measured.
    engine: "numba" (the event loop compiled over flat arrays, `_events`; the default where numba imports) or
    "python" (`_run_python`, the reference: the same events and the same floating-point operations in the same
    order, so the two agree bit for bit, tests/test_dataflow.py)."""
    if engine is None:
        engine = "python" if numba is None else "numba"
    if engine not in ("numba", "python"):
        raise ValueError(f"engine {engine!r}: numba or python")
    if engine == "numba" and numba is None:
        raise ImportError("engine 'numba' needs numba (pip install numba; the dev extra has it)")
    g = _Graph(cfg, costs, pos, launch, design, tokens)
    spans = (_run_python if engine == "python" else _run_flat)(g, costs, design)
    n = g.n_exec
    pub = [spans[k, 0][1] for k in ((tok + 1) * n - 1 for tok in range(tokens))]
    return pub[-1] - pub[-2], spans


def _run_python(g: _Graph, costs: Costs, design: Design) -> dict:
    """The event engine over the graph's nodes: {(key, block): (start, finish)}."""
    grid, sets = g.grid, g.sets
    members: dict = {}                                    # key → [set id] waited on, through blocks
    for lst in g.nodes:
        for nd in lst:
            for pkey, sid in nd.deps:
                members.setdefault(pkey, set()).add(sid)
    left = {}                                             # (key, set id) → producer blocks not yet finished
    last = {}                                             # (key, set id) → the latest finish so far
    for pkey, sids in members.items():
        for sid in sids:
            left[pkey, sid] = len(g.sets[sid])
            last[pkey, sid] = 0.0
    in_set = [set(s) for s in sets]
    cur = [0] * grid
    phase = [WAIT] * grid
    t_lat = [0.0] * grid
    main = [0.0] * grid
    held = [[0.0] * len(lst) for lst in g.nodes]
    total_held = [0.0] * grid
    cap_sm = costs.sm_gbps * 1e3
    ring = design.early_bytes is not None
    queue_us = 0.0
    spans: dict = {}
    start = [0.0] * grid
    t = 0.0
    # Launch.ahead's copies: each block's next one (cp_k), what is left of it once posted (cp_left, −1: not yet),
    # and what of each node the copies brought (copied)
    cp_k = [0] * grid
    cp_left = [-1.0] * grid
    copied = [[0.0] * len(lst) for lst in g.nodes]

    known: dict = {}                                      # block → (its node, the time its inputs are seen)

    def ready(b):
        """When block b's current node sees all its inputs (None: not all finished yet)."""
        got = known.get(b)
        if got is not None and got[0] == cur[b]:
            if got[1] is not None:
                return got[1]
            if left[got[2]] > 0:                          # still waiting on the same producers
                return None
        nd = g.nodes[b][cur[b]]
        r = 0.0
        for (pkey, sid), d in zip(nd.deps, nd.delay):
            if left[pkey, sid] > 0:
                known[b] = (cur[b], None, (pkey, sid))
                return None
            r = max(r, last[pkey, sid] + d)
        known[b] = (cur[b], r, None)
        return r

    def finish(b, now):
        nd = g.nodes[b][cur[b]]
        spans[nd.key, b] = (start[b], now)
        for sid in members.get(nd.key, ()):
            if b in in_set[sid]:
                left[nd.key, sid] -= 1
                last[nd.key, sid] = max(last[nd.key, sid], now)
        total_held[b] -= held[b][cur[b]]
        cur[b] += 1
        phase[b] = WAIT if cur[b] < len(g.nodes[b]) else DONE

    def ahead(b):
        """(node index, bytes left of it) a block loads ahead now (None: nothing). Today's early loads: while it
        waits, the first bytes of the next node if that is an early stage. A ring: while it waits or pays a
        latency, the weights of the nodes after, in order, as far as the ring holds."""
        if total_held[b] >= g.cap - 1e-6 or phase[b] not in ((WAIT, LATENCY) if ring else (WAIT,)):
            return None
        lst, nodes = g.loadable[b], g.nodes[b]
        j = cur[b] + (1 if phase[b] == LATENCY else 0)
        while not ring and j < len(nodes) and nodes[j].stage is None:
            j += 1
        for j in range(j, len(lst) if ring else min(j + 1, len(lst))):
            if held[b][j] < lst[j] - 1e-6:
                return j, min(lst[j] - held[b][j], g.cap - total_held[b])
        return None

    meter = design.inflight if design.inflight is not None else float("inf")
    while True:
        changed = True
        while changed:                                    # every transition due now
            changed = False
            for b in range(grid):
                if phase[b] == WAIT:
                    r = ready(b)
                    if r is not None and r <= t + 1e-9:
                        nd = g.nodes[b][cur[b]]
                        start[b] = t
                        phase[b], t_lat[b] = LATENCY, t + nd.latency + queue_us
                        changed = True
                if phase[b] == LATENCY and t_lat[b] <= t + 1e-9:
                    nd = g.nodes[b][cur[b]]
                    main[b] = max(0.0, nd.weight - held[b][cur[b]] - copied[b][cur[b]]) + nd.cache
                    if cp_left[b] >= 0.0 and g.copies[b][cp_k[b]][1] == cur[b]:
                        cp_left[b] = -1.0                 # what has not landed, the stage streams itself
                        cp_k[b] += 1
                    phase[b] = STREAM
                    changed = True
                if phase[b] == STREAM and main[b] <= 1e-6:
                    finish(b, t)
                    changed = True
        if all(p == DONE for p in phase):
            break
        for b in range(grid):                             # a copy is posted once its block reaches the post
            cps = g.copies[b]
            if cp_left[b] < 0.0:
                # one whose stage started before it could be posted (nothing between them took time) is not sent
                while cp_k[b] < len(cps) and (cps[cp_k[b]][1] < cur[b] or
                                              (cps[cp_k[b]][1] == cur[b] and phase[b] >= STREAM)):
                    cp_k[b] += 1
                if cp_k[b] < len(cps) and cur[b] >= cps[cp_k[b]][0]:
                    cp_left[b] = cps[cp_k[b]][2]
        loads = [ahead(b) for b in range(grid)]
        streaming = [b for b in range(grid) if phase[b] == STREAM]
        loading = [b for b in range(grid) if loads[b] is not None]
        copying = [b for b in range(grid) if cp_left[b] >= 0.0]
        # each transfer's share of HBM: even, each at most its own cap (a metered loader: meter / round trip; a
        # copy, the copy engine's, as a stream's)
        caps = {b: cap_sm for b in streaming}
        caps.update({b: min(cap_sm, meter / max(costs.counter_us, 1e-3)) for b in loading})
        caps.update({-1 - b: cap_sm for b in copying})
        rates = _water_fill(caps, costs.hbm_tbps * 1e6)
        if design.queue:                                  # what a round trip starting now waits behind
            window = cap_sm * costs.counter_us
            # added one by one, not with sum(): from Python 3.12 sum() compensates float rounding, which no loop
            # elsewhere (the compiled engine) does
            streamed, asked = 0.0, 0.0
            for b in streaming:
                streamed += min(main[b], window)
            for b in loading:
                asked += min(loads[b][1], meter)
            for b in copying:                             # bulk copies, all posted at once: no meter
                asked += cp_left[b]
            flight = streamed + asked
            queue_us = max(0.0, flight / (costs.hbm_tbps * 1e6) - costs.counter_us)
        events = []
        for b in range(grid):
            if phase[b] == WAIT:
                r = ready(b)
                if r is not None:
                    events.append(r)
            elif phase[b] == LATENCY:
                events.append(t_lat[b])
        events += [t + main[b] / rates[b] for b in streaming]
        events += [t + loads[b][1] / rates[b] for b in loading]
        events += [t + cp_left[b] / rates[-1 - b] for b in copying]
        if not events:
            stuck = [(b, g.nodes[b][cur[b]].stage) for b in range(grid) if phase[b] == WAIT][:3]
            raise RuntimeError(f"the schedule deadlocks: blocks wait on producers that never finish {stuck}")
        t_next = max(min(events), t)
        dt = t_next - t
        for b in streaming:
            main[b] -= rates[b] * dt
        for b in loading:
            j, _ = loads[b]
            held[b][j] += rates[b] * dt
            total_held[b] += rates[b] * dt
        for b in copying:
            j = g.copies[b][cp_k[b]][1]
            copied[b][j] += rates[-1 - b] * dt
            cp_left[b] -= rates[-1 - b] * dt
            if cp_left[b] <= 1e-6:                        # landed
                cp_left[b] = -1.0
                cp_k[b] += 1
        t = t_next
    return spans


def _flatten(g: _Graph) -> dict:
    """The graph as flat arrays, nodes block after block (block b's are node_ptr[b]:node_ptr[b + 1]): per node its
    latency, bytes, loadable bytes and whether it is a barrier arrival; its deps as (key, set id) pair indices
    with their delays (dep_ptr), and the pairs its finish counts down (fin_ptr: the sets waited on that hold its
    block); per pair how many producer blocks it waits for."""
    members: dict = {}
    for lst in g.nodes:
        for nd in lst:
            for pkey, sid in nd.deps:
                members.setdefault(pkey, set()).add(sid)
    pair: dict = {}
    for pkey, sids in members.items():
        for sid in sids:
            pair[pkey, sid] = len(pair)
    in_set = [set(s) for s in g.sets]
    keys, blocks, lat, weight, cache, loadable, is_barrier = [], [], [], [], [], [], []
    dep_ptr, dep_pair, dep_delay, fin_ptr, fin_pair = [0], [], [], [0], []
    node_ptr = [0]
    for b, lst in enumerate(g.nodes):
        for nd, ld in zip(lst, g.loadable[b]):
            keys.append(nd.key)
            blocks.append(b)
            lat.append(nd.latency)
            weight.append(nd.weight)
            cache.append(nd.cache)
            loadable.append(ld)
            is_barrier.append(nd.stage is None)
            for (pkey, sid), d in zip(nd.deps, nd.delay):
                dep_pair.append(pair[pkey, sid])
                dep_delay.append(d)
            dep_ptr.append(len(dep_pair))
            fin_pair += [pair[nd.key, sid] for sid in members.get(nd.key, ()) if b in in_set[sid]]
            fin_ptr.append(len(fin_pair))
        node_ptr.append(len(keys))
    cp_ptr, cp_post, cp_dest, cp_bytes = [0], [], [], []
    for b, cps in enumerate(g.copies):
        for post, dest, nbytes in cps:
            cp_post.append(node_ptr[b] + post)
            cp_dest.append(node_ptr[b] + dest)
            cp_bytes.append(nbytes)
        cp_ptr.append(len(cp_post))
    i64, f64 = np.int64, np.float64
    return dict(cp_ptr=np.array(cp_ptr, i64), cp_post=np.array(cp_post, i64), cp_dest=np.array(cp_dest, i64),
                cp_bytes=np.array(cp_bytes, f64), keys=keys, blocks=blocks, node_ptr=np.array(node_ptr, i64), lat=np.array(lat, f64),
                weight=np.array(weight, f64), cache=np.array(cache, f64), loadable=np.array(loadable, f64),
                is_barrier=np.array(is_barrier, np.bool_), dep_ptr=np.array(dep_ptr, i64),
                dep_pair=np.array(dep_pair, i64), dep_delay=np.array(dep_delay, f64), fin_ptr=np.array(fin_ptr, i64),
                fin_pair=np.array(fin_pair, i64),
                left=np.array([len(g.sets[sid]) for _, sid in pair], i64))


def _run_flat(g: _Graph, costs: Costs, design: Design) -> dict:
    """`_run_python`'s events, compiled (`_events`) over the flattened graph."""
    f = _flatten(g)
    if any(f["node_ptr"][1:] == f["node_ptr"][:-1]):
        raise IndexError("a block with no nodes")             # where the Python engine fails too
    cap_sm = costs.sm_gbps * 1e3
    meter = design.inflight if design.inflight is not None else float("inf")
    # the constants of the Python engine's loop, computed by Python as there
    cap_load = min(cap_sm, meter / max(costs.counter_us, 1e-3))
    status, start, finish, cur = _events(
        f["node_ptr"], f["lat"], f["weight"], f["cache"], f["loadable"], f["is_barrier"], f["dep_ptr"], f["dep_pair"],
        f["dep_delay"], f["fin_ptr"], f["fin_pair"], f["left"], f["cp_ptr"], f["cp_post"], f["cp_dest"],
        f["cp_bytes"], float(g.cap), float(cap_sm), float(cap_load),
        design.early_bytes is not None, bool(design.queue), float(meter), float(cap_sm * costs.counter_us),
        float(costs.hbm_tbps * 1e6), float(costs.counter_us))
    if status:
        stuck = [(b, g.nodes[b][cur[b] - f["node_ptr"][b]].stage) for b in range(g.grid)
                 if cur[b] < f["node_ptr"][b + 1]][:3]
        raise RuntimeError(f"the schedule deadlocks: blocks wait on producers that never finish {stuck}")
    return dict(zip(zip(f["keys"], f["blocks"]), zip(start.tolist(), finish.tolist())))


def _jit(fn):
    return numba.njit(cache=True)(fn) if numba is not None else fn


@_jit
def _ready(i, dep_ptr, dep_pair, dep_delay, left, last):
    """When node i sees all its inputs; −1: not all finished yet."""
    r = 0.0
    for d in range(dep_ptr[i], dep_ptr[i + 1]):
        p = dep_pair[d]
        if left[p] > 0:
            return -1.0
        v = last[p] + dep_delay[d]
        if v > r:                                   # max(r, v) as Python takes it: r unless v is greater
            r = v
    return r


@_jit
def _earliest(blocks, n, amount, rates, t, t_min, found):
    """The earliest of (t_min if found) and each of the n transfers' ends, amount / rate after t."""
    for k in range(n):
        b = blocks[k]
        e = t + amount[b] / rates[b]
        if not found or e < t_min:
            t_min = e
            found = True
    return t_min, found


@_jit
def _events(node_ptr, lat, weight, cache, loadable, is_barrier, dep_ptr, dep_pair, dep_delay, fin_ptr, fin_pair,
            left0, cp_ptr, cp_post, cp_dest, cp_bytes, cap, cap_sm, cap_load, ring, queue, meter, window, hbm,
            counter_us):
    """`_run_python`'s loop over flat arrays (`_flatten`), block for block and operation for operation: (status,
    each node's start and finish, each block's current node); status 1: a deadlock. Python's min(a, b) and
    max(a, b) return a unless b is strictly less (greater), and are spelt so; a block's current node `cur` is an
    index into the flat arrays."""
    grid = len(node_ptr) - 1
    n = len(lat)
    left = left0.copy()
    last = np.zeros(len(left0))
    cur = node_ptr[:-1].copy()
    phase = np.zeros(grid, np.int64)                     # WAIT
    t_lat = np.zeros(grid)
    main = np.zeros(grid)
    held = np.zeros(n)
    total_held = np.zeros(grid)
    start = np.zeros(grid)
    span_start = np.zeros(n)
    span_end = np.zeros(n)
    scan = node_ptr[:-1].copy()        # a ring's first node not yet full from where it last looked (held only grows)
    load_j = np.full(grid, -1)
    load_amt = np.zeros(grid)
    rates = np.zeros(grid)
    streaming = np.zeros(grid, np.int64)
    loading = np.zeros(grid, np.int64)
    order = np.zeros(3 * grid, np.int64)                # entries: b (a stream or a load), grid + b (a copy)
    cp_k = cp_ptr[:-1].copy()                            # each block's next copy, an index into cp_*
    cp_left = np.full(grid, -1.0)                        # what is left of its posted copy (−1: none posted)
    copied = np.zeros(n)
    rates_c = np.zeros(grid)
    copying = np.zeros(grid, np.int64)
    queue_us = 0.0
    t = 0.0
    while True:
        changed = True
        while changed:
            changed = False
            for b in range(grid):
                if phase[b] == 0:
                    r = _ready(cur[b], dep_ptr, dep_pair, dep_delay, left, last)
                    if r >= 0.0 and r <= t + 1e-9:
                        start[b] = t
                        phase[b] = 1
                        t_lat[b] = t + lat[cur[b]] + queue_us
                        changed = True
                if phase[b] == 1 and t_lat[b] <= t + 1e-9:
                    i = cur[b]
                    x = weight[i] - held[i] - copied[i]
                    main[b] = (x if x > 0.0 else 0.0) + cache[i]
                    if cp_left[b] >= 0.0 and cp_dest[cp_k[b]] == i:
                        cp_left[b] = -1.0
                        cp_k[b] += 1
                    phase[b] = 2
                    changed = True
                if phase[b] == 2 and main[b] <= 1e-6:
                    i = cur[b]
                    span_start[i] = start[b]
                    span_end[i] = t
                    for k in range(fin_ptr[i], fin_ptr[i + 1]):
                        p = fin_pair[k]
                        left[p] -= 1
                        if t > last[p]:
                            last[p] = t
                    total_held[b] -= held[i]
                    cur[b] += 1
                    phase[b] = 0 if cur[b] < node_ptr[b + 1] else 3
                    changed = True
        done = True
        for b in range(grid):
            if phase[b] != 3:
                done = False
                break
        if done:
            break
        n_c = 0
        for b in range(grid):                            # Launch.ahead's copies posted by now
            if cp_left[b] < 0.0:
                while cp_k[b] < cp_ptr[b + 1] and (cp_dest[cp_k[b]] < cur[b] or
                                                   (cp_dest[cp_k[b]] == cur[b] and phase[b] >= 2)):
                    cp_k[b] += 1
                if cp_k[b] < cp_ptr[b + 1] and cur[b] >= cp_post[cp_k[b]]:
                    cp_left[b] = cp_bytes[cp_k[b]]
            if cp_left[b] >= 0.0:
                copying[n_c] = b
                n_c += 1
        # what each block loads ahead now (load_j −1: nothing)
        n_s = 0
        n_l = 0
        for b in range(grid):
            load_j[b] = -1
            if phase[b] == 2:
                streaming[n_s] = b
                n_s += 1
            if total_held[b] >= cap - 1e-6 or not (phase[b] == 0 or (ring and phase[b] == 1)):
                continue
            j = cur[b] + (1 if phase[b] == 1 else 0)
            end = node_ptr[b + 1]
            if ring:
                if scan[b] > j:
                    j = scan[b]
            else:
                while j < end and is_barrier[j]:
                    j += 1
                if j + 1 < end:
                    end = j + 1
            while j < end:
                if held[j] < loadable[j] - 1e-6:
                    break
                j += 1
            if ring:
                scan[b] = j
            if j < end:
                a = loadable[j] - held[j]
                c = cap - total_held[b]
                load_j[b] = j
                load_amt[b] = c if c < a else a
                loading[n_l] = b
                n_l += 1
        # water filling in the order of Python's stable sort by cap: streaming then loading blocks, each in block
        # order, unless a loader's cap is the smaller
        m = 0
        if cap_load < cap_sm:
            for k in range(n_l):
                order[m] = loading[k]
                m += 1
        for k in range(n_s):
            order[m] = streaming[k]
            m += 1
        if not cap_load < cap_sm:
            for k in range(n_l):
                order[m] = loading[k]
                m += 1
        for k in range(n_c):
            order[m] = grid + copying[k]
            m += 1
        bw = hbm
        for k in range(m):
            b = order[k]
            if b >= grid:
                v = bw / (m - k)
                rates_c[b - grid] = v if v < cap_sm else cap_sm
                bw -= rates_c[b - grid]
                continue
            c = cap_sm if phase[b] == 2 else cap_load
            v = bw / (m - k)
            rates[b] = v if v < c else c
            bw -= rates[b]
        if queue:
            streamed = 0.0
            asked = 0.0
            for k in range(n_s):
                b = streaming[k]
                streamed += window if window < main[b] else main[b]
            for k in range(n_l):
                b = loading[k]
                asked += meter if meter < load_amt[b] else load_amt[b]
            for k in range(n_c):
                asked += cp_left[copying[k]]
            q = (streamed + asked) / hbm - counter_us
            queue_us = q if q > 0.0 else 0.0
        found = False
        t_min = 0.0
        for b in range(grid):
            if phase[b] == 0:
                e = _ready(cur[b], dep_ptr, dep_pair, dep_delay, left, last)
                if e < 0.0:
                    continue
            elif phase[b] == 1:
                e = t_lat[b]
            else:
                continue
            if not found or e < t_min:
                t_min = e
                found = True
        t_min, found = _earliest(streaming, n_s, main, rates, t, t_min, found)
        t_min, found = _earliest(loading, n_l, load_amt, rates, t, t_min, found)
        t_min, found = _earliest(copying, n_c, cp_left, rates_c, t, t_min, found)
        if not found:
            return 1, span_start, span_end, cur
        t_next = t if t > t_min else t_min
        dt = t_next - t
        for k in range(n_s):
            b = streaming[k]
            main[b] -= rates[b] * dt
        for k in range(n_l):
            b = loading[k]
            held[load_j[b]] += rates[b] * dt
            total_held[b] += rates[b] * dt
        for k in range(n_c):
            b = copying[k]
            copied[cp_dest[cp_k[b]]] += rates_c[b] * dt
            cp_left[b] -= rates_c[b] * dt
            if cp_left[b] <= 1e-6:
                cp_left[b] = -1.0
                cp_k[b] += 1
        t = t_next
    return 0, span_start, span_end, cur


def _water_fill(caps: dict, total: float) -> dict:
    """An even share of `total` for each key, none above its cap, what a capped one leaves shared by the rest."""
    out, left, keys = {}, total, sorted(caps, key=caps.get)
    for i, b in enumerate(keys):
        out[b] = min(caps[b], left / (len(keys) - i))
        left -= out[b]
    return out


def price(cfg: ModelConfig, costs: Costs, pos: int, launch: plan.Launch = plan.Launch(),
          design: Design = Design()) -> float:
    """µs per token of a design: slot by slot where every hand-off is a barrier or a flag on today's deals
    (simulate.simulate), block by block otherwise (`run`)."""
    if design.handoff != "counter" and design.deal == "today" and not design.queue:   # the slot model's case
        return simulate(cfg, costs, pos, launch, design).us_per_token
    return run(cfg, costs, pos, launch, design)[0]


def predict(cfg: ModelConfig, costs: Costs, designs: list[str], positions: list[int]) -> str:
    """µs per token and tok/s of each design at each position, against today's kernel priced by the same model
    (the slot model's or the block-by-block one's: they differ by ~1%, tests/test_dataflow.py)."""
    out = [f"{'design':28s} {'position':>8s} {'µs/token':>9s} {'tok/s':>7s} {'vs today':>9s}"]
    for pos in positions:
        today = {}
        for text in designs:
            name, design, fields = parse_design(text)
            # today's kernel priced by the same engine, with the same account of queueing
            events = (design.handoff == "counter" or design.deal != "today" or bool(design.queue), design.queue)
            if events not in today:
                today[events] = price(cfg, costs, pos, design=Design(queue=design.queue)) if events[0] else \
                    simulate(cfg, costs, pos).us_per_token
            us = price(cfg, costs, pos, dataclasses.replace(plan.Launch(), **fields), design)
            out.append(f"{name:28s} {pos:8d} {us:9.1f} {1e6 / us:7.0f} {100 * (today[events] / us - 1):+8.1f}%")
    return "\n".join(out)
