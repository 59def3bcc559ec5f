"""An item's output (`Embedding`), as every layer from the transport up hands it on.

It pickles its tensors as NumPy arrays (`vitpool.transport.wire`), which Ray moves through its
object store without pickling torch storage, so `ray.get` on a pool's result reference gives an
`Embedding`. It lives here, under the transport that fills it from a batch's outputs, and
`vitpool.items` gives it to callers with the inputs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vitpool.transport.wire import from_array, to_array, wire_dtype_name


@dataclass
class Embedding:
    """The encoder's output for one item.

    Attributes:
        tokens: merged output tokens [num_tokens, hidden] (the LLM's embedding width).
        deepstack: the model's extra outputs the LLM consumes, one row per token (Qwen3-VL's
            deepstack features, each [num_tokens, hidden]); empty for models without.
    """

    tokens: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def from_outputs(cls, outputs: Sequence[torch.Tensor]) -> Embedding:
        """From the item's tensors in `vitpool.specs.OutputLayout` order: tokens, then extras."""
        return cls(outputs[0], list(outputs[1:]))

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The item's tensors in `vitpool.specs.OutputLayout` order."""
        return [self.tokens, *self.deepstack]

    @property
    def nbytes(self) -> int:
        """The bytes of all its tensors."""
        return sum(tensor.nbytes for tensor in self.outputs)

    @classmethod
    def joined(cls, parts: Sequence[Embedding]) -> Embedding:
        """One item's embedding from its parts' (`PathRules`), in order: each output concatenated
        along its tokens."""
        if len(parts) == 1:
            return parts[0]
        return cls.from_outputs([torch.cat(tensors) for tensors in zip(*(part.outputs for part in parts))])

    def __reduce__(self) -> tuple:
        dtype_name = wire_dtype_name(self.tokens.dtype)
        return _embedding_from_arrays, (
            dtype_name,
            to_array(self.tokens),
            [to_array(d) for d in self.deepstack],
        )


_sharing = threading.local()


@contextlib.contextmanager
def shared_results() -> Iterator[None]:
    """Within it, Embeddings fetched from Ray's object store (`ray.get` on `encode_refs` results)
    are read-only views of the node's shared memory instead of private copies: every worker on
    the node reads the same bytes, with no copy per rank. Do not write into them (the process
    would crash); clone one to write, or move it to a GPU, which copies anyway."""
    previous = getattr(_sharing, "on", False)
    _sharing.on = True
    try:
        yield
    finally:
        _sharing.on = previous


def _embedding_from_arrays(dtype_name: str, tokens: np.ndarray, deepstack: list[np.ndarray]) -> Embedding:
    copy = not getattr(_sharing, "on", False)
    return Embedding(
        from_array(tokens, dtype_name, copy_read_only=copy),
        [from_array(d, dtype_name, copy_read_only=copy) for d in deepstack],
    )
