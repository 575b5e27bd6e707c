"""Every recipe's command line: ``--help`` lists every config key with its default and docstring, ``--dry-run``
prints the resolved config, placement, layouts and memory per rank without launching anything, and a bad key is a
one-line error with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from preloaded import PreloadedPython

from spmd_rlhf.config import field_docs

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
NAMES = ["ppo", "grpo", "remax", "rloo", "safe_rlhf"]


def command(name: str, *args: str) -> list[str]:
    return [str(RECIPES / f"{name}.py"), "--config", str(RECIPES / "configs" / f"{name}.yaml"), *args]


def run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python recipes/<name>.py ...`` started by a fresh interpreter."""
    return subprocess.run([sys.executable, *command(name, *args)], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def preloaded() -> Iterator[PreloadedPython]:
    """``python recipes/<name>.py ...`` as forks of one interpreter that has imported the package (``--help`` and
    ``--dry-run`` of every recipe, a recipe's refusal of another algorithm: seconds of imports each, saved); the bad
    key starts a fresh interpreter, whose stderr must hold nothing but the one line from the start on."""
    with PreloadedPython() as python:
        yield python


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")  # the dry run builds the tiny assets here once


@pytest.mark.parametrize("name", ["grpo", "safe_rlhf"])  # one shared main(); two recipes suffice
def test_help_lists_every_key(name, workdir, preloaded):
    shown = preloaded.run(command(name, "--help"), cwd=workdir, timeout=120, stderr_apart=True)
    assert shown.returncode == 0, shown.stderr
    for key, (default, _doc) in field_docs().items():
        assert f"{key} = {default}" in shown.stdout, key
    assert "Adaptive KL" in shown.stdout and "--dry-run" in shown.stdout


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_prints_the_plan_and_launches_nothing(name, workdir, preloaded):
    arguments = command(name, "--dry-run", "--world-size", "4", "actor.tp=2", "rollout.tp=2")
    shown = preloaded.run(arguments, cwd=workdir, timeout=120, stderr_apart=True)
    assert shown.returncode == 0, shown.stderr
    assert f"name: {name}" in shown.stdout  # the resolved config
    assert "# placement: colocate, world size 4" in shown.stdout
    actor = next(line for line in shown.stdout.splitlines() if line.startswith("actor "))
    assert actor.split()[2:8] == ["1", "2", "2", "1", "1", "2"]  # pp dp tp ep cp fsdp
    assert [line.split(":")[0] for line in shown.stdout.splitlines() if line.startswith("rank ")] == [
        f"rank {r}" for r in range(4)
    ]
    assert "from the first generation on (rollout.keep_engine)" in shown.stdout


def test_dry_run_of_a_mixture_of_experts_actor_with_ep_and_cp(workdir, preloaded):
    from spmd_rlhf.tiny.model import make_tiny

    moe = make_tiny(family="qwen3_moe", out_dir=str(workdir / "moe"), hidden_size=32, vocab_size=300)
    arguments = command("grpo", "--dry-run", "--world-size", "4", f"model.path={moe}", "actor.ep=2", "actor.cp=2")
    shown = preloaded.run(arguments, cwd=workdir, timeout=120, stderr_apart=True)
    assert shown.returncode == 0, shown.stderr
    actor = next(line for line in shown.stdout.splitlines() if line.startswith("actor "))
    assert actor.split()[2:7] == ["1", "4", "1", "2", "2"]  # pp dp tp ep cp
    assert len([line for line in shown.stdout.splitlines() if line.startswith("rank ") and "MiB" in line]) == 4


def test_the_dry_run_shows_hsdp_groups_and_the_state_a_replica_holds(workdir, monkeypatch):
    """actor.fsdp_size=2 of dp 4: the fsdp column says 2 where the reference's says 4, and the actor's state per rank
    is twice FSDP's over all four ranks."""
    from spmd_rlhf.config import load_config
    from spmd_rlhf.controller.dry_run import describe

    monkeypatch.chdir(workdir)

    def actor_line(*overrides: str) -> list[str]:
        shown = describe(
            load_config(None, ["algorithm.name=grpo", "critic.enabled=false", "rollout.n=2", *overrides]), 4
        )
        return next(line for line in shown.splitlines() if line.startswith("actor ")).split()

    sharded, hybrid = actor_line(), actor_line("actor.fsdp_size=2")
    assert sharded[2:8] == ["1", "4", "1", "1", "1", "4"] and hybrid[2:8] == ["1", "4", "1", "1", "1", "2"]
    assert float(hybrid[9]) == pytest.approx(2 * float(sharded[9]), rel=0.1)  # MiB per rank, to 0.1


def test_bad_key_is_one_line_and_exit_code_2(workdir):
    shown = run("grpo", "actor.tpp=2", cwd=workdir)
    assert shown.returncode == 2
    assert shown.stderr.strip().splitlines() == ["grpo: actor.tpp: unknown key; did you mean actor.tp?"]


def test_a_recipe_refuses_an_algorithm_it_does_not_run(workdir, preloaded):
    arguments = command("ppo", "algorithm.name=grpo", "critic.enabled=false", "rollout.n=2")
    shown = preloaded.run(arguments, cwd=workdir, timeout=120, stderr_apart=True)
    assert shown.returncode == 2
    assert shown.stderr.strip().splitlines() == [
        "ppo: algorithm.name=grpo: the ppo recipe runs ppo; run the recipe of that algorithm (recipes/<algorithm>.py) "
        "or set algorithm.name to one of these"
    ]
