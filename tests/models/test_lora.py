"""LoRA adapters against PEFT on the same weights, for every family: the adapted forward, the base with adapters off,
a PEFT adapter as the starting point (with rsLoRA and per-layer ranks and alphas too), and the merged weights; the
PEFT adapters that are refused (DoRA, regular-expression target modules)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hf_fixtures import FAMILIES, padded_batch, write_hf_model

from spmd_rlhf.config import LORA_TARGETS, ConfigError, LoRAConfig
from spmd_rlhf.models.lora import (
    LoRAAdapters,
    is_adapter,
    layer_splits,
    lora_config_of,
    merged_weight,
    write_peft_adapter,
)
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.weights import build_model, load_weights


def lora_model(path: str, config: LoRAConfig, *, seed: int = 0):
    model = build_model(path, attention_backend="torch")
    adapters = parallelize(model, tp_mesh=None, dp_mesh=None, lora=config)
    load_weights(model, path, device="cpu")
    adapters.initialize(model, seed=seed)
    return model.eval(), adapters


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Non-zero B (fresh adapters are the base model exactly); returns every adapter tensor by name."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return {name: param.detach().clone() for name, param in model.named_parameters() if is_adapter(name)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), write_hf_model(request.param, str(path))


def test_targets_are_the_tensor_parallel_layers():
    assert sorted(LORA_TARGETS) == sorted(layer_splits())


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj", "down_proj"]])
def test_forward_equals_peft_and_base_with_adapters_off(family, targets, tmp_path):
    from peft import PeftModel

    path, hf_model = family
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    model, adapters = lora_model(path, config)
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trained and all(is_adapter(name) for name in trained)
    assert all(param.dtype == torch.float32 for name, param in model.named_parameters() if is_adapter(name))
    tensors = randomize_adapters(model)
    write_peft_adapter(str(tmp_path / "adapter"), tensors, adapters.peft_config(path))
    input_ids, attention_mask, position_ids = padded_batch(batch=3, seq=12, side="left")
    real = attention_mask.bool()
    with torch.no_grad():
        base = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        peft_model = PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
        expected = peft_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = model(input_ids, attention_mask=attention_mask)
        with adapters.disabled():
            ours_base = model(input_ids, attention_mask=attention_mask)
        peft_model.unload()  # hands hf_model back without adapters for the next test
    assert (expected[real] - base[real]).abs().max() > 1e-3  # the adapters change the output
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5
    assert (ours_base[real] - base[real]).abs().max().item() <= 1e-5


def test_peft_adapter_is_a_starting_point_and_merges_like_peft(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    path = str(tmp_path / "base")
    hf_model = write_hf_model("qwen2_untied", path)
    peft_model = get_peft_model(
        hf_model, PeftLoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    config = LoRAConfig(rank=4, alpha=16.0, adapter_path=str(tmp_path / "adapter"))
    model, adapters = lora_model(path, config)
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=10, side="left")
    with torch.no_grad():
        expected = peft_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = model(input_ids, attention_mask=attention_mask)
        merged = peft_model.merge_and_unload().state_dict()
    real = attention_mask.bool()
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5
    params = dict(model.named_parameters())
    for layer in adapters.layers:
        ours_merged = merged_weight(
            params[f"{layer}.weight"],
            params[f"{layer}.lora_A.weight"],
            params[f"{layer}.lora_B.weight"],
            config.scale_of(layer),
        )
        torch.testing.assert_close(ours_merged, merged[f"{layer}.weight"], atol=1e-6, rtol=1e-6)


SCALINGS = {
    "rslora": dict(use_rslora=True),
    "alpha_pattern": dict(alpha_pattern={"q_proj": 64.0, "layers.1.mlp.down_proj": 2.0}),
    "rank_pattern": dict(rank_pattern={"v_proj": 2, "layers.0.self_attn.q_proj": 8}),
    "all_three": dict(use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 4.0}),
}


@pytest.mark.parametrize("scaling", list(SCALINGS.values()), ids=list(SCALINGS))
def test_peft_adapter_with_its_own_scales_loads_merges_and_saves_like_peft(scaling, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "base")
    hf_model = write_hf_model("qwen2_untied", path)
    peft_model = get_peft_model(
        hf_model, PeftLoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, **scaling)
    )
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    config = LoRAConfig(rank=4, alpha=16.0, adapter_path=str(tmp_path / "adapter"), **scaling)
    model, adapters = lora_model(path, config)
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=10, side="left")
    real = attention_mask.bool()
    with torch.no_grad():
        expected = peft_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = model(input_ids, attention_mask=attention_mask)
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5
    params = dict(model.named_parameters())
    for layer in adapters.layers:
        assert (
            params[f"{layer}.lora_A.weight"].shape[0] == peft_model.base_model.model.get_submodule(layer).r["default"]
        )
    # Our own adapter file of the same adapters: PEFT reads the same scales from it, and so does a merged export.
    exported = lora_config_of(adapters.peft_config(path))
    assert all(exported.scale_of(layer) == config.scale_of(layer) for layer in adapters.layers)
    write_peft_adapter(
        str(tmp_path / "ours"), {name: params[name] for name in params if is_adapter(name)}, adapters.peft_config(path)
    )
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        merged = peft_model.merge_and_unload().state_dict()
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "ours")).eval()
        again = reloaded(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert (again[real] - expected[real]).abs().max().item() <= 1e-5
    for layer in adapters.layers:
        ours_merged = merged_weight(
            params[f"{layer}.weight"],
            params[f"{layer}.lora_A.weight"],
            params[f"{layer}.lora_B.weight"],
            config.scale_of(layer),
        )
        torch.testing.assert_close(ours_merged, merged[f"{layer}.weight"], atol=1e-6, rtol=1e-6)


def test_pattern_keys_match_layers_as_in_peft():
    from peft.utils.other import get_pattern_key

    patterns = {"0.self_attn.q_proj": 1, "self_attn.(k|v)_proj": 2, "layers.1.mlp.down_proj": 3, "up_proj": 5}
    config = LoRAConfig(rank=8, rank_pattern=patterns)
    for index in (0, 1, 10):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.up_proj"):
            layer = f"model.layers.{index}.{module}"
            assert config.rank_of(layer) == patterns.get(get_pattern_key(list(patterns), layer), 8), layer
    assert config.rank_of("model.layers.10.self_attn.q_proj") == 8  # a key matches after a dot, not inside a name


@pytest.mark.parametrize(
    "peft_settings, our_settings, message",
    [
        (dict(use_dora=True), {}, "is a DoRA adapter \\(use_dora=true\\).*use a LoRA adapter"),
        (dict(target_modules=r".*\.self_attn\.q_proj"), {}, "target_modules='.*a regular expression.*list of layer"),
        (dict(use_rslora=True), {}, "has use_rslora=true; set lora.use_rslora to match \\(now false\\)"),
        (dict(rank_pattern={"q_proj": 8}), {}, "has rank_pattern=.*set lora.rank_pattern"),
        # PEFT saves the keys sorted, so q_proj comes first and wins for every q_proj.
        (
            dict(rank_pattern={"self_attn.q_proj": 6, "q_proj": 4}),
            dict(rank_pattern={"self_attn.q_proj": 6, "q_proj": 4}),
            "self_attn.q_proj \\(rank, scale\\) \\(4, 4.0\\), lora.* gives it \\(6, .*pattern keys overlap",
        ),
        (dict(layers_to_transform=[0]), {}, "has layers_to_transform=\\[0\\]: adapters on some decoder layers only"),
        (dict(bias="lora_only"), {}, "has bias='lora_only': trained biases, which these LoRA layers do not do"),
        (dict(modules_to_save=["lm_head"]), {}, "has modules_to_save=\\['lm_head'\\]: whole modules trained"),
    ],
    ids=[
        "dora",
        "regex_targets",
        "rslora_unset",
        "rank_pattern_unset",
        "patterns_in_another_order",
        "layers_to_transform",
        "bias",
        "modules_to_save",
    ],
)
def test_peft_adapter_of_another_kind_is_refused_by_name(peft_settings, our_settings, message, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    path = str(tmp_path / "base")
    settings = dict(r=2, lora_alpha=16, target_modules=["q_proj"]) | peft_settings
    get_peft_model(write_hf_model("llama3", path), PeftLoraConfig(**settings)).save_pretrained(
        str(tmp_path / "adapter")
    )
    config = LoRAConfig(rank=2, target_modules=["q_proj"], adapter_path=str(tmp_path / "adapter"), **our_settings)
    with pytest.raises(ValueError, match=message):
        lora_model(path, config)


def test_mismatched_peft_adapter_names_the_key(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    path = str(tmp_path / "base")
    get_peft_model(write_hf_model("llama3", path), PeftLoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        str(tmp_path / "adapter")
    )
    with pytest.raises(ValueError, match="set lora.rank"):
        lora_model(path, LoRAConfig(rank=4, target_modules=["q_proj"], adapter_path=str(tmp_path / "adapter")))


def test_fresh_adapters_start_at_the_base_model(family):
    path, hf_model = family
    model, _ = lora_model(path, LoRAConfig(rank=2))
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=8, side="right")
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = model(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(rank=-1), "rank=-1"),
        (dict(rank=4, target_modules=["lm_head"]), "target_modules"),
        (dict(rank=4, dropout=1.0), "dropout"),
        (dict(rank=None, adapter_path="x"), "adapter_path"),
        (dict(rank=4, rank_pattern={"q_proj": 0}), "rank_pattern"),
        (dict(rank=4, alpha_pattern={"(q_proj": 2.0}), "alpha_pattern"),
    ],
)
def test_config_rejects(settings, message):
    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**settings)


def test_lora_is_off_by_default_and_scales_by_alpha_over_rank():
    assert not LoRAConfig().enabled and not LoRAConfig(rank=0).enabled
    layer = "model.layers.0.self_attn.q_proj"
    assert LoRAConfig(rank=8, alpha=16).scale_of(layer) == 2.0
    assert LoRAConfig(rank=4, alpha=16, use_rslora=True).scale_of(layer) == 8.0
    assert LoRAConfig(rank=8, alpha=16, rank_pattern={"q_proj": 2}, alpha_pattern={"q_proj": 4}).scale_of(layer) == 2.0
    adapters = LoRAAdapters(LoRAConfig(rank=2), {})
    with adapters.disabled():
        assert not adapters.enabled
    assert adapters.enabled


def test_a_critic_trains_its_adapters_and_its_value_head_in_float32(tmp_path):
    path = str(tmp_path / "critic")
    write_hf_model("llama3", path, kind="value")
    model = build_model(path, head="value", dtype=torch.bfloat16, attention_backend="torch")
    parallelize(model, tp_mesh=None, dp_mesh=None, lora=LoRAConfig(rank=2, target_modules=["q_proj"]))
    trained = {name: param.dtype for name, param in model.named_parameters() if param.requires_grad}
    assert set(trained) == {"score.weight", "score.bias"} | {
        f"model.layers.{index}.self_attn.q_proj.lora_{piece}.weight" for index in range(2) for piece in "AB"
    }
    assert set(trained.values()) == {torch.float32}
    assert model.model.layers["0"].mlp.up_proj.weight.dtype == torch.bfloat16  # the frozen base stays in bf16


def test_a_critic_adapter_with_its_head_loads_in_peft(tmp_path):
    from peft import PeftModel

    path = str(tmp_path / "critic")
    hf_model = write_hf_model("qwen2_untied", path, kind="value")
    model = build_model(path, head="value", attention_backend="torch")
    adapters = parallelize(model, tp_mesh=None, dp_mesh=None, lora=LoRAConfig(rank=2, alpha=4.0))
    load_weights(model, path, device="cpu")
    adapters.initialize(model, seed=0)
    randomize_adapters(model)
    with torch.no_grad():
        model.score.weight.mul_(3.0)  # a trained head differs from the base's
    trained = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    write_peft_adapter(str(tmp_path / "adapter"), trained, adapters.peft_config(path, head="value"))
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=9, side="left")
    with torch.no_grad():
        expected = (
            PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter"))
            .eval()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            .logits[..., 0]
        )
        ours = model.eval()(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5


def test_adapter_gradients_are_the_same_under_activation_checkpointing(tmp_path):
    path = str(tmp_path / "base")
    write_hf_model("qwen3", path)
    gradients = []
    for checkpointing in (False, True):
        model = build_model(path, attention_backend="torch")
        adapters = parallelize(
            model,
            tp_mesh=None,
            dp_mesh=None,
            activation_checkpointing=checkpointing,
            lora=LoRAConfig(rank=2, dropout=0.1),
        )
        load_weights(model, path, device="cpu")
        adapters.initialize(model, seed=0)
        randomize_adapters(model)
        input_ids, attention_mask, _ = padded_batch(batch=2, seq=8, side="right")
        torch.manual_seed(0)  # the same dropout masks; checkpointing replays them in the recomputation
        model.train()(input_ids, attention_mask=attention_mask).float().logsumexp(-1).mean().backward()
        gradients.append({name: param.grad for name, param in model.named_parameters() if param.requires_grad})
    assert gradients[0].keys() == gradients[1].keys()
    assert all(gradients[0][name].abs().max() > 0 for name in gradients[0])
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_adapter_dropout_applies_while_training_only(tmp_path, dropout):
    """``lora.dropout`` drops an adapter's inputs in training mode only; at 0 no call is made and nothing changes."""
    path = str(tmp_path / "base")
    write_hf_model("qwen3", path)
    model, _ = lora_model(path, LoRAConfig(rank=2, dropout=dropout))
    randomize_adapters(model)
    input_ids, attention_mask, _ = padded_batch(batch=2, seq=8, side="right")
    outputs = {}
    for mode, seed in itertools.product(("train", "eval"), (0, 1)):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs[mode, seed] = getattr(model, mode)()(input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(outputs["eval", 0], outputs["eval", 1], rtol=0, atol=0)
    assert torch.equal(outputs["train", 0], outputs["train", 1]) == (dropout == 0.0)
    torch.testing.assert_close(outputs["train", 0] if dropout == 0.0 else outputs["eval", 0], outputs["eval", 0])


@pytest.mark.parametrize("moe_family", ["qwen2_moe", "mixtral"])
def test_lora_on_a_moe_model_adapts_the_dense_parts_and_says_the_experts_stay_frozen(moe_family, tmp_path, caplog):
    from spmd_rlhf.tiny.model import make_tiny

    path = make_tiny(family=moe_family, out_dir=str(tmp_path / moe_family))
    with caplog.at_level("INFO", logger="spmd_rlhf.models.lora"):
        model, adapters = lora_model(path, LoRAConfig(rank=2, target_modules=list(LORA_TARGETS)))
    assert "routed experts and routers of its" in caplog.text
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all(is_adapter(name) for name in trainable)
    assert not any(".mlp.experts." in name or ".mlp.gate." in name for name in adapters.layers)
    assert any("self_attn.q_proj" in name for name in adapters.layers)
    if moe_family == "qwen2_moe":  # the always-on shared expert is a dense MLP: it gets adapters
        assert any(".mlp.shared_expert.gate_proj" in name for name in adapters.layers)
    input_ids = torch.tensor([[3, 5, 7, 9]])
    randomize_adapters(model)
    model(input_ids).sum().backward()
    assert all(param.grad is None for name, param in model.named_parameters() if ".mlp.experts." in name)
