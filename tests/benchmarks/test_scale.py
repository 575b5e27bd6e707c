"""``benchmarks/scale.py --smoke``: GRPO on two CPU ranks at the smoke shape, every stage measured and given a floor
(positive, finite, consistent with its parts), and the floor model's parts at a real shape checked by hand."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from scale_floor import ADAM_BYTES, design_parts, stage_floors  # noqa: E402

from spmd_rlhf.config import load_config  # noqa: E402
from spmd_rlhf.mapping.cost import working_bytes  # noqa: E402
from spmd_rlhf.mapping.devices import Layout  # noqa: E402
from spmd_rlhf.mapping.placement import config_dataflow  # noqa: E402
from spmd_rlhf.mapping.workload import model_shape  # noqa: E402
from spmd_rlhf.models.sharded_save import DEFAULT_BAND_BYTES  # noqa: E402
from spmd_rlhf.models.streamed_vocabulary import DEFAULT_CHUNK_BYTES as STREAM_CHUNK_BYTES  # noqa: E402


def actor_spec(config):
    return next(spec for spec in config_dataflow(config)[0] if spec.name == "actor")


def test_floor_parts_at_a_real_shape(tmp_path):
    """0.5B's widths, one layer, a smaller vocabulary: the parts are the shapes' bytes, sharded over two ranks."""
    from spmd_rlhf.tiny.model import make_tiny

    model_dir = make_tiny(
        family="qwen2",
        out_dir=str(tmp_path / "model"),
        hidden_size=896,
        num_layers=1,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        model_vocab_size=32768,
    )
    config = load_config(
        ROOT / "recipes" / "configs" / "ppo.yaml",
        [
            f"model.path={model_dir}",
            "data.batch_size=2",
            "rollout.n=2",
            "rollout.max_new_tokens=16",
            "trainer.total_steps=1",
            "actor.micro_batch_size=2",
            "critic.micro_batch_size=2",
            "reference.micro_batch_size=2",
            "actor.mini_batch_size=4",
            "critic.mini_batch_size=4",
        ],
    )
    floors = stage_floors(config, devices=2)
    shape = model_shape(model_dir)
    actor, critic = shape.parameters("lm"), shape.parameters("value")
    assert floors["load"] == {
        "actor weights (float32 shard)": actor * 4 / 2,
        "critic weights (float32 shard)": critic * 4 / 2,
        "reference weights (float32 shard)": actor * 4 / 2,
    }
    # One step: no Adam moments before the update; from it on, both trained roles' moments.
    assert not any("Adam" in part for part in floors["generate"])
    assert floors["save"]["actor Adam moments (shard)"] == actor * ADAM_BYTES / 2
    generation = {part: size for part, size in floors["generate"].items() if part not in floors["load"]}
    tokens = 64 + 16  # max_prompt_length + max_new_tokens, 4 rows over 2 replicas
    assert generation == {
        "actor generation copy (float32, 1/1)": actor * 4,
        f"KV cache (2 rows x {tokens} tokens)": 2 * tokens * shape.kv_bytes_per_token(4),
    }
    # The micro-batch's working set is the mapper's (activations, response logits, float32 log-prob chunks).
    ((name, size),) = ((part, size) for part, size in floors["update"].items() if part.startswith("actor micro-batch"))
    assert size == pytest.approx(
        working_bytes(actor_spec(config), Layout(pp=1, dp=2, tp=1), config_dataflow(config)[1])
    )

    # The design's transient buffers: the tied actor's 112 MiB vocabulary streams (above fsdp_unit_mb), so its root
    # unit is the final norm; the reshard gathers the vocabulary whole; the save's writer holds two bands of at most
    # DEFAULT_BAND_BYTES (64 MiB).
    buffers = design_parts(config, devices=2)
    vocabulary = 32768 * 896
    assert buffers["generate"] == {"actor FSDP unit (or streamed vocabulary) gathered by the reshard": vocabulary * 4}
    # The larger trained role's: the critic's (its root holds the value head beside the final norm; a layer; its
    # untied embedding streams too) over the actor's.
    critic_root = shape.parameters("value") - shape.layers * shape.block_parameters - vocabulary
    assert critic_root > 896
    # By default its units stay gathered and its float32 gradients unsharded across the micro-batches (all but the
    # streamed vocabulary; the gradient shard is in the strict floor); with unsharded_accumulation_mb=0 one unit at
    # a time.
    streamed_rows = {"critic streamed vocabulary: one step's rows gathered + their gradient": 2 * STREAM_CHUNK_BYTES}
    assert buffers["update"] == {
        "critic every FSDP unit gathered + float32 gradients unsharded across micro-batches": (
            (shape.parameters("value") - vocabulary) * (4 + 4 * (1 - 1 / 2))
        ),
        **streamed_rows,
    }
    per_unit = dataclasses.replace(
        config,
        actor=dataclasses.replace(config.actor, unsharded_accumulation_mb=0),
        critic=dataclasses.replace(config.critic, unsharded_accumulation_mb=0),
    )
    assert design_parts(per_unit, devices=2)["update"] == {
        "critic FSDP root gathered + its unsharded gradient": 2 * critic_root * 4,
        "critic largest other FSDP unit gathered + its unsharded gradient": 2 * shape.block_parameters * 4,
        **streamed_rows,
    }
    assert buffers["export"] == {"save band being assembled + one piece": 2 * min(vocabulary * 4, DEFAULT_BAND_BYTES)}
    assert buffers["load"] == buffers["save"] == buffers["resume"] == {}


def test_a_mixture_of_experts_shape_names_its_family_and_may_keep_fewer_experts():
    from gpu_common import shape_fields

    fields = shape_fields("30b-a3b", layers=2, experts=8)
    assert (fields["family"], fields["num_layers"], fields["num_experts"], fields["num_experts_per_tok"]) == (
        "qwen3_moe",
        2,
        8,
        8,
    )
    assert shape_fields("0.5b")["family"] == "qwen2"
    with pytest.raises(ValueError, match="the 0.5b shape is dense"):
        shape_fields("0.5b", experts=8)


def test_the_long_sequence_mode_measures_each_cp_degree(tmp_path):
    """``scale.py --seq-len`` at the smoke shape: the update of rows of 48 tokens at cp = 2 on two gloo ranks (ring
    attention under auto where cp does not split the heads), each rank's rise measured against a positive floor."""
    import json
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(BENCHMARKS / "scale.py"), "--smoke", "--seq-len", "48", "--cp", "2"]
    finished = subprocess.run(
        [*command, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    (result,) = [json.loads(path.read_text()) for path in tmp_path.glob("scale_seq_len_*.json")]
    (row,) = result["rows"]
    assert row["length"] == 48 and row["cp"] == 2 and len(row["rise_bytes_per_rank"]) == 2
    assert row["floor"] > 0 and row["steady_rise_bytes"] > 0 and row["update_s"] > 0
