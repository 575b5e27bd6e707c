"""Algorithm 1: placements are set partitions, allocations split the devices, layouts obey what the framework can
run, d_cost adds and maxes as the paper defines, and the plan is the cheapest of every mapping."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spmd_rlhf.mapping.devices import Cluster, Layout
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES
from spmd_rlhf.mapping.search import Planner, allocations, candidate_layouts, placements, role_stage_seconds
from spmd_rlhf.mapping.workload import NAMED_SHAPES, STAGES, Batch, dataflow

H100 = BUILTIN_PROFILES["h100"]
BATCH = Batch(prompts=512, prompt_length=512, response_length=512, micro_batch_size=8, mini_batch_size=256)


def ppo(actor: str = "7b", critic: str = "7b"):
    return dataflow(
        "ppo",
        actor=NAMED_SHAPES[actor],
        critic=NAMED_SHAPES[critic],
        reference=NAMED_SHAPES[actor],
        reward=NAMED_SHAPES[critic],
    )


@pytest.mark.parametrize(("count", "bell"), [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_placements_are_every_set_partition_once(count, bell):
    names = [f"role{i}" for i in range(count)]
    found = list(placements(names))
    assert len(found) == bell == len({frozenset(map(frozenset, sets)) for sets in found})
    for sets in found:
        assert sorted(name for roles in sets for name in roles) == names


def test_allocations_cover_the_devices_above_each_minimum():
    found = list(allocations(10, [2, 1, 3]))
    assert all(sum(parts) == 10 and parts[0] >= 2 and parts[1] >= 1 and parts[2] >= 3 for parts in found)
    assert len(found) == len(set(found)) == math.comb(10 - 6 + 2, 2)  # 4 spare units over 3 sets
    assert list(allocations(3, [2, 2])) == []


def test_layouts_are_ones_the_framework_runs():
    tied = NAMED_SHAPES["0.5b"]  # tied embeddings, 14 heads, 2 KV heads
    actor = dataflow("grpo", actor=tied)[0]
    cluster = Cluster(16, 8, H100)
    layouts = candidate_layouts(actor, 16, cluster, BATCH)
    assert layouts and all(layout.devices == 16 for layout in layouts)
    assert all(layout.pp == 1 for layout in layouts)  # tied LM head: no pipeline stages
    assert {layout.tp for layout in layouts} <= {1, 2}  # tp divides 14 heads and 2 KV heads, within a node
    assert all(layout.tp % layout.tp_g == 0 for layout in layouts)
    assert all(BATCH.mini_batch_size % (BATCH.micro_batch_size * layout.dp) == 0 for layout in layouts)
    reference = ppo()[2]  # 7b: untied, 32 heads
    assert {layout.dp for layout in candidate_layouts(reference, 6, Cluster(6, 8, H100), BATCH)} == {
        1,
        2,
    }  # 3, 6 ∤ 512 rows
    untied = ppo()[1]  # the 7b critic: 32 heads, pipeline allowed
    pipelined = [layout for layout in candidate_layouts(untied, 64, Cluster(64, 8, H100), BATCH) if layout.pp > 1]
    assert pipelined and all(layout.tp <= 8 for layout in pipelined)
    assert any(layout.cp > 1 for layout in pipelined)  # context parallelism through a pipeline


def test_the_search_offers_ep_for_moe_models_and_cp_for_every_model_and_writes_them_into_the_config():
    moe = dataflow("grpo", actor=NAMED_SHAPES["30b-a3b"])[0]  # 128 experts, 32 heads
    layouts = candidate_layouts(moe, 16, Cluster(16, 8, H100), BATCH)
    assert {layout.ep for layout in layouts} == {1, 2, 4, 8, 16} and {layout.cp for layout in layouts} == {
        1,
        2,
        4,
        8,
        16,
    }
    assert all(layout.dp % layout.ep == 0 and layout.dp % layout.cp == 0 for layout in layouts)
    assert Layout(pp=1, dp=16, tp=1, tp_g=1, ep=4, cp=4) in layouts
    dense = dataflow("grpo", actor=NAMED_SHAPES["0.5b"])[0]  # 14 heads: Ulysses at cp 2, ring beyond
    layouts = candidate_layouts(dense, 16, Cluster(16, 8, H100), BATCH)
    assert {layout.ep for layout in layouts} == {1} and {layout.cp for layout in layouts} == {1, 2, 4, 8, 16}
    assert all(layout.dp % layout.cp == 0 for layout in layouts)
    assert str(Layout(pp=1, dp=4, tp=2, ep=2, cp=2)) == "pp=1 dp=4 tp=2 ep=2 cp=2"

    from spmd_rlhf.config import load_config
    from spmd_rlhf.mapping.placement import mapping_overrides
    from spmd_rlhf.mapping.search import Mapping

    config = load_config(None, [])
    layouts = {"actor": Layout(pp=1, dp=4, tp=1, tp_g=1, ep=1, cp=2), "reference": Layout(pp=1, dp=4, tp=1, ep=2)}
    mapping = Mapping(sets=(("actor", "reference"),), devices=(4,), layouts=layouts, stage_seconds={})
    overrides = mapping_overrides(config, mapping)
    assert {"actor.cp=2", "actor.ep=1", "reference.ep=2", "reference.cp=1"} <= set(overrides)


def test_a_sequence_too_long_for_one_rank_is_split_over_cp_ranks():
    """Rows of 41k tokens: a 0.5B actor's update at cp = 1 needs about 80 GiB per rank on two H100s, at cp = 2 about
    53, so the search takes cp = 2 (and on a batch that fits it keeps cp = 1: the all-to-alls only cost)."""
    roles = dataflow("grpo", actor=NAMED_SHAPES["0.5b"])[:1]
    long_rows = Batch(prompts=2, samples=1, prompt_length=1024, response_length=40 * 1024, micro_batch_size=1)
    best = Planner(roles, Cluster(2, 8, H100), long_rows).plan().best
    assert best.layouts["actor"].cp == 2
    assert Planner(roles, Cluster(2, 8, H100), BATCH).plan().best.layouts["actor"].cp == 1


def test_d_cost_sums_within_a_set_and_takes_the_slowest_set():
    planner = Planner(ppo(), Cluster(32, 8, H100), BATCH)
    sets, devices = (("actor", "reference"), ("critic", "reward")), (16, 16)
    mapping = planner.evaluate(sets, devices)
    for stage in STAGES:
        per_set = [
            sum(planner.auto_parallel(name, count, roles)[1].get(stage, 0.0) for name in roles)
            for roles, count in zip(sets, devices)
        ]
        assert mapping.stage_seconds[stage] == pytest.approx(max(per_set))
    assert mapping.seconds == pytest.approx(sum(mapping.stage_seconds.values()))
    assert mapping.layouts["actor"].tp_g >= 1 and mapping.layouts["critic"].tp_g == 0


def test_plan_is_the_cheapest_mapping():
    planner = Planner(ppo(), Cluster(32, 8, H100), BATCH)
    every = list(planner.mappings())
    result = planner.plan(runners_up=3)
    assert result.mappings_evaluated == len(every) > 10
    assert result.best.seconds == pytest.approx(min(mapping.seconds for mapping in every))
    ranked = [result.best, *result.runners_up]
    assert [mapping.seconds for mapping in ranked] == sorted(mapping.seconds for mapping in ranked)
    assert len(result.runners_up) == 3


def test_colocating_everything_wins_on_a_small_cluster():
    # The paper's small-cluster result: sharing 8 GPUs beats splitting them when every model needs most of them.
    result = Planner(ppo(), Cluster(8, 8, H100), BATCH).plan()
    assert result.best.sets == (("actor", "critic", "reference", "reward"),)


def test_roles_that_cannot_fit_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="no mapping fits.*use more devices"):
        Planner(ppo("70b", "70b"), Cluster(8, 8, H100), BATCH).plan()


def test_partial_nodes_are_refused():
    with pytest.raises(ValueError, match="not whole nodes of 8"):
        Planner(ppo(), Cluster(12, 8, H100), BATCH)


def test_cpu_ranks_sharing_cores_slow_each_other_down():
    import dataclasses

    shared = dataclasses.replace(H100, shared_cores=8)
    alone, crowded = Planner(ppo(), Cluster(16, 16, H100), BATCH), Planner(ppo(), Cluster(16, 16, shared), BATCH)
    everything = (("actor", "critic", "reference", "reward"),)
    assert crowded.evaluate(everything, (16,)).seconds == pytest.approx(2 * alone.evaluate(everything, (16,)).seconds)
    split = (("actor", "reference"), ("critic", "reward"))
    free, busy = alone.evaluate(split, (8, 8)), crowded.evaluate(split, (8, 8))
    assert busy.stage_seconds["generation"] == pytest.approx(
        free.stage_seconds["generation"]
    )  # only the actor's 8 ranks
    assert busy.stage_seconds["training"] == pytest.approx(2 * free.stage_seconds["training"])  # all 16 ranks


def test_a_generative_judge_is_costed_as_generation_on_replicas_of_one_stage():
    cluster = Cluster(8, 8, H100)
    batch = Batch(prompts=64, samples=4, prompt_length=512, response_length=512, micro_batch_size=8)
    scorer = next(
        role for role in dataflow("grpo", actor=NAMED_SHAPES["7b"], reward=NAMED_SHAPES["7b"]) if role.name == "reward"
    )
    judge = dataclasses.replace(scorer, head="lm", judge_tokens=256)
    layout = Layout(pp=1, dp=8, tp=1)

    def preparation(role) -> float:
        return role_stage_seconds(role, layout, cluster, batch, free_bytes=H100.device_memory)["preparation"]

    # Writing verdicts costs more than one forward pass over the same rows, and more the longer they may be.
    assert preparation(scorer) < preparation(judge) < preparation(dataclasses.replace(judge, judge_tokens=512))
    assert {candidate.pp for candidate in candidate_layouts(scorer, 8, cluster, batch)} != {1}
    assert {candidate.pp for candidate in candidate_layouts(judge, 8, cluster, batch)} == {1}


def test_a_kept_engine_takes_memory_through_training():
    # rollout.keep_engine holds the 7B actor's generation shard and KV cache beside every other pass: on 8 H100s
    # nothing then fits, on 16 the roles split; released after each generation, colocating them all still wins.
    import dataclasses

    kept = dataclasses.replace(BATCH, keep_engine=True)
    with pytest.raises(ValueError, match="no mapping fits.*rollout.keep_engine=false"):
        Planner(ppo(), Cluster(8, 8, H100), kept).plan()
    released = Planner(ppo(), Cluster(16, 8, H100), BATCH).plan().best
    holding = Planner(ppo(), Cluster(16, 8, H100), kept).plan().best
    assert released.sets == (("actor", "critic", "reference", "reward"),) and not released.keep_engine
    assert len(holding.sets) == 2 and holding.keep_engine


def test_mixture_of_experts_roles_split_over_tp_where_it_divides_the_expert_width():
    import dataclasses

    from spmd_rlhf.mapping.workload import NAMED_SHAPES, RoleSpec

    moe = NAMED_SHAPES["30b-a3b"]  # 4 KV heads; experts 768 wide
    actor = RoleSpec("actor", moe, "lm", trained=True, work={"generation": ("generate",), "training": ("train",)})
    assert {layout.tp for layout in candidate_layouts(actor, 16, Cluster(16, 8, H100), BATCH)} == {1, 2, 4}
    narrow = dataclasses.replace(actor, shape=dataclasses.replace(moe, expert_intermediate=770))  # 2 divides, 4 not
    assert {layout.tp for layout in candidate_layouts(narrow, 16, Cluster(16, 8, H100), BATCH)} == {1, 2}
    assert Planner([actor], Cluster(16, 8, H100), BATCH).plan().best.layouts["actor"].tp > 1


def test_a_generative_judge_holds_a_whole_replica_per_dp_rank():
    """A judge keeps a TP-sharded replica on every DP rank (P b / tp), not an FSDP shard over all its devices: a 7B
    judge on 8 devices holds 14 GB per device at tp = 1, 1.7 GB at tp = 8, and its layouts and feasibility follow."""
    from spmd_rlhf.mapping.cost import held_bytes, resident_bytes

    batch = Batch(prompts=64, samples=4, prompt_length=512, response_length=512, micro_batch_size=8)
    scorer = next(
        role for role in dataflow("grpo", actor=NAMED_SHAPES["7b"], reward=NAMED_SHAPES["7b"]) if role.name == "reward"
    )
    judge = dataclasses.replace(scorer, head="lm", judge_tokens=256)
    whole = judge.shape.parameters("lm") * batch.dtype_bytes
    for tp in (1, 8):
        layout = Layout(pp=1, dp=8 // tp, tp=tp)
        replica = resident_bytes(judge, 8, batch) + held_bytes(judge, layout, batch, free_bytes=0.0)
        assert replica == pytest.approx(whole / tp)
        assert held_bytes(scorer, layout, batch, free_bytes=0.0) == 0  # an FSDP-sharded scorer holds its shard only
    # On 16 GB devices the replica fits only split over enough TP ranks.
    small = dataclasses.replace(H100, device_memory=16 * 2**30)
    chosen = Planner([judge], Cluster(8, 8, small), batch).auto_parallel("reward", 8, ("reward",))
    assert chosen is not None and chosen[0].tp >= 2


def test_hybrid_sharding_is_offered_where_fsdp_would_cross_nodes_and_chosen_for_7b_on_64_devices():
    """HSDP (``<role>.fsdp_size``) is a candidate where FSDP over all of dp would cross nodes, its group the most DP
    ranks whose TP ranks fit a node (and for a frozen role, replication: fsdp_size 1); it keeps FSDP's gathers on the
    node's links (faster passes) at the cost of a replica's whole state per group (held bytes), and on 8 nodes the 7B
    plan takes it and writes it."""
    from spmd_rlhf.config import load_config
    from spmd_rlhf.mapping.cost import held_bytes, pass_seconds, resident_bytes
    from spmd_rlhf.mapping.placement import mapping_overrides

    actor = dataflow("grpo", actor=NAMED_SHAPES["7b"])[0]
    cluster = Cluster(64, 8, H100)
    hybrid = [layout for layout in candidate_layouts(actor, 64, cluster, BATCH) if layout.fsdp]
    assert hybrid and all(layout.dp * layout.tp > 8 for layout in hybrid)
    assert all(layout.fsdp * layout.tp == 8 and layout.dp % layout.fsdp == 0 for layout in hybrid)
    assert not any(layout.fsdp for layout in candidate_layouts(actor, 8, Cluster(8, 8, H100), BATCH))
    # A frozen role may also replicate its weights (fsdp_size 1) wherever dp > 1, within a node too.
    reference = ppo()[2]
    replicated = {layout.fsdp for layout in candidate_layouts(reference, 8, Cluster(8, 8, H100), BATCH)}
    assert replicated == {0, 1}
    sharded, replicated = Layout(pp=1, dp=64, tp=1, tp_g=1), Layout(pp=1, dp=64, tp=1, tp_g=1, fsdp=8)
    assert str(replicated) == "pp=1 dp=64 tp=1 fsdp_size=8 tp_g=1"
    for train in (True, False):
        faster = pass_seconds(actor, replicated, cluster, BATCH, train=train)
        assert faster < 0.8 * pass_seconds(actor, sharded, cluster, BATCH, train=train)
    extra = resident_bytes(actor, 8, BATCH) - resident_bytes(actor, 64, BATCH)
    assert held_bytes(actor, replicated, BATCH, free_bytes=0) == pytest.approx(extra)
    assert held_bytes(actor, sharded, BATCH, free_bytes=0) == 0
    # An MoE model's expert-parallel experts stay sharded over efsdp, across the replicas: only the rest replicates.
    from spmd_rlhf.mapping.cost import replicated_bytes

    moe = dataflow("grpo", actor=NAMED_SHAPES["30b-a3b"])[0]
    dense_part = 1 - moe.shape.routed_expert_parameters / moe.shape.parameters(moe.head)
    whole = replicated_bytes(moe, Layout(pp=1, dp=64, tp=1, fsdp=8), BATCH)
    assert replicated_bytes(moe, Layout(pp=1, dp=64, tp=1, ep=8, fsdp=8), BATCH) == pytest.approx(whole * dense_part)
    assert 0 < dense_part < 0.1
    best = Planner(dataflow("grpo", actor=NAMED_SHAPES["7b"]), cluster, BATCH).plan().best
    chosen = best.layouts["actor"]
    assert chosen.fsdp_replicas > 1
    overrides = mapping_overrides(load_config(None, []), best)
    assert f"actor.fsdp_size={chosen.fsdp}" in overrides


def test_roles_whose_hsdp_layouts_do_not_fit_together_fall_back_to_fsdp_over_all_of_dp():
    """Each role picks its fastest layout alone, HSDP's included, which holds a replica's state; on 32 H100s the four
    7B roles of PPO colocated do not fit together that way, so the set takes the layouts without HSDP (before the
    fallback colocating everything was refused there as not fitting)."""
    cluster = Cluster(32, 8, H100)
    planner = Planner(ppo(), cluster, BATCH)
    everything = ("actor", "critic", "reference", "reward")
    assert planner._set_layouts(everything, 32, hybrid=True) is None
    assert any(planner.auto_parallel(name, 32, everything)[0].fsdp_replicas > 1 for name in everything)
    mapping = planner.evaluate((everything,), (32,))
    assert mapping is not None and all(layout.fsdp_replicas == 1 for layout in mapping.layouts.values())


def test_a_lora_actor_is_planned_with_a_frozen_base_and_trained_adapters():
    """A 70B GRPO actor does not fit 8 H100s training every weight (16 bytes each); with rank-16 LoRA on every linear
    layer it keeps its base in bf16 and trains 207 M adapter parameters, and the plan fits (with activation
    checkpointing: without sequence parallelism every TP rank keeps the residual stream's activations whole)."""
    from spmd_rlhf.config.choices import LORA_TARGETS
    from spmd_rlhf.mapping.cost import resident_bytes
    from spmd_rlhf.mapping.workload import lora_parameters

    actor = dataflow("grpo", actor=NAMED_SHAPES["70b"])[0]
    adapters = lora_parameters(actor.shape, "lm", LORA_TARGETS, lambda layer: 16)
    lora = dataclasses.replace(actor, lora_parameters=adapters)
    assert 200e6 < adapters < 210e6
    parameters = actor.shape.parameters("lm")
    assert resident_bytes(lora, 8, BATCH) == (parameters * 2 + adapters * 16) / 8
    cluster = Cluster(8, 8, H100)
    with pytest.raises(ValueError, match="no mapping fits"):
        Planner([actor], cluster, BATCH).plan()
    checkpointed = dataclasses.replace(BATCH, activation_checkpointing=True)
    assert Planner([lora], cluster, checkpointed).plan().best.layouts["actor"].devices == 8
