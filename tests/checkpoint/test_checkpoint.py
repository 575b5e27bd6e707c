"""Checkpoints: the atomic directory protocol under a crash mid-save, resume resolution, the role state round trip
(weights, optimizer, LR schedule, RNG), Hugging Face export of a real PPO run's actor and critic from the DCP shards
alone (logits equal to ``transformers``), export's peak memory (a bucket, never the model), which checkpoints get
Hugging Face copies (``trainer.save_hf``), the ``spmd-rlhf export`` errors, and a resume into another world size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import run_recipe, torchrun

from spmd_rlhf import checkpoint
from spmd_rlhf.checkpoint import CheckpointError
from spmd_rlhf.cli import main as cli
from spmd_rlhf.config import TrainerConfig
from spmd_rlhf.models import load_model
from spmd_rlhf.tiny.model import make_tiny

# ---- the directory protocol ------------------------------------------------------------------------------------------


def write_step(run_dir: Path, step: int, contents: str = "") -> Path:
    def write_contents(staging: Path) -> None:
        (staging / "contents.txt").write_text(contents or f"step {step}")

    state = {"step": step, "recipe": "test"}
    return checkpoint.write_checkpoint(run_dir / f"step_{step}", write_contents, trainer_state=state)


def test_checkpoints_are_renamed_whole_and_latest_names_the_newest(tmp_path):
    write_step(tmp_path, 1)
    write_step(tmp_path, 2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_1", "step_2"]
    assert (tmp_path / "latest").read_text() == "step_2"
    assert checkpoint.read_trainer_state(tmp_path / "step_2") == {"step": 2, "recipe": "test"}
    write_step(tmp_path, 2, "again")  # saving a step that exists replaces it
    assert (tmp_path / "step_2" / "contents.txt").read_text() == "again"
    assert not list(tmp_path.glob("*.tmp"))


def test_keep_last_deletes_the_oldest_but_never_the_one_latest_names(tmp_path):
    for step in (1, 2, 3):
        write_step(tmp_path, step)
    assert checkpoint.prune_checkpoints(tmp_path, 2) == [tmp_path / "step_1"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]
    (tmp_path / "latest").write_text("step_2")  # a resume from an older step: latest is not the highest
    assert checkpoint.prune_checkpoints(tmp_path, 1) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]
    # Through write_checkpoint: the save, then the retention, in one call; nothing left under a staging name.
    state = {"step": 4, "recipe": "test"}
    checkpoint.write_checkpoint(tmp_path / "step_4", lambda staging: None, trainer_state=state, keep_last=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_4"]


def test_save_cadence_by_steps_by_minutes_and_after_the_last():
    def due(done: int, *, every: int = 0, minutes: float = 0.0, every_minutes: float = 0.0) -> bool:
        return checkpoint.save_due(
            done, total_steps=10, save_every=every, minutes_since_save=minutes, save_every_minutes=every_minutes
        )

    assert [done for done in range(1, 11) if due(done, every=4)] == [4, 8, 10]
    assert [done for done in range(1, 11) if due(done)] == [10]  # save_every=0: only the last
    assert due(3, minutes=30.5, every_minutes=30) and not due(3, minutes=29.9, every_minutes=30)
    assert not due(3, minutes=1e9, every_minutes=0)  # 0: no time-based saves
    # null save_every: a tenth of the run, at least every step.
    assert TrainerConfig(total_steps=150).steps_between_saves() == 15
    assert TrainerConfig(total_steps=4).steps_between_saves() == 1
    assert TrainerConfig(total_steps=150, save_every=0).steps_between_saves() == 0


def test_small_files_and_the_directory_are_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(Path(f"/proc/self/fd/{descriptor}").resolve().name)
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    state = {"step": 1, "recipe": "test"}
    checkpoint.write_checkpoint(tmp_path / "step_1", lambda staging: None, trainer_state=state, config_yaml="a: 1\n")
    # Each small file through its staging name, then its directory; the run directory after the rename and latest.
    assert synced.count(f"{checkpoint.CONFIG_FILE}.tmp") == 1 and synced.count(f"{checkpoint.TRAINER_STATE}.tmp") == 1
    assert synced.count("latest.tmp") == 1 and synced.count(tmp_path.name) >= 2
    assert (tmp_path / "step_1" / checkpoint.CONFIG_FILE).read_text() == "a: 1\n"


def test_resume_resolution(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert checkpoint.latest_checkpoint(run_dir) is None
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        checkpoint.resolve_checkpoint(run_dir)
    with pytest.raises(CheckpointError, match="no such directory"):
        checkpoint.resolve_checkpoint(tmp_path / "missing")
    for step in (1, 3, 2):
        write_step(run_dir, step)
    assert checkpoint.resolve_checkpoint(run_dir) == run_dir / "step_2"  # latest, not the highest step
    assert checkpoint.resolve_checkpoint(run_dir / "step_3") == run_dir / "step_3"
    # A pointer naming no finished checkpoint (a crash while a same-named checkpoint was replaced): the highest step.
    (run_dir / "latest").write_text("step_7")
    assert checkpoint.latest_checkpoint(run_dir) == run_dir / "step_3"


# ---- a role's state, and a crash while saving it ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny(family="llama", out_dir=str(tmp_path_factory.mktemp("tiny") / "model"))


def trained_critic(model_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """A value-head model one AdamW step into training, so the optimizer has state."""
    model = load_model(model_dir, head="value")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    model(torch.randint(3, 100, (2, 6))).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_role_state_round_trip(tmp_path, tiny_model_dir):
    model, optimizer, scheduler = trained_critic(tiny_model_dir)
    state_dir = checkpoint.role_state_dir(tmp_path, "critic")
    checkpoint.save_role_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)
    checkpoint.save_model_config(state_dir, model, tokenizer_path=tiny_model_dir)
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    saved_moments = {id(p): optimizer.state[p]["exp_avg"].clone() for p in model.parameters()}
    next_random = torch.rand(4)
    train_step(model, optimizer, scheduler)
    checkpoint.load_role_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    for param in model.parameters():
        assert torch.equal(optimizer.state[param]["exp_avg"], saved_moments[id(param)])
    assert scheduler.last_epoch == 1
    assert torch.equal(torch.rand(4), next_random)  # the CPU RNG continues where it was saved
    # The single-process export path reads the same weights back without the model directory, in small buckets.
    buckets = list(checkpoint.read_role_tensors(tmp_path, "critic", bucket_bytes=4096))
    assert len(buckets) > 2
    exported = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    assert list(exported) == [name for name, _ in model.named_parameters()]
    for name, tensor in exported.items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, tiny_model_dir):
    model, optimizer, scheduler = trained_critic(tiny_model_dir)
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)

    def save_critic(staging: Path) -> None:
        checkpoint.save_role_state(checkpoint.role_state_dir(staging, "critic"), **parts)

    checkpoint.write_checkpoint(tmp_path / "step_1", save_critic, trainer_state={"step": 1, "recipe": "test"})
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    train_step(model, optimizer, scheduler)

    def crash(staging: Path) -> None:
        save_critic(staging)
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed mid-save"):
        checkpoint.write_checkpoint(tmp_path / "step_2", crash, trainer_state={"step": 2, "recipe": "test"})
    assert (tmp_path / "latest").read_text() == "step_1"
    assert not (tmp_path / "step_2").exists()
    # Even a staging dir that got as far as trainer_state.json is never resumed from.
    (tmp_path / "step_2.tmp" / "trainer_state.json").write_text(json.dumps({"step": 2, "recipe": "test"}))
    resumed = checkpoint.resolve_checkpoint(tmp_path)
    assert resumed == tmp_path / "step_1"
    with pytest.raises(CheckpointError, match="unfinished"):
        checkpoint.read_trainer_state(tmp_path / "step_2.tmp")
    checkpoint.load_role_state(checkpoint.role_state_dir(resumed, "critic"), **parts)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    # The next save removes the leftover.
    checkpoint.write_checkpoint(tmp_path / "step_3", save_critic, trainer_state={"step": 3, "recipe": "test"})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_1", "step_3"]


# ---- export's memory -------------------------------------------------------------------------------------------------

_EXPORT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import transformers
    from spmd_rlhf import checkpoint

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    run, out, bucket = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = dict(dtype=torch.bfloat16, bucket_bytes=bucket, max_shard_bytes=16 * 2**20)
    checkpoint.export_hf(run, out + "/warm_up", **options)  # first-use imports and caches are not the export's
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = status("VmRSS")
    checkpoint.export_hf(run, out + "/measured", **options)
    print(status("VmHWM") - before)
    """
)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_streams_one_bucket_at_a_time(tmp_path):
    """An ~80 MB float32 role state exported as bfloat16 in 2 MiB buckets: the process grows by a bucket, the tensor
    read and its converted copy (plus slack), not by the model; the files (three, with an index) equal the source."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny(
        family="llama",
        out_dir=str(tmp_path / "model"),
        hidden_size=512,
        intermediate_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        model_vocab_size=1030,
    )
    model = load_model(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the checkpoint is the model
    parts = dict(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    )

    def save_actor(staging: Path) -> None:
        state_dir = checkpoint.role_state_dir(staging, "actor")
        checkpoint.save_role_state(state_dir, process_group=None, **parts)  # noqa: F821 (deleted after the call)
        checkpoint.save_model_config(state_dir, model, tokenizer_path=model_dir)  # noqa: F821

    checkpoint.write_checkpoint(tmp_path / "run" / "step_1", save_actor, trainer_state={"step": 1, "recipe": "test"})
    model_bytes = sum(param.nbytes for param in model.parameters())
    largest_tensor = max(param.nbytes for param in model.parameters())
    del model, parts, optimizer
    bucket = 2 * 2**20
    finished = subprocess.run(
        [sys.executable, "-c", _EXPORT_SCRIPT, str(tmp_path / "run"), str(tmp_path), str(bucket)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    peak = int(finished.stdout.split()[-1])
    assert model_bytes > 75 * 10**6 and largest_tensor <= bucket + 2**20
    # A bucket being filled, one saved chunk read into memory, one tensor converted, and 8 MiB of slack.
    assert peak < bucket + 2 * largest_tensor + 8 * 2**20 < model_bytes / 3, (peak, model_bytes)
    out = tmp_path / "measured" / "actor"
    assert sorted(path.name for path in out.glob("model*")) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    assert exported.dtype == torch.bfloat16
    source = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, source[name].to(torch.bfloat16)), name


def test_hf_copy_due():
    due = {
        mode: [checkpoint.hf_copy_due(mode, last=last) for last in (False, True)]
        for mode in ("final", "every", "never")
    }
    assert due == {"final": [False, True], "every": [True, True], "never": [False, False]}


# ---- a real run: export and resume into another world size -----------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """A 2-step PPO run on 2 ranks (actor and critic), saving after each step; returns its run directory."""
    workdir = tmp_path_factory.mktemp("ppo")
    run_recipe("ppo", workdir, "trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0")
    return workdir / "out"


def test_export_equals_transformers_without_the_model_dir(tmp_path, monkeypatch, ppo_run):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    # From a copy of the run, in a directory where the run's model path (tiny/model) does not exist.
    shutil.copytree(ppo_run, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert cli(["export", "run", "hf", "--roles", "actor", "critic"]) == 0
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    roles = (("actor", AutoModelForCausalLM, "lm"), ("critic", AutoModelForTokenClassification, "value"))
    for role, hf_class, head in roles:
        # The DCP export equals the Hugging Face copy the workers wrote from their live weights at save time...
        exported, live = load_file(f"hf/{role}/model.safetensors"), load_file(f"run/step_2/{role}/model.safetensors")
        assert exported.keys() == live.keys()
        for name in live:
            assert torch.equal(exported[name], live[name]), name
        # ... and transformers computes our logits / values from it.
        theirs = hf_class.from_pretrained(f"hf/{role}").eval()
        ours = load_model(f"run/step_2/{role}", head=head)
        with torch.no_grad():
            hf_out, our_out = theirs(input_ids).logits, ours(input_ids)
        torch.testing.assert_close(hf_out.squeeze(-1) if head == "value" else hf_out, our_out)
    assert Path("hf/actor/tokenizer.json").is_file()


def test_only_the_final_checkpoint_holds_hf_copies(ppo_run):
    """trainer.save_hf=final (the default) with a save after each of 2 steps: both hold the sharded state."""
    for step, has_hf in (("step_1", False), ("step_2", True)):
        for role in ("actor", "critic"):
            assert (ppo_run / step / f"{role}_state" / ".metadata").is_file()
            assert (ppo_run / step / role / "config.json").is_file() == has_hf, (step, role)


def test_save_hf_every_in_bfloat16(tmp_path):
    """trainer.save_hf=every and trainer.save_hf_dtype=bfloat16 on a 2-step GRPO run saving after each step: both
    checkpoints hold a bfloat16 Hugging Face copy of the actor, equal to the float32 export of its state rounded."""
    overrides = ("trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0", "trainer.save_hf=every")
    run_recipe("grpo", tmp_path, *overrides, "trainer.save_hf_dtype=bfloat16")
    for step in ("step_1", "step_2"):
        copy = tmp_path / "out" / step / "actor"
        assert json.loads((copy / "config.json").read_text())["dtype"] == "bfloat16"
        live = load_file(str(copy / "model.safetensors"))
        exported = checkpoint.export_hf(tmp_path / "out" / step, tmp_path / "export" / step)["actor"]
        for name, tensor in load_file(str(exported / "model.safetensors")).items():
            assert live[name].dtype == torch.bfloat16 and torch.equal(live[name], tensor.to(torch.bfloat16)), name


def test_time_based_saves_and_the_resolved_config_in_a_real_run(tmp_path):
    """save_every=0 with a tiny save_every_minutes saves after every step; each checkpoint and the run directory hold
    the resolved config."""
    overrides = (
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.save_every_minutes=1e-9",
        "trainer.val_every=0",
        "actor.lr=0.0015",
    )
    run_recipe("grpo", tmp_path, *overrides)
    out = tmp_path / "out"
    assert sorted(path.name for path in out.glob("step_*")) == ["step_1", "step_2"]
    for config_file in (out / "config.yaml", out / "step_1" / "config.yaml"):
        assert "lr: 0.0015" in config_file.read_text() and "save_every: 0" in config_file.read_text()


def test_save_hf_never(tmp_path):
    """trainer.save_hf=never: the final checkpoint holds the sharded state only, which export turns into a copy."""
    run_recipe("grpo", tmp_path, "trainer.total_steps=1", "trainer.val_every=0", "trainer.save_hf=never")
    final = tmp_path / "out" / "step_1"
    assert (final / "actor_state" / ".metadata").is_file() and not (final / "actor").exists()
    assert (checkpoint.export_hf(final, tmp_path / "export")["actor"] / "model.safetensors").is_file()


def test_export_errors(tmp_path, capsys, ppo_run):
    (tmp_path / "file").write_text("")
    cases = [
        ([str(tmp_path), str(tmp_path / "out")], "is neither a checkpoint"),
        (
            [str(ppo_run / "step_1"), str(tmp_path / "out"), "--roles", "actor", "reference"],
            "holds no reference state (roles in it: actor, critic)",
        ),
        ([str(ppo_run), str(tmp_path / "file" / "out")], "cannot write to"),
    ]
    for args, message in cases:
        assert cli(["export", *args]) == 2
        error = capsys.readouterr().err
        assert error.startswith("export error: ") and message in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()  # a missing role is found before anything is written


def test_resume_into_one_rank(tmp_path, ppo_run):
    """A checkpoint written by 2 DP ranks loads on 1: the weights it holds equal the saved ones, and it trains on."""
    workdir = ppo_run.parent
    finished = torchrun(
        "load_checkpoint.py",
        "ppo",
        str(ppo_run / "step_2"),
        str(tmp_path),
        "trainer.output_dir=resumed",
        "trainer.val_every=0",
        nproc=1,
        timeout=300,
        cwd=str(workdir),
        forked=True,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    for role in ("actor", "critic"):
        loaded = load_file(str(tmp_path / role / "model.safetensors"))
        saved = load_file(str(ppo_run / "step_2" / role / "model.safetensors"))
        assert loaded.keys() == saved.keys()
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), (role, name)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert torch.isfinite(torch.tensor([metrics["actor/loss"], metrics["critic/loss"]])).all()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, tiny_model_dir, monkeypatch):
    """A full disk fails DCP deep inside torch.save; the save says what it needs and where instead, writing nothing."""
    import shutil
    from collections import namedtuple

    model, optimizer, scheduler = trained_critic(tiny_model_dir)
    state_dir = checkpoint.role_state_dir(tmp_path, "critic")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 1024, 1024))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(checkpoint.CheckpointError, match=r"\(2 rank\(s\) writing .* GiB free .* trainer.output_dir"):
        checkpoint.save_role_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)
    assert not any(tmp_path.rglob("*.distcp"))
    monkeypatch.undo()
    checkpoint.save_role_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)
    assert any(tmp_path.rglob("*.distcp"))
