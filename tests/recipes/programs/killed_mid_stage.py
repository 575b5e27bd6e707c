"""A GRPO run in which worker rank VICTIM SIGKILLs its own process on entering a stage, while the other ranks are in
that stage and about to wait for it in the stage's collectives: the job must end non-zero, naming the lost rank.

    torchrun --nproc-per-node 2 tests/recipes/programs/killed_mid_stage.py generate@1 1 RUN_DIR \
        --config recipes/configs/grpo.yaml key=value ...

STAGE@CALL is ``generate`` or ``update`` (the actor's) or ``rollout`` (the rollout role's generation, with
rollout.enabled) and which call of it (1: the first step's) kills. Every rank writes its pid
to ``RUN_DIR/pid.<rank>`` at start, and the victim the time of its death to ``RUN_DIR/killed_at``, so the test can
check how long the job outlived it and that no process is left.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from spmd_rlhf.controller import entry, role_handles
from spmd_rlhf.recipes.grpo import GRPORecipe
from spmd_rlhf.runtime import data_parallel
from spmd_rlhf.workers import ActorWorker, RolloutWorker

STAGE, _, CALL = sys.argv[1].partition("@")
VICTIM, RUN_DIR = int(sys.argv[2]), Path(sys.argv[3])
CALLS: Counter[str] = Counter()


def enter(stage: str, rank: int) -> None:
    """Rank VICTIM kills itself on the CALL-th entry into STAGE."""
    CALLS[stage] += 1
    if stage == STAGE and CALLS[stage] == int(CALL) and rank == VICTIM:
        (RUN_DIR / "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


class DyingActor(ActorWorker):
    """The actor, except that rank VICTIM kills itself on the CALL-th entry into STAGE."""

    def _enter(self, stage: str) -> None:
        enter(stage, self.context.rank)

    @data_parallel
    def generate_sequences(self, *args, **kwargs):
        self._enter("generate")
        return super().generate_sequences(*args, **kwargs)

    @data_parallel
    def update_actor(self, *args, **kwargs):
        self._enter("update")
        return super().update_actor(*args, **kwargs)


class DyingRollout(RolloutWorker):
    """The rollout role, except that rank VICTIM kills itself on the CALL-th generation when STAGE is rollout."""

    @data_parallel
    def generate_sequences(self, *args, **kwargs):
        enter("rollout", self.context.rank)
        return super().generate_sequences(*args, **kwargs)


if __name__ == "__main__":
    (RUN_DIR / f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
    del sys.argv[1:4]  # the rest is the recipe's own command line
    role_handles.WORKERS["actor"] = (DyingActor, role_handles.ActorHandle)
    role_handles.WORKERS["rollout"] = (DyingRollout, role_handles.RolloutHandle)
    entry.main(GRPORecipe, "recipes/configs/grpo.yaml")
