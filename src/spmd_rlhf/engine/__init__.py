"""Generation engine: paged KV cache, continuous batching, prefix sharing, on the training model's own code.

Landed so far: ``sequence`` (requests and sampling settings), ``block_manager`` (ref-counted blocks, prefix sharing)
and ``scheduler`` (prefill/decode steps, preemption by recompute). The sampler, model runner and engine follow.
"""
