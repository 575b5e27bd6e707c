"""Load the typed configuration from a YAML file and ``key=value`` overrides; print it; document its keys.

    spmd-rlhf config --show recipes/configs/ppo.yaml actor.lr=1e-6

YAML and overrides are only inputs. OmegaConf merges them onto the dataclass schema of ``spmd_rlhf.config``
(wrong types fail there), then the dataclasses are built bottom-up and validate themselves in ``__post_init__``.
Every failure is one ``ConfigError`` line naming the full dotted key and what is allowed.
"""

import ast
import functools
import inspect
import os
import textwrap
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from difflib import get_close_matches
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from spmd_rlhf.config.errors import ConfigError, format_value
from spmd_rlhf.config.framework import FrameworkConfig

ConfigT = TypeVar("ConfigT")


def load_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | None = None, schema: type[ConfigT] = FrameworkConfig
) -> ConfigT:
    """Build ``schema`` from the YAML file at ``path`` (None: defaults only), then ``key=value`` overrides in order.

    Raises ConfigError, one line naming the dotted key, for a missing or malformed file, a malformed override, an
    unknown key, a value of the wrong type and a value or combination that fails validation.
    """
    sources = [] if path is None else [_load_yaml(path)]
    return _merge(schema, sources + [_parse_override(item) for item in overrides or []])


def with_overrides(config: ConfigT, overrides: list[str]) -> ConfigT:
    """``config`` with ``key=value`` overrides applied, validated as ``load_config`` validates a file; the keys
    ``config`` derived are derived again."""
    base = OmegaConf.structured(config)
    for key in getattr(config, "derived", {}):
        OmegaConf.update(base, key, None)  # derived again from the overridden values
    return _merge(type(config), [base] + [_parse_override(item) for item in overrides])


def _merge(schema: type[ConfigT], sources: list[DictConfig]) -> ConfigT:
    try:
        user = OmegaConf.merge(OmegaConf.create(), *sources)
        # Checked before the typed merge: OmegaConf's message for a scalar given for a section has no key.
        values = OmegaConf.to_container(user)
        _check_keys(schema, values, "")
        user = OmegaConf.create(_switch_words(schema, values))
        merged = OmegaConf.merge(OmegaConf.structured(schema), user)
        values = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        raise _translate(schema, error) from None
    return _build(schema, values, "")


def to_yaml(config: object) -> str:
    """The resolved config as YAML; ``load_config`` reads it back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def field_docs(schema: type = FrameworkConfig) -> dict[str, tuple[str, str]]:
    """Every leaf key of ``schema``, dotted, -> (its default as written in YAML, its docstring), in schema order; a
    derived key's default is null (what a config leaves it), not the value the defaults derive."""
    defaults = schema()
    for key in getattr(defaults, "derived", {}):
        *sections, name = key.split(".")
        setattr(functools.reduce(getattr, sections, defaults), name, None)
    return dict(_leaf_docs(defaults, ""))


def config_reference(*, markdown: bool = False) -> str:
    """Every key with its default and docstring, from the dataclasses themselves: plain text (a recipe's ``--help``,
    ``spmd-rlhf config --keys``) or Markdown, one table per section (docs/config.md's reference; a test keeps
    that copy equal to this)."""
    docs = field_docs()
    if not markdown:
        return "\n".join(f"{key} = {default}\n    {doc}" for key, (default, doc) in docs.items()) + "\n"
    lines: list[str] = []
    section = None
    for key, (default, doc) in docs.items():
        head = key.split(".")[0] if "." in key else "(top level)"
        if head != section:
            section = head
            lines += ["", f"**{section}**", "", "| key | default | meaning |", "| --- | --- | --- |"]
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(lines[1:]) + "\n"


def _leaf_docs(config: Any, prefix: str) -> Iterator[tuple[str, tuple[str, str]]]:
    docs = _attribute_docs(type(config))
    for item in fields(config):
        value = getattr(config, item.name)
        if is_dataclass(value):
            yield from _leaf_docs(value, f"{prefix}{item.name}.")
        else:
            yield prefix + item.name, (format_value(value), docs.get(item.name, ""))


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its declaration, for ``cls`` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # subclasses last, so their docstrings win
        if not is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, following in zip(body, body[1:], strict=False):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


@functools.cache
def _field_types(schema: type) -> dict[str, Any]:
    hints = get_type_hints(schema)
    return {item.name: hints[item.name] for item in fields(schema)}


def _load_yaml(path: str | os.PathLike[str]) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(error)}") from None
    except (OSError, UnicodeDecodeError, OmegaConfBaseException) as error:
        raise ConfigError(f"{path}: cannot load: {str(error).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
    return loaded


def _parse_override(item: str) -> DictConfig:
    key, equals, _ = item.partition("=")
    if not equals or not all(key.split(".")):
        raise ConfigError(f"override {item!r}: expected key=value, e.g. actor.lr=1e-6")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as error:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {_yaml_problem(error)}") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"override {item!r}: {str(error).splitlines()[0]}") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def _check_keys(schema: type, values: dict[Any, Any], prefix: str) -> None:
    """Raise for the first key of ``values`` that ``schema`` lacks, or a non-mapping given for a section."""
    types = _field_types(schema)
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in types:
            close = get_close_matches(str(key), list(types), n=1)
            where = prefix.rstrip(".") or "the top level"
            hint = f"did you mean {prefix}{close[0]}?" if close else f"{where} allows: " + ", ".join(types)
            raise ConfigError(f"{dotted}: unknown key; {hint}")
        if is_dataclass(types[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}={format_value(value)}: expected {_describe(types[key])}")
            _check_keys(types[key], value, dotted + ".")


def _switch_words(schema: type, values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` with a boolean given for a string key read back as the word it was: YAML 1.1 reads ``off`` and
    ``on`` (also ``no`` / ``yes``) as booleans, so ``algorithm.router_replay=off`` or ``partial_rollouts: off``
    would otherwise arrive as false."""
    types = _field_types(schema)
    result = {}
    for key, value in values.items():
        declared = types[key]
        if is_dataclass(declared) and isinstance(value, dict):
            value = _switch_words(declared, value)
        elif isinstance(value, bool) and str in (declared, *get_args(declared)):
            value = "on" if value else "off"
        result[key] = value
    return result


def _translate(schema: type, error: OmegaConfBaseException) -> ConfigError:
    """One line naming the key, for an error OmegaConf raised while type-checking or resolving interpolations."""
    key = error.full_key
    declared = _declared_type(schema, key) if key else None
    if isinstance(error, ValidationError) and declared is not None:
        return ConfigError(f"{key}={format_value(error.value)}: expected {_describe(declared)}")
    problem = str(error).splitlines()[0]
    return ConfigError(f"{key}: {problem}" if key else problem)


def _declared_type(schema: type, key: str) -> Any:
    """The type declared at dotted ``key`` (list items written ``name[i]``), or None if ``schema`` has no such key."""
    declared: Any = schema
    for part in key.replace("[", ".[").split("."):
        if part.startswith("["):
            declared = get_args(declared)[0] if get_origin(declared) is list else None
        elif is_dataclass(declared):
            declared = _field_types(declared).get(part)
        else:
            return None
    return declared


_TYPE_WORDS = {
    bool: ("true or false", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(declared: Any) -> str:
    args = get_args(declared)
    if type(None) in args:
        return _describe(next(arg for arg in args if arg is not type(None))) + " or null"
    if get_origin(declared) is list:
        return f"a list of {_TYPE_WORDS.get(args[0], ('', 'items'))[1]} in brackets, e.g. [a, b]"
    if is_dataclass(declared):
        return "a section with keys " + ", ".join(_field_types(declared))
    return _TYPE_WORDS.get(declared, (f"a value of type {declared}",))[0]


def _build(schema: type[ConfigT], values: dict[str, Any], section: str) -> ConfigT:
    """Construct ``schema`` bottom-up from plain values, so each ``__post_init__`` validates with its section known."""
    types = _field_types(schema)
    arguments = {
        name: _build(types[name], value, f"{section}{name}.") if is_dataclass(types[name]) else value
        for name, value in values.items()
    }
    try:
        return schema(**arguments)
    except ConfigError as error:
        raise ConfigError(f"{section}{error}") from None
