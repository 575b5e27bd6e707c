"""An environment for the multi-turn GRPO test: answers every turn with a tool message until ``rollout.max_turns``."""

from spmd_rlhf.envs import Environment, StepResult, initial_messages


class AlwaysObserve(Environment):
    def reset(self, row):
        return initial_messages(row)

    def step(self, messages, new_text):
        return StepResult([{"role": "tool", "content": "408"}], reward=0.25)
