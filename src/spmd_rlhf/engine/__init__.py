"""Generation engine: paged KV cache, continuous batching, prefix sharing, on the training model's own code.

Landed so far: ``sequence`` (requests and sampling settings), ``block_manager`` (ref-counted blocks, prefix sharing),
``scheduler`` (prefill/decode steps, preemption by recompute) and ``sampler`` (greedy, temperature, top-k, top-p,
per-request seeds, log-probs of sampled tokens). The model runner (paged attention) and the engine loop follow.
"""
