"""The update loop shared by trained roles: AdamW with warm-up + constant/cosine LR, PPO epochs x mini-batches x
micro-batches with gradient accumulation, global-norm clipping.

Loss normalisation makes an update independent of the DP size and of how rows are grouped into micro-batches (row
counts or token-balanced groups, ``training.micro_batches``): each micro-batch's loss is its share of the whole
mini-batch's loss (``algos.aggregation``, denominators counted over all DP ranks), its gradients are accumulated, and
summed over DP ranks. Summed, that is exactly the gradient of the unsplit mini-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spmd_rlhf.algos import Denominators
from spmd_rlhf.checkpoint import load_role_state, save_role_state
from spmd_rlhf.config import TrainableRoleConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.training.context_parallel import ContextRow
from spmd_rlhf.training.packing import PACKED_FIELDS, MicroBatch
from spmd_rlhf.training.reducer import DPReducer
from spmd_rlhf.training.router_losses import RouterLosses, router_coefficients
from spmd_rlhf.training.router_replay import ROUTED_EXPERTS
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.training.skipped_steps import SkippedSteps

LossFunction = Callable[[torch.Tensor, MicroBatch, Batch, Denominators], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(model outputs, micro-batch, its rows on the model's device, mini-batch denominators) -> (this micro-batch's share
of the mini-batch loss, metrics as 0-dim tensors on the device)."""

MINI_BATCH_ROW = "mini_batch_row"
"""Field of the rows that ``Trainer.update`` packs: each row's place in its mini-batch, by which a micro-batch finds
its rows in the mini-batch already on the device."""
LOSS_MASK = "loss_mask"
"""A batch field: the response tokens the losses count (a rollout correction's rejection leaves some out); without
it, ``response_mask``."""


def learning_rate_factor(
    step: int, *, warmup_steps: int, schedule: str, total_steps: int, min_lr_ratio: float
) -> float:
    """Multiplier of the peak LR at optimizer-schedule step ``step``: linear warm-up from 0, then constant or cosine
    decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_gradients(
    gradients: list[torch.Tensor],
    max_norm: float | None,
    *,
    stage_groups: list[dist.ProcessGroup],
    pipeline_group: dist.ProcessGroup | None,
    device: torch.device,
) -> float:
    """Scale ``gradients`` in place so their global L2 norm is at most ``max_norm`` (None: no clipping); returns the
    norm before clipping.

    The gradients are this rank's pieces (DTensor shards over DP and TP, or replicas). ``stage_groups`` (DP, TP)
    span the ranks that hold pieces of the same parameters; ``pipeline_group`` the stages holding other layers. Each
    local piece's squared norm is divided by the number of ranks holding that same piece (FSDP-only parameters are
    replicated over TP), so summing over all groups gives the exact global norm, however the parameters are laid out.
    """
    ranks_per_stage = math.prod(group.size() for group in stage_groups)
    # The local pieces by how many ranks hold each, so that each kind takes one fused norm (torch._foreach_norm), not
    # one call per parameter.
    pieces: dict[int, list[torch.Tensor]] = defaultdict(list)
    for gradient in gradients:
        local, shards = gradient, 1
        if isinstance(gradient, DTensor):
            local = gradient.to_local()
            placements = enumerate(gradient.placements)
            # Shard and FSDP's _StridedShard split a dimension; Replicate (and Partial, never left in a gradient) do
            # not.
            shards = math.prod(
                gradient.device_mesh.size(dim) for dim, placement in placements if not placement.is_replicate()
            )
        pieces[ranks_per_stage // shards].append(local.detach())
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for holders, locals_ in pieces.items():
        squares += torch.stack(torch._foreach_norm(locals_, 2, dtype=torch.float64)).square().sum() / holders
    for group in [*stage_groups, pipeline_group]:
        if group is not None and group.size() > 1:
            dist.all_reduce(squares, group=group)
    # The step's one read: whether to clip and whether to skip are decided on the host.
    norm = float(squares.sqrt())
    if max_norm is not None and math.isfinite(norm) and norm > max_norm:
        torch._foreach_mul_([piece for locals_ in pieces.values() for piece in locals_], max_norm / (norm + 1e-6))
    return norm


class Trainer:
    """Optimizer, schedule and update loop of one trained role (the actor or the critic): it trains ``model`` and
    takes the statistics of each mini-batch over the DP group with ``reducer``."""

    def __init__(
        self,
        model: ShardedModel,
        reducer: DPReducer,
        role_config: TrainableRoleConfig,
        *,
        total_steps: int,
        max_response_length: int,
        max_skipped_steps: int,
    ) -> None:
        self.model = model
        self.reducer = reducer
        self.skipped = SkippedSteps(max_skipped_steps, role=model.context.name)
        self.role_config = role_config
        self.max_response_length = max_response_length
        # Fused: one pass over each parameter's state (CPU and CUDA kernels, DTensor shards included) where the
        # default loops over the parameters in Python, six passes each: 8x faster on CPU for 0.5B-sized layers.
        # Only trained parameters get optimizer state: with LoRA, the adapters (and a critic's head), not the base.
        self.optimizer = torch.optim.AdamW(
            [param for param in model.module.parameters() if param.requires_grad],
            lr=role_config.lr,
            betas=tuple(role_config.betas),
            weight_decay=role_config.weight_decay,
            fused=True,
        )
        self.router_losses = self._router_losses(model, role_config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: learning_rate_factor(
                step,
                warmup_steps=role_config.warmup_steps,
                schedule=role_config.lr_schedule,
                total_steps=total_steps,
                min_lr_ratio=role_config.min_lr_ratio,
            ),
        )

    @staticmethod
    def _router_losses(model: ShardedModel, role_config: TrainableRoleConfig) -> RouterLosses | None:
        """An MoE model's router losses and expert-load metrics (``training.router_losses``); None for a dense model
        and through a pipeline, where a stage's routers are not where its loss is (nonzero coefficients refused)."""
        role, args = model.context.name, model.module.args
        aux, z = router_coefficients(role, role_config, args)
        if args.moe is None:
            return None
        if model.pipeline is not None:
            if aux or z:
                raise ValueError(
                    f"{role}.router_aux_loss_coef / router_z_loss_coef must be 0 with {role}.pp > 1 (the routers of "
                    "earlier stages are not where the loss is); set them to 0"
                )
            return None
        return RouterLosses(model.module, args.moe.num_experts, aux_coef=aux, z_coef=z)

    def rows_per_mini_batch(self, batch: Batch, method: str) -> int:
        dp_size, role = self.reducer.size, self.reducer.role
        mini_batch_size = self.role_config.mini_batch_size
        if mini_batch_size % dp_size:
            raise ValueError(
                f"{role}.mini_batch_size={mini_batch_size} must divide over {dp_size} DP ranks ({role}.{method})"
            )
        rows = mini_batch_size // dp_size
        if len(batch) % rows:
            raise ValueError(
                f"{role}.{method}: {len(batch)} rows per DP rank do not split into mini-batches of "
                f"{rows} ({role}.mini_batch_size={mini_batch_size} over {dp_size} ranks)"
            )
        return rows

    def update(self, batch: Batch, loss_function: LossFunction, *, method: str, prefix: str) -> dict[str, float]:
        """PPO epochs over ``batch`` (this rank's rows), one optimizer step per mini-batch; returns mean metrics.

        Nothing is read from the device inside the micro-batch loop: the rows are packed from a host copy of their
        layout (``PACKED_FIELDS``), the fields the losses read move to the model's device once, and every loss and
        metric stays there until one read at the end. The gradient norm is read once per optimizer step (whether to
        clip and whether to skip the step are decided on the host)."""
        self.reducer.check_equal_shards(batch, method)
        rows = self.rows_per_mini_batch(batch, method)
        self.model.module.train()
        skipped_before = self.skipped.total
        # The tokens the losses count: ``loss_mask`` where a rollout correction rejected some, else the responses.
        counted = LOSS_MASK if LOSS_MASK in batch.tensors else "response_mask"
        # The recorded experts travel with the layout where router replay routes the micro-batches by them.
        replayed = [ROUTED_EXPERTS] if ROUTED_EXPERTS in batch.tensors and self.model.router_replay is not None else []
        layout = {key: batch[key] for key in dict.fromkeys([*PACKED_FIELDS, counted, *replayed])}
        layout[MINI_BATCH_ROW] = torch.arange(len(batch)) % rows
        host_minis = Batch(layout, group_size=batch.group_size).to("cpu").chunk_rows(rows)
        device_minis = Batch(dict(batch.tensors), group_size=batch.group_size).to(self.model.device).chunk_rows(rows)
        # Every mini-batch's counted tokens and rows over all DP ranks, in one collective for the whole update.
        tokens = torch.stack([mini[counted].sum() for mini in host_minis]).tolist() if host_minis else []
        counts, _ = self.reducer.totals(
            [float(value) for count, mini in zip(tokens, host_minis) for value in (count, len(mini))]
        )
        cp_group = self.model.cp_group
        step_losses: list[list[torch.Tensor]] = []
        device_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        grad_norms: list[float] = []
        for _ in range(self.role_config.ppo_epochs):
            for index, (mini, device_mini) in enumerate(zip(host_minis, device_minis)):
                denominators = Denominators(counts[2 * index], counts[2 * index + 1], float(self.max_response_length))
                records: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
                routed: dict[str, torch.Tensor | dict[str, torch.Tensor] | None] = {}

                def router_share(rows: int, token_mask: torch.Tensor | None = None) -> torch.Tensor | None:
                    """This rank's share of the routers' losses of the forward just run (``RouterLosses.take``); the
                    whole value and the metrics wait in ``routed`` for the micro-batch's record."""
                    share, whole, metrics = self.router_losses.take(
                        rows / denominators.sequences, prefix, token_mask=token_mask, group=cp_group
                    )
                    routed.update(whole=whole, metrics=metrics)
                    return share

                def micro_batch_loss(outputs: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
                    on_device = device_mini.select(micro.rows[MINI_BATCH_ROW])
                    loss, micro_metrics = loss_function(outputs, micro, on_device, denominators)
                    own = loss
                    if self.router_losses is not None:
                        if cp_group is None:  # (under cp, every rank's share was taken after its chunk's forward)
                            share = router_share(len(micro))
                            own = loss if share is None else loss + share
                        micro_metrics = {**micro_metrics, **routed["metrics"]}
                        if routed["whole"] is not None:
                            loss = loss + routed["whole"]
                    records.append((loss.detach(), micro_metrics))
                    # FSDP averages gradients over DP ranks; each rank's loss is already its share of the global
                    # mini-batch loss, so scale by the DP size to make the average a sum (gloo has no pre-scaled sum).
                    return own * self.reducer.size

                def every_rank(row: ContextRow, real_tokens: torch.Tensor) -> torch.Tensor | None:
                    share = router_share(row.rows, real_tokens)
                    return None if share is None else share * self.reducer.size

                results, _ = self.model.run_model(
                    mini,
                    micro_batch_size=self.role_config.micro_batch_size,
                    output_fn=micro_batch_loss,
                    train=True,
                    every_rank=every_rank if self.router_losses is not None and cp_group is not None else None,
                )
                # The real micro-batches are the last len(results) calls: a pipeline schedule left to infer its
                # stages' shapes calls the loss function on placeholder outputs first (torch 2.13; ours are declared).
                real = records[len(records) - len(results) :]
                step_losses.append([loss for loss, _ in real])
                for _, micro_metrics in real:
                    for key, value in micro_metrics.items():
                        device_metrics[key].append(value)
                grad_norms.append(self._step(f"{self.model.context.name}.{method}"))
        # The update's one read of what it measured on the device, in the order it was recorded.
        recorded = [tensor for tensors in [*step_losses, *device_metrics.values()] for tensor in tensors]
        read = iter(torch.stack(recorded).tolist() if recorded else [])
        local_losses = [sum(next(read) for _ in losses) for losses in step_losses]
        metrics = {key: [next(read) for _ in tensors] for key, tensors in device_metrics.items()}
        metrics[f"{prefix}/grad_norm"] = grad_norms
        # Each mini-batch's loss summed over DP ranks, all of them in one collective.
        metrics[f"{prefix}/loss"] = self.reducer.totals(local_losses)[0]
        metrics[f"{prefix}/lr"] = [self.scheduler.get_last_lr()[0]]
        if self.model.cp_group is not None:
            metrics[f"{prefix}/cp_padding_tokens"] = [float(self.model.context_parallel.padding_tokens)]
        self.scheduler.step()
        means = {key: sum(values) / len(values) for key, values in metrics.items()}
        return {**means, f"{prefix}/skipped_steps": float(self.skipped.total - skipped_before)}

    def save(self, checkpoint_dir: str) -> None:
        """Sharded model, optimizer, LR-schedule and RNG state with DCP (each rank writes its own shards) for an exact
        resume, plus the model config and tokenizer that ``spmd-rlhf export`` needs to rebuild the model from it
        alone."""
        save_role_state(
            checkpoint_dir,
            model=self.model.module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            process_group=self.model.role_group,
        )
        self.model.save_config(checkpoint_dir)

    def load(self, checkpoint_dir: str) -> None:
        """Restore what ``save`` wrote (any DP size can load it: DCP reshards on load)."""
        load_role_state(
            checkpoint_dir,
            model=self.model.module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            process_group=self.model.role_group,
        )

    def _step(self, stage: str) -> float:
        """Clip, step and zero the gradients; a non-finite gradient norm skips the step (never applied; counted in
        ``<prefix>/skipped_steps``, and more than ``trainer.max_skipped_steps`` in a row stop the run)."""
        gradients = [p.grad for p in self.model.module.parameters() if p.grad is not None]
        model = self.model
        norm = clip_gradients(
            gradients,
            self.role_config.grad_clip,
            stage_groups=[model.mesh["dp"].get_group(), model.mesh["tp"].get_group()],
            pipeline_group=model.pp_group,
            device=model.device,
        )
        # The scheduler steps once per update, so its count is the training step being run (resumed with it).
        if self.skipped.allows(norm, step=self.scheduler.last_epoch + 1, stage=stage):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
