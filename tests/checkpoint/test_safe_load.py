"""``checkpoint.safe_load``: DCP checkpoints load without running code from them. A non-tensor item that would run a
command under full pickle is refused by name (and plain ``dcp.load`` does run it, so the item is truly hostile), and
a ``.metadata`` pointing a shard outside the checkpoint's directory is refused (plain DCP reads the file there)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spmd_rlhf.checkpoint import CheckpointError, safe_load


class RunsCommand:
    """Pickles as a call of ``os.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_plain_state_round_trips(tmp_path):
    dcp.save(
        {"weight": torch.arange(6.0).view(2, 3), "counters": {"step": 3, "lr": [1e-5]}},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    state = {"weight": torch.zeros(2, 3), "counters": {"step": 0, "lr": [0.0]}}
    safe_load.load(state, tmp_path, no_dist=True)
    assert torch.equal(state["weight"], torch.arange(6.0).view(2, 3))
    assert state["counters"] == {"step": 3, "lr": [1e-5]}


def test_a_hostile_bytes_item_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    state_dir = tmp_path / "state"
    dcp.save({"weight": torch.ones(2), "extra": RunsCommand(f"touch {marker}")}, checkpoint_id=state_dir, no_dist=True)
    with pytest.raises(CheckpointError, match=r"extra in \S+/state is not plain data .*not loaded"):
        safe_load.load({"weight": torch.zeros(2), "extra": None}, state_dir, no_dist=True)
    assert not marker.exists()
    dcp.load({"weight": torch.zeros(2), "extra": None}, checkpoint_id=state_dir, no_dist=True)
    assert marker.exists()  # what full pickle does with the same item


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_shard_path_outside_the_checkpoint_is_refused(tmp_path, where):
    state_dir = tmp_path / "state"
    dcp.save({"weight": torch.arange(4.0)}, checkpoint_id=state_dir, no_dist=True)
    (shard,) = state_dir.glob("*.distcp")
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(shard, outside)
    shard.unlink()
    target = "../elsewhere.distcp" if where == "parent" else str(outside)
    with open(state_dir / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # our own file, written just above
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=target) for index, info in metadata.storage_data.items()
    }
    with open(state_dir / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    with pytest.raises(CheckpointError, match=r"points a shard at '\S*elsewhere\.distcp', outside the checkpoint"):
        safe_load.load({"weight": torch.zeros(4)}, state_dir, no_dist=True)
    loaded = {"weight": torch.zeros(4)}
    dcp.load(loaded, checkpoint_id=state_dir, no_dist=True)
    assert torch.equal(loaded["weight"], torch.arange(4.0))  # plain DCP read the file outside
