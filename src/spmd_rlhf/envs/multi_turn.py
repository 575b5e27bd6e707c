"""Multi-turn rollouts on the generation engine: generate a turn for every live trajectory, let each environment
answer, append the answer's tokens, repeat.

Per trajectory, after the prompt: the policy's tokens of each turn exactly as sampled (with their log-probs, mask 1),
then the observations' tokens from the chat template's delta (``chat_delta.ChatDelta``; mask 0, log-prob 0), and so
on. Every turn's engine output must extend the trajectory's tokens (``check_prefix_extension``), and all turns run in
one ``prefix_cache_session``, so each turn's prefill reuses the K/V blocks of the turns before it.

A trajectory ends when its environment says so, after ``max_turns`` turns, when a turn ends without the template's
end-of-turn token (cut at ``max_new_tokens``, or another stop token: there is no token-exact way to append an
observation after an unfinished turn), or when the next observation would leave no room in the budget of
``max_response_tokens`` tokens after the prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from spmd_rlhf.engine import LLMEngine, SamplingParams, Sequence
from spmd_rlhf.engine.sampler import derive_seed
from spmd_rlhf.envs.base import Environment, StepResult
from spmd_rlhf.envs.chat_delta import ChatDelta, check_prefix_extension, template_context

T = TypeVar("T")

Response = tuple[list[int], list[int], list[float], list[float]]
"""One response as ``response_tensors`` takes it: token ids after the prompt, generated mask (1 where the policy
sampled the token), the engine's log-probs before top-k / top-p and under the distribution each token was drawn from
(both 0 on observation tokens)."""


def _run_here(compute: Callable[[], T]) -> T:
    return compute()


@dataclass
class MultiTurnStats:
    """Engine counters summed over a rollout's turns."""

    turns: int = 0
    """Engine calls (the longest trajectory's turns)."""
    prefill_tokens: int = 0
    cached_prefill_tokens: int = 0
    """Prompt tokens whose K/V were already in the cache (an earlier turn's, or another sample's of the prompt)."""
    preemptions: int = 0


@dataclass
class Trajectory:
    prompt_token_ids: list[int]
    messages: list[dict[str, Any]]
    """The conversation as text: the initial messages, then each assistant turn and its observations."""
    template_context: dict[str, Any] = field(default_factory=dict)
    """The system message and tools the prompt was rendered with (``chat_delta.template_context``); observation
    deltas are rendered with them."""
    response_token_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: generated and observation tokens, in order."""
    generated_mask: list[int] = field(default_factory=list)
    """1 where the policy sampled the token of ``response_token_ids``, 0 on observation (template) tokens."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token (before top-k / top-p); 0 on observation tokens."""
    sampling_log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated token under the distribution it was drawn from; 0 on observation
    tokens."""
    env_reward: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The environment's ``metrics()`` once the rollout has ended."""
    num_turns: int = 0
    finish_reason: str | None = None
    """done (the environment ended it), max_turns, unfinished_turn or budget."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.response_token_ids

    def extend(
        self,
        token_ids: list[int],
        *,
        generated: bool,
        log_probs: Sequence_[float] | None = None,
        sampling_log_probs: Sequence_[float] | None = None,
    ) -> None:
        self.response_token_ids += token_ids
        self.generated_mask += [int(generated)] * len(token_ids)
        self.log_probs += list(log_probs) if generated else [0.0] * len(token_ids)
        self.sampling_log_probs += list(sampling_log_probs) if generated else [0.0] * len(token_ids)

    @property
    def response(self) -> Response:
        return self.response_token_ids, self.generated_mask, self.log_probs, self.sampling_log_probs


def run_multi_turn(
    engine: LLMEngine,
    prompt_token_ids: list[list[int]],
    environments: list[Environment],
    rows: list[dict[str, Any]],
    params: list[SamplingParams],
    *,
    delta: ChatDelta,
    max_turns: int,
    max_response_tokens: int,
    reuse_prefix: bool = True,
    share: Callable[[Callable[[], T]], T] = _run_here,
    environment_workers: int = 1,
) -> tuple[list[Trajectory], MultiTurnStats]:
    """One trajectory per prompt, ``environments[i]`` (fresh) answering trajectory i started from ``rows[i]``, turns
    sampled with ``params[i]`` (its ``max_new_tokens`` per turn; turn t > 0 draws with seed ``derive_seed(seed, t)``
    so turns never repeat one another's noise). ``reuse_prefix=False`` gives each turn a fresh cache, as a
    single-turn engine would (for measuring what cross-turn reuse saves).

    ``share(compute)`` runs the environments' side of a turn: a tensor-parallel replica's ranks generate the same
    tokens but must also append the same observations, so the actor passes a ``share`` that computes on the
    replica's first rank and broadcasts the result (tools then run once per replica, and a nondeterministic tool
    cannot split the replica's schedules). The default computes here.

    ``environment_workers`` threads answer a turn's trajectories at once (each trajectory has its own environment,
    so they are independent; tools waiting on a subprocess or the network overlap); the answers are taken in
    trajectory order, so the result does not depend on the count."""
    trajectories = [
        Trajectory(list(tokens), environment.reset(row), template_context(row))
        for tokens, environment, row in zip(prompt_token_ids, environments, rows, strict=True)
    ]
    stats = MultiTurnStats()
    longest = [len(tokens) + max_response_tokens for tokens in prompt_token_ids]
    with engine.prefix_cache_session(longest) if reuse_prefix else contextlib.nullcontext():
        live = list(range(len(trajectories)))
        for turn in range(max_turns):
            if not live:
                break
            requests = [trajectories[index].token_ids for index in live]
            turn_params = [
                _turn_params(params[index], turn, max_response_tokens - len(trajectories[index].response_token_ids))
                for index in live
            ]
            outputs = engine.generate(requests, turn_params)
            stats.turns += 1
            stats.prefill_tokens += engine.stats.prefill_tokens
            stats.cached_prefill_tokens += engine.stats.cached_prefill_tokens
            stats.preemptions += engine.stats.preemptions
            texts = [delta.tokenizer.decode(output.generated_token_ids, skip_special_tokens=True) for output in outputs]
            for index, request, output in zip(live, requests, outputs):
                check_prefix_extension(request, output.token_ids, where=f"trajectory {index} turn {turn}")
                trajectories[index].extend(
                    output.generated_token_ids,
                    generated=True,
                    log_probs=output.log_probs,
                    sampling_log_probs=output.sampling_log_probs,
                )
                trajectories[index].num_turns += 1

            def answer_turn() -> list[_Answer]:
                steps = [(environments[index], trajectories[index].messages, text) for index, text in zip(live, texts)]
                results = _step_all(steps, workers=environment_workers)
                return [
                    _answer(
                        environments[index],
                        trajectories[index],
                        text,
                        result,
                        output.generated_token_ids,
                        delta,
                        last_turn=turn + 1 >= max_turns,
                        max_response_tokens=max_response_tokens,
                    )
                    for index, text, result, output in zip(live, texts, results, outputs)
                ]

            still_live = []
            for index, text, answer in zip(live, texts, share(answer_turn)):
                trajectory = trajectories[index]
                trajectory.messages.append({"role": "assistant", "content": text})
                trajectory.env_reward += answer.reward
                if answer.reason is None:
                    trajectory.messages += answer.observations
                    trajectory.extend(answer.observation_ids, generated=False)
                    still_live.append(index)
                else:
                    trajectory.finish_reason = answer.reason
            live = still_live
    for trajectory, numbers in zip(
        trajectories, share(lambda: [environment.metrics() for environment in environments])
    ):
        trajectory.env_metrics = numbers
    return trajectories, stats


@dataclass
class _Answer:
    """An environment's answer to one turn, as every rank of a generation replica applies it."""

    reward: float
    """The turn's reward, plus the trajectory reward when the trajectory ends here."""
    reason: str | None
    """Why the trajectory ends here, or None."""
    observations: list[dict[str, Any]]
    observation_ids: list[int]


def _step_all(steps: list[tuple[Environment, list[dict[str, Any]], str]], *, workers: int) -> list[StepResult]:
    """Each environment's ``step`` on its trajectory's messages and new text, ``workers`` at a time, in order. Only
    the environments run on the threads: the tokenizer (not safe to share between threads) stays on the caller's."""
    if workers == 1 or len(steps) <= 1:
        return [environment.step(messages, text) for environment, messages, text in steps]
    with ThreadPoolExecutor(min(workers, len(steps)), thread_name_prefix="environment") as pool:
        return list(pool.map(lambda step: step[0].step(step[1], step[2]), steps))


def _answer(
    environment: Environment,
    trajectory: Trajectory,
    text: str,
    result: StepResult,
    generated: list[int],
    delta: ChatDelta,
    *,
    last_turn: bool,
    max_response_tokens: int,
) -> _Answer:
    messages = trajectory.messages + [{"role": "assistant", "content": text}]
    reason = _end_reason(generated, result.done, last_turn, delta)
    observation_ids: list[int] = []
    if reason is None:
        observation_ids = delta.observation_ids(result.observations, **trajectory.template_context)
        # The next turn needs room for at least one token after the observation.
        if len(trajectory.response_token_ids) + len(observation_ids) >= max_response_tokens:
            reason = "budget"
    if reason is None:
        return _Answer(result.reward, None, result.observations, observation_ids)
    return _Answer(result.reward + environment.trajectory_reward(messages), reason, [], [])


def _turn_params(params: SamplingParams, turn: int, room: int) -> SamplingParams:
    seed = params.seed if turn == 0 or params.seed is None else derive_seed(params.seed, turn)
    return replace(params, max_new_tokens=min(params.max_new_tokens, room), seed=seed)


def _end_reason(generated: list[int], done: bool, last_turn: bool, delta: ChatDelta) -> str | None:
    if done:
        return "done"
    if last_turn:
        return "max_turns"
    if not generated or generated[-1] != delta.turn_end_id:
        return "unfinished_turn"
    return None


def single_turn_response(seq: Sequence) -> Response:
    """An engine output as a response: every token after the prompt generated."""
    return seq.generated_token_ids, [1] * seq.num_generated, seq.log_probs, seq.sampling_log_probs


def response_tensors(responses: list[Response], *, width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """``Response`` rows as right-padded ``[rows, width]`` tensors: ``responses``, ``response_mask`` (the generated
    tokens: what the loss and the KL see), ``trajectory_mask`` (every token after the prompt, observations included:
    what attention sees), ``rollout_log_probs`` (the engine's unfiltered log-probs, what training computes) and
    ``sampling_log_probs`` (under the top-k / top-p distribution each token was drawn from: the behaviour policy),
    both 0 elsewhere."""
    rows = len(responses)
    tensors = {
        "responses": torch.full((rows, width), pad_token_id, dtype=torch.long),
        "response_mask": torch.zeros((rows, width), dtype=torch.long),
        "trajectory_mask": torch.zeros((rows, width), dtype=torch.long),
        "rollout_log_probs": torch.zeros((rows, width), dtype=torch.float32),
        "sampling_log_probs": torch.zeros((rows, width), dtype=torch.float32),
    }
    for row, (token_ids, generated_mask, log_probs, sampling_log_probs) in enumerate(responses):
        length = len(token_ids)
        assert length <= width, f"a response of {length} tokens is over the {width} budget"
        tensors["responses"][row, :length] = torch.tensor(token_ids, dtype=torch.long)
        tensors["response_mask"][row, :length] = torch.tensor(generated_mask, dtype=torch.long)
        tensors["trajectory_mask"][row, :length] = 1
        tensors["rollout_log_probs"][row, :length] = torch.tensor(log_probs, dtype=torch.float32)
        tensors["sampling_log_probs"][row, :length] = torch.tensor(sampling_log_probs, dtype=torch.float32)
    return tensors
