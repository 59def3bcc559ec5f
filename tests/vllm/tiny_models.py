"""A tiny random Qwen3-VL checkpoint that vLLM can serve on a CPU: config, weights, a byte-level
tokenizer with Qwen's special tokens and chat template, and the image processor's settings.

    python tests/vllm/tiny_qwen3_vl.py DIRECTORY

Head sizes are 64 in both towers (vLLM's CPU attention refuses 16); no video processor is written,
so neither side needs torchvision.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 320  # 256 bytes, the special tokens, room to spare

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VISION = {
    "model_type": "qwen3_vl", "depth": 3, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2,
    "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 144, "deepstack_visual_indexes": [0, 1], "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
}
TEXT = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                        "mrope_interleaved": True},
    "tie_word_embeddings": False,
}
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
}


def write_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return {token: fast.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def build(directory: Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(directory)
    config = Qwen3VLConfig(
        vision_config=VISION, text_config=TEXT,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # visible weights: transformers initialises some to exact zeros or ones
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
