"""A call's results as they come back: Embeddings over the same-node channel, Ray references
through a Ray call. Here the references are fetched (a failed fetch becomes the item's
EncodeError), items of several inputs are joined, and each value goes back to its slot.
"""

from __future__ import annotations

from typing import Any

import ray

from vitpool.errors import EncodeError
from vitpool.items import Embedding
from vitpool.pool.calls import PartResults


def fetched(index: int, ref: ray.ObjectRef) -> Any:
    """One item's result from the object store, or the error that fetching it raised."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        return fetch_failure(index, error)


def lost_with_its_node(value: Any) -> bool:
    """Whether a fetch failed because the object went with its node (not with this process)."""
    cause = value.__cause__ if isinstance(value, EncodeError) else None
    return isinstance(cause, ray.exceptions.ObjectLostError) and not isinstance(
        cause, ray.exceptions.OwnerDiedError
    )


def fetch_failure(index: int, error: BaseException) -> EncodeError:
    failure = EncodeError(f"item {index}: its result could not be fetched from Ray's object store: {error}")
    failure.__cause__ = error
    return failure


def refs_among(results: list[Any]) -> dict[tuple[int, int | None], ray.ObjectRef]:
    """The results that came as Ray references (through a Ray call), by (item, part or None); the
    others came over the same-node channel as Embeddings."""
    refs: dict[tuple[int, int | None], ray.ObjectRef] = {}
    for i, result in enumerate(results):
        if isinstance(result, ray.ObjectRef):
            refs[(i, None)] = result
        elif isinstance(result, PartResults):
            refs.update(
                {(i, j): part for j, part in enumerate(result.parts) if isinstance(part, ray.ObjectRef)}
            )
    return refs


def joined_ref(index: int, result: PartResults, timeout_s: float | None) -> ray.ObjectRef:
    """A reference to the joined Embedding of an item's parts.

    Raises:
        EncodeError: a part could not be fetched from the object store (its item named).
        TimeoutError: not within `timeout_s`.
    """
    try:
        parts = ray.get(list(result.parts), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"item {index}: its parts were not fetched within {timeout_s} s") from None
    except ray.exceptions.RayError as error:
        raise fetch_failure(index, error) from error
    return ray.put(Embedding.joined(parts))


def put_back(results: list[Any], refs: dict[tuple[int, int | None], Any], values: list[Any]) -> None:
    """Each fetched value where its reference was."""
    for (index, part), value in zip(refs, values):
        if part is None:
            results[index] = value
        else:
            results[index].parts[part] = value


def joined(results: list[Any], return_exceptions: bool) -> list[Any]:
    """Items of several inputs as one Embedding each (or their first part's error)."""
    for index, result in enumerate(results):
        if isinstance(result, PartResults):
            errors = [part for part in result.parts if isinstance(part, BaseException)]
            if errors and not return_exceptions:
                raise errors[0]
            results[index] = errors[0] if errors else Embedding.joined(result.parts)
    return results
