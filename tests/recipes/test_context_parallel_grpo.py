"""GRPO with context parallelism: the recipe on 2 CPU ranks with the actor at cp = 2 by ring attention and the
reference at cp = 2 by Ulysses (the tiny model's 4 heads) takes the same steps as at cp = 1: the same rewards, and
losses, gradient norms, KL and entropy equal to float32 rounding. Each rank then runs a chunk of every packed row of
its cp group, its own rows' results gathered back to it."""

from __future__ import annotations

import pytest
from torchrun_helpers import run_recipe

STEPS = 4
SHORT = (f"trainer.total_steps={STEPS}", "trainer.val_every=0", "trainer.save_every=0")
COMPARED = ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("cp_grpo")
    split = ("actor.cp=2", "actor.cp_attention=ring", "reference.cp=2", "reference.cp_attention=ulysses")
    return {"cp1": run_recipe("grpo", root / "cp1", *SHORT), "cp2": run_recipe("grpo", root / "cp2", *SHORT, *split)}


def test_grpo_at_cp_2_takes_the_steps_of_cp_1(runs):
    one, two = runs["cp1"], runs["cp2"]
    assert [record["step"] for record in one] == [record["step"] for record in two] == list(range(STEPS))
    for step, (expected, measured) in enumerate(zip(one, two)):
        assert measured["reward/mean"] == expected["reward/mean"], step  # the same responses were sampled
        for key in COMPARED:
            assert measured[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (step, key)
    assert all(record["actor/cp_padding_tokens"] >= 0 for record in two)
    assert "actor/cp_padding_tokens" not in one[0]
