"""A generative judge on the reward (or cost) role's ranks (``<role>.kind=generative``): a causal LM that reads each
prompt and response and writes a verdict, generating through the project's engine.

Each DP rank of the role's mesh holds the judge TP-sharded over ``mesh["tp"]`` in ``model.dtype`` (a whole replica
per DP rank, like the rollout role's; never trained, never resharded) and judges its DP shard of the rows: the
responses are decoded with the policy's tokenizer, the judge's prompts built and parsed by ``rewards.judge``, and
tokenized in the judge's own chat template (``data.retokenize.judge_tokenizer``). The KV cache is sized for each
call's requests and freed when it returns, so the judge holds only its weights between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from spmd_rlhf.config import FrameworkConfig, ScoringRoleConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.data.retokenize import judge_tokenizer, response_texts
from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.rewards.judge import JudgeParser
from spmd_rlhf.runtime import RoleContext
from spmd_rlhf.workers.generation import sample_seed, stop_token_ids
from spmd_rlhf.workers.rollout import generation_replica

JUDGE_SEED_OFFSET = 7919
"""Added to trainer.seed for the judge's sampling seeds, so that its draws are not the policy's."""


@dataclass(frozen=True)
class Judged:
    """One DP shard judged."""

    scores: torch.Tensor
    """``[rows]`` float32: each response's normalised score, or the fallback."""
    unparsed: int
    too_long: int
    """Rows whose judge prompt and verdict would not fit the judge's context (``max_position_embeddings``): scored
    with the fallback without being generated."""
    generated_tokens: int
    seconds: float
    """Wall-clock seconds from the first prompt built to the last verdict parsed."""


class Judge:
    """The judge model, its tokenizer, engine and sampling settings, and ``judge`` over a batch of rollouts."""

    def __init__(
        self, context: RoleContext, config: FrameworkConfig, role_config: ScoringRoleConfig, *, policy_tokenizer
    ) -> None:
        role, path = context.name, role_config.model_path
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = judge_tokenizer(role_config, policy_tokenizer, role=role)
        self.parser = JudgeParser(role_config, role=role)
        self.model = generation_replica(
            path,
            dtype=getattr(torch, config.model.dtype),
            tp_mesh=context.mesh["tp"],
            device=context.device,
            attention_backend=config.model.attention,
            role=role,
            load=True,
        )
        self.engine = LLMEngine(
            self.model,
            eos_token_id=self.tokenizer.eos_token_id,
            max_num_seqs=config.rollout.max_num_seqs,
            seed=config.trainer.seed,
            decode_graphs="auto" if config.rollout.cuda_graphs else "off",
            overlap_host=config.rollout.overlap_host,
            compile_layers=config.rollout.compile,
            decode_matmul=config.rollout.decode_matmul,
        )
        self.params = SamplingParams(
            temperature=role_config.judge_temperature,
            top_p=role_config.judge_top_p,
            max_new_tokens=role_config.judge_max_new_tokens,
            stop_token_ids=stop_token_ids([], path, self.model.args.vocab_size),
        )
        self.seed = config.trainer.seed + JUDGE_SEED_OFFSET

    def prompt_ids(self, batch: Batch) -> list[list[int]]:
        """Each row's judge prompt in the judge's chat template and tokens (``rewards.judge``)."""
        texts = response_texts(self.policy_tokenizer, batch["responses"], batch["response_mask"])
        messages = [
            [{"role": "user", "content": self.parser.user_message(prompt, text, truth)}]
            for prompt, text, truth in zip(batch["raw_prompt"], texts, batch["ground_truth"])
        ]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def request_params(self, batch: Batch) -> list[SamplingParams]:
        """The sampling settings of each row's verdict, seeded by the row's prompt (``uid``) and its place among the
        prompt's ``group_size`` responses, as the policy's samples are, but from a stream of the judge's own: a
        sampled verdict is the same whatever the role's DP layout."""
        group_size = batch.group_size
        return [
            replace(self.params, seed=sample_seed(self.seed, uid, row % group_size, group_size))
            for row, uid in enumerate(batch["uid"].tolist())
        ]

    def judge(self, batch: Batch) -> Judged:
        """Every row of ``batch`` judged: generated, decoded without special tokens and parsed; a row whose prompt
        and ``judge_max_new_tokens`` exceed the judge's context is not generated and takes the fallback score
        (``Judged.too_long``). The TP ranks of a replica run the same requests with the same seeds, so they write (and
        parse) the same verdicts."""
        start = time.perf_counter()
        prompts, params = self.prompt_ids(batch), self.request_params(batch)
        context = self.model.args.max_position_embeddings
        fits = [row for row, ids in enumerate(prompts) if len(ids) + self.params.max_new_tokens <= context]
        outputs = self.engine.generate([prompts[row] for row in fits], [params[row] for row in fits])
        self.engine.free_cache()
        written = [out.generated_token_ids for out in outputs]
        verdicts = self.parser.verdicts(self.tokenizer.batch_decode(written, skip_special_tokens=True))
        scores = torch.full((len(prompts),), self.parser.fallback, dtype=torch.float32)
        scores[fits] = torch.tensor(verdicts.scores, dtype=torch.float32)
        return Judged(
            scores,
            verdicts.unparsed,
            len(prompts) - len(fits),
            sum(len(tokens) for tokens in written),
            time.perf_counter() - start,
        )
