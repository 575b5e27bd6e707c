"""The trainer-to-rollout weight sync (``hybrid.weight_sync``): bucket plans, and on 4 gloo ranks (2 training + 2
rollout) the rollout's weights bitwise equal to the trainer's cast to the rollout dtype after every sync, from FSDP to
a TP replica and from TP to two replicas; a rollout of another model fails on both sides, naming both."""

from __future__ import annotations

import json

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.hybrid.weight_sync import bucket_plan
from spmd_rlhf.tiny.model import make_tiny


def test_bucket_plan_fills_buckets_in_order_and_gives_a_large_tensor_its_own():
    shapes = [("a", (4,)), ("b", (4,)), ("big", (100,)), ("c", (2,)), ("d", (8,))]
    assert bucket_plan(shapes, element_bytes=2, bucket_bytes=20) == [[0, 1], [2], [3, 4]]
    assert bucket_plan(shapes, element_bytes=2, bucket_bytes=10_000) == [[0, 1, 2, 3, 4]]
    assert bucket_plan([], element_bytes=2, bucket_bytes=8) == []


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    kwargs = dict(family="llama", hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300)
    policy = make_tiny(out_dir=str(root / "policy"), num_layers=2, **kwargs)
    other = make_tiny(out_dir=str(root / "other"), num_layers=3, **kwargs)
    out = root / "out"
    out.mkdir()
    finished = torchrun("weight_sync.py", str(policy), str(other), str(out), nproc=4, timeout=300)
    assert finished.returncode == 0, finished.stdout[-4000:]
    return out


@pytest.mark.parametrize("scenario", ["fsdp_to_tp", "tp_to_replicas"])
def test_rollout_weights_equal_the_trainers_bitwise_after_each_sync(synced, scenario):
    for version in (0, 1):
        trainer = torch.load(synced / f"{scenario}_v{version}_trainer.pt")
        assert all(tensor.dtype == torch.bfloat16 for tensor in trainer.values())
        for rank in (2, 3):
            rollout = torch.load(synced / f"{scenario}_v{version}_rollout{rank}.pt")
            assert rollout.keys() == trainer.keys()
            for name, tensor in trainer.items():
                assert torch.equal(rollout[name], tensor), (scenario, version, rank, name)
    first = torch.load(synced / f"{scenario}_v0_trainer.pt")
    assert any(not torch.equal(first[name], tensor) for name, tensor in trainer.items())  # the update moved them
    metrics = json.loads((synced / "metrics.json").read_text())[f"{scenario}_v1"]
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 2 for t in trainer.values())
    assert metrics["weight_sync/buckets"] > 2


def test_a_rollout_of_another_model_fails_on_both_sides_naming_both(synced):
    for rank in range(4):
        message = (synced / f"mismatch_rank{rank}.txt").read_text()
        assert "from actor rank 0 to rollout ranks [2, 3]" in message and "models differ" in message, (rank, message)
