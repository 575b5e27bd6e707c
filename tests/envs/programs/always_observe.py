"""An environment for the multi-turn GRPO test: answers every turn with a tool message until ``rollout.max_turns``.

Its answer differs from rank to rank (a longer one on odd ranks): the ranks of a tensor-parallel generation replica
only agree because the actor takes the replica leader's answers (``HybridEngine.on_replica_leader``); without that
their token sequences, and so their schedules and collectives, would part."""

import os

from spmd_rlhf.envs import Environment, StepResult, initial_messages


class AlwaysObserve(Environment):
    def reset(self, row):
        return initial_messages(row)

    def step(self, messages, new_text):
        content = "408" if int(os.environ.get("RANK", "0")) % 2 == 0 else "the tool answers 408"
        return StepResult([{"role": "tool", "content": content}], reward=0.25)
