"""What one RL step runs, declared once: the kinds of role there are, and for each algorithm family the work each
role does in the paper's three stages (generation, preparation, training).

Everything that must know an algorithm's roles derives from these declarations: config validation (which roles a
run enables), the recipes' ``setup`` (which workers to spawn), the device mapper's workload
(``mapping.workload.dataflow``), MFU's pass count (``metrics.step_metrics.step_passes``) and the dry run. A recipe
class carries its family's declaration beside its ``step`` (``PPORecipe.dataflow = PPO``); this module holds no torch
and no recipe, so the config layer can validate a config before any recipe is imported.

A recipe class is an algorithm family: one ``step``, one dataflow. ``algorithm.name`` picks the member of the family
(the GRPO family's advantage estimator: grpo, rloo, reinforce_pp, reinforce_pp_baseline); ``recipes/rloo.py`` is the
GRPO recipe under RLOO's name and config, so it runs ``algorithm.name=rloo`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class RunSettings(Protocol):
    """What the dataflow reads of a config: its sections (a ``RunSettings``; declared here so that the dataflow,
    which the config's checks use, does not import the config back)."""

    algorithm: Any
    rollout: Any
    actor: Any
    reference: Any
    reward: Any
    cost: Any


STAGES = ("generation", "preparation", "training")
"""The paper's three stages of an RLHF step, run one after another; roles in different pools overlap within one."""

PASSES = {"generate": "generation", "greedy": "generation", "forward": "preparation", "train": "training"}
"""A pass -> the stage it runs in: ``generate`` (sample the rollouts), ``greedy`` (ReMax's extra greedy rollout of
one response per prompt), ``forward`` (log-probs, values, scores) or ``train`` (forward + backward + step, per
epoch)."""


@dataclass(frozen=True)
class RoleKind:
    """What a role is, whatever the algorithm."""

    worker: str
    """The worker that runs it: actor, critic, reference, reward (reward and cost models and rules) or rollout
    (generation-only replicas fed the actor's weights, for asynchronous RL)."""
    head: str
    """The model's output: lm (a policy: actor, reference), value (critics) or score (reward and cost models)."""
    trained: bool
    may_be_rule: bool = False
    """``<role>.kind=rule`` (a Python function) or ``remote`` (a service) instead of a model: it runs no model
    pass."""


ROLE_KINDS: dict[str, RoleKind] = {
    "actor": RoleKind("actor", "lm", trained=True),
    "critic": RoleKind("critic", "value", trained=True),
    "reference": RoleKind("reference", "lm", trained=False),
    "reward": RoleKind("reward", "score", trained=False, may_be_rule=True),
    "cost": RoleKind("reward", "score", trained=False, may_be_rule=True),
    "cost_critic": RoleKind("critic", "value", trained=True),
    "rollout": RoleKind("rollout", "lm", trained=False),
}
"""Every role a run may have, in the order roles are listed, built and placed."""

ROLES = tuple(ROLE_KINDS)


@dataclass(frozen=True)
class Condition:
    """A switch of the config that adds work to a step."""

    name: str
    holds: Callable[[RunSettings], bool]
    setting: Callable[[RunSettings], str]
    """The key and value that decide it, as a message names them (``algorithm.kl_penalty=reward``)."""


def reference_is_actor_base(config: RunSettings) -> bool:
    """The actor trains LoRA adapters and no other reference model is named: the reference policy is the actor's
    frozen base with its adapters switched off, so the actor computes the reference log-probs and no reference role
    (no second copy of the model) exists."""
    return config.actor.lora.enabled and config.reference.model_path is None


def _kl_setting(config: RunSettings) -> str:
    setting = f"algorithm.kl_penalty={config.algorithm.kl_penalty}"
    if reference_is_actor_base(config):
        setting += f" with actor.lora.rank={config.actor.lora.rank} (the reference is the actor's base, adapters off)"
    return setting


KL_TO_REFERENCE = Condition(
    "kl_to_reference",
    lambda config: config.algorithm.kl_penalty != "none" and not reference_is_actor_base(config),
    _kl_setting,
)
KL_TO_ACTOR_BASE = Condition(
    "kl_to_actor_base",
    lambda config: config.algorithm.kl_penalty != "none" and reference_is_actor_base(config),
    _kl_setting,
)
RECOMPUTE_LOG_PROBS = Condition(
    "recompute_log_probs",
    lambda config: config.rollout.recompute_log_probs,
    lambda config: f"rollout.recompute_log_probs={str(config.rollout.recompute_log_probs).lower()}",
)


@dataclass(frozen=True)
class Work:
    """One pass of one role in a step, run when ``when`` holds (always when None)."""

    role: str
    kind: str
    """A key of ``PASSES``."""
    when: Condition | None = None

    @property
    def stage(self) -> str:
        return PASSES[self.kind]


def generate(role: str, *, when: Condition | None = None) -> Work:
    return Work(role, "generate", when)


def greedy(role: str, *, when: Condition | None = None) -> Work:
    return Work(role, "greedy", when)


def forward(role: str, *, when: Condition | None = None) -> Work:
    return Work(role, "forward", when)


def train(role: str) -> Work:
    return Work(role, "train")


@dataclass(frozen=True)
class Dataflow:
    """One algorithm family's step: the passes each role runs, in the order the step issues them."""

    family: str
    work: tuple[Work, ...]

    def __post_init__(self) -> None:
        for item in self.work:
            assert item.role in ROLE_KINDS and item.kind in PASSES, item

    def roles(self, conditions: Mapping[str, bool]) -> dict[str, dict[str, tuple[str, ...]]]:
        """Role -> stage -> the passes it runs there, for the roles the step uses when ``conditions`` (condition
        name -> holds) are as given; in ``ROLES`` order. A stage where a role's only passes are switched off stays
        listed with none (the actor's preparation without recomputed log-probs)."""
        result: dict[str, dict[str, tuple[str, ...]]] = {}
        for role in ROLES:
            declared = [item for item in self.work if item.role == role]
            active = [item for item in declared if item.when is None or conditions[item.when.name]]
            if not active:
                continue
            stages = dict.fromkeys(item.stage for item in declared)
            result[role] = {stage: tuple(item.kind for item in active if item.stage == stage) for stage in stages}
        return result

    def roles_of(self, config: RunSettings) -> dict[str, dict[str, tuple[str, ...]]]:
        """``roles`` with the conditions resolved against ``config``."""
        return self.roles(conditions(config))

    def models_of(self, config: RunSettings) -> dict[str, dict[str, tuple[str, ...]]]:
        """``roles_of`` without the roles that are rules or services under ``config`` (``reward.kind=rule``): the
        models."""
        return {role: work for role, work in self.roles_of(config).items() if is_model(role, config)}

    def passes(self, config: RunSettings) -> list[Work]:
        """The step's model passes under ``config``, in the order the step issues them."""
        return [
            item for item in self.work if (item.when is None or item.when.holds(config)) and is_model(item.role, config)
        ]

    def requirement(self, role: str, config: RunSettings) -> tuple[bool, str]:
        """Whether the step under ``config`` calls ``role``, and the setting that decides it, as a config error
        names it: ``every algorithm``, ``algorithm.name=grpo`` or a condition's key (``algorithm.kl_penalty=none``)."""
        declared = [item for item in self.work if item.role == role]
        if any(item.when is None for item in declared):
            everywhere = all(
                any(i.role == role and i.when is None for i in a.dataflow.work) for a in ALGORITHMS.values()
            )
            return True, "every algorithm" if everywhere else f"algorithm.name={config.algorithm.name}"
        if declared:
            condition = next(item.when for item in declared if item.when is not None)
            return any(item.when.holds(config) for item in declared), condition.setting(config)
        return False, f"algorithm.name={config.algorithm.name}"


PIPELINE_SCORERS = ("reward",)
"""With a rollout role, the roles the rollout pipeline itself calls right behind each batch's generation
(``controller.rollout_pipeline``): the only ones that may share its devices without a call of the step waiting behind
the next batch's generation (a role runs its calls in issue order)."""

ROLLOUT_ROLE = Condition(
    "rollout_role",
    lambda config: config.rollout.enabled,
    lambda config: f"rollout.enabled={str(config.rollout.enabled).lower()}",
)
ON_ACTOR = Condition(
    "generate_on_actor",
    lambda config: not config.rollout.enabled,
    lambda config: f"rollout.enabled={str(config.rollout.enabled).lower()}",
)
CONDITIONS = (KL_TO_REFERENCE, KL_TO_ACTOR_BASE, RECOMPUTE_LOG_PROBS, ROLLOUT_ROLE, ON_ACTOR)


def is_model(role: str, config: RunSettings) -> bool:
    """The role runs a model under ``config``: a scoring model or a generative judge (a rule or remote reward or cost
    does not)."""
    return not ROLE_KINDS[role].may_be_rule or getattr(config, role).kind in ("model", "generative")


def conditions(config: RunSettings) -> dict[str, bool]:
    """Every condition's name -> whether it holds under ``config``."""
    return {condition.name: condition.holds(config) for condition in CONDITIONS}


# ---- the declarations ----------------------------------------------------------------------------------------------

GRPO = Dataflow(
    "grpo",
    (
        generate("actor", when=ON_ACTOR),
        generate("rollout", when=ROLLOUT_ROLE),
        forward("reward"),
        forward("actor", when=RECOMPUTE_LOG_PROBS),
        forward("reference", when=KL_TO_REFERENCE),
        forward("actor", when=KL_TO_ACTOR_BASE),
        train("actor"),
    ),
)
"""GRPO and its critic-free family (recipes/grpo.py, rloo.py): sample, score, log-probs, one policy update."""

REMAX = Dataflow(
    "remax",
    (
        generate("actor", when=ON_ACTOR),
        generate("rollout", when=ROLLOUT_ROLE),
        forward("reward"),
        forward("actor", when=RECOMPUTE_LOG_PROBS),
        forward("reference", when=KL_TO_REFERENCE),
        forward("actor", when=KL_TO_ACTOR_BASE),
        greedy("actor", when=ON_ACTOR),
        greedy("rollout", when=ROLLOUT_ROLE),
        train("actor"),
    ),
)
"""ReMax (recipes/remax.py): GRPO's step plus a greedy response per prompt as the baseline, scored by the reward
(with a rollout role, both generations on it, at the same policy version)."""

PPO = Dataflow(
    "ppo",
    (
        generate("actor", when=ON_ACTOR),
        generate("rollout", when=ROLLOUT_ROLE),
        forward("reward"),
        forward("actor", when=RECOMPUTE_LOG_PROBS),
        forward("reference", when=KL_TO_REFERENCE),
        forward("actor", when=KL_TO_ACTOR_BASE),
        forward("critic"),
        train("actor"),
        train("critic"),
    ),
)
"""PPO (recipes/ppo.py): GRPO's step plus a critic's values before the update and its own update beside the actor's."""

SAFE_RLHF = Dataflow(
    "safe_rlhf",
    (
        generate("actor", when=ON_ACTOR),
        generate("rollout", when=ROLLOUT_ROLE),
        forward("reward"),
        forward("actor", when=RECOMPUTE_LOG_PROBS),
        forward("reference", when=KL_TO_REFERENCE),
        forward("actor", when=KL_TO_ACTOR_BASE),
        forward("critic"),
        forward("cost"),
        forward("cost_critic"),
        train("actor"),
        train("critic"),
        train("cost_critic"),
    ),
)
"""Safe-RLHF (recipes/safe_rlhf.py): PPO's step with the cost mirrored: a cost model, a cost critic and its update."""


@dataclass(frozen=True)
class Algorithm:
    """An ``algorithm.name``: the dataflow of its family, and how its advantages use the prompt's samples."""

    dataflow: Dataflow
    group_baseline: bool = False
    """The baseline comes from the other responses to the same prompt: it needs rollout.n >= 2, and dynamic
    sampling (which drops groups without signal) applies."""


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(PPO),
    "grpo": Algorithm(GRPO, group_baseline=True),
    "remax": Algorithm(REMAX),
    "rloo": Algorithm(GRPO, group_baseline=True),
    "reinforce_pp": Algorithm(GRPO),
    "reinforce_pp_baseline": Algorithm(GRPO, group_baseline=True),
    "safe_rlhf": Algorithm(SAFE_RLHF),
}
"""Every ``algorithm.name`` (in the order messages list them) -> its algorithm."""

GROUP_ALGORITHMS = tuple(name for name, algorithm in ALGORITHMS.items() if algorithm.group_baseline)


def dataflow_of(algorithm: str) -> Dataflow:
    """The dataflow of ``algorithm.name``; a ValueError naming the choices for an unknown one."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r}: must be one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[algorithm].dataflow


def algorithms_of(dataflow: Dataflow) -> tuple[str, ...]:
    """The ``algorithm.name`` values whose step is ``dataflow``."""
    return tuple(name for name, algorithm in ALGORITHMS.items() if algorithm.dataflow is dataflow)
