"""GRPO with LoRA adapters learns the tiny task on 2 ranks, with the actor's base as the reference (no reference
role); its checkpoint exports as a PEFT adapter that ``peft`` loads onto the base and, with ``--merge``, as a full
model that ``transformers`` loads, both giving the same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrun_helpers import run_recipe

from spmd_rlhf.checkpoint import safe_load
from spmd_rlhf.cli import main as cli_main
from spmd_rlhf.models.lora import is_adapter
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.tiny.task import make_task

LORA = (
    "actor.lora.rank=16",
    "actor.lora.alpha=32",
    "actor.lr=1e-3",
    "reference.enabled=false",
    "trainer.val_every=0",
    "trainer.total_steps=60",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    workdir = tmp_path_factory.mktemp("lora_grpo")
    # A random-init LM head (std 0.02) gives logits of about +-0.2 whatever the hidden state, so adapters on the
    # decoder layers could not move the distribution; a head 10x larger stands in for a pretrained model's.
    model = make_tiny(family="qwen2", out_dir=str(workdir / "tiny" / "model"), tie_word_embeddings=False)
    tensors = load_file(f"{model}/model.safetensors")
    tensors["lm_head.weight"] *= 10
    save_file(tensors, f"{model}/model.safetensors", metadata={"format": "pt"})
    make_task(task="arithmetic", out_dir=str(workdir / "tiny" / "task"))
    return workdir, run_recipe("grpo", workdir, *LORA)


def mean_reward(records: list[dict]) -> float:
    return sum(record["reward/mean"] for record in records) / len(records)


def test_grpo_with_lora_raises_the_reward(run):
    workdir, records = run
    assert [record["step"] for record in records] == list(range(60))
    first, later = mean_reward(records[:5]), mean_reward(records[30:])
    assert later > first + 0.05, (first, later)
    assert records[0]["kl/mean"] == 0.0 and records[-1]["kl/mean"] > 0  # the reference: the base, adapters off
    state = workdir / "out" / "step_60" / "actor_state"
    assert not (workdir / "out" / "step_60" / "reference_state").exists()
    # The checkpoint holds the adapters and their optimizer state, not the frozen base.
    saved = [
        key for key in safe_load.read_metadata(state).state_dict_metadata if key.startswith(("model.", "optimizer."))
    ]
    model_keys = [key for key in saved if key.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all(is_adapter(key) for key in model_keys)
    assert all(".lora_" in key for key in saved if key.startswith("optimizer.state."))


def test_export_round_trips_through_peft_and_transformers(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    workdir, _ = run
    base_dir = str(workdir / "tiny" / "model")
    assert cli_main(["export", str(workdir / "out"), str(tmp_path / "adapter")]) == 0
    assert cli_main(["export", str(workdir / "out"), str(tmp_path / "merged"), "--merge"]) == 0
    adapter, run_copy = (
        load_file(tmp_path / "adapter" / "actor" / "adapter_model.safetensors"),
        load_file(workdir / "out" / "step_60" / "actor" / "adapter_model.safetensors"),
    )
    assert adapter.keys() == run_copy.keys() and all(adapter[name].equal(run_copy[name]) for name in adapter)
    assert json.loads((tmp_path / "adapter" / "actor" / "adapter_config.json").read_text())["r"] == 16
    input_ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        base_logits = base(input_ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(tmp_path / "adapter" / "actor")).eval()(input_ids).logits
        merged_logits = (
            AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged" / "actor")).eval()(input_ids).logits
        )
    assert (peft_logits - base_logits).abs().max() > 1e-2  # trained adapters
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=1e-4)


def test_resume_loads_the_adapters_and_continues(run, tmp_path):
    """The default tiny sizes make the whole model one FSDP unit: the adapters load into it, the base stays as read."""
    workdir, records = run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(workdir, resumed_dir)
    resumed = run_recipe("grpo", resumed_dir, *LORA[:-1], "trainer.total_steps=62")
    assert [record["step"] for record in resumed] == list(range(62))
    assert resumed[:60] == records
    assert abs(resumed[60]["kl/mean"] - records[-1]["kl/mean"]) < 0.5 * records[-1]["kl/mean"]  # not restarted at 0
