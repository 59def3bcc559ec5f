"""MiniCPM-OCR (minicpm_ocr): MiniCPM-V 4.6's vision path (MiniCPMOcrVisionModel and MiniCPMOcrMerger
are 4.6's classes renamed) read in the "4x" mode by default (no in-tower window merger: h*w / 4
tokens a slice), "16x" by 4.6's adapter; transformers' keys; slices of target sizes. The processor
output is 4.6's (`processor.py` reads either mode's prompt)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.minicpm_ocr.adapter"

RECORD = FamilyRecord(
    name="minicpm_ocr",
    towers={
        "minicpm_ocr_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "MiniCPMOcrAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "MiniCPMOcrAdapter",
                prefixes=("model.vision_tower.", "model.merger.", "vision_tower.", "merger."),
            ),
        ),
    },
    model_types=("minicpm_ocr",),
    # vLLM 0.32 cannot serve it: its registry (vllm/model_executor/models/registry.py) has no
    # MiniCPMOcrForConditionalGeneration (only MiniCPM-V 4.6's and 4.7's models), and its
    # transformers (5.19) has no minicpm_ocr model type for its Transformers modeling backend; its
    # tokens would be the slices' in the processor's order, as 4.6's
    vllm_layout=None,
    transformers_parts=None,
    image_features="vitpool.families.minicpm_ocr.features:MiniCPMOcrFeatures",
    # only the keys every MiniCPM-V batch of images holds: each image's slice count comes from
    # num_patches_per_image or from the prompt, and the cutter says what is missing where neither is.
    # It cuts every batch 4.6's cutter cuts, the same way, and also a "4x" prompt: one cut for the
    # three families' batches (`cut_as`, 4.6's cutter's name), so that items_from finds it by its keys.
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "target_sizes"),
        split="vitpool.families.minicpm_ocr.processor:items",
        cut_as="vitpool.families.minicpmv4_6.processor:items",
    ),
)
