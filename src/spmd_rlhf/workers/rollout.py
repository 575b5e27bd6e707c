"""The rollout role: generation-only replicas of the policy on ranks of their own, for asynchronous RL.

Each DP rank of the role's mesh is a replica; its ranks hold the policy TP-sharded over ``mesh["tp"]``
(``rollout.tp``) in ``model.dtype``, built once and never trained. It runs the actor's model code and the same
engine (``workers.generation``), so its samples and log-probs are the actor's on the same weights. The weights come
from the actor by ``receive_weights`` (``hybrid.weight_sync``, over the ``weight_sync`` group both roles declare);
each sync carries the policy version (updates the actor had taken), and every generated token is tagged with the
version that produced it (``token_versions``), which is how the trainer measures and bounds staleness. With
``rollout.partial_rollouts`` a batch is generated in segments (``start_generation``, ``continue_generation``,
``finish_generation``) and held between them, so that later syncs land mid-generation (``engine.generation_run``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.engine import GenerationRun, LLMEngine
from spmd_rlhf.envs.multi_turn import single_turn_response
from spmd_rlhf.hybrid.weight_sync import SyncSides, receive_weights, sync_group_ranks
from spmd_rlhf.mapping.role_pools import role_pools
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.local_tensor_parallel import run_locally
from spmd_rlhf.models.merged_linear import merge_projections
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.runtime import ParallelDims, RoleContext, data_parallel, one_to_all
from spmd_rlhf.runtime.device import check_thread
from spmd_rlhf.training.router_replay import ROUTED_EXPERTS
from spmd_rlhf.workers.base import RoleWorker
from spmd_rlhf.workers.generation import Generator
from spmd_rlhf.workers.replicas import OneReplica

GENERATED = (
    "responses",
    "response_mask",
    "trajectory_mask",
    "rollout_log_probs",
    "sampling_log_probs",
    "token_versions",
)
"""What generation adds to the prompts of a batch: what a checkpoint keeps of a batch in flight."""
CARRIED = ("env_reward", ROUTED_EXPERTS)
"""What generation adds besides ``GENERATED`` when it makes it (a multi-turn environment's rewards, router replay's
record of the experts): kept with a batch in flight that has it."""


def weight_sync_groups(config: FrameworkConfig) -> dict[str, list[list[int]]]:
    """The ``weight_sync`` group (the actor's first rank and every rollout rank), declared alike by both roles so the
    runtime makes it once; none without a rollout role."""
    if not config.rollout.enabled:
        return {}
    pools = role_pools(config, dist.get_world_size())
    return {"weight_sync": [sync_group_ranks(pools["actor"].ranks, pools["rollout"].ranks)]}


def generation_replica(
    path: str,
    *,
    dtype: torch.dtype,
    tp_mesh: DeviceMesh,
    device: torch.device,
    attention_backend: str = "auto",
    role: str = "rollout",
    load: bool = False,
) -> DecoderLM:
    """The model at ``path`` TP-sharded over ``tp_mesh`` in ``dtype`` for generation (the LM head gathers the
    logits), its parameters allocated but not filled (the weight sync fills them, in place, before any generation),
    or with ``load`` filled from ``path``'s checkpoint (each rank reading its own TP pieces: a generative judge); its
    q/k/v and gate/up projections merged (``merge_projections``), its TP-split modules computing on local shards
    (``models.local_tensor_parallel``)."""
    model = build_model(path, head="lm", dtype=dtype, attention_backend=attention_backend)
    parallelize(model, tp_mesh=tp_mesh, dp_mesh=None, gather_logits=True, role=role)
    if load:
        load_weights(model, path, device=device)
    else:
        model.to_empty(device=device)
        model.tie_weights()
        model.reset_buffers()
    model.requires_grad_(False).eval()
    merge_projections(model)
    run_locally(model, tp_mesh)
    return model


def sync_sides(config: FrameworkConfig, groups: dict[str, dist.ProcessGroup]) -> SyncSides:
    """The sides of the weight sync as this rank sees them (``group`` None on actor ranks outside it: they only
    take part in gathering the trainer's shards)."""
    ranks = weight_sync_groups(config)["weight_sync"][0]
    return SyncSides(ranks[0], tuple(ranks[1:]), groups.get("weight_sync"), config.trainer.collective_timeout_s)


class RolloutWorker(RoleWorker):
    """Generation replicas fed the actor's weights: ``receive_weights`` then ``generate_sequences``."""

    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.rollout)
        path = config.actor.model_path or config.model.path
        self.model = generation_replica(
            path,
            dtype=getattr(torch, config.model.dtype),
            tp_mesh=self.mesh["tp"],
            device=self.device,
            attention_backend=config.model.attention,
        )
        self.replica = OneReplica(self.mesh["tp"].get_group() if self.mesh["tp"].size() > 1 else None)
        """This rank's replica (its TP ranks agree on a multi-turn environment's answers)."""
        self.generator = Generator(
            config,
            role=context.name,
            model_path=path,
            vocab_size=self.model.args.vocab_size,
            device=self.device,
            reducer=self.reducer,
        )
        self.sides = sync_sides(config, context.groups)
        self.version: int | None = None
        """The policy version of the weights held (the actor's update count at the sync); None before the first."""
        self.in_flight: dict[int, tuple[LLMEngine, GenerationRun]] = {}
        """With rollout.partial_rollouts: batch index -> its generation between segments (each with its KV cache)."""

    @staticmethod
    def process_groups(
        dims: ParallelDims, ranks: tuple[int, ...], config: FrameworkConfig
    ) -> dict[str, list[list[int]]]:
        return weight_sync_groups(config)

    @one_to_all
    def receive_weights(self, version: int) -> None:
        """Take the actor's weights of policy ``version`` (the actor's ``send_weights`` runs beside it)."""
        bucket_bytes = int(self.config.rollout.sync_bucket_mb * 2**20)
        receive_weights(self.model, sides=self.sides, bucket_bytes=bucket_bytes, version=version, device=self.device)
        self.version = version
        for _, run in self.in_flight.values():
            run.update_weights(version, self.config.rollout.partial_rollouts)

    def _check_weights(self, method: str) -> int:
        if self.version is None:
            raise RuntimeError(
                f"the rollout role has no weights yet: the coordinator must sync them (receive_weights) before its "
                f"first {method}"
            )
        return self.version

    @data_parallel
    def generate_sequences(self, prompts: Batch, *, greedy: bool = False, samples: int | None = None) -> Batch:
        """``Generator.generate`` on this replica's weights, plus ``token_versions`` ``[rows, R]``: the policy
        version of each response token (0 past the response)."""
        version = self._check_weights("generate_sequences")
        batch = self.generator.generate(prompts, self.model, self.replica, greedy=greedy, samples=samples)
        batch.meta["metrics"]["rollout/policy_version"] = float(version)
        tensors = {**batch.tensors, "token_versions": batch["response_mask"] * version}
        return Batch(tensors, batch.non_tensors, batch.meta, group_size=batch.group_size)

    # ---- partial rollouts: one batch generated in segments, weight syncs between them ---------------------------

    @data_parallel
    def start_generation(self, prompts: Batch, *, batch: int) -> None:
        """Queue ``rollout.n`` responses per prompt of batch ``batch`` and run their first segment
        (``rollout.partial_segment_tokens`` tokens each); the generation stays in flight, with its KV cache, until
        ``finish_generation``. Each later ``receive_weights`` applies ``rollout.partial_rollouts`` to it."""
        version = self._check_weights("start_generation")
        assert batch not in self.in_flight, f"batch {batch} is already in flight"
        requests, params, _ = self.generator.requests(self.generator.host_prompts(prompts), n=self.config.rollout.n)
        engine = self._engine_in_flight()
        self.in_flight[batch] = (engine, engine.start(requests, params, version=version))
        self._segment(batch)

    @one_to_all
    def continue_generation(self, *, batch: int) -> None:
        """One more segment of batch ``batch``, on the weights held now."""
        self._segment(batch)

    def _engine_in_flight(self) -> LLMEngine:
        """An engine for one more batch in flight: at most algorithm.max_staleness are at once, each with a KV
        cache of its own, so each gets an equal share of the memory left for them."""
        free_slots = self.config.algorithm.max_staleness - len(self.in_flight)
        assert free_slots >= 1, f"{len(self.in_flight)} batches are in flight already"
        return self.generator.engine(self.model, shares=free_slots)

    def _segment(self, batch: int) -> None:
        check_thread(self.device)
        engine, run = self.in_flight[batch]
        engine.advance(run, segment_tokens=self.config.rollout.partial_segment_tokens)

    @data_parallel
    def finish_generation(self, prompts: Batch, *, batch: int) -> Batch:
        """Batch ``batch`` (its ``prompts``, as ``start_generation`` had them) generated to the end on the weights held
        now, as ``generate_sequences`` returns a batch: ``token_versions`` holds each token's own version, and
        ``rollout/mixed_version_responses`` counts the responses whose tokens span several versions."""
        version = self._check_weights("finish_generation")
        engine, run = self.in_flight.pop(batch)
        engine.advance(run)
        versions = [run.token_versions(seq) for seq in run.seqs]
        counters = {
            "preemptions": run.num_preemptions,
            "cuda_graphs": engine.stats.cuda_graphs,
            "cuda_graph_captures": engine.stats.cuda_graph_captures,
            "mixed_version_responses": sum(len(set(tokens)) > 1 for tokens in versions),
        }
        responses = [single_turn_response(seq) for seq in run.seqs]
        self.generator.release(engine)  # kept for the next batch with rollout.keep_engine, else its KV cache goes
        del engine, run
        token_versions = torch.zeros((len(versions), self.config.rollout.response_length), dtype=torch.long)
        for row, tokens in enumerate(versions):
            token_versions[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        rows = self.generator.assemble(
            self.generator.host_prompts(prompts),
            responses,
            counters,
            replicas=self.replica,
            n=self.config.rollout.n,
            carried={"token_versions": token_versions},
        )
        rows.meta["metrics"]["rollout/policy_version"] = float(version)
        return rows

    # ---- in-flight batches in a checkpoint (an exact resume) --------------------------------------------------

    def _rows_file(self, directory: str) -> Path:
        return Path(directory) / f"dp{self.dp_rank}_of_{self.reducer.size}.safetensors"

    def _generation_file(self, directory: str) -> Path:
        tp = self.mesh["tp"].size()
        return Path(directory) / f"dp{self.dp_rank}_of_{self.reducer.size}_tp{self.tp_rank}_of_{tp}.safetensors"

    @one_to_all
    def save_generation(self, directory: str, *, batch: int) -> None:
        """Write batch ``batch``'s generation in flight (partial rollouts) into ``directory``: each rank its
        replica's ``GenerationRun.snapshot`` and its shard of the K/V the run may still read. Holds a copy of those
        blocks (at most the generation's KV cache) on the device and the host while writing."""
        engine, run = self.in_flight[batch]
        Path(directory).mkdir(parents=True, exist_ok=True)
        kv = {key: tensor.contiguous().cpu() for key, tensor in engine.runner.read_blocks(run.kv_blocks).items()}
        save_file(kv, str(self._generation_file(directory)), metadata={"snapshot": json.dumps(run.snapshot())})

    @data_parallel
    def restore_generation(self, prompts: Batch, directory: str, *, batch: int) -> None:
        """Take back the generation of batch ``batch`` (its ``prompts``) that ``save_generation`` wrote, in flight
        as it was."""
        path = self._missing_or(self._generation_file(directory), "dp*_of_*_tp*_of_*.safetensors")
        with safe_open(str(path), framework="pt") as file:
            snapshot = json.loads(file.metadata()["snapshot"])
            kv = {key: file.get_tensor(key) for key in ("keys", "values")}
        requests, params, _ = self.generator.requests(self.generator.host_prompts(prompts), n=self.config.rollout.n)
        engine = self._engine_in_flight()
        self.in_flight[batch] = (engine, engine.resume(requests, params, snapshot, kv))

    def _missing_or(self, path: Path, pattern: str) -> Path:
        """``path``, or an error naming the files of the replicas that saved the in-flight batch instead."""
        if not path.is_file():
            saved = sorted(file.name for file in path.parent.glob(pattern))
            raise FileNotFoundError(
                f"{path} is missing: the in-flight rollouts in {path.parent} were saved by {saved} (replicas of that "
                f"run); resume with the rollout layout that saved them (rollout.n_ranks and rollout.tp)"
            )
        return path

    @data_parallel
    def save_rows(self, batch: Batch, directory: str) -> None:
        """Write this replica's rows of a generated batch still in flight (what generation made: responses, masks,
        both engine log-probs, token versions, and ``CARRIED`` where it made them; and its metrics) into
        ``directory``, one file per replica."""
        if self.tp_rank != 0:
            return  # the replica's TP ranks hold the same rows
        Path(directory).mkdir(parents=True, exist_ok=True)
        tensors = {key: batch[key].contiguous() for key in GENERATED if key != "trajectory_mask"}
        tensors["trajectory_mask"] = batch["attention_mask"][:, -batch["responses"].shape[1] :].contiguous()
        tensors.update((key, batch[key].contiguous()) for key in CARRIED if key in batch.tensors)
        metadata = {"metrics": json.dumps(batch.meta["metrics"]), "group_size": str(batch.group_size)}
        save_file(tensors, str(self._rows_file(directory)), metadata=metadata)

    @data_parallel
    def restore_rows(self, prompts: Batch, directory: str) -> Batch:
        """The batch ``save_rows`` wrote for ``prompts`` (the same prompts, split the same way), as generation
        returned it."""
        path = self._missing_or(self._rows_file(directory), "dp*_of_*.safetensors")
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata()
            generated = {key: file.get_tensor(key) for key in (*GENERATED, *CARRIED) if key in file.keys()}
        group_size = int(metadata["group_size"])
        repeated = prompts.repeat(group_size)
        if len(repeated) != len(generated["responses"]):
            raise ValueError(f"{path} holds {len(generated['responses'])} rows, not the {len(repeated)} of its prompts")
        metrics = json.loads(metadata["metrics"])
        carried = tuple(key for key in CARRIED if key in generated)
        return self.generator.rollout_batch(
            repeated, generated, metrics, group_size=group_size, extra=("token_versions", *carried)
        )
