"""The cost model's terms behave as the hardware does: decode reads weights, training is ~3x a forward pass,
communication vanishes for one rank and grows across nodes, memory bounds the KV cache."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spmd_rlhf.mapping.cost import (
    OPS_PER_LAYER,
    accumulates_unsharded,
    gathers_forward_once,
    generation_seconds,
    head_output_bytes,
    pass_seconds,
    resident_bytes,
    ring_context_parallel,
    unsharded_accumulation_bytes,
    working_bytes,
)
from spmd_rlhf.mapping.devices import Cluster, Layout
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES
from spmd_rlhf.mapping.workload import NAMED_SHAPES, Batch, dataflow

H100 = BUILTIN_PROFILES["h100"]
ACTOR = dataflow("grpo", actor=NAMED_SHAPES["7b"])[0]
BATCH = Batch(prompts=64, prompt_length=512, response_length=512, micro_batch_size=8)


def test_batch_one_decode_is_bound_by_reading_the_weights():
    cluster = Cluster(1, 8, H100)
    batch = dataclasses.replace(BATCH, prompts=1, response_length=1000, prompt_length=1)
    seconds = generation_seconds(ACTOR, Layout(1, 1, 1, 1), cluster, batch, rows=1, free_bytes=H100.device_memory)
    weight_read = ACTOR.shape.parameters("lm") * 2 / H100.attained_memory_bandwidth
    kernels = ACTOR.shape.layers * OPS_PER_LAYER * H100.op_latency  # eager launches; what CUDA graphs remove
    assert seconds / 1000 == pytest.approx(weight_read + kernels, rel=0.05)
    faster_memory = Cluster(1, 8, dataclasses.replace(H100, memory_bandwidth=2 * H100.memory_bandwidth))
    halved = generation_seconds(ACTOR, Layout(1, 1, 1, 1), faster_memory, batch, rows=1, free_bytes=H100.device_memory)
    assert halved / 1000 == pytest.approx(weight_read / 2 + kernels, rel=0.05)


def test_training_costs_about_three_forward_passes_when_compute_bound():
    cluster = Cluster(1, 8, H100)
    layout = Layout(1, 1, 1)
    forward = pass_seconds(ACTOR, layout, cluster, BATCH, train=False)
    train = pass_seconds(ACTOR, layout, cluster, BATCH, train=True)
    assert 2.9 < train / forward < 3.3
    checkpointed = pass_seconds(
        ACTOR, layout, cluster, dataclasses.replace(BATCH, activation_checkpointing=True), train=True
    )
    assert checkpointed / forward == pytest.approx(train / forward * 4 / 3, rel=0.05)
    selective = dataclasses.replace(BATCH, activation_checkpointing=True, checkpoint_policy="selective")
    assert pass_seconds(ACTOR, layout, cluster, selective, train=True) == train  # no matmul runs again
    full = dataclasses.replace(BATCH, activation_checkpointing=True)
    none_kept, selective_kept, full_kept = (working_bytes(ACTOR, layout, batch) for batch in (BATCH, selective, full))
    assert full_kept < selective_kept < 0.6 * none_kept


def test_sequence_parallelism_splits_the_replicated_activations_over_tp():
    """Without sequence parallelism a TP rank keeps the residual stream's and the norms' activations whole (8 h per
    token and layer): at tp = 4 more than a quarter of tp = 1's; with it every activation splits, at tp = 1 a no-op,
    and under activation checkpointing the kept block inputs split too."""
    split = dataclasses.replace(ACTOR, sequence_parallel=True)
    full = dataclasses.replace(BATCH, activation_checkpointing=True)
    for batch in (BATCH, full):
        whole = working_bytes(ACTOR, Layout(1, 1, 1), batch)
        assert working_bytes(split, Layout(1, 1, 1), batch) == whole
        replicated, divided = (working_bytes(role, Layout(1, 1, 4), batch) for role in (ACTOR, split))
        assert divided < 0.85 * replicated and replicated > 0.3 * whole


def test_context_and_expert_parallelism_cost_their_all_to_alls():
    """Ulysses (cp): per layer, q, k and v out to head shards and the output back, once in the forward and once in the
    backward, for each of a rank's 1/cp chunks; experts (ep): each token's routed copies out and back per MoE layer, and
    FSDP gathers each rank's 1/ep of the experts over dp / ep ranks only."""
    cluster = Cluster(1, 8, dataclasses.replace(H100, overlaps_communication=False))
    exchange = cluster.all_to_all(8e6, 4, extent=4)
    assert exchange > cluster.all_to_all(8e6, 2, extent=2) > 0 == cluster.all_to_all(8e6, 1, extent=1)
    shape = ACTOR.shape
    plain, split = (pass_seconds(ACTOR, Layout(1, 8, 1, cp=cp), cluster, BATCH, train=True) for cp in (1, 2))
    tokens = BATCH.micro_batch_size * BATCH.sequence_length
    width = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * BATCH.dtype_bytes
    micro_batches = BATCH.rows // 8 // BATCH.micro_batch_size
    chunks = 2 * cluster.all_to_all(tokens / 2 * width, 2, extent=2)
    assert split - plain == pytest.approx(micro_batches * shape.layers * 2 * chunks)
    moe = dataflow("grpo", actor=NAMED_SHAPES["30b-a3b"])[0]
    dense_fsdp, expert_parallel = (
        pass_seconds(moe, Layout(1, 8, 1, ep=ep), cluster, BATCH, train=True) for ep in (1, 8)
    )
    routed = tokens * 8 * moe.shape.hidden * BATCH.dtype_bytes
    all_to_alls = micro_batches * moe.shape.moe_layers * 2 * 2 * cluster.all_to_all(routed, 8, extent=8)
    # At ep = dp = 8 no rank gathers experts: the all-to-alls replace the experts' gathers and reduce-scatters.
    assert expert_parallel - all_to_alls < dense_fsdp


def test_ring_context_parallel_costs_the_keys_and_values_passed_around_the_ring():
    """Where cp does not split the heads (0.5B: 14 heads, cp = 4) cp_attention=auto runs ring attention: each chunk's
    keys and values pass every other rank once in the forward and, with their gradients, twice in the backward."""
    actor = dataflow("grpo", actor=NAMED_SHAPES["0.5b"])[0]
    cluster = Cluster(1, 8, dataclasses.replace(H100, overlaps_communication=False))
    shape = actor.shape
    assert not ring_context_parallel(shape, Layout(1, 8, 1, cp=2))
    assert ring_context_parallel(shape, Layout(1, 8, 1, cp=4))
    plain, ring = (pass_seconds(actor, Layout(1, 8, 1, cp=cp), cluster, BATCH, train=True) for cp in (1, 4))
    tokens = BATCH.micro_batch_size * BATCH.sequence_length
    kv_width = 2 * shape.kv_heads * shape.head_dim * BATCH.dtype_bytes
    micro_batches = BATCH.rows // 8 // BATCH.micro_batch_size
    around = 3 * cluster.all_gather(tokens * kv_width, 4, extent=4)
    assert ring - plain == pytest.approx(micro_batches * shape.layers * 4 * around)


def test_communication_is_free_on_one_rank_and_slower_across_nodes():
    cluster = Cluster(16, 8, H100)
    assert cluster.all_gather(1e9, 1, extent=1) == 0.0
    within, across = cluster.all_gather(1e9, 8, extent=8), cluster.all_gather(1e9, 16, extent=16)
    assert across > 5 * within  # InfiniBand per GPU is ~9x slower than NVLink


def test_resident_state_is_sharded_over_every_device():
    assert resident_bytes(ACTOR, 8, BATCH) == ACTOR.shape.parameters("lm") * 16 / 8
    reference = dataflow("grpo", actor=NAMED_SHAPES["7b"], reference=NAMED_SHAPES["7b"])[1]
    assert resident_bytes(reference, 8, BATCH) == reference.shape.parameters("lm") * 2 / 8
    assert working_bytes(ACTOR, Layout(1, 1, 2), BATCH) < working_bytes(ACTOR, Layout(1, 1, 1), BATCH)


def test_the_kv_cache_gets_what_memory_is_left():
    cluster = Cluster(1, 8, H100)
    shard = ACTOR.shape.parameters("lm") * 2
    assert generation_seconds(ACTOR, Layout(1, 1, 1, 1), cluster, BATCH, rows=64, free_bytes=shard) == math.inf
    roomy = generation_seconds(ACTOR, Layout(1, 1, 1, 1), cluster, BATCH, rows=64, free_bytes=shard + 40e9)
    tight = generation_seconds(ACTOR, Layout(1, 1, 1, 1), cluster, BATCH, rows=64, free_bytes=shard + 2e9)
    assert tight > 2 * roomy  # fewer sequences at once: more waves, each re-reading the weights every step


@pytest.mark.parametrize("trained", [False, True])
def test_head_outputs_are_what_the_log_prob_path_allocates(trained):
    """An LM head's share of a pass: logits at the response positions only, in bf16, read in float32 chunks (here
    1,200 positions of a 32,000-token vocabulary: three chunks). The estimate is within 10% of the bytes the
    log-prob and entropy path allocates (tensor storages counted after every op), forward only and with backward."""
    import torch

    from spmd_rlhf.metrics.peak_memory import PeakMemory
    from spmd_rlhf.models.logprob import log_probs_and_entropy_from_logits

    shape = dataclasses.replace(NAMED_SHAPES["7b"], hidden=64, vocab=32_000)
    batch = Batch(prompts=2, prompt_length=300, response_length=600, micro_batch_size=2)
    role = dataflow("grpo", actor=shape)[0]
    role = dataclasses.replace(role, trained=trained)
    positions = batch.micro_batch_size * batch.response_length
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, shape.hidden, generator=generator, dtype=torch.bfloat16).requires_grad_(trained)
    lm_head = torch.randn(shape.vocab, shape.hidden, generator=generator, dtype=torch.bfloat16)
    labels = torch.randint(0, shape.vocab, (positions,), generator=generator)
    with PeakMemory(torch.device("cpu")) as memory, torch.set_grad_enabled(trained):
        log_probs, entropy = log_probs_and_entropy_from_logits(hidden @ lm_head.T, labels)
        if trained:
            (log_probs.sum() + entropy.sum()).backward()
    estimate = head_output_bytes(role, Layout(1, 1, 1), batch, trained=trained)
    assert 0.9 * estimate < memory.peak_increase < 1.1 * estimate, (memory.peak_increase, estimate)


def test_a_role_that_keeps_its_blocks_gathered_gathers_once_per_mini_batch_or_call():
    """Within its unsharded_accumulation_mb, a trained role's update gathers and reduce-scatters once per mini-batch
    (``ShardedModel.accumulate_unsharded``), and holds the gathered blocks and unsharded gradients; beyond it, or at
    pp > 1, per micro-batch as FSDP does."""
    cpu = Cluster(1, 2, dataclasses.replace(H100, overlaps_communication=False))  # every gather shows in the time
    small = dataflow("grpo", actor=NAMED_SHAPES["0.5b"])[0]
    batch = dataclasses.replace(BATCH, prompts=8, prompt_length=64, response_length=64, micro_batch_size=1)
    layout = Layout(1, 2, 1)
    bounded = dataclasses.replace(small, unsharded_accumulation_mb=0.0)
    assert accumulates_unsharded(small, layout, batch) and not accumulates_unsharded(bounded, layout, batch)
    assert not accumulates_unsharded(small, Layout(2, 1, 1), batch)
    held = unsharded_accumulation_bytes(small, layout, batch)
    assert held == pytest.approx(small.shape.body_parameters * (2 + 4 / 2))
    assert working_bytes(small, layout, batch) - working_bytes(bounded, layout, batch) == pytest.approx(held)
    once, per_micro = (pass_seconds(role, layout, cpu, batch, train=True) for role in (small, bounded))
    units = small.shape.layers + 1
    unit_bytes = small.shape.parameters("lm") * batch.dtype_bytes / units
    gather = units * cpu.all_gather(unit_bytes, 2, extent=2)
    reduce_scatter = units * cpu.all_gather(unit_bytes * 4 / batch.dtype_bytes, 2, extent=2)  # float32 gradients
    m = batch.rows // 2  # micro-batches per rank, one mini-batch
    # per micro-batch: a gather in forward and in backward, a reduce-scatter; once: one gather, one reduce-scatter
    assert per_micro - once == pytest.approx(m * (2 * gather + reduce_scatter) - (gather + reduce_scatter), rel=1e-6)
    # forward-only: one gather per call within forward_gather_mb, else one per micro-batch
    reference = dataflow("grpo", actor=NAMED_SHAPES["0.5b"], reference=NAMED_SHAPES["0.5b"])[1]
    assert reference.name == "reference" and gathers_forward_once(reference, layout, batch)
    per_call_bounded = dataclasses.replace(reference, forward_gather_mb=0.0)
    assert not gathers_forward_once(per_call_bounded, layout, batch)
    once, per_micro = (pass_seconds(role, layout, cpu, batch, train=False) for role in (reference, per_call_bounded))
    assert per_micro - once == pytest.approx((m - 1) * gather, rel=1e-6)
    gathered = working_bytes(reference, layout, batch) - working_bytes(per_call_bounded, layout, batch)
    assert gathered == pytest.approx(reference.shape.body_parameters * batch.dtype_bytes)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_the_mapper_counts_a_layers_activations_as_the_token_budget_does(tmp_path, family):
    """One count of what a token keeps per layer for the backward (this decoder's ops: 11 h + 3 kv + 4 I), for the
    mapper's memory and the derived token budgets alike, read from the same checkpoint."""
    from spmd_rlhf.mapping.cost import layer_activation_bytes
    from spmd_rlhf.mapping.workload import model_shape
    from spmd_rlhf.models import read_decoder_args
    from spmd_rlhf.tiny.model import make_tiny
    from spmd_rlhf.training.token_budget import layer_activation_elements

    path = make_tiny(family=family, out_dir=str(tmp_path / family))
    args = read_decoder_args(path)
    assert layer_activation_bytes(model_shape(path), 2) == 2 * layer_activation_elements(args)
    assert layer_activation_elements(args) > 17 * args.hidden_size  # above the Korthikanti count it replaced
