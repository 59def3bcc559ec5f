"""`items_from`: a Hugging Face processor's output, cut into vitpool items, for every family.

Each family's record says what its processor returns and names the function that cuts it
(`vitpool.models.family.ProcessorOutput`); this module finds the family a batch belongs to, by the
keys the batch holds or as the caller names it, and turns each cut into an `Image` or a `Video`.
No model is loaded: a caller needs no engine to make its items.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitpool.items import Image, Item, Video
from vitpool.models.family import FamilyRecord, ProcessorOutput, named_object
from vitpool.models.processor_items import VIDEO, ProcessorItem
from vitpool.models.registry import RECORDS, record_of

VIDEO_PIXELS = "pixel_values_videos"


def items_from(
    batch: Mapping[str, Any], family: str | None = None, model: str | os.PathLike | None = None
) -> list[Item]:
    """One item per image of a processor's output, in the processor's order, then one per video.

    Args:
        batch: what the model's Hugging Face processor (or image / video processor) returned, a
            `BatchFeature` or a dict, with tensors (`return_tensors="pt"` or "np"). Keys the family
            does not use are ignored.
        family: the family whose processor made the batch, by its name or a `model_type`
            ("qwen3_vl", "glm4v_moe", ...): needed only where the batch's keys fit families that cut
            them differently.
        model: instead of `family`, the local checkpoint directory the processor belongs to (its
            config.json names the model type).

    Raises:
        ValueError: the batch lacks a key the family needs (named), fits no family or several, or
            does not add up (say, grid rows that do not account for the pixel rows).
        TypeError: `batch` is not a mapping.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            "batch must be what the processor returned (a BatchFeature or a dict), not "
            f"{type(batch).__name__}"
        )
    if family is not None and model is not None:
        raise ValueError("pass family= or model=, not both")
    if model is not None:
        family = _model_type_of(model)
    record = _named(family) if family is not None else _found(batch)
    output = record.processor_output
    assert output is not None  # _named and _found return records that have one
    if not output.video_keys and (VIDEO_PIXELS in batch or any(key.startswith("video_") for key in batch)):
        # refused, not dropped: the prompt would keep placeholders that no item fills
        raise ValueError(f"{record.name} takes images only; the batch holds videos ({_listed(batch)})")
    cut = named_object(output.split)
    missing = output.missing(batch.keys())
    if family is not None:  # named (or by model=): the cutter cuts per tile where the counts are absent
        missing = tuple(key for key in missing if key not in output.count_keys)
    if missing:
        # the family's cutter says best what is missing and where to get it (a processor that drops
        # a count the image processor keeps); a cutter that does not raise gets the plain account
        cut(batch)
        raise ValueError(
            f"the batch lacks {', '.join(missing)}, which {record.name}'s processor output holds; it has "
            f"{_listed(batch)}"
        )
    return [_item(part) for part in cut(batch)]


def _item(part: ProcessorItem) -> Item:
    kind = Video if part.modality == VIDEO else Image
    return kind(part.pixel_values, part.grid, dict(part.inputs) if part.inputs else None)


def _named(name: str) -> FamilyRecord:
    record = next((r for r in RECORDS if r.name == name), None) or record_of(name)
    if record is None:
        raise ValueError(f"no family {name!r}; the families are {sorted(r.name for r in RECORDS)}")
    if record.processor_output is None:
        raise ValueError(
            f"{record.name}'s processor output has no cutter yet; build its items by hand (README)"
        )
    return record


def _found(batch: Mapping[str, Any]) -> FamilyRecord:
    """The family the batch's keys fit. Families that cut the same keys the same way (the grid
    families) are one answer; families that would cut it differently need family= to decide."""
    keyed = [r for r in RECORDS if r.processor_output is not None]
    fitting = [r for r in keyed if not r.processor_output.missing(batch.keys())]  # type: ignore[union-attr]
    cutters: dict[tuple[str, frozenset[str]], list[FamilyRecord]] = {}
    for record in fitting:
        output: ProcessorOutput = record.processor_output  # type: ignore[assignment]
        cutters.setdefault((output.cut_as or output.split, _matched(output, batch.keys())), []).append(record)
    # the most specific: a cutter whose keys the batch holds include every other fitting one's
    # (LLaVA-OneVision's pixel_values, image_sizes and batch_num_images over Mistral 3's first two)
    widest = [key for key in cutters if all(other[1] <= key[1] for other in cutters)]
    if len(widest) == 1:
        return cutters[widest[0]][0]
    if cutters:
        names = sorted(r.name for r in fitting)
        raise ValueError(
            f"the batch's keys ({_listed(batch)}) fit the processors of {', '.join(names)}, which cut it "
            "differently; pass family= (one of those) or model= (the checkpoint's directory)"
        )
    raise ValueError(
        f"the batch's keys ({_listed(batch)}) are no family's processor output; {_nearest(keyed, batch)}. "
        "Pass what the processor returned as it is (a BatchFeature or its dict), or name the family "
        "with family="
    )


MAX_NEAREST = 4  # processors named where a batch fits none


def _nearest(keyed: list[FamilyRecord], batch: Mapping[str, Any]) -> str:
    """The processors nearest a batch that fits none. First those whose full processor returns it
    as it is, lacking only what says where an image's tiles end (`ProcessorOutput.count_keys`):
    named, they cut it a tile an item. Then those using the most of its keys, the ones lacking the
    fewest first, each with what it lacks; where one or two are that near, in their cutters' words
    (which call of the processor keeps what is missing)."""
    named_cuts = sorted(record.name for record in keyed if _cut_when_named(record, batch))
    used = {record.name: _used_keys(record) & set(batch.keys()) for record in keyed}
    most = max(len(keys) for keys in used.values())
    if most == 0:
        pixels = sorted({record.processor_output.image_keys[0] for record in keyed})  # type: ignore[union-attr]
        return f"it holds no pixels under any family's key ({', '.join(pixels)})"
    near = sorted(
        (record for record in keyed if len(used[record.name]) == most and record.name not in named_cuts),
        key=lambda record: (len(record.processor_output.missing(batch.keys())), record.name),  # type: ignore[union-attr]
    )
    accounts = [_lacks(record, batch, in_its_words=len(near) <= 2) for record in near[:MAX_NEAREST]]
    more = f", or {len(near) - MAX_NEAREST} more" if len(near) > MAX_NEAREST else ""
    nearest = f"the nearest: {'; or '.join(accounts)}{more}" if accounts else ""
    if not named_cuts:
        return nearest
    full = (
        f"it is what the full processors of {', '.join(named_cuts)} return (they drop where an image's "
        f"tiles end): pass family= one of those ({_example(named_cuts[0])}) and each tile is an item, as "
        "the model encodes them"
    )
    return f"{full}; else {nearest}" if nearest else full


def _cut_when_named(record: FamilyRecord, batch: Mapping[str, Any]) -> bool:
    """`record`'s cutter takes the batch once the caller names the family: it lacks only count keys
    (and holds nothing that marks another family's, which `missing` would name)."""
    output = record.processor_output
    assert output is not None  # keyed records have one
    missing = output.missing(batch.keys())
    return bool(missing) and set(missing) <= set(output.count_keys)


def _example(name: str) -> str:
    return f"vitpool.items_from(out, family={name!r})"


def _used_keys(record: FamilyRecord) -> set[str]:
    output = record.processor_output
    assert output is not None  # keyed records have one
    return set(output.image_keys) | set(output.video_keys) | set(output.other_keys)


def _lacks(record: FamilyRecord, batch: Mapping[str, Any], in_its_words: bool) -> str:
    """What `record`'s processor output holds that the batch lacks, in its cutter's words where
    asked and it gives a reason."""
    output = record.processor_output
    assert output is not None
    account = f"{record.name}'s, which also holds {', '.join(output.missing(batch.keys()))}"
    if in_its_words:
        try:
            named_object(output.split)(batch)
        except ValueError as error:
            return f"{account} ({error})"
        except Exception:  # noqa: BLE001, S110 - a cutter given a batch not its own may fail any way
            pass
    return account


def _matched(output: ProcessorOutput, keys: Any) -> frozenset[str]:
    """The keys of `output`'s groups (images, videos) that a batch with `keys` holds."""
    return frozenset(key for group in output.held_groups(keys) for key in group)


def _model_type_of(model: str | os.PathLike) -> str:
    """A local checkpoint's model type, from its config.json (read as JSON: no transformers)."""
    path = Path(model)
    config = path if path.name == "config.json" else path / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise ValueError(f"model={str(model)!r}: cannot read its config.json ({error})") from None
    if not isinstance(model_type, str):
        raise ValueError(  # noqa: TRY004 - a bad model=, raised as the unreadable config.json above is
            f"model={str(model)!r}: its config.json names no model_type"
        )
    return model_type


def _listed(batch: Mapping[str, Any]) -> str:
    return ", ".join(sorted(map(str, batch.keys()))) or "no keys"
