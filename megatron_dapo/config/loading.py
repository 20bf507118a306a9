"""Defaults <- a YAML delta file <- dotted overrides (`algo.eps_high=0.28`), typed against the tree.

Unknown keys and wrong types are errors that name the key (with a "did you mean").
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_dapo.config.ranges import may_change_on_resume
from megatron_dapo.config.schema import Config, ConfigError
from megatron_dapo.config.validation import validate


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    if isinstance(value, CliText):
        return _coerce_text(value, tp, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _looks_like_float(value):
        return float(value)  # YAML 1.1 reads 1e-6 as a string; users mean a number
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


class CliText(str):
    """An override value as typed on the command line; parsed as YAML against the field's type."""


def _coerce_text(text: CliText, tp: Any, key: str) -> Any:
    try:
        parsed = yaml.load(text, Loader=_StrictLoader) if text.strip() else ""
        return _coerce(parsed, tp, key)
    except (ConfigError, yaml.YAMLError) as e:
        if _accepts_str(tp):
            return _coerce(str(text), tp, key)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"override {key}={text}: not a valid value ({_yaml_problem(e)})") from None


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (not: the last wins)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line from a YAML error: what is wrong and where (1-based line and column)."""
    def at(mark: Any) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    what = (getattr(e, "problem", None) or str(e).splitlines()[0]) + at(getattr(e, "problem_mark", None))
    context = getattr(e, "context", None)
    return f"{what} ({context}{at(getattr(e, 'context_mark', None))})" if context else what


def read_yaml(path: Path) -> Any:
    """Parse a YAML file strictly (duplicate keys are errors); a ConfigError names the file and line."""
    try:
        return yaml.load(path.read_text(), Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_problem(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _unknown(key: str, name: str, known: list[str]) -> ConfigError:
    section = key[: len(key) - len(name)]
    hint = _keys_named(Config(), name)[:3] or [section + k for k in difflib.get_close_matches(name, known, n=1)]
    near = f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""
    return ConfigError(f"unknown config key {key!r}{near}; valid here: {sorted(known)}")


def _keys_named(cfg: Any, name: str, prefix: str = "") -> list[str]:
    """The dotted keys of the tree under `cfg` whose last part is `name` (`steps` -> `train.steps`)."""
    found = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == name:
            found.append(f"{prefix}{f.name}")
        if dataclasses.is_dataclass(value):
            found += _keys_named(value, name, f"{prefix}{f.name}.")
    return found


def apply_delta(cfg: Any, delta: dict[str, Any], prefix: str = "") -> None:
    """Apply a nested mapping of overrides onto the dataclass `cfg` in place."""
    hints = _field_types(cfg)
    for name, value in delta.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise _unknown(key, str(name), list(hints))
        current = getattr(cfg, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of sub-keys, got {value!r}")
            apply_delta(current, value, prefix=f"{key}.")
        else:
            setattr(cfg, name, _coerce(value, hints[name], key))


def parse_override(text: str) -> dict[str, Any]:
    """`a.b.c=VALUE` -> {"a": {"b": {"c": CliText(VALUE)}}}, parsed as YAML against the field type."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    value = CliText(raw)
    out: dict[str, Any] = {}
    node = out
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return raw.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML delta file <- dotted overrides, then validate() (world size unknown yet)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        delta = read_yaml(p) or {}
        if not isinstance(delta, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        apply_delta(cfg, delta)
    for text in overrides:
        apply_delta(cfg, parse_override(text))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100)


def config_changes(saved: dict, now: dict, prefix: str = "", defaults: Config | None = None) -> list[str]:
    """`key: saved -> now` for every setting that differs, except those a resumed run may change (read off
    the fields of `defaults`, the default tree, built once per call)."""
    defaults = defaults or Config()
    out = []
    for key in sorted(set(saved) | set(now)):
        dotted, a, b = f"{prefix}{key}", saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, dotted + ".", defaults)
        elif a != b and not may_change_on_resume(defaults, dotted):
            out.append(f"{dotted}: {a!r} -> {b!r}")
    return out
