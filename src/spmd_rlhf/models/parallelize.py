"""Tensor and data parallelism for ``DecoderLM``, applied from outside the model in one fixed order: the TP plan (a dict
of module name -> parallel style: ``tp_plan``'s local-shard styles, the LM head's ``ColwiseParallel``), activation
checkpointing, ``torch.compile`` (GPU), then FSDP2 ``fully_shard`` per run of decoder layers (one layer each at real
sizes; ``fsdp_units``), on an untied embedding and LM head (each alone) that do not stream, and on the root. Without TP,
vocabulary weights of unit size (an embedding, an LM head, a tied pair) stream instead, sharded over dp outside FSDP
(``streamed_vocabulary``).

TP follows Megatron's split: q/k/v and gate/up are column-parallel (each TP rank owns whole heads / a slice of the
MLP), o and down are row-parallel (their outputs all-reduced), the embedding is vocab-parallel (each rank owns a
slice of the vocabulary; the partial lookups are all-reduced) and the LM head is vocab-parallel too. Training keeps
the LM head's logits sharded over the vocabulary (``vocab_parallel_log_probs`` never gathers them); generation
gathers them (``gather_logits=True``) so each rank samples from the full distribution. Norms and the value / score
heads are small and replicated over TP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from spmd_rlhf.config import LoRAConfig
from spmd_rlhf.models.context_parallel import apply_context_parallel
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.expert_parallel import check_expert_parallel, shard_experts
from spmd_rlhf.models.lora import LoRAAdapters, apply_lora
from spmd_rlhf.models.moe import MoEBlock
from spmd_rlhf.models.sequence_parallel import split_moe_rows
from spmd_rlhf.models.streamed_vocabulary import stream_vocabulary, vocabulary_stream
from spmd_rlhf.models.tp_plan import (
    DECODER_LAYER_PLAN,
    HEAD_NORM_PLAN,
    SHARED_EXPERT_PLAN,
    ColumnParallel,
    RowParallel,
    SequenceParallelNorm,
    SharedColumnInput,
    VocabularyParallelEmbedding,
)


def tensor_parallel_plan(
    model: DecoderLM, *, gather_logits: bool, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Module name -> parallel style, for the parts ``model`` has: each layer's entries of the layer plans whose
    module the layer holds (a mixture-of-experts layer has no dense MLP, only some have a shared expert, only
    ``qk_norm`` models per-head norms), the embedding and the head (a pipeline stage may lack them);
    ``sequence_parallel``: the sequence-parallel styles, and the decoder norms' (``tp_plan``)."""
    plan: dict[str, ParallelStyle] = {}
    layer_plans = {**DECODER_LAYER_PLAN, **SHARED_EXPERT_PLAN, **HEAD_NORM_PLAN}
    for index, layer in model.model.layers.items():
        for key, style in layer_plans.items():
            name = key.removeprefix("model.layers.*.")
            if _has_submodule(layer, name):
                if sequence_parallel and isinstance(style, RowParallel):
                    style = RowParallel(sequence_parallel=True)
                plan[f"model.layers.{index}.{name}"] = style
                if isinstance(style, ColumnParallel):  # its parent sums the shared input's gradient over tp
                    parent = f"model.layers.{index}.{name.rsplit('.', 1)[0]}"
                    plan[parent] = SharedColumnInput(sequence_parallel=sequence_parallel)
        if sequence_parallel:
            for norm in ("input_layernorm", "post_attention_layernorm"):
                plan[f"model.layers.{index}.{norm}"] = SequenceParallelNorm()
    if sequence_parallel and model.model.norm is not None:
        plan["model.norm"] = SequenceParallelNorm(gather=True)
    if model.model.embed_tokens is not None:
        plan["model.embed_tokens"] = VocabularyParallelEmbedding(sequence_parallel=sequence_parallel)
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate() if gather_logits else Shard(-1))
    return plan


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def check_tensor_parallel(model: DecoderLM, tp: int, *, role: str) -> None:
    """Raise a ``ValueError`` naming the fix when ``tp`` does not divide the sizes it splits (with mixture-of-experts
    layers, the experts' and the shared expert's intermediate widths too)."""
    args = model.args
    sizes = {
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
    }
    if args.moe is not None and args.moe.layers:
        sizes["moe_intermediate_size"] = args.moe.moe_intermediate_size
        if args.moe.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = args.moe.shared_expert_intermediate_size
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"{role}.tp={tp} does not divide the model's {name}={size}; choose a tp that divides it")


def group_layers(layer_bytes: list[int], min_unit_bytes: int) -> list[list[int]]:
    """Consecutive layer indices grouped so that each group holds at least ``min_unit_bytes`` (a layer that large is
    a group of its own); the layers after the last full group are left out: they join the root unit, which is no
    larger than ``min_unit_bytes`` plus the parameters the root already has. ``min_unit_bytes`` 0: one group per
    layer. One rule for ``fsdp_units`` and for the memory floors that size its gathered buffers."""
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(layer_bytes):
        current.append(index)
        held += size
        if held >= min_unit_bytes:
            groups.append(current)
            current, held = [], 0
    return groups


def _local_bytes(module: torch.nn.Module) -> int:
    """Bytes of this rank's TP shard of ``module``'s parameters (before FSDP, which gathers exactly that)."""
    return sum(
        (param.to_local() if isinstance(param, DTensor) else param).numel() * param.element_size()
        for param in module.parameters()
    )


def fsdp_units(
    model: DecoderLM, min_unit_bytes: int = 0, *, streamed: list[list[torch.nn.Module]] | None = None
) -> list[torch.nn.Module | list[torch.nn.Module]]:
    """What FSDP2 shards as units of their own, below the root: runs of consecutive decoder layers of at least
    ``min_unit_bytes`` each (``group_layers``; one layer per unit at 0), and an untied embedding and LM head, each
    alone when it reaches ``min_unit_bytes`` and does not stream (``streamed``, from ``streamed_vocabularies``). FSDP
    gathers one unit at a time and runs one all-gather (and in the backward one reduce-scatter) per unit, whose fixed
    latency dominates when units are small, so small layers share a unit and a model smaller than ``min_unit_bytes``
    is the root alone. The root stays gathered from the forward to the end of the backward: with the embedding and
    head in the root, a 7B model's 1.1 B vocabulary parameters would be gathered (and their gradient unsharded)
    together for the whole pass. A tied pair is no unit: one parameter belongs to one unit, and the embedding and the
    head use it at both ends of the forward; it streams, or below ``min_unit_bytes`` stays in the root."""
    layers = list(model.model.layers.values())
    units: list[torch.nn.Module | list[torch.nn.Module]] = [
        layers[group[0]] if len(group) == 1 else [layers[index] for index in group]
        for group in group_layers([_local_bytes(layer) for layer in layers], min_unit_bytes)
    ]
    if not _tied(model):
        streaming = {id(module) for group in streamed or [] for module in group}
        vocabulary = (model.model.embed_tokens, getattr(model, "lm_head", None))
        units += [
            module
            for module in vocabulary
            if module is not None and _local_bytes(module) >= min_unit_bytes and id(module) not in streaming
        ]
    return units


def _tied(model: DecoderLM) -> bool:
    """Whether ``model`` holds an embedding and an LM head that share one weight."""
    embedding, head = model.model.embed_tokens, getattr(model, "lm_head", None)
    return embedding is not None and head is not None and head.weight is embedding.weight


def _tied_without_tensor_parallelism(model: DecoderLM, tp_mesh: DeviceMesh | None) -> bool:
    """Whether ``model`` ties its embedding to an LM head it holds, with no TP split of them (a vocab-parallel
    embedding is a DTensor op, which takes no sparse gradient)."""
    return _tied(model) and (tp_mesh is None or tp_mesh.size() == 1)


def streamed_vocabularies(
    model: DecoderLM, tp_mesh: DeviceMesh | None, dp_mesh: DeviceMesh, *, offload: bool, min_unit_bytes: int
) -> list[list[torch.nn.Module]]:
    """The vocabulary weights that stream (``streamed_vocabulary``) instead of being FSDP units or in its root, each
    as the modules that use it (a tied embedding and head share one): without TP (a vocab-parallel split is TP's),
    sharded over more than one rank (the 1-D dp mesh, or the shard dimension of a 2-D HSDP mesh), not offloaded to
    the host, and each weight at least ``min_unit_bytes`` (the size at which it would be a unit of its own)."""
    if (tp_mesh is not None and tp_mesh.size() > 1) or dp_mesh.size(-1) < 2 or offload:
        return []
    embedding, head = model.model.embed_tokens, getattr(model, "lm_head", None)
    groups = [[embedding, head]] if _tied(model) else [[module] for module in (embedding, head) if module is not None]
    return [group for group in groups if _local_bytes(group[0]) >= min_unit_bytes]


def unsharded_accumulation_bytes(model: DecoderLM, *, compute_dtype: torch.dtype, gradients: bool = True) -> int:
    """Bytes per rank that keeping the parallelized ``model`` gathered, with its gradients unsharded, across a
    mini-batch's micro-batches holds beyond what FSDP holds: each parameter's TP shard in ``compute_dtype`` and, for
    the trained ones, its float32 gradient (FSDP accumulates unsharded gradients in the reduce dtype) less the share
    of it that FSDP's sharded gradient holds anyway (1/dp; 1/fsdp_size under HSDP; 1/efsdp of an expert share,
    which ep keeps sharded).
    Streamed vocabulary weights are left out: they gather and reduce one step of rows at a time whatever FSDP
    does. ``gradients=False``: the parameters only (a forward-only call
    that keeps them gathered)."""
    streamed = {
        id(param)
        for module in model.modules()
        if vocabulary_stream(module) is not None
        for param in module.parameters()
    }
    held = 0.0
    for param in model.parameters():
        if id(param) in streamed:
            continue
        # FSDP shards dim 0 over its mesh, the first of the parameter's (dp; efsdp for an expert-parallel one; under
        # HSDP dp_shard, after dp_replicate, whose replicas hold the same piece): the local piece times its size is
        # what FSDP gathers (up to its padding).
        sharded_over = 1
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            sharded_over = param.device_mesh.size(names.index("dp_shard") if "dp_shard" in names else 0)
        elements = (param.to_local() if isinstance(param, DTensor) else param).numel() * sharded_over
        held += elements * compute_dtype.itemsize
        if gradients and param.requires_grad:
            held += elements * 4 * (1 - 1 / sharded_over)
    return int(held)


def compiles_blocks(setting: str, *, on_gpu: bool) -> bool:
    """Whether ``model.compile`` (``setting``) compiles decoder blocks: on always; auto on a GPU, whatever the
    layout (TP blocks compute on local shards, ``tp_plan``; context and expert parallelism's collectives compile:
    ``compile_block``); off never."""
    return setting == "on" or (setting == "auto" and on_gpu)


SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._grouped_mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.spmd_rlhf.length_bucketed_attention.default,  # models.length_buckets (imported with the decoder)
    }
)
"""What ``model.checkpoint_policy=selective`` keeps from a block's forward: the matmuls' and attention's outputs, the
work the backward would otherwise do again at full cost; everything else (norms, rotations, the activation function,
residual adds, casts) is recomputed."""


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_contexts():
    """``torch.utils.checkpoint``'s ``context_fn`` for selective checkpointing (``SAVED_OPS``)."""
    return create_selective_checkpoint_contexts(_save_matmuls)


COMPILE_BACKEND = "inductor"
"""TorchDynamo's backend for ``parallelize(compile_layers=True)`` (tests set ``aot_eager``: no code generation)."""


def compile_block(layer: torch.nn.Module, *, backend: str = "inductor", attention_breaks: bool = False) -> None:
    """``torch.compile`` one decoder block in place (``Module.compile``: parameter names stay Hugging Face's;
    TorchDynamo leaves FSDP2's hooks on the block to run eagerly): one graph with no break (``fullgraph``), sizes
    symbolic from the first call (``dynamic``), so packed rows of any length and sequence count reuse it, and every
    block shares it (one code object, parameters as inputs). What recompiles is the attention layout that
    ``AttentionBatch.build`` picks (per-sequence rows, rows per length class for a long row, one masked attention, plain
    causal) and the grad mode (a training pass and a no-grad pass): at most 4 graphs per grad mode, 3 for packed rows,
    however many length classes the rows span (tests/models/test_compiled_blocks.py counts them), and one more where a
    block's input needs no gradient (LoRA's first block). A mixture-of-experts block may break its graph: the looped
    expert path (where grouped GEMMs do not serve: ``moe.grouped_mm_supported``) reads the expert counts on the host,
    and under expert parallelism the all-to-alls' split sizes; ``attention_breaks`` says the attention call breaks it:
    flash-attn, whose kernels TorchDynamo traces only where the installed version registers them as torch ops (not tried
    here: flash-attn has no CPU build), and ring attention, whose point-to-point exchanges run eagerly between two
    compiled pieces (``ring_attention.ring_attend``). Ulysses' all-to-alls and TP's all-reduces (its split layers
    compute on local shards, ``tp_plan``) compile inside the graph as functional collectives.
    ``backend``: TorchDynamo's (tests trace with ``aot_eager``, which skips Inductor's code generation)."""
    layer.compile(fullgraph=_whole_graph(layer, attention_breaks), dynamic=True, backend=backend)


def _whole_graph(layer: torch.nn.Module, attention_breaks: bool) -> bool:
    """Whether a block compiles with no graph break (``compile_block`` says when one may break)."""
    return not isinstance(layer.mlp, MoEBlock) and not attention_breaks


def compiled_forward(layer: torch.nn.Module, *, backend: str = "inductor", attention_breaks: bool = False) -> Callable:
    """``compile_block``'s compile of a block's own forward, for activation checkpointing to wrap: TorchDynamo does not
    trace into ``torch.utils.checkpoint`` from a compiled module call whose forward is the checkpoint (no frame
    compiles, and ``fullgraph`` makes that an error), so a checkpointed block is compiled inside its checkpoint, which
    then runs the compiled forward again in the backward (full), or with its matmuls' outputs kept (selective)."""
    return torch.compile(layer.forward, fullgraph=_whole_graph(layer, attention_breaks), dynamic=True, backend=backend)


def parallelize(
    model: DecoderLM,
    *,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None = None,
    efsdp_mesh: DeviceMesh | None = None,
    ep_tp_mesh: DeviceMesh | None = None,
    cp_group: torch.distributed.ProcessGroup | None = None,
    cp_attention: str = "auto",
    mp_policy: MixedPrecisionPolicy | None = None,
    gather_logits: bool = False,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    checkpoint_policy: str = "full",
    compile_layers: bool = False,
    offload: bool = False,
    min_unit_bytes: int = 0,
    role: str = "model",
    lora: LoRAConfig | None = None,
) -> LoRAAdapters | None:
    """Apply TP over ``tp_mesh`` (skipped when None or of size 1), expert parallelism over ``ep_mesh`` (skipped
    when None or of size 1: ``shard_experts``; with both, the experts split over ``ep_tp_mesh``, the ``(ep, tp)``
    slice of the role's mesh), context parallelism's attention over ``cp_group`` (``apply_context_parallel``, Ulysses
    or ring by ``cp_attention``; the caller feeds each rank its chunk of a row: ``training.context_parallel``), LoRA
    adapters split like their layers
    when ``lora`` is on (returned; None otherwise), activation checkpointing and ``torch.compile`` of each decoder
    layer if asked, then FSDP2 over ``dp_mesh`` (skipped when None; a 2-D ``("dp_replicate", "dp_shard")`` mesh
    gives HSDP: ``ParallelDims.build_hybrid_shard_mesh``), the experts' shares over
    ``efsdp_mesh`` (``dp = efsdp x ep``, one root mesh: ``ParallelDims.build_mesh``); ``offload``: FSDP2's
    ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory, each block copied to the device
    for its forward and backward); ``min_unit_bytes``: how ``fsdp_units`` groups layers.

    Works on a whole model or on a pipeline stage of one. Tied embedding / LM-head weights stay tied: both are
    vocab-sharded the same way, so the head reuses the embedding's sharded parameter. Under FSDP without TP vocabulary
    weights of at least ``min_unit_bytes`` stream (``streamed_vocabularies``); a smaller tied one stays in the root,
    its embedding's gradient sparse, added into the head's dense one in place. Neither checkpointing nor
    compiling wraps a layer in another module, so parameter names stay Hugging Face's.
    """
    tensor_parallel = tp_mesh is not None and tp_mesh.size() > 1
    sequence_parallel = sequence_parallel and tensor_parallel
    if tensor_parallel:
        check_tensor_parallel(model, tp_mesh.size(), role=role)
        if sequence_parallel:
            model.sequence_parallel = tp_mesh.size()
        plan = tensor_parallel_plan(model, gather_logits=gather_logits, sequence_parallel=sequence_parallel)
        parallelize_module(model, tp_mesh, plan)
        if model.model.embed_tokens is not None and getattr(model, "lm_head", None) is not None:
            model.tie_weights()
    expert_parallel = ep_mesh is not None and ep_mesh.size() > 1
    if expert_parallel:
        moe = model.args.moe
        experts = moe.num_experts if moe is not None and moe.layers else None
        check_expert_parallel(experts, ep_mesh.size(), key=f"{role}.ep")
    if expert_parallel and tensor_parallel:
        assert ep_tp_mesh is not None, "expert and tensor parallelism split the experts over the (ep, tp) mesh"
        shard_experts(model, ep_tp_mesh, split=("ep", "tp"))
    elif expert_parallel or tensor_parallel:
        shard_experts(model, ep_mesh if expert_parallel else tp_mesh, split=("ep",) if expert_parallel else ("tp",))
    if sequence_parallel and tensor_parallel:
        split_moe_rows(model, tp_mesh)
    if cp_group is not None:
        apply_context_parallel(
            model, cp_group, tp=tp_mesh.size() if tensor_parallel else 1, role=role, attention=cp_attention
        )
    adapters = apply_lora(model, lora, tp_mesh=tp_mesh) if lora is not None and lora.enabled else None
    # flash-attn's kernels and ring attention's exchanges break a compiled block's graph (``compile_block``).
    attention_breaks = model.attention_backend == "flash" or getattr(model, "context_parallel", None) == "ring"
    for layer in model.model.layers.values():
        if activation_checkpointing:
            # The layer's own forward, recomputed in the backward pass; hooks (FSDP's) stay on the module's call.
            forward = (
                compiled_forward(layer, backend=COMPILE_BACKEND, attention_breaks=attention_breaks)
                if compile_layers
                else layer.forward
            )
            selective = {"context_fn": selective_checkpoint_contexts} if checkpoint_policy == "selective" else {}
            layer.forward = functools.partial(checkpoint, forward, use_reentrant=False, **selective)
        elif compile_layers:
            compile_block(layer, backend=COMPILE_BACKEND, attention_breaks=attention_breaks)
    if dp_mesh is not None:
        policy = mp_policy or MixedPrecisionPolicy()
        streamed = streamed_vocabularies(model, tp_mesh, dp_mesh, offload=offload, min_unit_bytes=min_unit_bytes)
        ignored = {
            stream_vocabulary(
                group, dp_mesh, compute_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype or policy.param_dtype
            )
            for group in streamed
        }
        if not streamed and _tied_without_tensor_parallelism(model, tp_mesh):
            # The root unit holds the tied weight, and the backward sums two [vocab, hidden] gradients into it: the
            # head's, dense, and the embedding's. A sparse embedding gradient (the rows of the batch's tokens) is
            # added into the head's in place, so the whole-vocabulary gradient exists once, not twice.
            model.model.embed_tokens.sparse = True
        offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        if expert_parallel:
            for block in model.modules():
                if isinstance(block, MoEBlock):
                    # Their own unit, inside their layer's, sharded over efsdp: each share's gradient sums every DP
                    # rank's tokens (the all-to-all's backward brings them), so it is averaged over all of dp, as the
                    # other parameters are, not over efsdp.
                    fully_shard(block.experts, mesh=efsdp_mesh, mp_policy=policy, offload_policy=offload_policy)
                    block.experts.set_gradient_divide_factor(float(dp_mesh.size()))
                    if efsdp_mesh.device_type == "cpu" and efsdp_mesh.size() > 1:
                        # gloo has no pre-scaled sum (NCCL's PREMUL_SUM): a sum, then the division. (Not on one
                        # rank, where FSDP divides without communicating and would divide again after.)
                        block.experts.set_force_sum_reduction_for_comms(True)
        for module in fsdp_units(model, min_unit_bytes, streamed=streamed):
            fully_shard(module, mesh=dp_mesh, mp_policy=policy, offload_policy=offload_policy)
        fully_shard(
            model, mesh=dp_mesh, mp_policy=policy, offload_policy=offload_policy, ignored_params=ignored or None
        )
    return adapters
