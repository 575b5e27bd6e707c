"""Generating a batch of rollouts with the built-in engine: the part the actor (on its HybridEngine's generation
layout) and the rollout role (on replicas of its own) share.

``Generator.generate`` turns a DP shard of prompts into the rollout layout (``training.sharded_model``): it builds the
engine's requests (``rollout.n`` samples per prompt, each with a seed of its own that no DP split changes), runs them
on the model it is given, and pads the responses and the engine's log-probs to ``rollout.max_new_tokens``. Where the
rows of a DP shard are split over several generation replicas (the actor's micro-DP), ``workers.replicas.Replicas``
says which rows this rank answers and gathers the others'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.routes import rollout_routes
from spmd_rlhf.envs import ChatDelta, Environment, environment_factory
from spmd_rlhf.envs.multi_turn import Response, response_tensors, run_multi_turn, single_turn_response
from spmd_rlhf.runtime.device import check_thread
from spmd_rlhf.training.reducer import DPReducer
from spmd_rlhf.training.router_replay import ROUTED_EXPERTS
from spmd_rlhf.workers.replicas import Replicas

_SEED_STRIDE = 1_000_003


def stop_token_ids(configured: list[int], model_path: str, vocab_size: int) -> frozenset[int]:
    """``rollout.stop_token_ids`` and the eos_token_id(s) of the model's generation_config.json, if it has one: the
    ids besides the tokenizer's EOS that end a response. An id past the vocabulary is a config error."""
    ids = set(configured)
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
    outside = sorted(token for token in ids if token >= vocab_size)
    if outside:
        raise ValueError(
            f"stop token ids {outside} (rollout.stop_token_ids, or eos_token_id in {generation_config}) are outside "
            f"the model's vocabulary of {vocab_size}; remove them"
        )
    return frozenset(ids)


def sample_seed(run_seed: int, uid: int, sample: int, samples_per_prompt: int) -> int:
    """The sampling seed of sample ``sample`` of the prompt with run-unique ``uid``: the same whatever the DP split."""
    return (run_seed * _SEED_STRIDE + uid * samples_per_prompt + sample) % (2**63)


def kv_cache_budget(*, fraction: float, total: int, free: int, cached: int, role: str) -> int:
    """Bytes the KV cache may take so that the device holds at most ``fraction`` of its ``total`` bytes. What is in
    use (``total - free``, other processes included) counts against it, except this process's allocator cache
    (``cached`` = reserved - allocated bytes), which the KV cache reuses. An error naming the figures when nothing
    is left."""
    in_use = total - free - cached
    budget = int(fraction * total - in_use)
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"{role} generation may fill rollout.memory_fraction={fraction} of the device's {total / gib:.1f} GiB, but "
            f"{in_use / gib:.1f} GiB are in use before the KV cache (this process's tensors and other processes'), "
            "so no KV cache fits: raise rollout.memory_fraction, set rollout.kv_cache_blocks, or offload the roles "
            "that share the device (<role>.offload=true)"
        )
    return budget


class Generator:
    """The tokenizer, stop ids and engine settings of a policy's generation, and ``generate`` over any generation
    model of it. ``role``: the generating role's name (for messages); ``model_path`` / ``vocab_size``: the policy
    model's; ``reducer``: the role's DP group."""

    def __init__(
        self,
        config: FrameworkConfig,
        *,
        role: str,
        model_path: str,
        vocab_size: int,
        device: torch.device,
        reducer: DPReducer,
    ) -> None:
        self.config, self.device, self.reducer, self.role = config, device, reducer, role
        self._idle_engines: list[LLMEngine] = []
        """With rollout.keep_engine: engines between generations, each with its KV cache and CUDA graphs."""
        tokenizer_path = config.model.tokenizer_path or config.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if len(self.tokenizer) > vocab_size:
            # Prompt ids past the embedding would fail mid-run; responses would be decoded into the wrong text.
            raise ValueError(
                f"the tokenizer at {tokenizer_path} has {len(self.tokenizer)} tokens but the {role}'s model at "
                f"{model_path} has vocab_size={vocab_size}; point model.tokenizer_path at the model's own tokenizer "
                f"(null: model.path)"
            )
        tokenizer = self.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_token_ids = stop_token_ids(config.rollout.stop_token_ids, model_path, vocab_size)
        self.environment = self.chat_delta = None
        if config.rollout.environment is not None:
            self.environment = environment_factory(config.rollout.environment)
            # The template is checked here, once: one that cannot be followed token for token fails the run at start.
            roles = getattr(self.environment, "observation_roles", Environment.observation_roles)
            self.chat_delta = ChatDelta(self.tokenizer, source=tokenizer_path, observation_roles=roles)
            # A turn must be able to end where the template ends an assistant turn, or no observation can follow.
            self.stop_token_ids |= {self.chat_delta.turn_end_id}

    def engine(self, model: torch.nn.Module, *, shares: int = 1, rows: int | None = None) -> LLMEngine:
        """A generation engine over ``model`` with the rollout config's cache, batch and sampling settings: one that
        ``release`` kept (with its KV cache and CUDA graphs), else a new one. Give it back with ``release``.
        ``shares``: on GPU without rollout.kv_cache_blocks, a new engine's cache takes 1 / ``shares`` of the memory
        left, so that ``shares`` caches made one after another get equal parts (partial rollouts hold one per batch
        in flight). ``rows``: the requests of the call the engine is built for; with a cache sized from free memory,
        a new engine decodes at most that many at once (and at most rollout.max_num_seqs), so its KV cache and
        static decode buffers are no larger than such a call fills: a kept engine holds them through training."""
        # Engines over another model (a replaced generation copy) can never run again: their memory goes first.
        rollout = self.config.rollout
        kept = []
        for engine in self._idle_engines:
            # One built for a smaller call (validation first) would decode this one in waves: replaced, once.
            narrow = rows is not None and engine.max_num_seqs < min(rows, rollout.max_num_seqs)
            if engine.runner.model is model and not narrow:
                kept.append(engine)
            else:
                engine.free_cache()
        self._idle_engines = kept
        if self._idle_engines:
            return self._idle_engines.pop()
        sizing = {}
        if rollout.kv_cache_blocks:
            sizing["num_blocks"] = rollout.kv_cache_blocks
        elif self.device.type == "cuda":
            # Each rank measures its own free memory; the engine takes the minimum over the generation TP group, so
            # the replica's ranks run one schedule.
            free, total = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            sizing["kv_cache_bytes"] = (
                kv_cache_budget(fraction=rollout.memory_fraction, total=total, free=free, cached=cached, role=self.role)
                // shares
            )
        max_num_seqs = rollout.max_num_seqs
        if "kv_cache_bytes" in sizing and rows is not None:
            max_num_seqs = min(max_num_seqs, max(rows, 1))
        # Otherwise the engine sizes its cache to run every request to full length (host memory is plentiful
        # relative to the caches of CPU-sized models), so nothing is ever preempted. A null kv_block_size lets the
        # engine pick it from the attention backend (256 for flash-attn's paged kernel, else 16).
        return LLMEngine(
            model,
            eos_token_id=self.tokenizer.eos_token_id,
            block_size=rollout.kv_block_size,
            max_num_seqs=max_num_seqs,
            seed=self.config.trainer.seed,
            decode_graphs="auto" if rollout.cuda_graphs else "off",
            overlap_host=rollout.overlap_host,
            compile_layers=rollout.compile,
            decode_matmul=rollout.decode_matmul,
            # Decode is prepared once for the longest row, so graphs captured in one step serve every later one.
            max_model_len=self.config.data.max_prompt_length + rollout.response_length,
            record_routes=self.config.algorithm.router_replay == "rollout",
            **sizing,
        )

    def release(self, engine: LLMEngine) -> None:
        """Done with ``engine`` for now: with rollout.keep_engine it is kept for the next ``engine`` call over the
        same model, its KV cache and CUDA graphs with it; otherwise its KV cache is freed."""
        if self.config.rollout.keep_engine:
            self._idle_engines.append(engine)
        else:
            engine.free_cache()

    def generate(
        self,
        prompts: Batch,
        model: torch.nn.Module,
        replicas: Replicas,
        *,
        greedy: bool = False,
        samples: int | None = None,
    ) -> Batch:
        """``rollout.n`` responses per prompt (``samples`` if given; rows of one prompt consecutive, ``group_size =
        n``) from ``model``, responses padded to ``rollout.response_length`` so every DP shard has the same shape.
        ``greedy`` (validation, ReMax's baseline): one greedy response per prompt. The engine and its KV cache are
        kept for the next call with rollout.keep_engine, else dropped before this returns.

        With ``rollout.environment``, each response is a multi-turn trajectory (``envs.multi_turn``): ``response_mask``
        marks the tokens the policy generated (loss, KL, log-probs), ``attention_mask`` every token after the prompt
        too, and ``env_reward`` is each trajectory's environment reward; a GRPO group is the n trajectories of a
        prompt."""
        prompts = self.host_prompts(prompts)
        n = 1 if greedy else samples or self.config.rollout.n
        # This rank's generation replica answers a share of the DP group's prompts; the rows are gathered back below.
        mine = prompts.select(replicas.replica_rows(len(prompts)))
        requests, params, sources = self.requests(mine, n=n, greedy=greedy)
        engine = self.engine(model, rows=len(requests))
        per_row: dict[str, torch.Tensor] = {}
        carried: dict[str, torch.Tensor] = {}
        if self.environment is None:
            outputs = engine.generate(requests, params)
            responses = [single_turn_response(out) for out in outputs]
            counters = {"preemptions": engine.num_preemptions}
            if engine.runner.routes is not None and outputs:  # router replay's record, in the rollout layout
                width = (mine["input_ids"].shape[1], self.config.rollout.response_length)
                carried[ROUTED_EXPERTS] = rollout_routes(outputs, prompt_width=width[0], response_width=width[1])
        else:
            fields = ("data_source", "ground_truth", "extra_info")
            rows = [{"prompt": mine["raw_prompt"][i], **{key: mine[key][i] for key in fields}} for i in sources]
            environments = [self.environment() for _ in requests]
            trajectories, stats = run_multi_turn(
                engine,
                requests,
                environments,
                rows,
                params,
                delta=self.chat_delta,
                max_turns=self.config.rollout.max_turns,
                max_response_tokens=self.config.rollout.response_length,
                share=replicas.on_replica_leader,
                environment_workers=self.config.rollout.environment_workers,
            )
            responses = [t.response for t in trajectories]
            counters = {
                "preemptions": stats.preemptions,
                "prefill_tokens": stats.prefill_tokens,
                "cached_prefill_tokens": stats.cached_prefill_tokens,
            }
            per_row = {
                "env_reward": torch.tensor([t.env_reward for t in trajectories]),
                "turns": torch.tensor([float(t.num_turns) for t in trajectories]),
            }
            for key in trajectories[0].env_metrics if trajectories else ():
                per_row[f"env/{key}"] = torch.tensor([float(t.env_metrics[key]) for t in trajectories])
        counters["cuda_graphs"] = engine.stats.cuda_graphs
        counters["cuda_graph_captures"] = engine.stats.cuda_graph_captures
        self.release(engine)  # without rollout.keep_engine, the KV cache goes before training resumes
        return self.assemble(prompts, responses, counters, replicas=replicas, n=n, per_row=per_row, carried=carried)

    def host_prompts(self, prompts: Batch) -> Batch:
        """``prompts`` on the host, after checking this thread's device binding."""
        check_thread(self.device)
        # Prompts arrive on the data plane's device (the GPU under NCCL); the engine takes token lists and the rollout
        # is assembled on the host, as every role's results are: one copy here, not a device sync per prompt row.
        return prompts.to("cpu")

    def requests(
        self, prompts: Batch, *, n: int, greedy: bool = False
    ) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
        """The engine's requests for ``prompts`` (on the host): ``n`` per prompt, consecutive, each with its sampling
        seed; and the prompt row each answers."""
        rollout = self.config.rollout
        temperature = 0.0 if greedy else rollout.temperature
        prompt_tokens = [
            ids[mask.bool()].tolist() for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])
        ]
        requests, params, sources = [], [], []
        for index, (tokens, uid) in enumerate(zip(prompt_tokens, prompts["uid"].tolist())):
            for sample in range(n):
                requests.append(tokens)
                sources.append(index)
                params.append(
                    SamplingParams(
                        temperature=temperature,
                        top_k=rollout.top_k,
                        top_p=rollout.top_p,
                        max_new_tokens=rollout.max_new_tokens,
                        stop_token_ids=self.stop_token_ids,
                        seed=sample_seed(self.config.trainer.seed, uid, sample, n),
                    )
                )
        return requests, params, sources

    def assemble(
        self,
        prompts: Batch,
        responses: list[Response],
        counters: dict[str, float],
        *,
        replicas: Replicas,
        n: int,
        per_row: dict[str, torch.Tensor] | None = None,
        carried: dict[str, torch.Tensor] | None = None,
    ) -> Batch:
        """The rollout batch of ``prompts`` (the DP shard) from this replica's ``responses``, with its metrics:
        ``counters`` (engine work, each summed over replicas and DP shards as ``rollout/<name>``), ``per_row`` values
        (summed, and their means reported), and ``carried`` per-row tensors kept in the batch as they are."""
        per_row, carried = per_row or {}, carried or {}
        gathered = replicas.gather_rows(
            {
                **response_tensors(
                    responses, width=self.config.rollout.response_length, pad_token_id=self.pad_token_id
                ),
                **per_row,
                **carried,
            }
        )
        # Each replica counted its own engine work; the other DP groups' replicas add theirs below.
        counter_values = [replicas.sum_over_replicas(value) for value in counters.values()]
        repeated = prompts.repeat(n)
        rows = len(repeated)
        response_mask, trajectory_mask = gathered["response_mask"], gathered["trajectory_mask"]
        lengths = trajectory_mask.sum(dim=1).double()
        per_row_sums = [float(gathered[key].double().sum()) for key in per_row]
        sums, (longest, negated_shortest) = self.reducer.totals(
            [
                float(lengths.sum()),
                float(rows),
                float((trajectory_mask[:, -1] == 1).sum()),
                float(repeated["attention_mask"].sum()),
                float(response_mask.sum()),
                *counter_values,
                *per_row_sums,
            ],
            [float(lengths.max()), -float(lengths.min())],
        )
        (length_sum, row_count, clipped, prompt_tokens, generated), sums = sums[:5], sums[5:]
        counter_sums, row_sums = sums[: len(counters)], sums[len(counters) :]
        metrics = {
            "response_length/mean": length_sum / row_count,
            "response_length/max": longest,
            "response_length/min": -negated_shortest,
            "response_length/clip_ratio": clipped / row_count,
            "rollout/generated_tokens": generated,
            "rollout/prompt_tokens": prompt_tokens,
            **{f"rollout/{name}": total for name, total in zip(counters, counter_sums)},
        }
        if self.environment is not None:
            metrics["rollout/observation_tokens"] = length_sum - generated
            metrics.update({f"rollout/{key}/mean": total / row_count for key, total in zip(per_row, row_sums)})
        extra = {"env_reward": gathered["env_reward"]} if self.environment is not None else {}
        extra.update((key, gathered[key]) for key in carried)
        return self.rollout_batch(repeated, {**gathered, **extra}, metrics, group_size=n, extra=tuple(extra))

    @staticmethod
    def rollout_batch(
        repeated: Batch,
        generated: dict[str, torch.Tensor],
        metrics: dict[str, float],
        *,
        group_size: int,
        extra: tuple[str, ...] = (),
    ) -> Batch:
        """The rollout layout from the prompts (each repeated once per sample) and the generated tensors
        (``responses``, ``response_mask``, ``trajectory_mask``, ``rollout_log_probs``, ``sampling_log_probs``), with
        the ``extra`` keys of ``generated`` carried along (``env_reward``, ``token_versions``)."""
        responses = generated["responses"]
        tensors = {
            "prompts": repeated["input_ids"],
            "responses": responses,
            "response_mask": generated["response_mask"],
            "input_ids": torch.cat([repeated["input_ids"], responses], dim=1),
            "attention_mask": torch.cat([repeated["attention_mask"], generated["trajectory_mask"]], dim=1),
            "rollout_log_probs": generated["rollout_log_probs"],
            "sampling_log_probs": generated["sampling_log_probs"],
            "uid": repeated["uid"],
            **{key: generated[key] for key in extra},
        }
        return Batch(tensors, dict(repeated.non_tensors), {"metrics": metrics}, group_size=group_size)
