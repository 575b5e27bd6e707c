"""A role's model, sharded over the role's mesh: built, parallelized, loaded, run in micro-batches, and exported.

``ShardedModel`` is the part every model-holding role (actor, critic, reference, a reward or cost model) composes: it
builds one ``DecoderLM`` on the meta device, keeps this rank's pipeline stage (``mesh["pp"]``), applies tensor
parallelism over ``mesh["tp"]`` and FSDP2 over ``mesh["dp"]`` (HSDP: over the role's 2-D ``fsdp_mesh``;
``models.parallelize``), loads this rank's pieces of
the weights, runs micro-batched forward passes over the rollout layout (fed packed, ``training.packing``, with or
without a pipeline) and writes a Hugging Face copy streamed from the shards (``models.sharded_save``).

The rollout layout (made by ``ActorWorker.generate_sequences``): ``prompts`` ``[rows, P]`` left-padded, ``responses``
``[rows, R]`` right-padded, ``input_ids = prompts ++ responses``, ``attention_mask`` over both, ``response_mask``
``[rows, R]``. The model's output at position ``P - 1 + t`` predicts (or values) response token ``t``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method

from spmd_rlhf.config import FrameworkConfig, RoleConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.models import DecoderLM, log_probs_and_entropy_from_logits, log_probs_from_logits
from spmd_rlhf.models.attention import resolve_backend
from spmd_rlhf.models.parallelize import compiles_blocks, parallelize
from spmd_rlhf.models.pipeline import Pipeline, split_stage
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.runtime import RoleContext
from spmd_rlhf.training.activation_offload import ActivationOffload
from spmd_rlhf.training.context_parallel import (
    ContextParallelRunner,
    ContextRow,
    TokenStatistics,
    context_parallel_pipeline,
    schedule,
)
from spmd_rlhf.training.fsdp_schedule import gather_policy, micro_batch_schedule
from spmd_rlhf.training.micro_batches import row_chunks, token_balanced_micro_batches
from spmd_rlhf.training.packing import MicroBatch, PackedRows, run_pipelined
from spmd_rlhf.training.pretrained_export import PretrainedExport
from spmd_rlhf.training.reducer import DPReducer
from spmd_rlhf.training.router_replay import RouterReplay, check_router_replay
from spmd_rlhf.training.token_budget import bytes_per_token, derived_token_budget, free_device_bytes

MicroBatchFunction = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""(the model's output for one micro-batch, that micro-batch) -> a loss (training) or per-row results."""


# The value and score heads return a view ([..., 1] squeezed); outputs are never modified in place here, which is the
# only case in which that view would matter to FSDP's backward hooks.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _detached(result: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | torch.Tensor:
    if isinstance(result, dict):
        return {name: value.detach() for name, value in result.items()}
    return result.detach()


def _in_row_order(results: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    """Per-micro-batch results, concatenated on the host and put back in the rows' order."""
    grouped = torch.cat(results).cpu()
    values = torch.empty_like(grouped)
    values[order] = grouped
    return values


class ShardedModel(PretrainedExport):
    """One ``DecoderLM`` (``module``) of the role in ``context``: its pipeline stage, tensor-parallel over
    ``mesh["tp"]`` and FSDP2-sharded over ``mesh["dp"]`` (``context.fsdp_mesh``). ``reducer`` (the role's DP
    group) agrees micro-batch counts and checks that every DP rank got as many rows."""

    def __init__(
        self,
        context: RoleContext,
        config: FrameworkConfig,
        role_config: RoleConfig,
        *,
        head: str,
        trainable: bool,
        reducer: DPReducer,
        router_replay: str = "off",
    ) -> None:
        self.config = config
        self.role_config = role_config
        self.reducer = reducer
        self.context = context
        self.mesh = context.mesh
        self.device = context.device
        coordinates = context.coordinates
        path = self.model_path = role_config.model_path or config.model.path
        torch.manual_seed(config.trainer.seed)
        compute_dtype = getattr(torch, config.model.dtype)
        lora = getattr(role_config, "lora", None) if trainable else None
        self.lora = lora if lora is not None and lora.enabled else None
        """The role's LoRA settings when it trains adapters (its base weights then stay frozen in model.dtype)."""
        # Trained roles keep float32 master weights and compute in model.dtype; frozen ones (a LoRA base too) store
        # model.dtype directly.
        storage_dtype = torch.float32 if trainable and self.lora is None else compute_dtype
        # Built on the meta device and parallelized there; each rank then reads only its own pieces of the weights.
        # The backend is resolved from model.dtype here: at run time the model would read its dtype from weights that
        # FSDP keeps as float32 shards until their unit is gathered (and a streamed vocabulary never gathers whole).
        attention = resolve_backend(config.model.attention, device=self.device, dtype=compute_dtype)
        model = build_model(path, head=head, dtype=storage_dtype, attention_backend=attention)
        check_router_replay(router_replay, model.args)
        dims, name = context.dims, context.name
        model = split_stage(model, stage=coordinates.pp, pp=dims.pp, role=name)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        on_gpu = self.device.type == "cuda"
        experts = context.expert_mesh
        self.cp_group = context.groups.get("cp")
        """This rank's context-parallel group (``<role>.cp > 1``): micro-batches run split over it
        (``training.context_parallel``)."""
        self.adapters = parallelize(
            model,
            tp_mesh=self.mesh["tp"],
            dp_mesh=context.fsdp_mesh,
            ep_mesh=experts["ep"] if experts is not None else None,
            efsdp_mesh=experts["efsdp"] if experts is not None else None,
            ep_tp_mesh=experts["ep", "tp"] if experts is not None and dims.tp > 1 else None,
            cp_group=self.cp_group,
            cp_attention=role_config.cp_attention,
            sequence_parallel=role_config.sequence_parallel,
            mp_policy=policy,
            role=name,
            lora=self.lora,
            activation_checkpointing=config.model.activation_checkpointing and trainable,
            checkpoint_policy=config.model.checkpoint_policy,
            compile_layers=compiles_blocks(config.model.compile, on_gpu=on_gpu),
            offload=role_config.offload and on_gpu,
            min_unit_bytes=int(role_config.fsdp_unit_mb * 2**20),
        )
        load_weights(model, path, device=self.device)
        if (self.cp_group is not None or dims.pp > 1) and isinstance(model, FSDPModule):
            # Context parallelism and a pipeline's last stage call the decoder and the head apart (the head on
            # gathered hidden states, or in the schedule's output function): FSDP treats each as a forward of the root.
            for method in ("hidden_states", "head_outputs"):
                register_fsdp_forward_method(model, method)
        if self.adapters is not None:
            self.adapters.initialize(model, seed=config.trainer.seed)
        self.accumulate_unsharded, self.gather_forward = gather_policy(
            model,
            trainable=trainable,
            pipelined=dims.pp > 1,
            offloaded=role_config.offload and on_gpu,
            compute_dtype=compute_dtype,
            accumulation_mb=getattr(role_config, "unsharded_accumulation_mb", 0.0),
            forward_gather_mb=role_config.forward_gather_mb,
        )
        """Whether a mini-batch's micro-batches keep the units gathered and the gradients unsharded, and whether a
        forward-only call keeps them gathered: ``training.fsdp_schedule``."""
        self.offloads_activations = trainable and on_gpu and config.model.activation_offload
        """Training forwards keep their saved activations in host memory (``model.activation_offload``)."""
        if not trainable:
            model.requires_grad_(False)
        self.module: DecoderLM = model
        self.tp_group = self.mesh["tp"].get_group() if dims.tp > 1 else None
        """Set when the LM head's logits are sharded over the vocabulary across this group."""
        self.vocab_start = coordinates.tp * (model.args.vocab_size // dims.tp)
        self.pp_group = self.mesh["pp"].get_group() if dims.pp > 1 else None
        self.stage_ranks = dims.stage_ranks(context.ranks, context.role_rank)
        """Global rank of each pipeline stage of this rank's pipeline, in stage order."""
        self.role_group = context.groups["role"]
        """All of the role's ranks (DP x TP x PP): sharded checkpoints are written and read over it."""
        if router_replay != "off" and dims.pp > 1:
            raise ValueError(f"algorithm.router_replay={router_replay} needs {name}.pp=1; set one of them")
        self.router_replay = RouterReplay(model) if router_replay != "off" else None
        """Set when micro-batches whose rows carry ``routed_experts`` route by them (``training.router_replay``)."""
        self.context_parallel = None
        """With ``<role>.cp > 1``: runs the micro-batches split over the cp group (``training.context_parallel``)."""
        self.log_prob_temperature = config.rollout.temperature or 1.0
        """The temperature of the log-probs each rank computes of its chunk under context parallelism (the actor's
        and the reference's, as ``response_log_probs``' callers pass it)."""
        if self.cp_group is not None:
            self.context_parallel = ContextParallelRunner(
                model, self.cp_group, replay=self.router_replay, device=self.device
            )
        self.pipeline = None
        if dims.pp > 1:
            self.pipeline = Pipeline(
                model,
                stage=coordinates.pp,
                stage_ranks=self.stage_ranks,
                group=self.pp_group,
                device=self.device,
                schedule=role_config.pp_schedule,
                activation_dtype=compute_dtype,
            )

    @property
    def tokenizer_path(self) -> str:
        return self.config.model.tokenizer_path or self.config.model.path

    # ---- forward passes over the rollout layout ----------------------------------------------------------------

    def micro_batch_rows(self, batch: Batch, rows_per_micro_batch: int, *, train: bool) -> list[list[int]]:
        """Row indices of each micro-batch of ``batch``: token-balanced groups within the role's
        ``max_tokens_per_micro_batch`` (0: ``token_budget``'s, derived on GPU for a training pass or a forward-only
        one by ``train``; their count agreed over the DP group, and at least what the pipeline schedule needs), else
        ``rows_per_micro_batch`` consecutive rows."""
        max_tokens = self.role_config.max_tokens_per_micro_batch
        if max_tokens == 0:
            max_tokens = self.derived_token_budget(batch, train=train)
        if max_tokens is None:
            return row_chunks(len(batch), rows_per_micro_batch)
        max_tokens *= self.context.dims.cp  # the budget bounds each rank's chunk of a micro-batch
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        return token_balanced_micro_batches(
            lengths,
            max_tokens,
            lambda count: int(self.reducer.max(torch.tensor(count))),
            at_least=self.pipeline.min_micro_batches if self.pipeline is not None else 1,
        )

    def derived_token_budget(self, batch: Batch, *, train: bool) -> int | None:
        """On GPU, what the device's free memory holds of this pass's tokens (``training.token_budget``); None
        elsewhere, or where that cannot hold ``batch``'s widest row (then rows per micro-batch)."""
        if self.device.type != "cuda":
            return None
        args, dims = self.module.args, self.context.dims
        per_token = bytes_per_token(
            args,
            tp=dims.tp,
            pp=dims.pp,
            dtype_bytes=torch.finfo(getattr(torch, self.config.model.dtype)).bits // 8,
            train=train,
            activation_checkpointing=self.config.model.activation_checkpointing,
            checkpoint_policy=self.config.model.checkpoint_policy,
            sequence_parallel=self.module.sequence_parallel > 1,
        )
        longest = batch["attention_mask"].shape[1]
        return derived_token_budget(free_bytes=free_device_bytes(self.device), per_token=per_token, longest=longest)

    def run_model(
        self,
        batch: Batch,
        *,
        micro_batch_size: int,
        output_fn: MicroBatchFunction,
        train: bool,
        every_rank: Callable[[ContextRow, torch.Tensor], torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``output_fn(model output, micro-batch)`` for each micro-batch of ``batch`` (``micro_batch_rows``), and
        the rows of ``batch`` in the order the results cover them. With ``train``, each result is a loss to
        back-propagate (gradients accumulate); the returned results are detached.

        Each micro-batch is fed packed (``PackedRows``: no padding, the head only at response positions). Through a
        pipeline (then only its last stage returns results) every stage forms the same micro-batches, and they are
        padded to common shapes (``stack_packed``: a few padding tokens per micro-batch, never whole padded rows), as
        ``torch.distributed.pipelining`` needs; ``output_fn`` sees each micro-batch's own outputs only.

        Under context parallelism, ``every_rank`` runs on every rank of the group after each micro-batch's decoder
        forward (``training.context_parallel.context_parallel_step``).

        Peak per micro-batch: the logits of its response tokens, ``[response_tokens, vocab / tp]`` in the compute
        dtype, plus the activations of its tokens."""
        per_token = self.module.head != "score"
        groups = self.micro_batch_rows(batch, micro_batch_size, train=train)
        order = torch.tensor([row for rows in groups for row in rows], dtype=torch.long)
        # A pipeline and context parallelism lay each row out again (and build its length classes for that layout).
        relaid = self.pipeline is not None or self.context_parallel is not None
        multiple = None if relaid else self.module.sequence_parallel
        micros = [PackedRows(batch.select(rows), multiple=multiple) for rows in groups]
        steps, rows = [(None, index) for index in range(len(micros))], None
        if self.context_parallel is not None:
            steps = schedule(len(micros), self.context.dims.cp)
            rows = self.context_parallel.rows(micros, per_token=per_token)
        if self.pipeline is not None and micros:
            with ActivationOffload() if self.offloads_activations and train else contextlib.nullcontext():
                if rows is not None:
                    rows = [rows[owner][index] for owner, index in steps]
                    statistics = self._token_statistics(train=train)
                    return context_parallel_pipeline(
                        self.pipeline,
                        rows,
                        steps,
                        micros,
                        output_fn,
                        group=self.cp_group,
                        train=train,
                        statistics=statistics,
                    ), order
                return run_pipelined(self.pipeline, micros, output_fn, per_token=per_token, train=train), order
        results = []
        offload = self.offloads_activations and train
        with micro_batch_schedule(
            self.module,
            micro_batches=len(steps),
            train=train,
            accumulate_unsharded=self.accumulate_unsharded,
            gather_forward=self.gather_forward,
            hybrid_replicas=self.context.dims.fsdp_replicas,
        ) as before_micro_batch:
            for step, (owner, index) in enumerate(steps):
                before_micro_batch(step)
                micro = micros[index]
                if rows is not None:
                    mine = micro if owner == self.context_parallel.rank else None
                    with ActivationOffload() if offload else contextlib.nullcontext():
                        result = self.context_parallel.step(
                            rows[owner][index],
                            mine,
                            output_fn,
                            train=train,
                            statistics=self._token_statistics(train=train),
                            every_rank=every_rank,
                        )
                    if result is not None:
                        results.append(_detached(result))
                    continue
                replay = self.router_replay
                with replay.replaying(micro, self.device) if replay is not None else contextlib.nullcontext():
                    with ActivationOffload() if offload else contextlib.nullcontext():
                        result = output_fn(self.module(**micro.model_inputs(self.device, per_token=per_token)), micro)
                    if train:
                        result.backward()
                results.append(_detached(result))
        return results, order

    def forward_rows(self, batch: Batch, method: str, key: str, output_fn: MicroBatchFunction) -> Batch:
        """``Batch({key: output_fn results of every row})`` in ``batch``'s row order, forward only, on every rank of
        the role (a pipeline's last stage sends its results to the other stages). An ``output_fn`` may return a dict
        of per-row tensors instead, one of them under ``key``: each becomes a field."""
        self.reducer.check_equal_shards(batch, method)
        self.module.eval()
        with torch.no_grad():
            results, order = self.run_model(
                batch,
                micro_batch_size=self.role_config.forward_micro_batch_size or self.role_config.micro_batch_size,
                output_fn=output_fn,
                train=False,
            )
        values = None
        if results:
            results = [result if isinstance(result, dict) else {key: result} for result in results]
            values = {name: _in_row_order([result[name] for result in results], order) for name in results[0]}
        if self.pipeline is not None:
            carrier = [values]
            dist.broadcast_object_list(carrier, src=self.stage_ranks[-1], group=self.pp_group)
            values = carrier[0]
        if values is None:
            return Batch({key: None}, group_size=batch.group_size)
        return Batch({key: values.pop(key), **values}, group_size=batch.group_size)

    def _token_statistics(self, *, train: bool) -> TokenStatistics | None:
        """Under context parallelism with an LM head: each rank's per-token log-probs (and in training entropies) of
        its chunk's logits at the rollout temperature (``training.context_parallel``); None otherwise."""
        if self.module.head != "lm":
            return None
        options = dict(temperature=self.log_prob_temperature, group=self.tp_group, vocab_start=self.vocab_start)

        def statistics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if train:
                return torch.stack(log_probs_and_entropy_from_logits(logits, labels, **options), dim=-1)
            return log_probs_from_logits(logits, labels, **options)[:, None]

        return statistics

    def response_log_probs(
        self, logits: torch.Tensor, micro: MicroBatch, temperature: float, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[rows, R]`` of the response tokens under softmax(logits / temperature), and optionally the
        entropy of that distribution at each response position; zero where ``response_mask`` is 0. Under TP the
        logits are this rank's vocabulary slice and the softmax statistics are reduced over the TP group. Under
        context parallelism ``logits`` are the per-token log-probs (and entropies) each rank computed of its chunk
        at ``log_prob_temperature`` (``_token_statistics``), gathered: they are read as they are."""
        if self.context_parallel is not None and self.module.head == "lm":
            if temperature != self.log_prob_temperature:
                raise ValueError(
                    f"under {self.context.name}.cp > 1 log-probs are computed at the rollout temperature "
                    f"{self.log_prob_temperature}, not {temperature}"
                )
            statistics = micro.response_outputs(logits)
            if with_entropy and statistics.shape[1] < 2:
                raise ValueError("under context parallelism only a training pass computes the entropy")
            entropy = micro.scatter(statistics[:, 1]) if with_entropy else None
            return micro.scatter(statistics[:, 0]), entropy
        # The logits go in unscaled and in the model's dtype, at response positions only: the log-prob functions
        # scale them in float32 chunk by chunk (or in the fused kernel's registers), never as a float32
        # [tokens, vocab] copy.
        logits = micro.response_outputs(logits)
        labels = micro.response_labels(self.device)
        options = dict(temperature=temperature, group=self.tp_group, vocab_start=self.vocab_start)
        if with_entropy:
            log_probs, entropy = log_probs_and_entropy_from_logits(logits, labels, **options)
            return micro.scatter(log_probs), micro.scatter(entropy)
        return micro.scatter(log_probs_from_logits(logits, labels, **options)), None
