"""A tower-only config must carry what its family's projector reads: every family that runs its
projector in the graph checks it through `require_fields`, naming what is missing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vitpool.families.gemma3.adapter import projector_config as gemma3_projector_config
from vitpool.families.idefics3.adapter import connector_config
from vitpool.families.mistral3.adapter import projector_config as mistral3_projector_config
from vitpool.models.projected import require_fields


def test_missing_fields_are_named_and_present_ones_pass():
    config = SimpleNamespace(text_hidden_size=64, scale_factor=None)
    require_fields(config, ("text_hidden_size",), "x", "to build y")
    with pytest.raises(ValueError, match=r"^a thing needs \['scale_factor', 'other'\] to build y$"):
        require_fields(config, ("text_hidden_size", "scale_factor", "other"), "a thing", "to build y")


@pytest.mark.parametrize(
    "build, message",
    [
        (
            gemma3_projector_config,
            (
                r"a Gemma 3 vision config needs \['text_hidden_size', 'mm_tokens_per_image'\] "
                r"to build its multi_modal"
            ),
        ),
        (
            connector_config,
            (
                r"an Idefics3 / SmolVLM vision config needs \['text_hidden_size', 'scale_factor'\] "
                r"to build its connector"
            ),
        ),
        (
            mistral3_projector_config,
            (
                r"Mistral 3's projector needs \[.*'text_hidden_size'.*\] "
                r"besides the Pixtral vision config: .* got a Simple"
            ),
        ),
    ],
)
def test_a_bare_vision_config_is_refused_with_what_it_lacks(build, message):
    with pytest.raises(ValueError, match=message):
        build(SimpleNamespace(model_type="siglip_vision_model"))
