"""Keys whose value follows from the others: left null, they take that value; set, they must agree with it (the
checks say so, naming both keys). A user turns a feature on with one key, not three.

- ``rollout.enabled``: true exactly when ``algorithm.max_staleness >= 1``; ``rollout.recompute_log_probs`` then too, or
  with a rollout-correction preset other than ``disabled`` (the correction compares recomputed and engine log-probs).
- ``placement``: ``split`` with a rollout role (it generates on ranks of its own), else ``colocate``.
- ``<role>.enabled``: whether the algorithm's step calls the role under this config (its dataflow), so GRPO has no
  critic and LoRA without a reference ``model_path`` has no reference role (the actor's base is the reference).

The derived keys and the reason for each are kept on the config (``config.derived``); the run prints them once and
``spmd-rlhf config --show`` lists them.
"""

from __future__ import annotations

from typing import Any

from spmd_rlhf.config.dataflow import ROLES, RunSettings, dataflow_of
from spmd_rlhf.config.errors import format_value


def derive(config: RunSettings) -> dict[str, tuple[Any, str]]:
    """Fill every derivable key of ``config`` left null, in place; returns key -> (value, the setting it follows)."""
    derived: dict[str, tuple[Any, str]] = {}

    def fill(section: Any, key: str, value: Any, because: str) -> None:
        name = key.rsplit(".", 1)[-1]
        if getattr(section, name) is None:
            setattr(section, name, value)
            derived[key] = (value, because)

    staleness = config.algorithm.max_staleness
    because = f"algorithm.max_staleness={staleness}"
    fill(config.rollout, "rollout.enabled", staleness >= 1, because)
    preset = config.algorithm.correction.preset
    corrects = preset not in (None, "disabled")
    reason = because if staleness >= 1 or not corrects else f"algorithm.correction.preset={preset}"
    fill(config.rollout, "rollout.recompute_log_probs", staleness >= 1 or corrects, reason)
    fill(
        config,
        "placement",
        "split" if config.rollout.enabled else "colocate",
        "rollout.enabled=" + format_value(config.rollout.enabled),
    )
    flow = dataflow_of(config.algorithm.name)
    for role in ROLES:
        if role != "rollout":
            used, by = flow.requirement(role, config)
            fill(getattr(config, role), f"{role}.enabled", used, by)
    return derived


def describe_derived(derived: dict[str, tuple[Any, str]]) -> str:
    """``derived: rollout.enabled=true (algorithm.max_staleness=1), ...``; empty when nothing was derived."""
    if not derived:
        return ""
    return "derived: " + ", ".join(f"{key}={format_value(value)} ({why})" for key, (value, why) in derived.items())
