"""A batch in flight on the rollout role, written into a checkpoint and read back (``RolloutWorker.save_rows`` /
``restore_rows``): everything generation made comes back, a multi-turn environment's rewards and router replay's
record of the experts included (dropped, a resumed run would train on other scores or routes than the uninterrupted
one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.training.router_replay import ROUTED_EXPERTS
from spmd_rlhf.workers.generation import Generator
from spmd_rlhf.workers.rollout import RolloutWorker


def _worker() -> RolloutWorker:
    """The parts of a rollout worker the rows' files use: its place among the replicas and the batch layout."""
    worker = object.__new__(RolloutWorker)
    worker.context = SimpleNamespace(coordinates=SimpleNamespace(dp=0, tp=0))
    worker.reducer, worker.generator = SimpleNamespace(size=1), Generator
    return worker


@pytest.mark.parametrize("carried", [(), ("env_reward",), ("env_reward", ROUTED_EXPERTS)])
def test_a_batch_in_flight_comes_back_whole(tmp_path, carried):
    prompts = Batch(
        {
            "input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "uid": torch.tensor([0, 1]),
        },
        {"raw_prompt": ["a", "b"]},
    )
    generated = {
        "responses": torch.randint(0, 50, (4, 5)),
        "response_mask": torch.ones(4, 5),
        "trajectory_mask": torch.ones(4, 5, dtype=torch.long),
        "rollout_log_probs": torch.randn(4, 5),
        "sampling_log_probs": torch.randn(4, 5),
        "token_versions": torch.full((4, 5), 3),
        "env_reward": torch.tensor([0.5, -1.0, 0.0, 2.0]),
        ROUTED_EXPERTS: torch.randint(0, 4, (4, 8, 2, 2), dtype=torch.uint8),
    }
    extra = ("token_versions", *carried)
    batch = Generator.rollout_batch(prompts.repeat(2), generated, {"reward/x": 1.0}, group_size=2, extra=extra)
    worker = _worker()
    worker.save_rows(batch, str(tmp_path))
    restored = worker.restore_rows(prompts, str(tmp_path))
    assert restored.tensors.keys() == batch.tensors.keys()
    for key, tensor in batch.tensors.items():
        assert torch.equal(restored[key], tensor), key
    assert restored.meta["metrics"] == batch.meta["metrics"] and restored.group_size == 2
