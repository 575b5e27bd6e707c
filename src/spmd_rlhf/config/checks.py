"""The checks across config sections: roles against the algorithm's dataflow, layouts against pool sizes, batch
sizes against DP sizes, token budgets, the KV cache, and the switches of asynchronous RL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from spmd_rlhf.config import dataflow
from spmd_rlhf.config.choices import DEFAULT_KV_BLOCK_SIZE, PLACEMENTS
from spmd_rlhf.config.dataflow import GROUP_ALGORITHMS, ROLES, RunSettings
from spmd_rlhf.config.errors import ConfigError, format_value, one_of, require
from spmd_rlhf.config.roles import RoleConfig


class CheckedConfig(RunSettings, Protocol):
    """What the checks read of a ``FrameworkConfig`` (declared here: the config calls the checks, not the reverse)."""

    placement: str
    data: Any
    trainer: Any
    critic: Any
    cost_critic: Any

    def enabled_roles(self) -> dict[str, RoleConfig]: ...

    def resource_pools(self) -> dict[str, list[str]]: ...


def check_framework(config: CheckedConfig) -> None:
    """The checks across sections, with full dotted keys (``actor.tp=3: must divide actor.n_ranks=8``). Every check
    runs, so one ``ConfigError`` line names every problem at once (``a=..: ...; also b=..: ...``); the layout checks
    run only once the roles and the placement are right, and the rest once the layouts are, since they read them."""
    problems: list[str] = []

    def check(function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except ConfigError as error:
            problems.append(str(error))
        except Exception:
            if not problems:
                raise
            # A check that assumed an earlier one passed; the earlier problems are the ones to report.

    check(one_of, config, "placement", PLACEMENTS)
    for role in ROLES:
        check(_check_role_matches_algorithm, config, role)
    if not problems:
        for name, role in config.enabled_roles().items():
            check(_check_layout, config, name, role)
            check(_check_sequence_parallel, config, name, role)
        check(_check_pools, config)
    if problems:
        _raise(problems)  # what follows reads the roles and their layouts
    tp_rule = f"must divide actor.tp={config.actor.tp}"
    check(require, config, "rollout.tp", config.actor.tp % config.rollout.tp == 0, tp_rule)
    for function in (
        _check_kv_cache,
        _check_group_baseline,
        _check_training_batches,
        _check_token_budgets,
        _check_asynchronous,
        _check_scoring_models,
    ):
        check(function, config)
    rule = "needs data.val_files; list validation files or set trainer.val_every=0"
    check(require, config, "trainer.val_every", config.trainer.val_every == 0 or bool(config.data.val_files), rule)
    if problems:
        _raise(problems)


def _raise(problems: list[str]) -> None:
    raise ConfigError("; also ".join(problems))


def _check_group_baseline(config: CheckedConfig) -> None:
    if config.algorithm.name in GROUP_ALGORITHMS:
        rule = f"algorithm.name={config.algorithm.name} needs >= 2 responses per prompt for its group baseline"
        require(config, "rollout.n", config.rollout.n >= 2, rule)
        rule = (
            f"algorithm.name={config.algorithm.name} compares a prompt's responses with each other, and greedy "
            f"decoding makes them all the same (every advantage 0); set a sampling temperature > 0, e.g. 1.0"
        )
        require(config, "rollout.temperature", config.rollout.temperature > 0, rule)


def _check_scoring_models(config: CheckedConfig) -> None:
    for name in ("reward", "cost"):
        role = getattr(config, name)
        if role.enabled and role.kind in ("model", "generative"):
            what = "a causal LM to judge with" if role.kind == "generative" else f"a trained {name} model"
            rule = f"{name}.kind={role.kind} needs the directory of {what}"
            require(config, f"{name}.model_path", role.model_path is not None, rule)


def _check_role_matches_algorithm(config: CheckedConfig, role: str) -> None:
    # An enabled role the algorithm never calls would hold devices for nothing; say so rather than idle.
    used, by = dataflow.dataflow_of(config.algorithm.name).requirement(role, config)
    verb = "needs" if used else "never calls"
    rule = f"{by} {verb} the {role}; set {role}.enabled={format_value(used)} or leave it out (null derives it)"
    require(config, f"{role}.enabled", getattr(config, role).enabled == used, rule)


def _check_pools(config: CheckedConfig) -> None:
    for name, role in config.enabled_roles().items():
        if config.placement == "manual":
            require(config, f"{name}.pool", role.pool is not None, "placement=manual needs a pool for every role")
        else:
            rule = f"only used with placement=manual (placement={config.placement}); set {name}.pool=null"
            require(config, f"{name}.pool", role.pool is None, rule)
    for pool, members in config.resource_pools().items():
        sized = [name for name in members if getattr(config, name).n_ranks]
        for name in sized[1:]:
            first_n_ranks = getattr(config, sized[0]).n_ranks
            rule = (
                f"must equal {sized[0]}.n_ranks={first_n_ranks}; "
                f"roles sharing a pool (here {pool}, placement={config.placement}) span all of its ranks"
            )
            require(config, f"{name}.n_ranks", getattr(config, name).n_ranks == first_n_ranks, rule)


def _check_asynchronous(config: CheckedConfig) -> None:
    rollout, staleness = config.rollout, config.algorithm.max_staleness
    rule = "needs rollout.enabled=true (it sends the actor's weights to a rollout role)"
    require(config, "rollout.background_sync", rollout.enabled or not rollout.background_sync, rule)
    if rollout.enabled:
        rule = (
            f"the rollout role generates on ranks of its own; use placement=split (actor and reference | "
            f"rollout and scorers), auto, standalone or manual, or set rollout.enabled=false "
            f"(placement={config.placement})"
        )
        require(config, "placement", config.placement in ("split", "auto", "standalone", "manual"), rule)
        rule = "the rollout receives the actor's weights from one pipeline; set actor.pp=1 with rollout.enabled"
        require(config, "actor.pp", config.actor.pp == 1, rule)
        rule = (
            "a multi-turn trajectory is generated in one piece (its turns wait on the environment between them); "
            "set rollout.partial_rollouts=off with rollout.environment"
        )
        require(
            config, "rollout.partial_rollouts", rollout.environment is None or rollout.partial_rollouts == "off", rule
        )
        rule = "draws extra batches on the actor's devices, synchronously; set it false with rollout.enabled=true"
        require(config, "algorithm.dynamic_sampling", not config.algorithm.dynamic_sampling, rule)
    if staleness:
        rule = f"algorithm.max_staleness={staleness} generates on a rollout role of its own; set rollout.enabled=true"
        require(config, "rollout.enabled", rollout.enabled, rule)
        rule = (
            f"algorithm.max_staleness={staleness} corrects stale samples with pi_old / pi_behaviour, which "
            f"needs the log-probs recomputed under the current policy; set rollout.recompute_log_probs=true"
        )
        require(config, "rollout.recompute_log_probs", rollout.recompute_log_probs, rule)
    rule = (
        "a response can only span a weight update when batches are generated ahead; set "
        "algorithm.max_staleness >= 1 (and rollout.enabled=true), or rollout.partial_rollouts=off"
    )
    require(config, "rollout.partial_rollouts", rollout.partial_rollouts == "off" or staleness >= 1, rule)
    replay = config.algorithm.router_replay
    rule = "records the experts in the old-policy log-prob recompute; set rollout.recompute_log_probs=true"
    require(config, "algorithm.router_replay", replay != "recompute" or rollout.recompute_log_probs, rule)
    rule = (
        "records the experts of single-turn generation in one segment only (no rollout.environment, "
        "rollout.partial_rollouts=off); set algorithm.router_replay=recompute"
    )
    one_piece = rollout.environment is None and rollout.partial_rollouts == "off"
    require(config, "algorithm.router_replay", replay != "rollout" or one_piece, rule)


def _check_kv_cache(config: CheckedConfig) -> None:
    rollout = config.rollout
    if not rollout.kv_cache_blocks:
        return
    longest = config.data.max_prompt_length + rollout.response_length
    block_size = rollout.kv_block_size or DEFAULT_KV_BLOCK_SIZE
    needed = -(-longest // block_size)
    rule = (
        f"holds {rollout.kv_cache_blocks * block_size} tokens, fewer than one sequence of "
        f"data.max_prompt_length + {rollout.response_length_keys} = {longest}; set it to at least {needed} "
        f"(blocks of {block_size} tokens: rollout.kv_block_size={format_value(rollout.kv_block_size)}) or 0 to "
        f"size the cache for every request"
    )
    require(config, "rollout.kv_cache_blocks", rollout.kv_cache_blocks >= needed, rule)


def _check_token_budgets(config: CheckedConfig) -> None:
    longest = config.data.max_prompt_length + config.rollout.response_length
    for name, role in config.enabled_roles().items():
        budget, cp = role.max_tokens_per_micro_batch, getattr(role, "cp", 1)
        needed = -(-longest // cp)  # with context parallelism the budget bounds each rank's chunk of a row
        row = f"data.max_prompt_length + {config.rollout.response_length_keys} = {longest}"
        what = f"the longest row, {row}" if cp == 1 else f"its {name}.cp={cp} chunk of the longest row, {row}"
        rule = f"must hold {what}; set it to at least {needed}, 0 (derived on GPU) or null"
        require(config, f"{name}.max_tokens_per_micro_batch", budget in (None, 0) or budget >= needed, rule)


def _check_training_batches(config: CheckedConfig) -> None:
    rows = config.data.batch_size * config.rollout.n
    for name in ("actor", "critic"):
        role = getattr(config, name)
        if not role.enabled:
            continue
        key = f"{name}.mini_batch_size"
        require(config, key, rows % role.mini_batch_size == 0, f"must divide data.batch_size*rollout.n={rows}")
        # Every data-parallel rank runs whole micro-batches of each mini-batch.
        dp = role.dp_size()
        per_pass = role.micro_batch_size * (dp or 1)
        unit = f"{name}.micro_batch_size*dp={per_pass}" if dp else f"{name}.micro_batch_size={per_pass}"
        require(config, key, role.mini_batch_size % per_pass == 0, f"must be a multiple of {unit}")
        rule = f"must be <= trainer.total_steps={config.trainer.total_steps}"
        require(config, f"{name}.warmup_steps", role.warmup_steps <= config.trainer.total_steps, rule)


def _check_sequence_parallel(config: CheckedConfig, name: str, role: RoleConfig) -> None:
    if not getattr(role, "sequence_parallel", False):
        return
    generates = name == "rollout" or getattr(role, "kind", "model") == "generative"
    require(config, f"{name}.sequence_parallel", not generates, "splits training and scoring passes, not generation")


def _check_layout(config: CheckedConfig, name: str, role: RoleConfig) -> None:
    n_ranks = role.n_ranks
    if not n_ranks:
        return  # the pool's size is only known at start
    require(config, f"{name}.tp", n_ranks % role.tp == 0, f"must divide {name}.n_ranks={n_ranks}")
    model_parallel = role.pp * role.tp
    rule = f"{name}.pp*{name}.tp={model_parallel} must divide {name}.n_ranks={n_ranks}"
    require(config, f"{name}.pp", n_ranks % model_parallel == 0, rule)
    rule = (
        f"{name}.pp*{name}.dp*{name}.tp must equal {name}.n_ranks={n_ranks}; "
        f"set {name}.dp={n_ranks // model_parallel} or 0 to derive it"
    )
    require(config, f"{name}.dp", role.dp in (0, n_ranks // model_parallel), rule)
    dp = n_ranks // model_parallel
    for key in ("ep", "cp"):  # a rollout role has neither: it generates, with every expert
        size = getattr(role, key, 1)
        require(config, f"{name}.{key}", dp % size == 0, f"must divide {name}.dp={dp} (it splits the DP ranks)")
