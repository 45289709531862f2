"""Sampling: turn logits into the next token, with temperature, top-k and top-p as Hugging Face applies them.

Contract (once per token):
    in   logits       [V]     fp32
         temperature  float   <= 0 means greedy
         top_k        int     <= 0 or >= V means off
         top_p        float   >= 1 means off
    out  token        int     (the kernel draws it; the reference gives the distribution it must draw from)

`reference_probs` is the distribution `transformers` samples from with TemperatureLogitsWarper → TopKLogitsWarper →
TopPLogitsWarper → softmax, in float64.
"""
import numpy as np

from ._common import F32


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    return {"logits": (cfg.vocab,), "token": ()}


def bytes_moved(cfg, pos: int) -> int:
    return F32 * cfg.vocab + 4                                  # read every logit, write one int32 token


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max())                                     # -inf entries become exact zeros
    return e / e.sum()


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {logits.shape}")
    if not np.isfinite(logits).all():
        raise ValueError("logits contain NaN or infinity")
    if np.isnan(temperature) or np.isnan(top_p) or top_p < 0:
        raise ValueError(f"need a temperature and 0 <= top_p, got temperature={temperature}, top_p={top_p}")
    V = logits.size
    if temperature <= 0:                                        # greedy: the first of the maximal logits
        probs = np.zeros(V)
        probs[int(np.argmax(logits))] = 1.0
        return probs

    scores = logits / temperature
    if 0 < top_k < V:
        # remove what is strictly below the k-th largest: ties with it stay, so more than k tokens can survive
        kth = np.partition(scores, V - top_k)[V - top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1:
        # HF sorts ascending and removes the low tail whose cumulative probability is <= 1 - top_p: what is left is
        # the smallest high-probability set whose mass reaches top_p. The top token always stays. Ties at the cut
        # are ordered by a stable sort (lower token index removed first), which is what torch.sort does on CPU.
        order = np.argsort(scores, kind="stable")
        cumulative = np.cumsum(softmax(scores[order]))
        remove = cumulative <= 1 - top_p
        remove[-1] = False
        scores[order[remove]] = -np.inf
    return softmax(scores)
