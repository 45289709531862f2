"""One decode step, section by section. Each section is a `<name>.cuh` (the kernel code) and a `<name>.py` (its
shape contract, the device-memory traffic it cannot avoid, and a numpy reference of what it computes).

SECTIONS lists them in the order one token flows through them: the embedding, then per layer the five layer
sections, then the LM head and sampling.
"""

PER_TOKEN_FIRST = ("embedding",)
PER_LAYER = ("qkv_rope_append", "attention_decode", "o_proj_residual", "gate_up_silu", "down_residual")
PER_TOKEN_LAST = ("lm_head", "sampling")
SECTIONS = PER_TOKEN_FIRST + PER_LAYER + PER_TOKEN_LAST
