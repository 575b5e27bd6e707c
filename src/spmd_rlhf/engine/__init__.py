"""Generation engine: paged KV cache, continuous batching, prefix sharing, on the training model's own code.

    engine = LLMEngine(model, eos_token_id=eos, kv_cache_bytes=4 * 1024**3)
    outputs = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, max_new_tokens=256))

``sequence`` (requests and sampling settings), ``block_manager`` (ref-counted blocks, prompt prefix sharing),
``scheduler`` (prefill/decode steps, preemption by recompute), ``sampler`` (greedy, temperature, top-k, top-p,
per-request seeds, log-probs of sampled tokens), ``model_runner`` (cache tensors, one model step on the paged cache),
``engine`` (the loop) and ``partial`` (a generation held across weight updates: partial rollouts).
"""

from spmd_rlhf.engine.generation_run import IN_FLIGHT, GenerationRun
from spmd_rlhf.engine.llm_engine import GenerationStats, LLMEngine
from spmd_rlhf.engine.sequence import SamplingParams, Sequence

__all__ = ["IN_FLIGHT", "GenerationRun", "GenerationStats", "LLMEngine", "SamplingParams", "Sequence"]
