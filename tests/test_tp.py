"""Tensor parallelism's split and exchanges, as reference math on the CPU: the decode step over N ranks (each
stage on its share of the weights, all-reduces of the residual's partial sums, the LM head's slices joined and the
greedy token merged) gives what the whole model gives, for every family, at awkward sizes."""
from __future__ import annotations

import numpy as np
import pytest

from workbench import plan
from workbench.errors import ConfigError
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights
from workbench.reference import KVCache, forward
from workbench.tp.reference import merge_argmax, reduction, tp_forward
from workbench.tp.shard import Sharding

# tiny's 6 query / 2 kv heads split in two; an 8 / 4 variant in four; Qwen3's q/k norms and Qwen2's biases
# (tiny's intermediate 712 is 356 per rank, not a multiple of the kernel's 8: 704 splits in two and in four)
TINY = get_config("tiny").with_(intermediate=704)
CASES = {"tiny/2": (TINY, 2),
         "gqa4/4": (TINY.with_(n_heads=8, n_kv_heads=4), 4),
         "qwen3/2": (TINY.with_(qk_norm=True), 2),
         "qwen2/2": (TINY.with_(qkv_bias=True), 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_n_ranks_compute_what_one_does(case):
    cfg, n = CASES[case]
    cfg = cfg.with_(max_seq=64)
    w = random_weights(cfg, 6, progress=False)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, 9)
    whole_cache = KVCache.empty(cfg, np.float64)
    want = forward(w, tokens, cache=whole_cache, dtype=np.float64)
    got = tp_forward(w, tokens, n, dtype=np.float64)
    # fp64 both ways: the sums are only regrouped (partials per rank), so the logits agree to rounding
    np.testing.assert_allclose(got.logits, want, rtol=1e-10, atol=1e-10)
    assert got.tokens == [int(t) for t in want.argmax(axis=-1)]
    sh = Sharding(cfg, n)
    for r, c in enumerate(got.caches):                  # each rank's cache is its kv heads of the whole one
        kv = sh.kv_heads(r)
        np.testing.assert_array_equal(c.k, whole_cache.k[:, kv.start:kv.stop])
        np.testing.assert_array_equal(c.v, whole_cache.v[:, kv.start:kv.stop])
    # one all-reduce after each residual projection of each layer, and one gather of the LM head
    kinds = [(e.stage, e.kind) for e in got.exchanges]
    assert kinds.count(("o_proj_residual", "all-reduce")) == cfg.n_layers
    assert kinds.count(("down_residual", "all-reduce")) == cfg.n_layers
    assert kinds[-1] == ("lm_head", "gather") and len(kinds) == 2 * cfg.n_layers + 1


def test_one_rank_is_the_plain_model_and_prepared_weights_split_alike():
    cfg = TINY.with_(max_seq=32)
    w = random_weights(cfg, 2, progress=False)
    p = prepare(w, progress=False)
    tokens = [5, 77, 300, 9]
    one = tp_forward(p, tokens, 1)
    assert len(one.exchanges) == 2 * cfg.n_layers + 1             # the same exchanges, each with itself
    np.testing.assert_allclose(one.logits, forward(p, tokens, dtype=np.float64), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tp_forward(p, tokens, 2).logits, one.logits, rtol=1e-10, atol=1e-10)


def test_a_second_call_continues_the_ranks_caches():
    cfg = TINY.with_(max_seq=32)
    w = random_weights(cfg, 3, progress=False)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, 12)
    first = tp_forward(w, tokens[:7], 2)
    rest = tp_forward(w, tokens[7:], 2, positions=np.arange(7, 12), caches=first.caches)
    np.testing.assert_allclose(rest.logits, forward(w, tokens, dtype=np.float64)[7:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="caches of the earlier ones"):
        tp_forward(w, tokens[7:], 2, positions=np.arange(7, 12))


def test_the_exchanges_come_from_the_plans_data_flow():
    assert {s.name for s in plan.STAGES if reduction(s)} == {"o_proj_residual", "down_residual"}
    assert all(reduction(s) == "x" for s in plan.STAGES if reduction(s))


def test_the_split_and_what_cannot_be_split():
    cfg = get_config("llama-3.1-8b")
    sh = Sharding(cfg, 8)
    assert [len(sh.q_heads(r)) for r in range(8)] == [4] * 8 and sh.kv_heads(7) == range(7, 8)
    assert sum(len(sh.vocab(r)) for r in range(8)) == cfg.vocab and sh.vocab(0).start == 0
    assert sh.vocab(7).stop == cfg.vocab and all(sh.vocab(r).stop == sh.vocab(r + 1).start for r in range(7))
    rc = sh.rank_config(3)
    assert (rc.n_heads, rc.n_kv_heads, rc.intermediate) == (4, 1, 1792) and rc.hidden == cfg.hidden
    assert sh.all_reduce_bytes() == 4 * 4096
    with pytest.raises(ConfigError, match="its 8 kv heads do not divide by 3"):
        Sharding(cfg, 3)
    with pytest.raises(ConfigError, match="positive integer"):
        Sharding(cfg, 0)
    with pytest.raises(ConfigError, match="kv heads do not divide by 16"):
        Sharding(cfg, 16)
    with pytest.raises(ConfigError, match=r"a rank's share breaks a kernel constraint \(intermediate \(356\) must "
                                          r"be a multiple of 8"):
        Sharding(get_config("tiny"), 2)


def test_the_greedy_token_is_merged_as_one_argmax_would_pick_it():
    assert merge_argmax([(1.0, 10), (3.0, 700), (3.0, 20)]) == (3.0, 20)     # a tie: the lower index
    assert merge_argmax([(-np.inf, 0), (-5.0, 9)]) == (-5.0, 9)
    cfg = TINY.with_(max_seq=16)
    w = random_weights(cfg, 4, progress=False)
    # a tie across the two ranks' slices: the same best logit in both halves of the vocabulary
    res = tp_forward(w, [3], 2)
    row = np.asarray(res.logits[0]).copy()
    sh = Sharding(cfg, 2)
    hi = float(row.max()) + 1
    a, b = sh.vocab(0).start + 3, sh.vocab(1).start + 5
    row[a] = row[b] = hi
    pairs = []
    for r in range(2):
        sl = sh.vocab(r)
        i = int(np.argmax(row[sl.start:sl.stop]))
        pairs.append((float(row[sl.start + i]), sl.start + i))
    assert merge_argmax(pairs)[1] == a == int(np.argmax(row))


def test_plan_shows_the_split_and_refuses_one_that_cannot_be(capsys):
    from workbench.cli import main
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = out.index("llama-3.1-8b over 4 GPUs (Megatron-style: heads, then the MLP's columns and rows, the LM head by "
                  "vocabulary)")
    rows = [line.split() for line in out[i + 2:i + 6]]
    assert [r[:5] for r in rows] == [["0", "0–7", "0–1", "0–3583", "0–32063"], ["1", "8–15", "2–3", "3584–7167",
                                     "32064–64127"], ["2", "16–23", "4–5", "7168–10751", "64128–96191"],
                                     ["3", "24–31", "6–7", "10752–14335", "96192–128255"]]
    assert out[i + 6].startswith("per token: 64 all-reduces of the residual (16384 B")
    assert main(["plan", "--model", "llama-3.2-1b", "--gpus", "3"]) == 2
    assert capsys.readouterr().err == "error: llama-3.2-1b cannot be split over 3 GPUs: its 8 kv heads do not " \
                                      "divide by 3\n"
