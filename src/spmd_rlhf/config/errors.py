"""``ConfigError`` and the small rules every section's checks are written with, each naming the key, its value
as written in YAML, and what is allowed."""

from __future__ import annotations

import functools


class ConfigError(ValueError):
    """A config that cannot run, as one line: the dotted key, its value and what is allowed.

    A section's own ``__post_init__`` names keys relative to the section (``tp=0: ...``); ``load_config`` adds the
    section's prefix (``actor.tp=0: ...``).
    """


def require(section: object, key: str, ok: bool, rule: str) -> None:
    """Raise ``key=<its value in section>: rule`` unless ``ok``; ``key`` is dotted relative to ``section``."""
    if not ok:
        value = functools.reduce(getattr, key.split("."), section)
        raise ConfigError(f"{key}={format_value(value)}: {rule}")


def at_least(section: object, minimum: int, *names: str) -> None:
    for name in names:
        require(section, name, getattr(section, name) >= minimum, f"must be >= {minimum}")


def one_of(section: object, name: str, choices: tuple[str, ...]) -> None:
    require(section, name, getattr(section, name) in choices, "must be one of " + ", ".join(choices))


def listed(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def format_value(value: object) -> str:
    """A value as it is written in YAML or an override (null, true, [0.9, 0.999]), so messages can be copied back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    if value == "":
        return '""'
    return str(value)
