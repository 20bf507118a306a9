"""Reading TensorBoard event files back: scalars and text summaries (tests, benchmarks, the PNG)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def _event_files(logdir: str | Path, kind: str) -> Iterator[Any]:
    """A loaded EventAccumulator (all its `kind` events kept) per TensorBoard event file in `logdir`, in the
    order the files were written. An event file being written by a live run is read as far as it goes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for f in sorted(Path(logdir).glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name)):
        ea = EventAccumulator(str(f), size_guidance={kind: 0})
        ea.Reload()
        yield ea


def read_scalars(logdir: str | Path, tags: Iterable[str] | None = None) -> dict[str, dict[int, float]]:
    """tag -> step -> value from the TensorBoard event files in `logdir` (only `tags`, if given), read in the
    order they were written: a step a resumed run wrote again has its last value. An event file being
    written by a live run is read as far as it goes."""
    wanted = None if tags is None else set(tags)
    out: dict[str, dict[int, float]] = {}
    for ea in _event_files(logdir, "scalars"):
        for tag in ea.Tags()["scalars"]:
            if wanted is None or tag in wanted:
                out.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def read_texts(logdir: str | Path) -> dict[str, dict[int, str]]:
    """tag -> step -> text of the TensorBoard text summaries in `logdir` (e.g. write_samples' `samples/val`),
    the last value written winning as in read_scalars."""
    out: dict[str, dict[int, str]] = {}
    for ea in _event_files(logdir, "tensors"):
        for tag in ea.Tags()["tensors"]:
            if tag.endswith("/text_summary"):
                out.setdefault(tag.removesuffix("/text_summary"), {}).update(
                    {e.step: e.tensor_proto.string_val[0].decode("utf-8") for e in ea.Tensors(tag)})
    return out
