"""The 3D-HybridEngine: the actor's weights resharded from its training layout to its generation layout and back,
on the same ranks, with no redundant copy (see ``layout.py`` for the groups).

Training -> generation (``generation_model``), one decoder block at a time:
  1. FSDP's own unshard of the block: one all-gather over DP; each rank then has its TP shard of the block;
  2. one all-gather over the micro-DP group (``t / tp_g`` ranks) of those TP shards, flattened together, which
     concatenated along each tensor's split dimension is exactly this rank's generation shard;
  3. FSDP reshards the block; the generation shard is copied into the generation model (TP-parallelized over the
     generation TP group with the same plan as training, except that the LM head gathers the logits).
With pipeline stages, each stage's ranks then broadcast their stages' generation shards to the ranks holding the
same shard on the other stages, so every rank has all layers. Generation -> training is dropping the generation
model: training never stopped owning its shards, so nothing moves. With ``keep_generation`` the generation model is
kept instead and every later reshard writes into its parameters in place: the same storage, so the CUDA graphs a
generation engine captured on it stay valid for the run.

Per rank the peak is the training state + the generation shard + the KV cache + one block's gathered buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from spmd_rlhf.collectives import all_gather_flat
from spmd_rlhf.hybrid.layout import GenerationLayout
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.local_tensor_parallel import run_locally
from spmd_rlhf.models.lora import ADAPTER_SUFFIXES, LoRAAdapters, is_adapter, merged_weight
from spmd_rlhf.models.merged_linear import merge_projections
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.pipeline import stage_layers
from spmd_rlhf.models.streamed_vocabulary import vocabulary_stream

T = TypeVar("T")


def _in_group_order(items: list, layout_ranks: list[int]) -> list:
    """``items`` indexed by group rank (a group's ranks in ascending order) reordered to ``layout_ranks``' order."""
    ascending = sorted(layout_ranks)
    return [items[ascending.index(rank)] for rank in layout_ranks]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _expert_parallel(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a gathered FSDP parameter) is an expert weight split over the role's ep mesh
    (``models.expert_parallel``)."""
    return isinstance(tensor, DTensor) and "ep" in (tensor.device_mesh.mesh_dim_names or ())


def _split_dim(tensor: torch.Tensor) -> int | None:
    """The dimension a TP-sharded (unsharded-over-DP) parameter is split along, or None if it is replicated over TP
    (an expert weight's split over ep is not TP's)."""
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        for index, placement in enumerate(tensor.placements):
            if placement.is_shard() and (index >= len(names) or names[index] != "ep"):
                return placement.dim % tensor.ndim
    return None


class HybridEngine:
    """Builds the actor's generation model from its training model (``worker.model``: a pipeline stage, TP over
    ``mesh["tp"]``, FSDP over ``mesh["dp"]``) and returns generated rows to the training layout."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        layout: GenerationLayout,
        rank: int,
        groups: dict[str, dist.ProcessGroup],
        pp_group: dist.ProcessGroup | None,
        stage_ranks: list[int],
        device: torch.device,
        attention_backend: str,
        adapters: LoRAAdapters | None = None,
        keep_generation: bool = False,
    ) -> None:
        """``groups``: this rank's ``generation_tp``, ``micro_dp`` and ``rollout_rows`` groups, made by the runtime
        from ``layout.process_groups()``; ``stage_ranks``: the global rank of each stage of this rank's pipeline;
        ``adapters``: the training model's LoRA adapters, merged into the generation weights as they are gathered;
        ``keep_generation``: ``generation_model`` returns one model for the run, resharded into in place."""
        self.model, self.layout, self.rank, self.adapters = model, layout, rank, adapters
        self.keep_generation = keep_generation
        self._kept: DecoderLM | None = None
        self.pp_group, self.stage_ranks = pp_group, stage_ranks
        self.device, self.attention_backend = device, attention_backend
        self.tp_group = groups["generation_tp"] if layout.tp > 1 else None
        self.micro_dp_group = groups["micro_dp"] if layout.micro_dp > 1 else None
        self.row_group = groups["rollout_rows"] if layout.replicas_per_dp_group > 1 else None
        self.tp_mesh = None
        if self.tp_group is not None:
            # The mesh in layout order, so DTensor's shard j sits on the rank the layout gives generation shard j.
            order = torch.tensor(layout.generation_tp_group(rank))
            self.tp_mesh = DeviceMesh.from_group(self.tp_group, device.type, mesh=order)

    # ---- training -> generation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def generation_model(self, dtype: torch.dtype) -> DecoderLM:
        """A generation model holding this rank's generation shard of the current weights (every rank of the actor
        must call it): a fresh one to drop (``del``) before training resumes, or with ``keep_generation`` the same
        model every call, its parameters overwritten in place."""
        generation = self._kept
        if generation is None or generation.model.embed_tokens.weight.dtype != dtype:
            self._kept = None  # a kept model of another dtype goes before its replacement is allocated
            generation = self._new_generation_model(dtype)
        if self.keep_generation:
            self._kept = generation
        targets = {name: _local(param) for name, param in generation.named_parameters(remove_duplicate=False)}
        for unit in self._blocks():
            self._gather_block(unit, targets)
        if self.pp_group is not None:
            self._exchange_stages(targets)
        return generation

    def _new_generation_model(self, dtype: torch.dtype) -> DecoderLM:
        """The generation layout's model in ``dtype``, allocated on this rank's device but not filled, its q/k/v and
        gate/up projections merged (``merge_projections``: their parameters are views of one weight, which the
        in-place writes of ``_gather_block`` and ``_exchange_stages`` fill), its TP-split modules computing on local
        shards (``run_locally``)."""
        with torch.device("meta"):
            generation = DecoderLM(self.model.args, head=self.model.head, attention_backend=self.attention_backend)
            generation = generation.to(dtype)
        parallelize(generation, tp_mesh=self.tp_mesh, dp_mesh=None, gather_logits=True, role="rollout")
        generation.to_empty(device=self.device)
        generation.tie_weights()
        generation.reset_buffers()
        generation.requires_grad_(False).eval()
        merge_projections(generation)
        if self.tp_mesh is not None:
            run_locally(generation, self.tp_mesh)
        return generation

    def _blocks(self):
        """The FSDP units, one at a time, each as its modules' (module, prefix of its parameter names in the whole
        model, prefixes of its sub-units): runs of decoder layers (and an untied embedding and head,
        ``parallelize.fsdp_units``), then the root, which manages the rest (the final norm; a tied embedding and head;
        small trailing layers) of this pipeline stage. The modules of one run share one FSDP state and are gathered
        together."""
        named = [(name, module) for name, module in self.model.named_modules() if isinstance(module, FSDPModule)]
        named.sort(key=lambda unit: unit[0] == "")  # the root last
        units: dict[int, list] = {}
        for name, module in named:
            prefix = f"{name}." if name else ""
            inner = tuple(
                f"{other[len(prefix) :]}." for other, _ in named if other != name and other.startswith(prefix)
            )
            units.setdefault(id(fully_shard.state(module)), []).append((module, prefix, inner))
        yield from units.values()

    def _gather_block(
        self, unit: list[tuple[torch.nn.Module, str, tuple[str, ...]]], targets: dict[str, torch.Tensor]
    ) -> None:
        unit[0][0].unshard()  # the whole unit: every module of a run of layers at once
        sharded, locals_ = [], []
        # Where each of the unit's tensors goes: its generation parameter, or for a LoRA adapter a buffer of its
        # generation shape (split like its layer), merged below into the generation copy of its layer's weight; the
        # training weights are never touched.
        destinations: dict[str, torch.Tensor] = {}
        adapters: list[str] = []
        for block, prefix, inner in unit:
            streams = {
                id(module.weight): vocabulary_stream(module) for module in block.modules() if vocabulary_stream(module)
            }
            for name, param in block.named_parameters():
                if name.startswith(inner):
                    continue  # a unit of its own
                full, dim = prefix + name, _split_dim(param)
                if id(param) in streams:  # a tied vocabulary sharded over dp outside FSDP: gathered whole here
                    streams[id(param)].gather_into(param.to_local(), targets[full])
                    continue
                local = _local(param)
                if _expert_parallel(param):
                    # Each ep rank's experts laid end to end: all of them, as the generation copy holds them (then
                    # still split over tp as in training, for the micro-DP gather below when tp_g < tp).
                    ep_group = param.device_mesh.get_group(param.device_mesh.mesh_dim_names.index("ep"))
                    direct = dim is None or self.micro_dp_group is None
                    whole = (
                        targets[full]
                        if direct
                        else local.new_empty((local.shape[0] * ep_group.size(), *local.shape[1:]))
                    )
                    all_gather_flat(whole.view(-1), local.to(whole.dtype).reshape(-1), group=ep_group)
                    if direct:
                        continue
                    local = whole
                if is_adapter(name):
                    shape = list(local.shape)
                    if dim is not None and self.micro_dp_group is not None:
                        shape[dim] *= self.layout.micro_dp
                    destinations[full] = local.new_empty(shape)
                    adapters.append(full)
                else:
                    destinations[full] = targets[full]
                if dim is None or self.micro_dp_group is None:
                    destinations[full].copy_(local)
                else:
                    sharded.append((full, local.shape, dim))
                    locals_.append(local.reshape(-1))
        flat = torch.cat(locals_) if locals_ else None
        del locals_
        unit[0][0].reshard()  # FSDP's gathered buffers go before the micro-DP gather allocates its own
        if flat is not None:
            self._gather_sharded(sharded, flat, destinations)
        for name in adapters:
            if name.endswith(ADAPTER_SUFFIXES[0]):
                layer = name.removesuffix(ADAPTER_SUFFIXES[0])
                weight = targets[f"{layer}.weight"]
                lora_a, lora_b = destinations[name], destinations[layer + ADAPTER_SUFFIXES[1]]
                weight.copy_(merged_weight(weight, lora_a, lora_b, self.adapters.config.scale_of(layer)))

    def _gather_sharded(
        self, sharded: list[tuple[str, torch.Size, int]], flat: torch.Tensor, targets: dict[str, torch.Tensor]
    ) -> None:
        """All-gather the flattened TP shards of one block over the micro-DP group; each tensor's generation shard is
        the ``m`` pieces laid side by side along its split dimension."""
        micro_dp = self.layout.micro_dp
        gathered = flat.new_empty(micro_dp * flat.numel())
        all_gather_flat(gathered, flat, group=self.micro_dp_group)
        pieces = _in_group_order(list(gathered.view(micro_dp, -1)), self.layout.micro_dp_group(self.rank))
        offset = 0
        for name, shape, dim in sharded:
            numel = shape.numel()
            for index, piece in enumerate(pieces):
                targets[name].narrow(dim, index * shape[dim], shape[dim]).copy_(
                    piece[offset : offset + numel].view(shape)
                )
            offset += numel

    def _exchange_stages(self, targets: dict[str, torch.Tensor]) -> None:
        """Broadcast each pipeline stage's generation shards, one block at a time, to the ranks holding the same
        shard on the other stages."""
        args = self.model.args
        num_stages = len(self.stage_ranks)
        for stage, layers in enumerate(stage_layers(args.num_layers, num_stages)):
            blocks = [[name for name in targets if name.startswith(f"model.layers.{index}.")] for index in layers]
            if stage == 0:
                blocks.append([name for name in targets if name.startswith("model.embed_tokens.")])
            if stage == num_stages - 1:
                blocks.append(
                    [name for name in targets if not name.startswith(("model.layers.", "model.embed_tokens."))]
                )
            source = self.stage_ranks[stage]
            for names in blocks:
                flat = torch.cat([targets[name].reshape(-1) for name in names])
                dist.broadcast(flat, src=source, group=self.pp_group)
                offset = 0
                for name in names:
                    target = targets[name]
                    target.copy_(flat[offset : offset + target.numel()].view(target.shape))
                    offset += target.numel()

    # ---- rows between the layouts --------------------------------------------------------------------------------

    def replica_rows(self, num_rows: int) -> torch.Tensor:
        """Indices of the rows (of a DP group's batch) this rank's generation replica answers."""
        return torch.arange(num_rows).tensor_split(self.layout.replicas_per_dp_group)[
            self.layout.replica_index(self.rank)
        ]

    def on_replica_leader(self, compute: Callable[[], T]) -> T:
        """``compute()`` run on the first rank of this rank's generation replica, its result on every rank of the
        replica (host work the replica's ranks must agree on, such as a multi-turn environment's answers)."""
        if self.tp_group is None:
            return compute()
        leader = self.layout.generation_tp_group(self.rank)[0]
        box = [compute() if self.rank == leader else None]
        dist.broadcast_object_list(box, src=leader, group=self.tp_group)
        return box[0]

    def sum_over_replicas(self, value: float) -> float:
        """``value`` summed over the generation replicas of this rank's DP group."""
        total = torch.tensor([float(value)], dtype=torch.float64)
        if self.row_group is not None:
            dist.all_reduce(total, group=self.row_group)
        return float(total)

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every replica's rows of each tensor, concatenated in replica order (= the DP group's row order)."""
        if self.row_group is None:
            return tensors
        size = self.row_group.size()
        order = self.layout.row_group(self.rank)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
        rows = next(iter(tensors.values())).shape[0]
        dist.all_gather(counts, torch.tensor([rows]), group=self.row_group)
        longest = max(int(count) for count in counts)
        counts = _in_group_order(counts, order)
        gathered = {}
        for key, tensor in tensors.items():
            padded = tensor.new_zeros(longest, *tensor.shape[1:])
            padded[:rows] = tensor
            parts = [torch.empty_like(padded) for _ in range(size)]
            dist.all_gather(parts, padded, group=self.row_group)
            gathered[key] = torch.cat(
                [part[: int(count)] for part, count in zip(_in_group_order(parts, order), counts)]
            )
        return gathered
