"""Config checks: what the decoder cannot honour is an error naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import hf_config, write_hf_model

from spmd_rlhf.models import ModelConfigError, args_from_hf_config, read_decoder_args
from spmd_rlhf.models.rope import rope_inverse_frequencies


def _rewrite_config(path, **changes):
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "name,overrides,field",
    [
        ("mistral", {"sliding_window": 16}, "sliding_window=16"),
        ("qwen2_untied", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window=8"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama3", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ("llama2_bias", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
    ],
)
def test_unsupported_settings_name_the_field(name, overrides, field):
    with pytest.raises(ModelConfigError, match=field.replace("[", r"\[").replace("(", r"\(")):
        args_from_hf_config(hf_config(name, **overrides))


def test_unknown_config_json_key_is_rejected(tmp_path):
    write_hf_model("qwen2_tied", str(tmp_path))
    _rewrite_config(tmp_path, quantization_config={"quant_method": "gptq"})
    with pytest.raises(ModelConfigError, match="quantization_config"):
        read_decoder_args(str(tmp_path))


def test_incomplete_rope_scaling_in_config_json_is_a_config_error(tmp_path):
    write_hf_model("llama2_bias", str(tmp_path))
    _rewrite_config(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 2.0}, rope_parameters=None)
    with pytest.raises(ModelConfigError, match="low_freq_factor"):
        read_decoder_args(str(tmp_path))


def test_unsupported_model_type_is_rejected():
    from transformers import AutoConfig

    with pytest.raises(ModelConfigError, match="model_type='gpt2'"):
        args_from_hf_config(AutoConfig.for_model("gpt2"))


def test_mistral_window_covering_every_position_is_full_attention():
    args = args_from_hf_config(hf_config("mistral", sliding_window=64))
    assert args.family == "mistral"


def test_family_flags():
    assert (
        args_from_hf_config(hf_config("qwen2_tied")).qkv_bias
        and not args_from_hf_config(hf_config("qwen2_tied")).o_bias
    )
    assert args_from_hf_config(hf_config("qwen3")).qk_norm and args_from_hf_config(hf_config("qwen3")).head_dim == 24
    llama2 = args_from_hf_config(hf_config("llama2_bias"))
    assert llama2.qkv_bias and llama2.o_bias and llama2.mlp_bias


def test_llama3_scaling_matches_transformers_and_changes_low_frequencies():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config("llama3")
    args = args_from_hf_config(config)
    ours = rope_inverse_frequencies(head_dim=args.head_dim, theta=args.rope_theta, scaling=args.rope_scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    unscaled = rope_inverse_frequencies(head_dim=args.head_dim, theta=args.rope_theta, scaling=None)
    assert torch.equal(ours[-1], unscaled[-1] / 8.0) and not torch.equal(ours, unscaled)
