"""The allowed values of the config's enumerated keys, kept here without importing torch; where a lower floor
owns the same names (attention backends, partial-rollout modes, environments, LoRA targets), a test keeps them
equal."""

# The same names as spmd_rlhf.models.attention.BACKENDS (a test keeps them equal) without importing torch here.
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "flash")
COMPILE_SETTINGS = ("auto", "on", "off")
DECODE_MATMULS = ("auto", "torch", "triton")
"""rollout.decode_matmul's values (spmd_rlhf.engine.decode_matmul.DECODE_MATMULS: a test keeps them equal)."""
CHECKPOINT_POLICIES = ("full", "selective")
CP_ATTENTION = ("auto", "ulysses", "ring")
"""<role>.cp_attention's values (spmd_rlhf.models.context_parallel.CP_ATTENTION: a test keeps them equal)."""
# spmd_rlhf.models.attention.DEFAULT_KV_BLOCK_SIZE (a test keeps them equal): the smaller of
# rollout.kv_block_size=null's two block sizes, so the check of a fixed rollout.kv_cache_blocks budget holds whichever
# one a rank picks.
DEFAULT_KV_BLOCK_SIZE = 16
PLACEMENTS = ("colocate", "split", "standalone", "manual", "auto")
DEVICE_SETTINGS = ("auto", "cuda", "cpu")
# "off" and the names of spmd_rlhf.engine.IN_FLIGHT (a test keeps them equal) without importing torch here.
PARTIAL_ROLLOUTS = ("off", "keep_kv", "recompute_kv", "drop")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers LoRA can adapt, by PEFT's names: the layers of spmd_rlhf.models.parallelize's TP plan (a
test keeps them equal); all-linear means every one of them (never the LM head, as in PEFT)."""
"""The values of trainer.device (runtime.device.select_device turns one into a device and a backend)."""
ENVIRONMENTS = ("tool",)
"""The names of the built-in multi-turn environments (``spmd_rlhf.envs.ENVIRONMENTS``; a test keeps them equal)."""
