"""The trainer-to-rollout weight sync (``hybrid.weight_sync``): bucket plans, and on 4 gloo ranks (2 training + 2
rollout) the rollout's weights bitwise equal to the trainer's cast to the rollout dtype after every sync, from FSDP to
a TP replica, from TP to two replicas, from a background sender's snapshot while training goes on, and from a
mixture-of-experts actor with its experts split over ep = 2 to whole-model replicas; a LoRA actor's weights with
its adapters merged, from FSDP and from TP; a rollout of another model fails on both sides, naming both; a
background send's failure or hang is raised by the next wait."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.hybrid import weight_sync
from spmd_rlhf.hybrid.weight_sync import BackgroundSender, bucket_plan, sync_bands
from spmd_rlhf.tiny.model import make_tiny

BUCKET_BYTES = 16_384
"""The bucket size of ``programs/weight_sync.py``."""


def test_bucket_plan_fills_buckets_in_order_and_gives_a_large_item_its_own():
    sizes = [8, 8, 200, 4, 16]
    assert bucket_plan(sizes, bucket_bytes=20) == [[0, 1], [2], [3, 4]]
    assert bucket_plan(sizes, bucket_bytes=10_000) == [[0, 1, 2, 3, 4]]
    assert bucket_plan([], bucket_bytes=8) == []


def test_parameters_travel_in_row_bands_no_larger_than_a_bucket():
    shapes = [("embed", (10, 4)), ("norm", (4,)), ("scalar", ()), ("wide", (2, 100))]
    bands = sync_bands(shapes, element_bytes=2, bucket_bytes=24)  # 3 rows of the embedding, 12 norm elements
    assert [(band.index, band.start, band.stop, band.numel) for band in bands] == [
        (0, 0, 3, 12),
        (0, 3, 6, 12),
        (0, 6, 9, 12),
        (0, 9, 10, 4),
        (1, 0, 4, 4),
        (2, 0, 1, 1),
        (3, 0, 1, 100),
        (3, 1, 2, 100),  # a row larger than a bucket is a band of its own
    ]
    assert bucket_plan([band.numel * 2 for band in bands], bucket_bytes=24)[:3] == [[0], [1], [2]]


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    kwargs = dict(family="llama", hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300)
    policy = make_tiny(out_dir=str(root / "policy"), num_layers=2, **kwargs)
    other = make_tiny(out_dir=str(root / "other"), num_layers=3, **kwargs)
    moe = make_tiny(family="qwen3_moe", out_dir=str(root / "moe"), hidden_size=32, vocab_size=300)
    out = root / "out"
    out.mkdir()
    finished = torchrun(
        "weight_sync.py", str(policy), str(other), str(moe), str(out), nproc=4, timeout=300, forked=True
    )
    assert finished.returncode == 0, finished.stdout[-4000:]
    return out


@pytest.mark.parametrize("scenario", ["fsdp_to_tp", "tp_to_replicas", "background", "experts_ep2", "hsdp_to_tp"])
def test_rollout_weights_equal_the_trainers_bitwise_after_each_sync(synced, scenario):
    """``background``: the trainer's weights as snapshotted; the send ran while they changed again."""
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
    if scenario == "background":
        assert metrics["changed_during_send"] == 1.0
        return
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 2 for t in trainer.values())
    assert metrics["weight_sync/buckets"] > 2


@pytest.mark.parametrize("scenario", ["lora_fsdp_to_tp", "lora_tp_to_replicas"])
def test_a_lora_actor_sends_its_weights_with_the_adapters_merged(synced, scenario):
    """The rollout (a model without adapters) holds the base model's parameters, every adapted weight ``W + s B A``:
    what merging the whole tensors gives, cast to the rollout dtype; at the start (``B = 0``) the base weights
    themselves, after an update only the adapted weights differ from them."""
    for version in (0, 1):
        expected = torch.load(synced / f"{scenario}_v{version}_trainer.pt")
        unmerged = torch.load(synced / f"{scenario}_v{version}_unmerged.pt")
        for rank in (2, 3):
            rollout = torch.load(synced / f"{scenario}_v{version}_rollout{rank}.pt")
            assert rollout.keys() == expected.keys()  # the adapters themselves are not sent
            for name, tensor in expected.items():
                assert torch.equal(rollout[name], tensor), (scenario, version, rank, name)
        moved = {name for name, tensor in expected.items() if not torch.equal(tensor, unmerged[name].to(tensor.dtype))}
        adapted = {f"{name[: -len('.lora_A.weight')]}.weight" for name in unmerged if name.endswith(".lora_A.weight")}
        assert moved == (adapted if version else set()), (version, sorted(moved ^ adapted))
        assert any("q_proj" in name for name in adapted) and any("down_proj" in name for name in adapted)


@pytest.mark.parametrize("scenario", ["fsdp_to_tp", "tp_to_replicas"])
def test_no_actor_rank_holds_a_whole_parameter_during_the_sync(synced, scenario):
    """The embedding (300 x 32) is larger than a bucket even in the rollout's bfloat16; every actor rank's largest
    allocation during a sync stays within one bucket (the band being assembled, the bucket, a piece)."""
    trainer = torch.load(synced / f"{scenario}_v1_trainer.pt")
    largest_parameter = max(t.numel() * t.element_size() for t in trainer.values())
    metrics = json.loads((synced / "metrics.json").read_text())
    assert largest_parameter > BUCKET_BYTES
    for version in (0, 1):
        assert 0 < metrics[f"{scenario}_v{version}"]["largest_allocation_bytes"] <= BUCKET_BYTES


def test_a_rollout_of_another_model_fails_on_both_sides_naming_both(synced):
    for rank in range(4):
        message = (synced / f"mismatch_rank{rank}.txt").read_text()
        assert "from actor rank 0 to rollout ranks [2, 3]" in message and "models differ" in message, (rank, message)


def test_a_background_send_that_fails_or_hangs_is_raised_by_the_next_wait(monkeypatch):
    sender = BackgroundSender(torch.device("cpu"), timeout_s=0.2)
    options = dict(
        rank=0, trainer_group=None, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES, device=torch.device("cpu")
    )
    sender.start({}, version=3, sides=None, **options)  # no sides: send_weights fails on its thread
    with pytest.raises(RuntimeError, match="background weight sync of policy version 3 failed: AttributeError"):
        sender.wait()
    sender.wait()  # reported once

    monkeypatch.setattr(weight_sync, "send_weights", lambda params, **options: time.sleep(2))
    sender.start({}, version=4)
    with pytest.raises(RuntimeError, match="version 4 has not ended within 0.2 s .trainer.collective_timeout_s."):
        sender.start({}, version=5)  # the next send waits for the one in flight first
