"""Model shapes count what the decoder builds, and each algorithm's dataflow has the roles and stages its recipe
runs."""

from __future__ import annotations

import json

import pytest
import torch

from spmd_rlhf.mapping.workload import NAMED_SHAPES, dataflow, model_shape
from spmd_rlhf.metrics.step_metrics import matmul_parameters
from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models.args import read_decoder_args


def parameter_count(args, head: str) -> int:
    """Parameters of the built model (on the meta device, nothing allocated; a tied head counted once)."""
    with torch.device("meta"):
        model = DecoderLM(args, head=head)
    return sum(param.numel() for param in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("head", ["lm", "value", "score"])
def test_shape_counts_equal_the_built_model(tiny_model_dir, head):
    shape = model_shape(str(tiny_model_dir))
    assert shape.parameters(head) == parameter_count(read_decoder_args(str(tiny_model_dir)), head)
    built = matmul_parameters(str(tiny_model_dir), head=head)
    assert (shape.body_matmul_parameters, shape.head_parameters(head)) == (built.body, built.head)
    assert shape.matmul_parameters(head) == built.total


def test_named_shapes_have_their_advertised_sizes():
    assert NAMED_SHAPES["7b"].parameters("lm") == pytest.approx(6.74e9, rel=0.01)
    assert NAMED_SHAPES["13b"].parameters("lm") == pytest.approx(13.0e9, rel=0.01)
    assert NAMED_SHAPES["70b"].parameters("lm") == pytest.approx(69.0e9, rel=0.01)
    assert NAMED_SHAPES["0.5b"].parameters("lm") == pytest.approx(0.494e9, rel=0.01)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="neither a size name .*7b.* nor a model directory"):
        model_shape("no_such_model")


def test_dataflows_follow_the_recipes():
    shape = NAMED_SHAPES["7b"]
    ppo = {role.name: role for role in dataflow("ppo", actor=shape, critic=shape, reference=shape, reward=shape)}
    assert list(ppo) == ["actor", "critic", "reference", "reward"]
    assert ppo["actor"].work == {"generation": ("generate",), "preparation": (), "training": ("train",)}
    assert ppo["critic"].work == {"preparation": ("forward",), "training": ("train",)} and ppo["critic"].trained
    assert not ppo["reward"].trained and ppo["reward"].head == "score"
    grpo = dataflow("grpo", actor=shape, reference=shape)  # rule reward: no reward model
    assert [role.name for role in grpo] == ["actor", "reference"]
    remax = dataflow("remax", actor=shape, reference=shape)
    assert remax[0].work["generation"] == ("generate", "greedy")
    safe = [
        role.name
        for role in dataflow("safe_rlhf", actor=shape, critic=shape, reference=shape, reward=shape, cost=shape)
    ]
    assert safe == ["actor", "critic", "reference", "reward", "cost", "cost_critic"]
    with pytest.raises(ValueError, match="trains a critic"):
        dataflow("ppo", actor=shape)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_shapes_count_every_expert_for_memory_and_the_routed_ones_for_flops(tmp_path, family):
    from spmd_rlhf.tiny.model import make_tiny

    path = make_tiny(family=family, out_dir=str(tmp_path / family))
    args, shape = read_decoder_args(path), model_shape(path)
    assert shape.experts == args.moe.num_experts and shape.moe_layers == len(args.moe.layers) > 0
    assert shape.parameters("lm") == parameter_count(args, "lm")
    with torch.device("meta"):
        model = DecoderLM(args, head="lm")
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    embedding = args.vocab_size * args.hidden_size
    routed = experts * args.moe.num_experts_per_tok // args.moe.num_experts
    # A token runs k of E routed experts: the matmul count leaves out the rest, and so does the step's FLOP count.
    active = parameter_count(args, "lm") - embedding * (not args.tie_word_embeddings) - experts + routed
    assert shape.matmul_parameters("lm") == active == matmul_parameters(path, head="lm").total


def test_the_30b_a3b_shape_has_its_advertised_total_and_active_sizes():
    shape = NAMED_SHAPES["30b-a3b"]
    assert shape.parameters("lm") == pytest.approx(30.5e9, rel=0.01)
    # Qwen's 3.3B activated parameters count the embedding, which the matmul count leaves out (a lookup).
    assert shape.matmul_parameters("lm") + shape.vocab * shape.hidden == pytest.approx(3.3e9, rel=0.03)


@pytest.mark.parametrize(
    ("family", "head", "overrides"),
    [
        ("qwen2", "lm", {}),
        (
            "qwen2",
            "value",
            {"target_modules": ["q_proj", "v_proj"], "rank_pattern": {r"layers\.0\.self_attn\.q_proj": 2}},
        ),
        ("qwen2_moe", "lm", {}),  # adapters on attention and the shared experts, the routed experts frozen
    ],
)
def test_lora_parameters_count_what_the_adapters_add(tmp_path, family, head, overrides):
    """The mapper's count of a LoRA role's trained parameters (``workload.lora_parameters``) equals what
    ``models.lora.apply_lora`` makes trainable on the built model, every target, rank pattern and head alike."""
    from spmd_rlhf.config.roles import LoRAConfig
    from spmd_rlhf.mapping.workload import lora_parameters
    from spmd_rlhf.models.lora import apply_lora
    from spmd_rlhf.tiny.model import make_tiny

    path = make_tiny(family=family, out_dir=str(tmp_path / family))
    if family == "qwen2_moe":  # a shared expert narrower than the dense MLP width (the model is built, not loaded)
        hf_config = json.loads((tmp_path / family / "config.json").read_text())
        hf_config["shared_expert_intermediate_size"] = 40
        (tmp_path / family / "config.json").write_text(json.dumps(hf_config))
    config = LoRAConfig(rank=4, **overrides)
    with torch.device("meta"):
        model = DecoderLM(read_decoder_args(path), head=head)
    apply_lora(model, config, tp_mesh=None)
    trained = sum(param.numel() for param in model.parameters() if param.requires_grad)
    assert lora_parameters(model_shape(path), head, config.modules, config.rank_of) == trained > 0
