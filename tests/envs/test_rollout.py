"""Multi-turn rollouts on the engine with the tiny model: the generated mask covers exactly the policy's tokens, the
engine's log-probs equal a training forward over the whole trajectory, each turn's prefill reuses the earlier turns'
K/V blocks without changing a token, limits hold, and a drifted prefix fails loudly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.envs import ChatDelta, Environment, StepResult, TrajectoryDriftError, initial_messages
from spmd_rlhf.envs.multi_turn import response_tensors, run_multi_turn
from spmd_rlhf.models import load_model, log_probs_from_logits
from spmd_rlhf.tiny.model import make_tiny, raise_eos_logit

OBSERVATION = [{"role": "tool", "content": "408"}]
TEMPERATURE, MAX_TURNS, PER_TURN, BUDGET = 0.9, 4, 10, 64


class Scripted(Environment):
    """Answers every turn with the same tool message, 0.5 reward per turn, 1 for the whole trajectory."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, new_text):
        return StepResult(OBSERVATION, reward=0.5)

    def trajectory_reward(self, messages):
        return 1.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("multiturn"))
    make_tiny(family="llama", out_dir=path)
    raise_eos_logit(path, scale=7.0)  # a random-init model almost never ends a turn; this one does after a few tokens
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path, head="lm", dtype=torch.float32, attention_backend="torch")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}*{b}="}], tokenize=False, add_generation_prompt=True
        )
        for a, b in ((12, 34), (56, 78), (9, 87))
    ]
    return model, tokenizer, [tokenizer.encode(text, add_special_tokens=False) for text in prompts]


class Concurrent(Scripted):
    """Scripted, each step taking a while and counting how many steps run at once (over every instance)."""

    lock, running, most = threading.Lock(), 0, 0

    def step(self, messages, new_text):
        with Concurrent.lock:
            Concurrent.running += 1
            Concurrent.most = max(Concurrent.most, Concurrent.running)
        time.sleep(0.02)
        with Concurrent.lock:
            Concurrent.running -= 1
        return super().step(messages, new_text)


def _rollout(model, tokenizer, prompts, *, samples=2, engine=None, reuse_prefix=True, environment=Scripted, workers=1):
    engine = engine or LLMEngine(model, eos_token_id=tokenizer.eos_token_id, block_size=4)
    requests = [tokens for tokens in prompts for _ in range(samples)]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_new_tokens=PER_TURN, seed=1000 + index)
        for index in range(len(requests))
    ]
    rows = [{"prompt": "q"} for _ in requests]
    trajectories, stats = run_multi_turn(
        engine,
        requests,
        [environment() for _ in requests],
        rows,
        params,
        delta=ChatDelta(tokenizer),
        max_turns=MAX_TURNS,
        max_response_tokens=BUDGET,
        reuse_prefix=reuse_prefix,
        environment_workers=workers,
    )
    return trajectories, stats


def test_masks_log_probs_limits_and_rewards(setup):
    model, tokenizer, prompts = setup
    trajectories, stats = _rollout(model, tokenizer, prompts)
    delta = ChatDelta(tokenizer)
    observation = delta.observation_ids(OBSERVATION)
    assert max(t.num_turns for t in trajectories) >= 3 and stats.turns >= 3  # several turns really ran
    for t in trajectories:
        assert len(t.response_token_ids) <= BUDGET and t.num_turns <= MAX_TURNS
        assert t.finish_reason in ("max_turns", "unfinished_turn", "budget")
        assert t.env_reward == pytest.approx(0.5 * t.num_turns + 1.0)
        # Walk the response: generated runs end at the end-of-turn token (but the last), observation runs are exactly
        # the template's delta, and only generated tokens have log-probs.
        position, turns = 0, 0
        while position < len(t.response_token_ids):
            start = position
            while position < len(t.response_token_ids) and t.generated_mask[position]:
                position += 1
            turns += 1
            assert position > start and all(lp < 0 for lp in t.log_probs[start:position])
            if position < len(t.response_token_ids):
                assert t.response_token_ids[position - 1] == delta.turn_end_id
                assert t.response_token_ids[position : position + len(observation)] == observation
                assert t.generated_mask[position : position + len(observation)] == [0] * len(observation)
                assert t.log_probs[position : position + len(observation)] == [0.0] * len(observation)
                position += len(observation)
        assert turns == t.num_turns
        # The engine's log-probs are a training forward's over the whole trajectory, observations included.
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            expected = log_probs_from_logits(model(ids)[:, :-1], ids[:, 1:], temperature=TEMPERATURE)[
                0, len(t.prompt_token_ids) - 1 :
            ]
        mask = torch.tensor(t.generated_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(t.log_probs)[mask], expected[mask], atol=2e-5, rtol=0)
        assert t.sampling_log_probs == t.log_probs  # nothing filtered: the sampled distribution is the full one
    tensors = response_tensors([t.response for t in trajectories], width=BUDGET, pad_token_id=0)
    assert tensors["response_mask"].sum() == sum(sum(t.generated_mask) for t in trajectories)
    assert bool((tensors["response_mask"] <= tensors["trajectory_mask"]).all())
    assert tensors["trajectory_mask"].sum() == sum(len(t.response_token_ids) for t in trajectories)
    for row, t in enumerate(trajectories):
        length = len(t.response_token_ids)
        assert tensors["rollout_log_probs"][row, :length].tolist() == torch.tensor(t.log_probs).tolist()
        assert not tensors["rollout_log_probs"][row, length:].any()
    assert torch.equal(tensors["sampling_log_probs"], tensors["rollout_log_probs"])


def test_prefix_reuse_across_turns_changes_no_token(setup):
    model, tokenizer, prompts = setup
    reused, reused_stats = _rollout(model, tokenizer, prompts)
    fresh, fresh_stats = _rollout(model, tokenizer, prompts, reuse_prefix=False)
    assert [t.token_ids for t in reused] == [t.token_ids for t in fresh]
    for a, b in zip(reused, fresh):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=2e-5, rtol=0)
    # Without the session only the n samples of a turn share blocks; with it, later turns skip the earlier turns'.
    assert reused_stats.cached_prefill_tokens > fresh_stats.cached_prefill_tokens
    assert (
        reused_stats.prefill_tokens + reused_stats.cached_prefill_tokens
        == fresh_stats.prefill_tokens + fresh_stats.cached_prefill_tokens
    )


def test_environments_answer_a_turn_at_once_with_the_same_result(setup):
    model, tokenizer, prompts = setup
    serial, _ = _rollout(model, tokenizer, prompts, environment=Concurrent)
    assert Concurrent.most == 1
    concurrent, _ = _rollout(model, tokenizer, prompts, environment=Concurrent, workers=4)
    assert Concurrent.most > 1
    assert [(t.token_ids, t.generated_mask, t.env_reward, t.finish_reason) for t in concurrent] == [
        (t.token_ids, t.generated_mask, t.env_reward, t.finish_reason) for t in serial
    ]


def test_a_drifted_prefix_fails_loudly(setup, monkeypatch):
    model, tokenizer, prompts = setup
    engine = LLMEngine(model, eos_token_id=tokenizer.eos_token_id, block_size=4)
    generate = engine.generate

    def drifting(requests, params):
        outputs = generate(requests, params)
        outputs[0].token_ids[1] += 1  # as if a history had been re-tokenized differently
        return outputs

    monkeypatch.setattr(engine, "generate", drifting)
    with pytest.raises(TrajectoryDriftError, match="trajectory 0 turn 0"):
        _rollout(model, tokenizer, prompts, engine=engine)


class FromRow(Scripted):
    """Scripted, starting from the row's messages (a system message among them)."""

    def reset(self, row):
        return initial_messages(row)


class RecordingDelta(ChatDelta):
    """A ChatDelta that records the context each observation delta is rendered in."""

    def __init__(self, tokenizer):
        self.contexts = []
        super().__init__(tokenizer)
        self.contexts.clear()  # the start-of-run check's own deltas

    def observation_ids(self, observations, *, system=None, tools=None):
        self.contexts.append((system, tools))
        return super().observation_ids(observations, system=system, tools=tools)


def test_deltas_are_rendered_with_the_rows_system_message_and_tools(setup):
    model, tokenizer, prompts = setup
    delta = RecordingDelta(tokenizer)
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]},
        {"prompt": "q", "extra_info": {"tools": [schema, "python"]}},  # a bare name is left to the prompt's text
    ]
    samples = 4
    run_multi_turn(
        LLMEngine(model, eos_token_id=tokenizer.eos_token_id, block_size=4),
        [tokens for tokens in prompts[:2] for _ in range(samples)],
        [FromRow() for _ in range(2 * samples)],
        [row for row in rows for _ in range(samples)],
        [SamplingParams(temperature=TEMPERATURE, max_new_tokens=PER_TURN, seed=seed) for seed in range(2 * samples)],
        delta=delta,
        max_turns=MAX_TURNS,
        max_response_tokens=BUDGET,
    )
    assert all(context in [("Be brief.", None), (None, [schema])] for context in delta.contexts)
    assert ("Be brief.", None) in delta.contexts and (None, [schema]) in delta.contexts
