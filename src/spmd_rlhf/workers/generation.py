"""Generating a batch of rollouts with the built-in engine: the part the actor (on its HybridEngine's generation
layout) and the rollout role (on replicas of its own) share.

``Generator.generate`` turns a DP shard of prompts into the rollout layout (``workers.sharded_model``): it builds the
engine's requests (``rollout.n`` samples per prompt, each with a seed of its own that no DP split changes), runs them
on the model it is given, and pads the responses and the engine's log-probs to ``rollout.max_new_tokens``. Where the
rows of a DP shard are split over several generation replicas (the actor's micro-DP), ``Replicas`` says which rows
this rank answers and gathers the others'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoTokenizer

from ..config_schema import FrameworkConfig
from ..data.batch import Batch
from ..engine import LLMEngine, SamplingParams
from ..runtime.device import check_thread
from .reducer import DPReducer

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


class Replicas(Protocol):
    """How the rows of one DP shard are spread over generation replicas (``hybrid.HybridEngine`` implements it)."""

    def replica_rows(self, num_rows: int) -> torch.Tensor: ...

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def sum_over_replicas(self, value: float) -> float: ...


class OneReplica:
    """A DP shard answered by one replica (the rollout role: each DP rank is a replica of its own)."""

    def replica_rows(self, num_rows: int) -> torch.Tensor:
        return torch.arange(num_rows)

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors

    def sum_over_replicas(self, value: float) -> float:
        return float(value)


class Generator:
    """The tokenizer, stop ids and engine settings of a policy's generation, and ``generate`` over any generation
    model of it. ``role``: the generating role's name (for messages); ``model_path`` / ``vocab_size``: the policy
    model's; ``reducer``: the role's DP group."""

    def __init__(
        self, config: FrameworkConfig, *, role: str, model_path: str, vocab_size: int, device: torch.device,
        reducer: DPReducer,
    ) -> None:
        self.config, self.device, self.reducer = config, device, reducer
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

    def _engine(self, model: torch.nn.Module) -> LLMEngine:
        rollout = self.config.rollout
        sizing = {}
        if rollout.kv_cache_blocks:
            sizing["num_blocks"] = rollout.kv_cache_blocks
        elif self.device.type == "cuda":
            # Each rank measures its own free memory; the engine takes the minimum over the generation TP group, so
            # the replica's ranks run one schedule.
            free, total = torch.cuda.mem_get_info(self.device)
            sizing["kv_cache_bytes"] = int(max(0, rollout.memory_fraction * total - (total - free)))
        # Otherwise the engine sizes its cache to run every request to full length (host memory is plentiful
        # relative to the caches of CPU-sized models), so nothing is ever preempted. A null kv_block_size lets the
        # engine pick it from the attention backend (256 for flash-attn's paged kernel, else 16).
        return LLMEngine(
            model, eos_token_id=self.tokenizer.eos_token_id, block_size=rollout.kv_block_size,
            max_num_seqs=rollout.max_num_seqs, seed=self.config.trainer.seed, **sizing,
        )

    def generate(
        self, prompts: Batch, model: torch.nn.Module, replicas: Replicas, *, greedy: bool = False,
        samples: int | None = None,
    ) -> Batch:
        """``rollout.n`` responses per prompt (``samples`` if given; rows of one prompt consecutive, ``group_size =
        n``) from ``model``, responses padded to ``rollout.max_new_tokens`` so every DP shard has the same shape.
        ``greedy`` (validation, ReMax's baseline): one greedy response per prompt. The engine and its KV cache are
        dropped before this returns."""
        check_thread(self.device)
        rollout = self.config.rollout
        n, response_length = (1 if greedy else samples or rollout.n), rollout.max_new_tokens
        temperature = 0.0 if greedy else rollout.temperature
        # This rank's generation replica answers a share of the DP group's prompts; the rows are gathered back below.
        mine = prompts.select(replicas.replica_rows(len(prompts)))
        prompt_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(mine["input_ids"], mine["attention_mask"])]
        requests, params = [], []
        for tokens, uid in zip(prompt_tokens, mine["uid"].tolist()):
            for sample in range(n):
                requests.append(tokens)
                params.append(
                    SamplingParams(
                        temperature=temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                        max_new_tokens=response_length, stop_token_ids=self.stop_token_ids,
                        seed=sample_seed(self.config.trainer.seed, uid, sample, n),
                    )
                )
        engine = self._engine(model)
        outputs = engine.generate(requests, params)
        preemptions = engine.num_preemptions
        del engine

        rows = len(requests)
        responses = torch.full((rows, response_length), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, response_length), dtype=torch.long)
        rollout_log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
        for row, output in enumerate(outputs):
            length = len(output.generated_token_ids)
            responses[row, :length] = torch.tensor(output.generated_token_ids)
            response_mask[row, :length] = 1
            rollout_log_probs[row, :length] = torch.tensor(output.log_probs)
        gathered = replicas.gather_rows(
            {"responses": responses, "response_mask": response_mask, "rollout_log_probs": rollout_log_probs}
        )
        # Each replica counted its own preemptions; the other DP groups' replicas add theirs below.
        preemptions = replicas.sum_over_replicas(preemptions)
        repeated = prompts.repeat(n)
        metrics = self._metrics(repeated, gathered["response_mask"], preemptions)
        return self.rollout_batch(repeated, gathered, metrics, group_size=n)

    def _metrics(self, repeated: Batch, response_mask: torch.Tensor, preemptions: float) -> dict[str, float]:
        rows = len(response_mask)
        lengths = response_mask.sum(dim=1).double()
        (length_sum, row_count, clipped, prompt_tokens, preemptions), (longest, negated_shortest) = self.reducer.totals(
            [float(lengths.sum()), float(rows), float((response_mask[:, -1] == 1).sum()),
             float(repeated["attention_mask"].sum()), float(preemptions)],
            [float(lengths.max()), -float(lengths.min())],
        )
        return {
            "response_length/mean": length_sum / row_count,
            "response_length/max": longest,
            "response_length/min": -negated_shortest,
            "response_length/clip_ratio": clipped / row_count,
            "rollout/generated_tokens": length_sum,
            "rollout/prompt_tokens": prompt_tokens,
            "rollout/preemptions": preemptions,
        }

    @staticmethod
    def rollout_batch(
        repeated: Batch, generated: dict[str, torch.Tensor], metrics: dict[str, float], *, group_size: int
    ) -> Batch:
        """The rollout layout from the prompts (each repeated once per sample) and the generated tensors
        (``responses``, ``response_mask``, ``rollout_log_probs``, and any more, such as ``token_versions``)."""
        responses, response_mask = generated["responses"], generated["response_mask"]
        return Batch(
            {
                "prompts": repeated["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([repeated["input_ids"], responses], dim=1),
                "attention_mask": torch.cat([repeated["attention_mask"], response_mask], dim=1),
                "rollout_log_probs": generated["rollout_log_probs"],
                "uid": repeated["uid"],
                **{key: value for key, value in generated.items() if key not in ("responses", "response_mask")},
            },
            dict(repeated.non_tensors),
            {"metrics": metrics},
            group_size=group_size,
        )
