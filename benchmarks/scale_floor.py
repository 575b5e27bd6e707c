"""The analytical memory floor per rank of each stage of a recipe step, from the model shapes and the config, for
``benchmarks/scale.py``. Not an entry point.

Built on the device mapper's memory model (``spmd_rlhf.mapping``: the config's roles and batch from
``config_dataflow``, 16 bytes per trained parameter, activations, response logits and log-prob chunks of one micro-batch
from ``working_bytes``), split by when each part must exist. On ``devices`` ranks with every role colocated and
sharded over all of them (FSDP), per rank:

- from the load on: each trained role's float32 weights (4 bytes per parameter) and each frozen role's weights in
  the compute dtype, sharded;
- from the first update on: Adam's two float32 moments of each trained role (8 bytes per parameter), sharded; during
  an update also the role's float32 gradients (4 bytes per parameter), sharded, plus its micro-batch's activations
  and response logits and the log-prob path's float32 chunks (``mapping.cost.working_bytes``);
- while generating: the actor's generation copy (the whole model in the compute dtype, split ``rollout.tp`` ways)
  and the KV cache of the replica's rows at full length; with ``rollout.keep_engine`` (the default) both stay from
  the first generation on, through every later stage of the run (a resumed run's first stages come before its first
  generation);
- while computing log-probs and values: one forward micro-batch's working set (a layer's activations and the
  response logits and float32 chunks) of the largest such pass.

Beyond that strict floor, the design itself needs transient buffers that are not a whole-model copy;
``design_parts`` adds them, for a second ratio:

- FSDP's gathered unit: FSDP2 all-gathers one unit at a time (a run of decoder layers of at least the role's
  ``fsdp_unit_mb``, one layer at these shapes; the root: the final norm, a value or score head, vocabulary weights
  below the unit size), in the compute dtype. The root stays gathered from the forward to the end of the backward,
  and the backward makes each unit's unsharded gradient before the reduce-scatter. Where a trained role's
  ``unsharded_accumulation_mb`` lets it, its update instead keeps every unit gathered and the float32 gradients
  unsharded across a mini-batch's micro-batches (less the gradient shard the strict floor holds). The HybridEngine's
  reshard gathers the same units one at a time beside the generation copy, and a forward-only call keeps every unit
  gathered from its first micro-batch on where ``forward_gather_mb`` lets it (else one at a time).
- Vocabulary weights of at least the unit size (an embedding, an LM head, a tied pair) stream outside FSDP
  (``spmd_rlhf.models.streamed_vocabulary``): a pass holds one step's gathered rows, and in the backward their
  gradient; the HybridEngine's reshard gathers each weight whole, as it gathers a unit.
- The streamed Hugging Face save's writer: the band being assembled and one piece received or converted, each at most
  ``BAND_BYTES`` (``spmd_rlhf.models.sharded_save``).

A stage that runs after the first update in the run (every stage of step 2 on, save, export, resume) has the Adam
moments in its floor: the measured peak is the largest over all of a stage's occurrences, so the floor of its last
occurrence is the tight lower bound. Not counted, so a peak above the floor is not by itself a defect: FSDP's
gathered block (one at a time), communication buffers, the allocator's cache, the engine's working tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.mapping.cost import GRADIENT_BYTES, TRAINING_BYTES_PER_PARAMETER, working_bytes
from spmd_rlhf.mapping.devices import Layout
from spmd_rlhf.mapping.placement import config_dataflow
from spmd_rlhf.mapping.workload import RoleSpec
from spmd_rlhf.models.parallelize import group_layers
from spmd_rlhf.models.sharded_save import DEFAULT_BAND_BYTES
from spmd_rlhf.models.streamed_vocabulary import DEFAULT_CHUNK_BYTES as STREAM_CHUNK_BYTES

WEIGHT_BYTES = 4
"""A trained role's float32 master weights, per parameter."""
ADAM_BYTES = TRAINING_BYTES_PER_PARAMETER - WEIGHT_BYTES - GRADIENT_BYTES
"""Adam's two float32 moments, per parameter."""

STAGES = ("load", "generate", "log_probs", "advantages", "update", "save", "export", "resume")
"""The benchmark's stages, in the order a run meets them."""
STAGE_OF_TIMER = {
    "generate": "generate",
    "reward": "log_probs",
    "old_log_probs": "log_probs",
    "ref_log_probs": "log_probs",
    "values": "log_probs",
    "advantages": "advantages",
    "update_actor": "update",
    "update_critic": "update",
}
"""The recipes' ``StageTimer`` names (``time/<name>`` metrics) -> the benchmark's stage; a name not listed is a
stage of its own, with the resident state as its floor."""


def full_model_bytes(config: FrameworkConfig) -> int:
    """The actor as one whole float32 copy: what a rank that gathered the full model would hold on top."""
    specs, _ = config_dataflow(config)
    actor = next(spec for spec in specs if spec.name == "actor")
    return actor.shape.parameters(actor.head) * 4


def stage_floors(config: FrameworkConfig, *, devices: int) -> dict[str, dict[str, float]]:
    """Per stage of ``STAGES``, the floor's parts in bytes per rank (their sum is the floor), for ``config`` run for
    ``config.trainer.total_steps`` steps on ``devices`` ranks with every role colocated (FSDP over all ranks)."""
    specs, batch = config_dataflow(config)
    layout = Layout(pp=1, dp=devices, tp=1)
    b = batch.dtype_bytes

    def parameters(spec: RoleSpec) -> int:
        return spec.shape.parameters(spec.head)

    trained = [spec for spec in specs if spec.trained]
    weights = {
        f"{spec.name} weights ({'float32' if spec.trained else config.model.dtype} shard)": parameters(spec)
        * (WEIGHT_BYTES if spec.trained else b)
        / devices
        for spec in specs
    }
    adam = {f"{spec.name} Adam moments (shard)": parameters(spec) * ADAM_BYTES / devices for spec in trained}
    after_update = config.trainer.total_steps > 1
    in_step = {**weights, **(adam if after_update else {})}

    actor = next(spec for spec in specs if spec.name == "actor")
    tp_g = config.rollout.tp
    replicas = devices // tp_g
    rows = -(-batch.rows // replicas)
    generation = {
        f"actor generation copy ({config.model.dtype}, 1/{tp_g})": parameters(actor) * b / tp_g,
        f"KV cache ({rows} rows x {batch.sequence_length} tokens)": rows
        * batch.sequence_length
        * actor.shape.kv_bytes_per_token(b)
        / tp_g,
    }

    forward = [
        dataclasses.replace(spec, trained=False)
        for spec in specs
        if spec.name != "actor" or config.rollout.recompute_log_probs
    ]
    forward_parts = {}
    if forward:
        largest = max(forward, key=lambda spec: working_bytes(spec, layout, batch))
        forward_parts = {
            f"{largest.name} forward micro-batch "
            "(a layer's activations, response logits, float32 log-prob chunks)": working_bytes(largest, layout, batch),
        }

    def update_parts(spec: RoleSpec) -> dict[str, float]:
        return {
            f"{spec.name} gradients (float32 shard)": parameters(spec) * GRADIENT_BYTES / devices,
            f"{spec.name} micro-batch "
            "(activations, response logits and their gradient, float32 log-prob chunks)": working_bytes(
                spec, layout, batch
            ),
        }

    update = max((update_parts(spec) for spec in trained), key=lambda parts: sum(parts.values()))
    # rollout.keep_engine: the generation copy and the KV cache stay from the first generation to the end of the run.
    kept = {f"{part}, kept (rollout.keep_engine)": size for part, size in generation.items()}
    kept = kept if config.rollout.keep_engine else {}
    return {
        "load": dict(weights),
        "generate": {**in_step, **generation},
        "log_probs": {**in_step, **forward_parts, **kept},
        "advantages": {**in_step, **kept},
        "update": {**weights, **adam, **update, **kept},
        "save": {**weights, **adam, **kept},
        "export": {**weights, **adam, **kept},
        "resume": {**weights, **adam},
    }


def streams_vocabulary(spec: RoleSpec, dtype_bytes: int, *, min_unit_bytes: int) -> bool:
    """Whether ``spec``'s vocabulary weights (an embedding, an LM head, or a tied pair) stream outside FSDP
    (``spmd_rlhf.models.parallelize.streamed_vocabularies``: each at least ``min_unit_bytes`` as stored; this floor's
    roles are sharded over at least 2 ranks, without TP or offload)."""
    stored = WEIGHT_BYTES if spec.trained else dtype_bytes
    return spec.shape.vocab * spec.shape.hidden * stored >= min_unit_bytes


def fsdp_unit_bytes(spec: RoleSpec, dtype_bytes: int, *, min_unit_bytes: int) -> tuple[int, int]:
    """(the root unit, the largest other unit) of ``spec`` gathered, in bytes of ``dtype_bytes`` per parameter, as
    ``spmd_rlhf.models.parallelize.fsdp_units`` cuts the model (on the parameters as stored: float32 for a trained
    role, else ``dtype_bytes``): runs of decoder layers of at least ``min_unit_bytes`` (``group_layers``); the root
    holds the rest (the final norm, a value or score head, the layers after the last full run, and vocabulary weights
    too small to stream)."""
    shape = spec.shape
    vocabulary = shape.vocab * shape.hidden
    stored = WEIGHT_BYTES if spec.trained else dtype_bytes
    runs = group_layers([shape.block_parameters * stored] * shape.layers, min_unit_bytes)
    grouped = sum(len(run) for run in runs)
    vocabulary_modules = 1 if spec.head != "lm" or shape.tied else 2
    root = shape.parameters(spec.head) - grouped * shape.block_parameters
    if streams_vocabulary(spec, dtype_bytes, min_unit_bytes=min_unit_bytes):
        root -= vocabulary_modules * vocabulary
    largest = max((len(run) * shape.block_parameters for run in runs), default=0)
    return root * dtype_bytes, largest * dtype_bytes


def design_parts(config: FrameworkConfig, *, devices: int) -> dict[str, dict[str, float]]:
    """Per stage, the transient buffers of the design that ``stage_floors`` leaves out (see the module docstring), in
    bytes per rank; none when a role is not sharded (one rank)."""
    if devices < 2:
        return {stage: {} for stage in STAGES}
    specs, batch = config_dataflow(config)
    b = batch.dtype_bytes
    actor = next(spec for spec in specs if spec.name == "actor")

    def units(spec: RoleSpec) -> tuple[int, int]:
        return fsdp_unit_bytes(spec, b, min_unit_bytes=int(getattr(config, spec.name).fsdp_unit_mb * 2**20))

    def streamed(spec: RoleSpec) -> float:
        """One step of a streamed vocabulary weight's rows, gathered (0 when it does not stream)."""
        min_unit_bytes = int(getattr(config, spec.name).fsdp_unit_mb * 2**20)
        vocabulary = spec.shape.vocab * spec.shape.hidden * b
        return min(STREAM_CHUNK_BYTES, vocabulary) if streams_vocabulary(spec, b, min_unit_bytes=min_unit_bytes) else 0

    def gathered(spec: RoleSpec) -> float:
        return max(*units(spec), streamed(spec))

    def training(spec: RoleSpec) -> dict[str, float]:
        root, unit = units(spec)
        parts = {
            f"{spec.name} FSDP root gathered + its unsharded gradient": 2 * root,
            f"{spec.name} largest other FSDP unit gathered + its unsharded gradient": 2 * unit,
        }
        held = unsharded_accumulation(spec)
        if held:
            parts = {f"{spec.name} every FSDP unit gathered + float32 gradients unsharded across micro-batches": held}
        if streamed(spec):
            parts[f"{spec.name} streamed vocabulary: one step's rows gathered + their gradient"] = 2 * streamed(spec)
        return parts

    def kept_gathered(spec: RoleSpec) -> int:
        """Parameters a role keeps gathered across micro-batches: all but a streamed vocabulary's."""
        vocabulary_modules = 1 if spec.head != "lm" or spec.shape.tied else 2
        streamed_parameters = vocabulary_modules * spec.shape.vocab * spec.shape.hidden if streamed(spec) else 0
        return spec.shape.parameters(spec.head) - streamed_parameters

    def unsharded_accumulation(spec: RoleSpec) -> float:
        """What a trained role's update holds beyond FSDP when its units stay gathered and its gradients unsharded
        across a mini-batch's micro-batches (``models.parallelize.unsharded_accumulation_bytes``, on where it fits
        ``<role>.unsharded_accumulation_mb`` and the model is more than one unit); 0 when that is off."""
        role = getattr(config, spec.name)
        root, unit = units(spec)
        held = kept_gathered(spec) * (b + GRADIENT_BYTES * (1 - 1 / devices))
        budget = role.unsharded_accumulation_mb
        return held if unit and (budget is None or held <= budget * 2**20) else 0

    def forward_gathered(spec: RoleSpec) -> float:
        """What a forward-only call holds gathered: every unit but a streamed vocabulary where the role's
        ``forward_gather_mb`` lets it and the model is more than one unit (``ShardedModel.gather_forward``), else
        one unit (``gathered``)."""
        budget = getattr(config, spec.name).forward_gather_mb
        root, unit = units(spec)
        held = kept_gathered(spec) * b
        if unit and (budget is None or 0 < held <= budget * 2**20):
            return held + streamed(spec)
        return gathered(spec)

    def reshard(spec: RoleSpec) -> float:
        """What the HybridEngine gathers at once: an FSDP unit, or a streamed vocabulary weight whole."""
        whole = spec.shape.vocab * spec.shape.hidden * b if streamed(spec) else 0
        return max(*units(spec), whole)

    forward = [
        spec for spec in specs if not spec.trained or (spec.name == "actor" and config.rollout.recompute_log_probs)
    ]
    saved_bytes = getattr(torch, config.trainer.save_hf_dtype).itemsize if config.trainer.save_hf_dtype else b
    largest_tensor = max(spec.shape.vocab * spec.shape.hidden for spec in specs if spec.trained) * saved_bytes
    band = min(DEFAULT_BAND_BYTES, largest_tensor)
    update = max((training(spec) for spec in specs if spec.trained), key=lambda parts: sum(parts.values()))
    return {
        "load": {},
        "generate": {"actor FSDP unit (or streamed vocabulary) gathered by the reshard": reshard(actor)},
        "log_probs": {"FSDP units gathered by a forward-only call": max(forward_gathered(spec) for spec in forward)}
        if forward
        else {},
        "advantages": {},
        "update": update,
        "save": {},
        "export": {"save band being assembled + one piece": 2 * band},
        "resume": {},
    }
