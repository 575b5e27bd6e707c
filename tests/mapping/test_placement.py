"""placement: auto — a recipe config planned onto the job's ranks and written back as a manual placement, the
``spmd-rlhf plan`` command, and a real run with the mapper's placement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_helpers import run_recipe

from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.mapping.placement import apply_mapping, config_dataflow, plan_config
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES
from spmd_rlhf.mapping.role_pools import place_roles, resolve_placement, role_pools

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def ppo_config(tiny_model_dir: Path, *overrides: str):
    return load_config(RECIPES / "configs" / "ppo.yaml", [f"model.path={tiny_model_dir}", "placement=auto", *overrides])


def test_the_config_dataflow_takes_the_config_batch(tiny_model_dir):
    roles, batch = config_dataflow(ppo_config(tiny_model_dir, "critic.micro_batch_size=16"))
    assert [role.name for role in roles] == ["actor", "critic", "reference"]  # reward.kind=rule is no model
    assert (batch.prompts, batch.samples, batch.prompt_length, batch.response_length) == (64, 1, 64, 4)
    assert roles[1].micro_batch_size == 16 and batch.dtype_bytes == 4


def test_every_mapping_of_the_plan_is_a_valid_manual_placement(tiny_model_dir):
    config = ppo_config(tiny_model_dir)
    result = plan_config(config, 4, profile=BUILTIN_PROFILES["h100"])
    for mapping in [result.best, *result.runners_up]:
        applied = apply_mapping(config, mapping)
        assert applied.placement == "manual"
        pools = role_pools(applied, 4)
        for roles, devices in zip(mapping.sets, mapping.devices):
            ranks = {pools[name].ranks for name in roles}
            assert len(ranks) == 1 and len(next(iter(ranks))) == devices  # a set shares one pool
            for name in roles:
                layout = mapping.layouts[name]
                assert (getattr(applied, name).pp, getattr(applied, name).tp) == (layout.pp, layout.tp)
        assert pools["reward"] == pools["actor"]  # the rule reward runs beside the actor
        assert applied.rollout.tp == mapping.layouts["actor"].tp_g
        assert sorted(rank for pool in {pool.ranks for pool in pools.values()} for rank in pool) == [0, 1, 2, 3]


def test_resolve_placement_leaves_other_placements_alone(tiny_model_dir):
    config = load_config(RECIPES / "configs" / "ppo.yaml", [f"model.path={tiny_model_dir}"])
    assert resolve_placement(config, 2) == (config, "")
    resolved, plan = resolve_placement(ppo_config(tiny_model_dir, "mapping.profile=a100"), 2)
    assert resolved.placement == "manual" and "# device mapping for 2 devices (a100, datasheet)" in plan


def test_plan_command_prints_the_mapping_and_runners_up():
    command = [
        sys.executable,
        "-m",
        "spmd_rlhf.cli",
        "plan",
        "--algo",
        "ppo",
        "--actor",
        "7b",
        "--critic",
        "13b",
        "--reward",
        "13b",
        "--gpus",
        "64",
        "--gpus-per-node",
        "8",
        "--runners-up",
        "3",
    ]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "# device mapping for 64 devices (h100, datasheet)" and lines[1].startswith("placement: [")
    for role in ("actor", "critic", "reference", "reward"):
        assert any(line.startswith(role + " ") and "pp=" in line for line in lines), role
    assert any(line.startswith("estimated step:") for line in lines)
    runners = lines[lines.index("# runners-up") + 1 :]
    assert len([line for line in runners if " s  [" in line]) == 3
    wrong = subprocess.run([*command[:4], "--algo", "dpo", "--gpus", "8"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "algorithm 'dpo': must be one of" in wrong.stderr


def test_a_recipe_runs_on_the_mappers_placement(tmp_path, monkeypatch):
    # No saved profile: the coordinator calibrates this machine inside the torchrun job, then plans.
    monkeypatch.setenv("SPMD_RLHF_PROFILE", str(tmp_path / "no_profile.json"))
    records = run_recipe(
        "ppo",
        tmp_path,
        "placement=auto",
        "mapping.profile=auto",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "actor.micro_batch_size=16",
        "critic.micro_batch_size=16",
    )
    assert len(records) == 2 and all(record["actor/loss"] == record["actor/loss"] for record in records)
    assert {"time/update_actor", "time/update_critic", "time/values", "time/ref_log_probs"} <= set(records[-1])


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_asynchronous_rl_plans_the_rollout_role_on_devices_of_its_own(tiny_model_dir, max_staleness):
    """placement=auto with a rollout role: its TP replicas get a set that no role the step calls shares (only the
    reward, which the rollout pipeline issues behind each generation), the plan counts the weight sync, and from
    max_staleness 1 on the step is the longer of generation and training, not their sum."""
    config = load_config(
        RECIPES / "configs" / "grpo.yaml",
        [f"model.path={tiny_model_dir}", "placement=auto", f"algorithm.max_staleness={max_staleness}"]
        + ["rollout.enabled=true", "rollout.recompute_log_probs=true"],
    )
    roles, batch = config_dataflow(config)
    assert [role.name for role in roles if role.replica] == ["rollout"] and batch.max_staleness == max_staleness
    result = plan_config(config, 4, profile=BUILTIN_PROFILES["h100"])
    for mapping in [result.best, *result.runners_up]:
        (rollout_set,) = [roles for roles in mapping.sets if "rollout" in roles]
        assert set(rollout_set) <= {"rollout", "reward"}
        stages = mapping.stage_seconds
        assert stages["weight_sync"] > 0
        if max_staleness:
            assert stages["weight_sync"] < mapping.seconds < sum(stages.values())
        else:
            assert mapping.seconds == sum(stages.values())
        applied = apply_mapping(config, mapping)
        pools = role_pools(applied, 4)
        assert (
            len(pools["rollout"].ranks) == applied.rollout.n_ranks == mapping.devices[mapping.sets.index(rollout_set)]
        )
        assert applied.rollout.tp == mapping.layouts["rollout"].tp
        assert pools["reward"] == pools["rollout"]  # the rule reward scores beside the generation
        assert not set(pools["rollout"].ranks) & set(pools["actor"].ranks)


def test_an_asynchronous_recipe_runs_on_the_mappers_placement(tmp_path):
    records = run_recipe(
        "grpo",
        tmp_path,
        "placement=auto",
        "mapping.profile=h100",
        "algorithm.max_staleness=1",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.save_every=0",
        nproc=4,
    )
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0, 1.0]
    assert records[0]["weight_sync/bytes"] > 0


def test_auto_placement_releases_the_engine_where_keeping_it_fits_nowhere(tiny_model_dir):
    import dataclasses

    from spmd_rlhf.mapping.devices import Cluster
    from spmd_rlhf.mapping.placement import describe_plan
    from spmd_rlhf.mapping.search import Planner

    config = ppo_config(tiny_model_dir, "rollout.keep_engine=true")
    specs, batch = config_dataflow(config)
    assert batch.keep_engine

    def fits(memory: float, keep: bool) -> bool:
        profile = dataclasses.replace(BUILTIN_PROFILES["h100"], device_memory=memory)
        try:
            Planner(specs, Cluster(2, 2, profile), dataclasses.replace(batch, keep_engine=keep)).plan()
            return True
        except ValueError:
            return False

    # The smallest device (in 1 % steps) on which the roles fit with the engine released: keeping it does not.
    memory = 2**20
    while not fits(memory, keep=False):
        memory *= 1.01
    assert not fits(memory, keep=True)
    profile = dataclasses.replace(BUILTIN_PROFILES["h100"], device_memory=memory)
    result = plan_config(config, 2, profile=profile)
    assert result.engine_released and not result.best.keep_engine
    assert apply_mapping(config, result.best).rollout.keep_engine is False
    assert "released after each generation" in describe_plan(result, devices=2, profile=profile)
    roomy = plan_config(config, 2, profile=BUILTIN_PROFILES["h100"])
    assert not roomy.engine_released and apply_mapping(config, roomy.best).rollout.keep_engine is True


@pytest.mark.parametrize("key", ["ep", "cp"])
def test_an_ep_or_cp_that_does_not_divide_the_dp_ranks_is_one_error_naming_it(key):
    """Both split the DP ranks: on 4 ranks at tp = 2 (dp = 2), 4 cannot; 2 can."""
    with pytest.raises(
        ValueError, match=rf"^actor\.{key}=4 does not divide its dp=2 \(4 ranks / \(pp=1 x tp=2\)\): it "
    ):
        place_roles(load_config(None, ["actor.tp=2", f"actor.{key}=4"]), 4)
    dims = place_roles(load_config(None, ["actor.tp=2", f"actor.{key}=2"]), 4).roles["actor"][1]
    assert getattr(dims, key) == 2 and dims.dp == 2


def test_fsdp_size_groups_the_dp_ranks_into_replicas_or_is_one_error_naming_it():
    """HSDP: on 8 ranks at tp = 2 (dp = 4), fsdp_size 2 gives two replicas of FSDP over 2 ranks; 3 does not divide
    dp; 0 (the default) and dp itself both shard over all of dp."""
    dims = place_roles(load_config(None, ["actor.tp=2", "actor.fsdp_size=2"]), 8).roles["actor"][1]
    assert (dims.dp, dims.fsdp_shards, dims.fsdp_replicas) == (4, 2, 2)
    with pytest.raises(ValueError, match=r"^actor\.fsdp_size=3 does not divide its dp=4 \(8 ranks / "):
        place_roles(load_config(None, ["actor.tp=2", "actor.fsdp_size=3"]), 8)
    for size in (0, 4):
        dims = place_roles(load_config(None, ["actor.tp=2", f"actor.fsdp_size={size}"]), 8).roles["actor"][1]
        assert (dims.fsdp_size, dims.fsdp_shards, dims.fsdp_replicas) == (0, 4, 1)
    with pytest.raises(ConfigError, match="actor.fsdp_size"):
        load_config(None, ["actor.fsdp_size=-1"])
    with pytest.raises(ConfigError, match="reward.fsdp_size.*whole replica per DP rank"):
        load_config(None, ["reward.kind=generative", "reward.fsdp_size=2"])
