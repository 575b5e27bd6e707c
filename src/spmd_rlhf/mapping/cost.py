"""The analytical cost model: seconds and bytes per device of a role's work on a layout, from FLOPs and bytes.

Per pass over the step's rows, with N a model's matmul parameters, P all its parameters, b bytes per element, t the
tokens of one micro-batch and n = pp·dp·tp devices:

- **Compute** is 2·N FLOPs per token forward (plus attention's 2·L²·heads·head_dim per layer and row), three times
  that for forward + backward, four with activation checkpointing, at the profile's attained FLOP/s; in training
  and forward-only passes the LM or value head's part of N runs at the response positions only.
- **FSDP** gathers each block's weights per micro-batch (P·b/(tp·pp) bytes over dp; FSDP2 reshards after forward),
  again in backward, and reduce-scatters float32 gradients; on GPUs prefetching overlaps this with compute, so a
  micro-batch costs the larger of the two (on CPU ranks the sum: ``DeviceProfile.overlaps_communication``). A trained
  role that keeps its blocks gathered through a mini-batch (``accumulates_unsharded``, within
  ``<role>.unsharded_accumulation_mb``) gathers once and reduce-scatters once per mini-batch instead, and holds the
  gathered blocks and unsharded gradients through its update; a forward-only call within ``<role>.forward_gather_mb``
  gathers once (``gathers_forward_once``). With HSDP (``Layout.fsdp``) the gathers and reduce-scatters run over the
  shard group, each replica holds the whole state sharded over its devices (``replicated_bytes``), and each unit's
  gradient shard is all-reduced across the replicas once per mini-batch.
- **TP** all-reduces the activations twice per layer forward (twice more in backward): not overlapped.
- **PP** runs m micro-batches through pp stages in (m + pp − 1) slots of one stage's time (the 1F1B/GPipe bubble).
- **Decode** is memory-bound: each step reads the generation shard (P·b/tp_g) and the KV cache of the running
  sequences, or is compute-bound for large batches, whichever is slower, plus a fixed cost per kernel; **prefill** is
  compute-bound. The KV cache gets the memory the colocated roles leave, which bounds the sequences decoded at once.
- **Resharding** for generation gathers the generation shard (FSDP's all-gather over dp, then over the tp / tp_g
  ranks that form one generation shard).

Memory per device: a trained role keeps 16 bytes per parameter (float32 weight, gradient and two Adam moments)
sharded n ways; a frozen role its weights in the compute dtype; activations of one micro-batch in flight per stage,
and its head's outputs at the response positions only (logits in the compute dtype, read by the log-prob path in
float32 vocabulary chunks).
"""

from __future__ import annotations

import math

from spmd_rlhf.mapping.devices import Cluster, Layout
from spmd_rlhf.mapping.workload import Batch, ModelShape, RoleSpec
from spmd_rlhf.models.context_parallel import resolve_cp_attention
from spmd_rlhf.models.logprob import rows_per_chunk
from spmd_rlhf.training.token_budget import (
    REPLICATED_HIDDENS,
    REPLICATED_SELECTIVE_HIDDENS,
    activation_elements,
    selective_checkpoint_elements,
    tp_rank_elements,
)

TRAINING_BYTES_PER_PARAMETER = 16
"""float32 weight + float32 gradient + Adam's two float32 moments."""
OPS_PER_LAYER = 14
"""Kernels one decoder layer launches per forward (norms, projections, rope, attention, activation, residuals)."""
GRADIENT_BYTES = 4
"""FSDP reduce-scatters gradients in float32."""
FORWARD_LOGPROB_CHUNKS = 3
"""Float32 vocabulary chunks the torch log-prob and entropy path (``models.logprob``) holds at once without
gradients: a chunk of scaled logits and logsumexp's shifted copy and exponentials of it."""
TRAINING_LOGPROB_CHUNKS = 4
"""The same with gradients: the backward pass adds the chunk of the logits' gradient being written. (The fused CUDA
kernels, which serve logits not split over TP, need none; the estimate keeps the torch path's.)"""
MAX_DECODE_BATCH = 256
"""Sequences decoded together at most (``rollout.max_num_seqs``)."""


def resident_bytes(role: RoleSpec, devices: int, batch: Batch) -> float:
    """Bytes per device the role keeps between its calls (the same for every layout on ``devices`` devices): a
    trained role's float32 weights, gradients and Adam moments, a frozen one's weights in the compute dtype; with
    LoRA a frozen base and the adapters' training state."""
    parameters = role.shape.parameters(role.head)
    if role.trained and role.lora_parameters:
        return (parameters * batch.dtype_bytes + role.lora_parameters * TRAINING_BYTES_PER_PARAMETER) / devices
    per_parameter = TRAINING_BYTES_PER_PARAMETER if role.trained else batch.dtype_bytes
    return parameters * per_parameter / devices


def _trained_fraction(role: RoleSpec) -> float:
    """The share of the role's parameters with gradients: all of a trained role's, a LoRA role's adapters only."""
    if not role.trained:
        return 0.0
    return role.lora_parameters / role.shape.parameters(role.head) if role.lora_parameters else 1.0


def kept_generation_bytes(role: RoleSpec, layout: Layout, batch: Batch, *, free_bytes: float) -> float:
    """Bytes per device a generating role's kept engine holds between generations (``batch.keep_engine``): the
    generation shard and its KV cache, which holds the rows a replica decodes at once at full length, or what
    ``free_bytes`` (the device's room beside every resident state) leaves beside the shard, whichever is less (as
    ``workers.generation`` sizes it); 0 for a layout that does not generate or an engine that is not kept."""
    if not (batch.keep_engine and layout.tp_g) or role.replica:
        return 0.0  # a rollout replica's weights are held_bytes', its KV cache generation_seconds' to size
    shape, b = role.shape, batch.dtype_bytes
    shard = shape.parameters(role.head) * b / layout.tp_g
    replicas = layout.devices // layout.tp_g
    running = min(math.ceil(batch.rows / replicas), MAX_DECODE_BATCH)
    kv_cache = running * batch.sequence_length * shape.kv_bytes_per_token(b) / layout.tp_g
    return shard + max(0.0, min(kv_cache, free_bytes - shard))


def held_bytes(role: RoleSpec, layout: Layout, batch: Batch, *, free_bytes: float) -> float:
    """Bytes per device the role holds between its calls beyond ``resident_bytes``, which depend on its layout: a kept
    engine's generation copy and KV cache (``kept_generation_bytes``), for a generative judge or a rollout role
    its whole replica TP-sharded on each DP rank (``P b / tp``) where ``resident_bytes`` counted an FSDP shard over all
    its devices, and under HSDP the state sharded over one replica's devices instead of all of them."""
    held = kept_generation_bytes(role, layout, batch, free_bytes=free_bytes)
    if role.judge_tokens or role.replica:
        held += role.shape.parameters(role.head) * batch.dtype_bytes / layout.tp - resident_bytes(
            role, layout.devices, batch
        )
    else:
        held += replicated_bytes(role, layout, batch)
    return held


def replicated_bytes(role: RoleSpec, layout: Layout, batch: Batch) -> float:
    """Bytes per device HSDP (``layout.fsdp_replicas > 1``) holds beyond ``resident_bytes``'s shard over all the
    role's devices: each replica holds the whole state sharded over its own devices only, expert-parallel experts
    excepted (FSDP shards them over efsdp, across the replicas); 0 without HSDP."""
    if layout.fsdp_replicas == 1:
        return 0.0
    devices = layout.devices
    extra = resident_bytes(role, devices // layout.fsdp_replicas, batch) - resident_bytes(role, devices, batch)
    experts = role.shape.routed_expert_parameters if layout.ep > 1 else 0
    return extra * (1 - experts / role.shape.parameters(role.head))


def unsharded_accumulation_bytes(role: RoleSpec, layout: Layout, batch: Batch) -> float:
    """Bytes per device a trained role holds through a mini-batch when it keeps its stage gathered and its gradients
    unsharded (``parallelize.unsharded_accumulation_bytes``): the decoder blocks' TP shard in the compute dtype and
    their float32 gradients (a LoRA role's adapters' only) less FSDP's 1/dp of them (1/fsdp_size under HSDP; vocabulary
    weights left out: at a real vocabulary they stream)."""
    elements = role.shape.body_parameters / (layout.tp * layout.pp)
    gradients = role.lora_parameters / (layout.tp * layout.pp) if role.lora_parameters else elements
    return elements * batch.dtype_bytes + gradients * GRADIENT_BYTES * (1 - 1 / layout.fsdp_shards)


def accumulates_unsharded(role: RoleSpec, layout: Layout, batch: Batch) -> bool:
    """Whether the role's update gathers each FSDP unit once per mini-batch and reduce-scatters once, not per
    micro-batch (``ShardedModel.accumulate_unsharded``): a trained role at pp = 1 whose held bytes fit its
    ``unsharded_accumulation_mb``."""
    if not role.trained or layout.pp > 1:
        return False
    budget = role.unsharded_accumulation_mb
    return budget is None or unsharded_accumulation_bytes(role, layout, batch) <= budget * 2**20


def gathers_forward_once(role: RoleSpec, layout: Layout, batch: Batch) -> bool:
    """Whether the role's forward-only passes gather each FSDP unit once per call, not per micro-batch
    (``ShardedModel.gather_forward``): pp = 1 and the stage's TP shard of its blocks in the compute dtype within its
    ``forward_gather_mb``."""
    if layout.pp > 1:
        return False
    budget = role.forward_gather_mb
    return budget is None or 0 < forward_gathered_bytes(role, layout, batch) <= budget * 2**20


def forward_gathered_bytes(role: RoleSpec, layout: Layout, batch: Batch) -> float:
    """Bytes per device a forward-only call holds gathered when it keeps its blocks so: their TP shard in the compute
    dtype (vocabulary weights left out, as in ``unsharded_accumulation_bytes``)."""
    return role.shape.body_parameters / layout.tp * batch.dtype_bytes


def _micro_batch(role: RoleSpec, batch: Batch) -> int:
    return role.micro_batch_size or batch.micro_batch_size


def head_output_bytes(role: RoleSpec, layout: Layout, batch: Batch, *, trained: bool) -> float:
    """Bytes per device of one micro-batch's head outputs and what the log-prob path makes of them.

    LM and value heads run at the response positions only (``output_positions``: every response at full length),
    a score head at every token. An LM head's logits ``[positions, vocab / tp]`` stay in the compute dtype, kept for
    backward with their gradient beside them when ``trained``; log-probs and entropy read them in float32 chunks of
    ``rows_per_chunk`` rows of the rank's vocabulary slice (``models.logprob``), a few at a time
    (``FORWARD_LOGPROB_CHUNKS``, ``TRAINING_LOGPROB_CHUNKS``): no float32 ``[positions, vocab]`` tensor is counted
    because none exists."""
    micro = _micro_batch(role, batch) / layout.cp  # each rank of a cp group: its chunk's
    if role.head != "lm":
        positions = micro * (batch.sequence_length if role.head == "score" else batch.response_length)
        return positions * batch.dtype_bytes * (2 if trained else 1)
    positions = micro * batch.response_length
    local_vocab = math.ceil(role.shape.vocab / layout.tp)
    logits = positions * local_vocab * batch.dtype_bytes
    chunk = min(positions, rows_per_chunk(local_vocab)) * local_vocab * 4
    if trained:
        return 2 * logits + TRAINING_LOGPROB_CHUNKS * chunk
    return logits + FORWARD_LOGPROB_CHUNKS * chunk


def layer_activation_bytes(shape: ModelShape, dtype_bytes: int) -> float:
    """Bytes one token keeps for the backward in one decoder layer of this decoder as built
    (``training.token_budget.activation_elements``: 11 h + 3 kv + 4 I elements, about 2x Korthikanti's 34 h bytes
    for a 4h MLP, as a 1.5B update on an H200 showed), I the wider of the dense MLP and an MoE layer's
    ``experts_per_token`` expert widths."""
    elements = activation_elements(
        hidden=shape.hidden, kv_width=shape.kv_heads * shape.head_dim, mlp_width=_token_mlp_width(shape)
    )
    return elements * dtype_bytes


def _token_mlp_width(shape: ModelShape) -> int:
    """A token's MLP width: the wider of the dense MLP and an MoE layer's ``experts_per_token`` expert widths."""
    dense = shape.intermediate if shape.moe_layers < shape.layers else 0
    return max(dense, shape.experts_per_token * shape.expert_intermediate if shape.moe_layers else 0)


def selective_checkpoint_bytes(shape: ModelShape, dtype_bytes: int) -> float:
    """Bytes one token keeps in one decoder layer under ``model.checkpoint_policy=selective``
    (``training.token_budget.selective_checkpoint_elements``), with ``layer_activation_bytes``'s MLP width."""
    kv_width = shape.kv_heads * shape.head_dim
    mlp = _token_mlp_width(shape)
    return selective_checkpoint_elements(hidden=shape.hidden, kv_width=kv_width, mlp_width=mlp) * dtype_bytes


def working_bytes(role: RoleSpec, layout: Layout, batch: Batch) -> float:
    """Bytes per device a pass needs on top of the resident state: activations of the micro-batches in flight and
    their head outputs (training); one layer's activations and the head outputs (forward only), with the log-prob
    path's float32 chunks (``head_output_bytes``). Generation is accounted for in ``generation_seconds`` (its shard
    and KV cache take what is left)."""
    if role.replica:
        return 0.0  # a rollout role only generates
    shape, b = role.shape, batch.dtype_bytes
    # Under context parallelism a rank holds its 1/cp chunk of each micro-batch, and the head's outputs of its chunk.
    tokens = _micro_batch(role, batch) * batch.sequence_length / layout.cp
    # Without sequence parallelism (or where it does not apply) every TP rank keeps the residual stream's and the
    # norms' activations whole (token_budget.REPLICATED_HIDDENS).
    split = {"tp": layout.tp, "sequence_parallel": role.sequence_parallel}
    hidden = shape.hidden
    layer = tp_rank_elements(layer_activation_bytes(role.shape, b), REPLICATED_HIDDENS * hidden * b, **split) * tokens
    outputs = head_output_bytes(role, layout, batch, trained=role.trained)
    if not role.trained:
        gathered = forward_gathered_bytes(role, layout, batch) if gathers_forward_once(role, layout, batch) else 0.0
        return layer + outputs + gathered
    if accumulates_unsharded(role, layout, batch):
        outputs += unsharded_accumulation_bytes(role, layout, batch)
    # 1F1B keeps pp micro-batches in flight on the first stage, each through layers/pp layers: ~ all layers' worth.
    in_flight = shape.layers / layout.pp * min(layout.pp, batch.rows)
    if batch.activation_checkpointing and batch.checkpoint_policy == "selective":
        selective = selective_checkpoint_bytes(role.shape, b)
        kept = tp_rank_elements(selective, REPLICATED_SELECTIVE_HIDDENS * hidden * b, **split) * tokens * in_flight
        kept += layer
    elif batch.activation_checkpointing:
        kept = tp_rank_elements(2 * hidden * b, 2 * hidden * b, **split) * tokens * in_flight + layer
    else:
        kept = layer * in_flight
    return kept + outputs


def ring_context_parallel(shape: ModelShape, layout: Layout) -> bool:
    """Whether ``cp_attention=auto`` runs ``layout``'s cp as ring attention: Ulysses cannot split the heads / tp."""
    if layout.cp <= 1:
        return False
    heads, kv_heads = shape.heads // layout.tp, max(1, shape.kv_heads // layout.tp)
    return resolve_cp_attention("auto", heads=heads, kv_heads=kv_heads, cp=layout.cp) == "ring"


def pass_seconds(role: RoleSpec, layout: Layout, cluster: Cluster, batch: Batch, *, train: bool) -> float:
    """Seconds for the role to run one pass (forward only, or forward + backward) over the step's rows."""
    shape, profile, b = role.shape, cluster.profile, batch.dtype_bytes
    pp, dp, tp = layout.pp, layout.dp, layout.tp
    rows_per_dp = math.ceil(batch.rows / dp)
    micro = min(_micro_batch(role, batch), rows_per_dp)
    micro_batches = math.ceil(rows_per_dp / micro)
    tokens = micro * batch.sequence_length
    # Full checkpointing runs each block's forward again in the backward; selective recomputes only elementwise work.
    recomputes = batch.activation_checkpointing and batch.checkpoint_policy == "full"
    passes = (4 if recomputes else 3) if train else 1
    # The body runs at every token, the head at the response positions only (a score head at every token).
    head_positions = tokens if role.head == "score" else micro * batch.response_length
    matmul = shape.body_matmul_parameters * tokens + shape.head_parameters(role.head) * head_positions
    flops = 2 * matmul + 2 * shape.layers * micro * batch.sequence_length**2 * shape.heads * shape.head_dim
    compute = passes * flops / (tp * pp) / profile.flops
    layers = shape.layers / pp
    # FSDP gathers (and in backward reduce-scatters) one unit at a time: each layer, and the root's embedding,
    # final norm and head.
    units = layers + 1
    # With ep > 1 each rank's share of the routed experts (1/ep of them) is gathered over the dp / ep ranks holding it.
    experts = shape.routed_expert_parameters if layout.ep > 1 else 0
    gathered = (shape.parameters(role.head) - experts) * b / (tp * pp * units)
    shards = layout.fsdp_shards  # HSDP: over the shard group's consecutive ranks, its replicas all-reducing after
    fsdp = units * cluster.all_gather(gathered, shards, extent=shards * tp)
    # Gradients of what trains (a LoRA role's adapters only).
    gradients = gathered * _trained_fraction(role) * GRADIENT_BYTES / b
    reduce_scatter = units * cluster.all_gather(gradients, shards, extent=shards * tp)
    # Once per mini-batch (``ShardedModel``: the last micro-batch's backward), each rank's gradient shard.
    replicas_all_reduce = units * cluster.all_reduce(gradients / shards, layout.fsdp_replicas, extent=dp * tp)
    if experts:
        expert_gathered, efsdp = experts / layout.ep * b / (tp * pp * units), dp // layout.ep
        fsdp += units * cluster.all_gather(expert_gathered, efsdp, extent=dp * tp)
        reduce_scatter += units * cluster.all_gather(expert_gathered * GRADIENT_BYTES / b, efsdp, extent=dp * tp)
    per_mini_batch = replicas_all_reduce if train else 0.0
    per_call = 0.0
    if train and accumulates_unsharded(role, layout, batch):
        # gathered in the mini-batch's first forward, reduce-scattered in its last backward, nothing in between
        per_mini_batch, fsdp = per_mini_batch + fsdp + reduce_scatter, 0.0
    elif train:  # gather again for backward, then reduce-scatter float32 gradients
        fsdp = 2 * fsdp + reduce_scatter
    elif gathers_forward_once(role, layout, batch):
        per_call, fsdp = fsdp, 0.0
    tensor_parallel = (
        layers * 2 * (passes - 1 if train else 1) * cluster.all_reduce(tokens * shape.hidden * b, tp, extent=tp)
    )
    kernels = passes * layers * OPS_PER_LAYER * profile.op_latency
    # All-to-alls run once in the forward, once in the backward and again in a full checkpoint's recompute, over
    # consecutive DP ranks (extent: ranks apart by tp). Ulysses (cp): q, k and v to head shards and the output back,
    # each rank's 1/cp chunk of the micro-batch; experts (ep): each token's routed copies out and their outputs back.
    # A rank runs a 1/cp chunk of each of its cp group's micro-batches: cp chunks per micro-batch of its own.
    exchanges = (3 if recomputes else 2) if train else 1
    if ring_context_parallel(shape, layout):
        # Ring (cp_attention=auto where cp does not split the heads): each chunk's keys and values pass every other
        # rank once per forward, and with their gradients (twice the bytes) in the backward.
        kv_width = 2 * shape.kv_heads * shape.head_dim / tp * b
        passes_around = (exchanges + 1 if train else 1) * cluster.all_gather(
            tokens * kv_width, layout.cp, extent=layout.cp * tp
        )
        context_parallel = layers * layout.cp * passes_around
    else:
        width = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp * b
        chunk = cluster.all_to_all(tokens / layout.cp * width, layout.cp, extent=layout.cp * tp)
        context_parallel = layers * exchanges * layout.cp * chunk
    routed = tokens * shape.experts_per_token * shape.hidden * b
    expert_parallel = (
        shape.moe_layers / pp * exchanges * 2 * cluster.all_to_all(routed, layout.ep, extent=layout.ep * tp)
    )
    pipeline_send = cluster.all_gather(tokens * shape.hidden * b * 2, 2, extent=layout.devices) if pp > 1 else 0.0
    overlapped = max(compute, fsdp) if profile.overlaps_communication else compute + fsdp
    slot = overlapped + tensor_parallel + kernels + context_parallel + expert_parallel
    slot += pipeline_send if train else pipeline_send / 2
    seconds = (micro_batches + pp - 1) * slot + per_call
    if train:
        mini = role.mini_batch_size or batch.mini_batch_size or batch.rows
        mini_batches = math.ceil(batch.rows / mini)  # per epoch, as ``seconds`` is so far
        steps = batch.ppo_epochs * mini_batches
        seconds += mini_batches * per_mini_batch
        optimizer = (  # each device steps its shard of the state (one replica's share under HSDP)
            (role.lora_parameters or shape.parameters(role.head))
            / (layout.devices // layout.fsdp_replicas)
            * TRAINING_BYTES_PER_PARAMETER
            * 2
            / profile.attained_memory_bandwidth
        )
        clip = cluster.all_reduce(4, layout.devices, extent=layout.devices)
        seconds = batch.ppo_epochs * seconds + steps * (optimizer + clip)
    return seconds


def generation_seconds(
    role: RoleSpec,
    layout: Layout,
    cluster: Cluster,
    batch: Batch,
    *,
    rows: int,
    free_bytes: float,
    reshard: bool = True,
) -> float:
    """Seconds for the actor to generate ``rows`` responses with tp_g-way replicas, including resharding into the
    generation layout (not with ``reshard`` False: a generative judge's replicas hold their weights as they are);
    ``free_bytes`` is what each device has left after every colocated role's resident state. ``math.inf`` if the
    generation shard and one sequence's KV cache do not fit."""
    shape, profile, b = role.shape, cluster.profile, batch.dtype_bytes
    tp_g = layout.tp_g
    parameters = shape.parameters(role.head)
    shard = parameters * b / tp_g
    kv_per_token = shape.kv_bytes_per_token(b) / tp_g
    length = batch.sequence_length
    capacity = int((free_bytes - shard) // (kv_per_token * length)) if free_bytes > shard else 0
    if capacity < 1:
        return math.inf
    replicas = layout.devices // tp_g
    rows_per_replica = math.ceil(rows / replicas)
    running = min(rows_per_replica, capacity, MAX_DECODE_BATCH)
    waves = math.ceil(rows_per_replica / running)
    matmul = shape.matmul_parameters(role.head)
    # Prefill: compute-bound over the wave's prompts.
    prompt_tokens = running * batch.prompt_length
    prefill_flops = (
        2 * matmul * prompt_tokens + 2 * shape.layers * running * batch.prompt_length**2 * shape.heads * shape.head_dim
    )
    prefill = (
        prefill_flops / tp_g / profile.flops
        + shape.layers * 2 * cluster.all_reduce(prompt_tokens * shape.hidden * b, tp_g, extent=tp_g)
        + shape.layers * OPS_PER_LAYER * profile.op_latency
    )
    # Decode: each step reads the shard and the running sequences' cache (at their mean context length).
    mean_context = batch.prompt_length + batch.response_length / 2
    read = shard + running * mean_context * kv_per_token
    decode_step = (
        max(read / profile.attained_memory_bandwidth, 2 * matmul * running / tp_g / profile.flops)
        + shape.layers * 2 * cluster.all_reduce(running * shape.hidden * b, tp_g, extent=tp_g)
        + shape.layers * OPS_PER_LAYER * profile.op_latency
    )
    generate = waves * (prefill + batch.response_length * decode_step)
    if not reshard:
        return generate
    micro_dp = layout.tp // tp_g
    shards = layout.fsdp_shards
    reshard = (
        cluster.all_gather(parameters * b / (layout.tp * layout.pp), shards, extent=shards * layout.tp)
        + cluster.all_gather(shard / layout.pp, micro_dp, extent=layout.tp)
        + cluster.all_gather(shard, layout.pp, extent=layout.devices)
    )
    return generate + reshard
