"""The valid range of every numeric field of the config tree, read from the field itself (schema.knob), and
what a resumed run may change.

`range_problems(cfg)` checks each value against its interval: NaN is never inside one, and `inf` only
where the interval is closed at infinity (none is). A field that is None where its type allows None is
not checked. A numeric field that declares no interval is reported (tests/test_config_ranges.py walks the
dataclasses too), so a new field cannot skip this check.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

INF = math.inf

class Interval(typing.NamedTuple):
    low: float
    high: float
    low_open: bool
    high_open: bool

    def __contains__(self, v: float) -> bool:  # type: ignore[override]  # NaN compares False: never inside
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == INF:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}" if self.low != -INF else "finite"
        return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_interval(text: str) -> Interval:
    """'[0, 1)' -> Interval(0, 1, low_open=False, high_open=True); 'inf' ends are always open."""
    low, high = (float(part) for part in text[1:-1].split(","))
    return Interval(low, high, text[0] == "(", text[-1] == ")")


def numeric_fields(obj: Any, prefix: str = "") -> dict[str, tuple[Any, dataclasses.Field]]:
    """dotted key -> (value, field) of every int / float (or optional int / float) field under `obj`."""
    out: dict[str, tuple[Any, dataclasses.Field]] = {}
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            out.update(numeric_fields(value, f"{prefix}{f.name}."))
        elif _is_numeric(tp):
            out[f"{prefix}{f.name}"] = (value, f)
    return out


def _is_numeric(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_numeric(a) for a in typing.get_args(tp) if a is not type(None))
    return tp in (int, float)


def range_problems(cfg: Any) -> list[str]:
    """One line per numeric field of `cfg` outside its interval (or without one: a bug)."""
    problems = []
    for key, (value, f) in numeric_fields(cfg).items():
        interval_text, why = f.metadata.get("interval"), f.metadata.get("why", "")
        if interval_text is None:
            problems.append(f"{key}: no valid range declared (megatron_dapo/config/schema.py: knob)")
            continue
        if value is None:
            continue
        interval = parse_interval(interval_text)
        if value not in interval:
            problems.append(f"{key}={value} must be {interval.describe()}" + (f" ({why})" if why else ""))
    return problems


def may_change_on_resume(cfg: Any, dotted: str) -> bool:
    """Whether setting `dotted` ("train.steps") may differ in a resumed run (schema.knob's on_resume, or
    its section's ON_RESUME)."""
    node: Any = cfg
    *path, name = dotted.split(".")
    for part in path:
        if getattr(node, "ON_RESUME", False):
            return True
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            return False
    if getattr(node, "ON_RESUME", False):
        return True
    fields = {f.name: f for f in dataclasses.fields(node)}
    return name in fields and bool(fields[name].metadata.get("on_resume"))
