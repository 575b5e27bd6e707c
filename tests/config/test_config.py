"""Config schema, loading, error messages and the ``spmd-rlhf config --show`` command."""

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import get_type_hints

import pytest
from omegaconf import OmegaConf

from spmd_rlhf.config import (
    ConfigError,
    FrameworkConfig,
    RolloutConfig,
    field_docs,
    load_config,
    to_yaml,
    with_overrides,
)
from spmd_rlhf.config.dataflow import is_model
from spmd_rlhf.config.loader import _attribute_docs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIGS = sorted((REPO / "recipes" / "configs").glob("*.yaml"))
GRPO = ["algorithm.name=grpo", "critic.enabled=false", "rollout.n=4", "algorithm.kl_penalty=loss"]


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves; an empty mapping (a dict-valued key's default, e.g. lora.rank_pattern) is a leaf, as
    no section is empty."""
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def _schema_classes(schema: type) -> set[type]:
    classes = {schema}
    for declared in get_type_hints(schema).values():
        if dataclasses.is_dataclass(declared):
            classes |= _schema_classes(declared)
    return classes


def test_defaults_construct_and_validate() -> None:
    config = FrameworkConfig()
    assert load_config(None) == config
    assert config.model.path == "tiny/model"
    assert config.data.train_files == ["tiny/task/train.parquet"]
    assert config.cost.enabled is False
    assert list(config.enabled_roles()) == ["actor", "critic", "reference", "reward"]
    assert config.resource_pools() == {"all": ["actor", "critic", "reference", "reward"]}


def test_a_remote_reward_takes_its_url_and_runs_no_model() -> None:
    config = load_config(None, ["reward.kind=remote", "reward.url=https://scorer.internal/v1/score"])
    assert config.reward.url == "https://scorer.internal/v1/score"
    assert (config.reward.remote_batch_size, config.reward.remote_timeout_s, config.reward.remote_retries) == (
        64,
        30,
        3,
    )
    assert not is_model("reward", config)


def test_yaml_then_overrides_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "actor:\n  lr: 1e-6\n  tp: 2\n"
        "critic:\n  lr: ${actor.lr}\n"
        "rollout:\n  n: 2\n  tp: 2\n"
        "trainer:\n  total_steps: 7\n"
    )
    config = load_config(path, ["trainer.total_steps=9", "rollout.temperature=0.7", "trainer.total_steps=11"])
    assert config.actor.lr == 1e-6  # PyYAML reads "1e-6" as a string; the float field converts it
    assert isinstance(config.actor.lr, float)
    assert config.critic.lr == 1e-6  # interpolation resolved
    assert (config.actor.tp, config.rollout.tp, config.rollout.n) == (2, 2, 2)
    assert config.trainer.total_steps == 11  # later overrides win
    assert config.rollout.temperature == 0.7
    assert config.critic.tp == 1  # untouched keys keep their defaults


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    config = load_config(None, [*GRPO, "actor.betas=[0.8,0.95]", "trainer.resume=null", "placement=split"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda path: path.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.algorithm.name == path.stem


def test_example_configs_exist() -> None:
    assert {path.stem for path in EXAMPLE_CONFIGS} >= {"ppo", "grpo"}


def test_resource_pools_follow_placement() -> None:
    split = load_config(None, ["placement=split"])
    assert split.resource_pools() == {"policy": ["actor", "reference"], "scoring": ["critic", "reward"]}
    manual = load_config(
        None,
        [
            "placement=manual",
            *(f"{role}.pool=gpu0" for role in ("actor", "reference")),
            *(f"{role}.pool=gpu1" for role in ("critic", "reward")),
        ],
    )
    assert manual.resource_pools() == {"gpu0": ["actor", "reference"], "gpu1": ["critic", "reward"]}
    assert load_config(None, ["placement=auto"]).resource_pools() == {}


def test_data_parallel_size_is_derived() -> None:
    config = load_config(
        None, ["actor.n_ranks=8", "actor.tp=2", "actor.pp=2", "critic.n_ranks=8", "critic.micro_batch_size=1"]
    )
    assert config.actor.dp_size() == 2
    assert config.critic.dp_size() == 8
    assert config.reference.dp_size() is None  # pool size known only at start


# (overrides, the dotted key the message must start with, a fragment saying what is allowed)
BAD_OVERRIDES = [
    (["bogus=1"], "bogus", "unknown key; the top level allows: model, data"),
    (["actor.tpp=2"], "actor.tpp", "did you mean actor.tp?"),
    (["rollout.zzz=1"], "rollout.zzz", "rollout allows: n, temperature"),
    (["trainer.total_steps=abc"], "trainer.total_steps", "=abc: expected an integer"),
    (["trainer.total_steps=1.5"], "trainer.total_steps", "expected an integer"),
    (["rollout.temperature=hot"], "rollout.temperature", "expected a number"),
    (["trainer.save_hf=sometimes"], "trainer.save_hf=sometimes", "must be one of final, every, never"),
    (["trainer.save_hf_dtype=float64"], "trainer.save_hf_dtype=float64", "must be null (model.dtype), float32"),
    (["critic.enabled=maybe"], "critic.enabled", "expected true or false"),
    (["actor.betas=[0.9,abc]"], "actor.betas[1]", "expected a number"),
    (["data.train_files=x.parquet"], "data.train_files", "expected a list of strings"),
    (["trainer.resume=[a]"], "trainer.resume", "expected a string or null"),
    (["actor=3"], "actor", "expected a section with keys enabled, model_path"),
    (["actor.tp=${nope}"], "actor.tp", "nope"),
    (["rollout.temperature=-1.0"], "rollout.temperature=-1.0", "must be >= 0"),
    (["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1]"),
    (
        ["algorithm.name=dpo"],
        "algorithm.name=dpo",
        "must be one of ppo, grpo, remax, rloo, reinforce_pp, reinforce_pp_baseline, safe_rlhf",
    ),
    (["algorithm.clip_ratio_low=0"], "algorithm.clip_ratio_low", "must be in (0, 1)"),
    (["actor.lr_schedule=linear"], "actor.lr_schedule", "must be one of constant, cosine"),
    (["critic.lr=0"], "critic.lr", "must be > 0"),
    (["actor.betas=[0.9]"], "actor.betas", "must be two numbers"),
    (["reference.tp=0"], "reference.tp=0", "must be >= 1"),
    (["trainer.loggers=[console,slack]"], "trainer.loggers", "allowed: console, jsonl, tensorboard, wandb"),
    (["placement=everywhere"], "placement", "must be one of colocate, split"),
]

BAD_COMBINATIONS = [
    (["actor.n_ranks=8", "actor.tp=3"], "actor.tp=3", "must divide actor.n_ranks=8"),
    (["actor.n_ranks=8", "actor.tp=2", "actor.pp=3"], "actor.pp=3", "must divide actor.n_ranks=8"),
    (["actor.n_ranks=8", "actor.dp=3"], "actor.dp=3", "set actor.dp=8 or 0"),
    (["actor.n_ranks=8", "actor.tp=2", "actor.ep=8"], "actor.ep=8", "must divide actor.dp=4"),
    (["actor.n_ranks=8", "critic.n_ranks=4"], "critic.n_ranks=4", "must equal actor.n_ranks=8"),
    (["placement=manual"], "actor.pool=null", "placement=manual needs a pool"),
    (["actor.pool=gpu0"], "actor.pool=gpu0", "only used with placement=manual"),
    (["rollout.tp=2"], "rollout.tp=2", "must divide actor.tp=1"),
    (
        ["algorithm.name=grpo", "critic.enabled=true"],
        "critic.enabled=true",
        "never calls the critic; set critic.enabled=false",
    ),
    (["algorithm.name=grpo", "critic.enabled=false"], "rollout.n=1", "needs >= 2 responses per prompt"),
    (["algorithm.name=safe_rlhf", "cost.enabled=false"], "cost.enabled=false", "needs the cost; set cost.enabled=true"),
    (
        ["algorithm.name=safe_rlhf"],
        "cost.model_path=null",
        "cost.kind=model needs",
    ),
    (["reference.enabled=false"], "reference.enabled=false", "algorithm.kl_penalty=reward needs the reference"),
    (["actor.enabled=false"], "actor.enabled=false", "every algorithm needs the actor"),
    (["actor.mini_batch_size=3"], "actor.mini_batch_size=3", "must divide data.batch_size*rollout.n=8"),
    (["critic.micro_batch_size=3"], "critic.mini_batch_size=8", "must be a multiple of critic.micro_batch_size=3"),
    (["actor.n_ranks=4", "critic.n_ranks=4"], "actor.mini_batch_size=8", "multiple of actor.micro_batch_size*dp=16"),
    (["actor.warmup_steps=100"], "actor.warmup_steps=100", "must be <= trainer.total_steps=20"),
    (["trainer.val_every=5"], "trainer.val_every=5", "needs data.val_files"),
    (["trainer.profile_steps=[20]"], "trainer.profile_steps=[20]", "end before trainer.total_steps=20"),
    (["trainer.profile_trace=true"], "trainer.profile_trace=true", "needs trainer.profile_steps"),
    (["reward.kind=model"], "reward.model_path=null", "reward.kind=model needs"),
    (["reward.kind=remote"], "reward.url=null", "kind=remote needs the reward service's URL"),
    (["reward.url=http://scorer:8000/score"], "reward.url=http://scorer:8000/score", "only used with kind=remote"),
    (["reward.kind=remote", "reward.url=scorer:8000"], "reward.url=scorer:8000", "must be an http:// or https://"),
    (["reward.kind=remote", "reward.url=http://s", "reward.remote_batch_size=0"], "reward.remote_batch_size=0", ">= 1"),
    (["reward.kind=remote", "reward.url=http://s", "reward.remote_retries=-1"], "reward.remote_retries=-1", ">= 0"),
    (["reward.kind=remote", "reward.url=http://s", "reward.remote_timeout_s=0"], "reward.remote_timeout_s=0", "> 0"),
    (["rollout.partial_rollouts=keep_kv"], "rollout.partial_rollouts=keep_kv", "set algorithm.max_staleness >= 1"),
    (["rollout.partial_rollouts=halfway"], "rollout.partial_rollouts=halfway", "must be one of off, keep_kv"),
    (["rollout.partial_segment_tokens=0"], "rollout.partial_segment_tokens=0", "must be >= 1"),
]


@pytest.mark.parametrize(("overrides", "key", "allowed"), BAD_OVERRIDES + BAD_COMBINATIONS)
def test_bad_values_name_the_key(overrides: list[str], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    message = str(caught.value)
    assert message.startswith(key), message
    assert allowed in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("actor.lr", "expected key=value"),
        ("=3", "expected key=value"),
        ("actor..lr=1", "expected key=value"),
        ("actor.betas=[0.9,", "value is not valid YAML"),
    ],
)
def test_malformed_override(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        load_config(None, [override])
    assert repr(override) in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("actor:\n  tpp: 2\n", "actor.tpp: unknown key; did you mean actor.tp?"),
        ("trainer:\n  total_steps: abc\n", "trainer.total_steps=abc: expected an integer"),
        ("algorithm:\n  name: grpo\ncritic:\n  enabled: false\n", "rollout.n=1: algorithm.name=grpo needs"),
        ("actor: {tp: [1,\n", "not valid YAML: "),
        ("a: 1\na: 2\n", "not valid YAML: found duplicate key a (line 2, column 1)"),
        ("- actor\n", "expected a mapping of config sections"),
        ("actor:\n", "actor=null: expected a section"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match="config file not found") as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ValueError)  # callers outside the CLI may catch ValueError


def test_sections_validate_on_their_own_with_relative_keys() -> None:
    # Built directly, a section does not know its place in the tree; load_config adds the prefix.
    with pytest.raises(ConfigError, match=r"^temperature=-1: must be >= 0$"):
        RolloutConfig(temperature=-1)


def test_field_docs_cover_every_leaf_with_docstring_and_default() -> None:
    docs = field_docs()
    leaves = _leaf_keys(OmegaConf.to_container(OmegaConf.structured(FrameworkConfig)))
    assert list(docs) == leaves
    assert all(docstring for _, docstring in docs.values()), [key for key, (_, doc) in docs.items() if not doc]
    assert docs["trainer.total_steps"] == ("20", "Training steps to run, each one rollout batch and its updates.")
    assert docs["critic.lr"][0] == "0.0001"  # per-role default from the section's factory
    assert docs["cost.enabled"][0] == "null"  # derived from the algorithm, so left null
    assert docs["model.tokenizer_path"][0] == "null"
    assert docs["actor.pp_schedule"][1].startswith(
        "Pipeline schedule when pp > 1"
    )  # inherited fields find their base class's docstring


def test_every_field_has_a_docstring() -> None:
    # Sections too, not only leaves: a field added without a docstring fails here.
    missing = [
        f"{cls.__name__}.{item.name}"
        for cls in _schema_classes(FrameworkConfig)
        for item in dataclasses.fields(cls)
        if not _attribute_docs(cls).get(item.name)
    ]
    assert not missing


def _run_cli(*args: str, action: str = "--show", in_process: bool = True) -> subprocess.CompletedProcess[str]:
    """``spmd-rlhf config ACTION ARGS``: the command's entry function in this process (a fresh interpreter costs
    seconds of imports per case), or with ``in_process=False`` the console command itself in a subprocess."""
    command = ["config", action, *args]
    if not in_process:
        return subprocess.run(
            [sys.executable, "-m", "spmd_rlhf.cli", *command],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
            timeout=120,
        )
    from spmd_rlhf import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = cli.main(command)
        except SystemExit as exit:  # argparse's usage errors
            code = exit.code
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda path: path.name)
def test_cli_shows_example_configs(path: Path, tmp_path: Path) -> None:
    result = _run_cli(str(path), "actor.lr=1e-6")
    assert result.returncode == 0, result.stderr
    shown = tmp_path / "shown.yaml"
    shown.write_text(result.stdout)
    assert load_config(shown) == load_config(path, ["actor.lr=1e-6"])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["recipes/configs/ppo.yaml", "actor.tpp=2"], "actor.tpp: unknown key"),
        (["recipes/configs/ppo.yaml", "trainer.total_steps=abc"], "trainer.total_steps=abc: expected an integer"),
        (["recipes/configs/ppo.yaml", "actor.n_ranks=8", "actor.tp=3"], "actor.tp=3: must divide actor.n_ranks=8"),
        (["recipes/configs/ppo.yaml", "actor.lr"], "expected key=value"),
        (["recipes/configs/absent.yaml"], "config file not found"),
        (["recipes"], "cannot load"),
    ],
)
def test_cli_reports_config_errors_in_one_line(args: list[str], fragment: str) -> None:
    result = _run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("config error: ")
    assert fragment in lines[0]
    assert result.stdout == ""


def test_cli_reports_malformed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("actor:\n  tp: 1\n lr: 2\n")
    result = _run_cli(str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "not valid YAML" in result.stderr


def test_attention_choices_are_the_model_backends():
    from spmd_rlhf.config import ATTENTION_BACKENDS
    from spmd_rlhf.models.attention import BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS


def test_decode_matmul_choices_are_the_engine_ones():
    from spmd_rlhf.config.choices import DECODE_MATMULS
    from spmd_rlhf.engine.decode_matmul import DECODE_MATMULS as ENGINE_DECODE_MATMULS

    assert DECODE_MATMULS == ENGINE_DECODE_MATMULS


def test_partial_rollout_choices_are_the_engine_modes():
    from spmd_rlhf.config import PARTIAL_ROLLOUTS
    from spmd_rlhf.engine import IN_FLIGHT

    assert PARTIAL_ROLLOUTS == ("off", *IN_FLIGHT)


def test_kv_block_size_check_uses_the_smaller_default_block():
    """A fixed rollout.kv_cache_blocks budget is checked with the smaller of kv_block_size=null's two sizes, so it
    holds one sequence whichever a rank picks."""
    from spmd_rlhf.config import DEFAULT_KV_BLOCK_SIZE
    from spmd_rlhf.models.attention import DEFAULT_KV_BLOCK_SIZE as ENGINE_DEFAULT
    from spmd_rlhf.models.attention import default_kv_block_size

    assert DEFAULT_KV_BLOCK_SIZE == ENGINE_DEFAULT == min(default_kv_block_size(b) for b in ("flash", "sdpa"))
    needed = -(-(load_config(None).data.max_prompt_length + load_config(None).rollout.max_new_tokens) // 16)
    with pytest.raises(
        ConfigError, match=f"rollout.kv_cache_blocks={needed - 1}: .*blocks of 16 tokens: rollout.kv_block_size=null"
    ):
        load_config(None, [f"rollout.kv_cache_blocks={needed - 1}"])
    assert load_config(None, [f"rollout.kv_cache_blocks={needed}"]).rollout.kv_block_size is None


def test_device_and_timeouts_reach_the_launch(monkeypatch):
    """trainer.device, trainer.timeout_s (calls), trainer.collective_timeout_s (collectives) and
    trainer.heartbeat_timeout_s (the coordinator's heartbeat) each reach their own RuntimeOptions field."""
    from spmd_rlhf.controller import entry
    from spmd_rlhf.recipes.ppo import PPORecipe

    seen = {}
    monkeypatch.setattr(entry, "launch", lambda main, *, options: seen.setdefault("options", options))
    monkeypatch.setattr(entry.os, "_exit", lambda code: None)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "ppo",
            "trainer.device=cpu",
            "trainer.timeout_s=123",
            "trainer.collective_timeout_s=45",
            "trainer.heartbeat_timeout_s=7",
        ],
    )
    entry.main(PPORecipe, str(Path(__file__).parents[2] / "recipes" / "configs" / "ppo.yaml"))
    options = seen["options"]
    assert (options.device, options.call_timeout_s, options.collective_timeout_s) == ("cpu", 123, 45)
    assert options.failure_timeout_s == 7  # trainer.heartbeat_timeout_s


def test_cli_lists_every_key_with_default_and_doc() -> None:
    from spmd_rlhf.config import field_docs

    result = _run_cli(action="--keys", in_process=False)
    assert result.returncode == 0
    for key, (default, doc) in field_docs().items():
        assert f"{key} = {default}\n    {doc}" in result.stdout


def test_overrides_apply_to_a_built_config_and_are_validated():

    config = load_config(None, ["actor.lr=0.5"])
    changed = with_overrides(config, ["actor.tp=2", "rollout.n=4"])
    assert (changed.actor.tp, changed.rollout.n, changed.actor.lr) == (2, 4, 0.5)
    assert config.actor.tp == 1  # the original is untouched
    with pytest.raises(ConfigError, match="rollout.tp=3: must divide actor.tp=2"):
        with_overrides(changed, ["rollout.tp=3"])


def test_lora_actor_serves_the_reference_from_its_base():
    from spmd_rlhf.config import load_config
    from spmd_rlhf.config.dataflow import GRPO, conditions

    lora = ["algorithm.name=grpo", "rollout.n=2", "actor.lora.rank=8"]
    with pytest.raises(
        ConfigError, match=r"reference\.enabled=true: .*actor\.lora\.rank=8 .* set reference\.enabled=false"
    ):
        load_config(None, [*lora, "reference.enabled=true"])
    config = load_config(None, lora)  # the reference role is derived away: the actor's base serves it
    assert config.reference.enabled is False and "reference.enabled" in config.derived
    assert conditions(config) == {
        "kl_to_reference": False,
        "kl_to_actor_base": True,
        "recompute_log_probs": False,
        "rollout_role": False,
        "generate_on_actor": True,
    }
    assert "reference" not in GRPO.roles_of(config) and GRPO.roles_of(config)["actor"]["preparation"] == ("forward",)
    # Another reference model named: a reference role as before.
    config = load_config(
        None,
        [
            "algorithm.name=grpo",
            "critic.enabled=false",
            "rollout.n=2",
            "actor.lora.rank=8",
            "reference.model_path=other",
        ],
    )
    assert conditions(config)["kl_to_reference"] and not conditions(config)["kl_to_actor_base"]
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules=\[lm_head\]"):
        load_config(None, ["actor.lora.rank=8", "actor.lora.target_modules=[lm_head]"])


def test_environment_choices_are_the_registry():
    from spmd_rlhf.config import ENVIRONMENTS
    from spmd_rlhf.envs import ENVIRONMENTS as REGISTRY

    assert ENVIRONMENTS == tuple(REGISTRY)


def test_one_key_turns_on_asynchronous_rl_and_the_rest_is_derived(tmp_path):
    """algorithm.max_staleness=1 alone: the rollout role, recomputed log-probs and a split placement follow; a key
    set against them is refused, and with_overrides derives them again from the new values."""
    grpo = REPO / "recipes" / "configs" / "grpo.yaml"
    config = load_config(grpo, ["algorithm.max_staleness=1"])
    assert (config.rollout.enabled, config.rollout.recompute_log_probs, config.placement) == (True, True, "split")
    assert config.derived["rollout.enabled"] == (True, "algorithm.max_staleness=1")
    with pytest.raises(ConfigError, match="rollout.recompute_log_probs=false: algorithm.max_staleness=1"):
        load_config(grpo, ["algorithm.max_staleness=1", "rollout.recompute_log_probs=false"])
    synchronous = load_config(grpo, [])
    assert (synchronous.rollout.enabled, synchronous.placement) == (False, "colocate")
    again = with_overrides(synchronous, ["algorithm.max_staleness=1"])
    assert (again.rollout.enabled, again.placement) == (True, "split")
    assert load_config(None, [*GRPO, "actor.lora.rank=8"]).derived["reference.enabled"][0] is False
    shown = _run_cli(str(grpo), "algorithm.max_staleness=1")
    assert "# derived: rollout.enabled=true (algorithm.max_staleness=1)" in shown.stdout, shown.stderr


def test_asynchronous_rl_takes_lora_environments_and_safe_rlhf_but_not_partial_multi_turn_trajectories():
    grpo = REPO / "recipes" / "configs" / "grpo.yaml"
    assert load_config(grpo, ["algorithm.max_staleness=1", "actor.lora.rank=8"]).rollout.enabled
    assert load_config(grpo, ["algorithm.max_staleness=1", "rollout.environment=tool"]).rollout.enabled
    safe = load_config(REPO / "recipes" / "configs" / "safe_rlhf.yaml", ["algorithm.max_staleness=1"])
    # The rollout beside the reward only: the critics' and the cost model's calls would queue behind its generation.
    assert safe.resource_pools() == {
        "policy": ["actor", "critic", "reference", "cost", "cost_critic"],
        "scoring": ["reward", "rollout"],
    }
    with pytest.raises(ConfigError, match="rollout.partial_rollouts=.*a multi-turn trajectory is generated in one"):
        load_config(grpo, ["algorithm.max_staleness=1", "rollout.environment=tool", "rollout.partial_rollouts=keep_kv"])


def test_every_independent_problem_is_named_in_one_error():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["algorithm.name=grpo", "critic.enabled=true", "cost_critic.enabled=true"])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("critic.enabled=true: ") and "; also cost_critic.enabled=true: " in message
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*GRPO, "rollout.n=1", "trainer.val_every=5"])
    assert "rollout.n=1: " in str(caught.value) and "; also trainer.val_every=5: " in str(caught.value)


def test_compiled_training_blocks_are_accepted_under_tensor_parallelism() -> None:
    """TP blocks compile (their forwards on local shards, ``tp_plan``): model.compile=on takes a role at tp > 1."""
    for setting in ("auto", "on", "off"):
        config = load_config(None, [f"model.compile={setting}", "actor.tp=2", "reference.tp=2"])
        assert config.model.compile == setting


def test_off_and_on_reach_string_keys_as_words(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare off / on as a boolean: a string key takes back the word, a boolean key keeps its boolean.
    overrides = ["algorithm.router_replay=off", "model.compile=on", "model.activation_checkpointing=off"]
    config = load_config(None, overrides)
    assert (config.algorithm.router_replay, config.model.compile, config.model.activation_checkpointing) == (
        "off",
        "on",
        False,
    )
    assert load_config(None, ["model.compile=true"]).model.compile == "on"
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  partial_rollouts: off\n")
    assert load_config(path).rollout.partial_rollouts == "off"
    with pytest.raises(ConfigError, match="algorithm.router_replay=on: must be one of off, rollout, recompute"):
        load_config(None, ["algorithm.router_replay=on"])
