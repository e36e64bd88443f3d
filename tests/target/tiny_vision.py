"""Tiny random vision-language targets built from their transformers 5.23 configs: Qwen3-VL (dense, deepstack
features into layers 0 and 1) and the Qwen3.5/3.6 layout (`qwen3_5` ForConditionalGeneration: Gated DeltaNet and
full attention, no deepstack), each with a word-level tokenizer holding the vision tokens, a Qwen-style chat
template that writes an image part as `<|vision_start|> <|image_pad|> <|vision_end|>`, and the image processor
settings a real checkpoint ships (`preprocessor_config.json`). Images are drawn here with PIL."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedTokenizerFast

VL_VOCAB = 96
VL_EOS, VL_PAD, VL_MASK = 93, 94, 95
VISION_WORDS = {"<|vision_start|>": 88, "<|vision_end|>": 89, "<|image_pad|>": 90, "<|video_pad|>": 91}
CHAT = {"<|im_start|>": 80, "<|im_end|>": 81, "user": 82, "assistant": 83, "system": 84}
IMAGE_TOKEN_ID = VISION_WORDS["<|image_pad|>"]
# Qwen3-VL's template, reduced: a content list's image parts (`type` image or image_url, or an `image` key) become
# the vision tokens, its text parts their text
VL_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|> {{ m.role }} "
    "{%- if m.content is string %} {{ m.content }}{% else %}{% for c in m.content %}"
    "{%- if c.type == 'image' or 'image' in c or 'image_url' in c %} <|vision_start|> <|image_pad|> <|vision_end|>"
    "{%- elif c.type == 'text' %} {{ c.text }}{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|> assistant {% endif -%}"
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",  # as real Qwen3-VL checkpoints name it
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 8,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}
TEXT = dict(
    vocab_size=VL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_id=VL_EOS,
    pad_token_id=VL_PAD,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)
LAYOUTS = {
    "qwen3_vl": (TEXT, VISION | {"deepstack_visual_indexes": [0, 1]}),
    "qwen3_5": (
        TEXT
        | dict(
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
        ),
        VISION,
    ),
}


def make_vl_tokenizer() -> PreTrainedTokenizerFast:
    used = set(VISION_WORDS.values()) | set(CHAT.values())
    vocab = {f"t{i}": i for i in range(VL_EOS) if i not in used} | VISION_WORDS | CHAT
    vocab |= {"<eos>": VL_EOS, "<pad>": VL_PAD, "<mask>": VL_MASK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")
    # the vision tokens are special tokens, split out of "<|image_pad|><|image_pad|>" as Qwen's tokenizer does
    fast.add_special_tokens({"additional_special_tokens": list(VISION_WORDS)})
    fast.chat_template = VL_TEMPLATE
    return fast


def make_vl_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of the same ids, as the Qwen3.5 tokenizer class (which transformers fixes for
    `qwen3_5` whatever the files say) reads one: prompt words t0..t60 are "t"/"Ġt" and a digit each, the chat and
    vision words special tokens."""
    pieces = ["t", "Ġt", "Ġ", *map(str, range(10))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    special = VISION_WORDS | CHAT | {"<eos>": VL_EOS, "<pad>": VL_PAD, "<mask>": VL_MASK}
    vocab |= {f"x{i}": i for i in range(len(pieces), VL_VOCAB) if i not in special.values()} | special
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")
    fast.add_special_tokens({"additional_special_tokens": list(VISION_WORDS) + list(CHAT)})
    fast.chat_template = VL_TEMPLATE
    return fast


def make_vl_model(layout: str, seed: int = 0):
    """A tiny random vision-language model of `layout`, its logits sharpened and EOS never the argmax (as
    `tests.conftest.make_hf_model`)."""
    torch.manual_seed(seed)
    text, vision = LAYOUTS[layout]
    config = AutoConfig.for_model(
        layout,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VISION_WORDS["<|video_pad|>"],
        vision_start_token_id=VISION_WORDS["<|vision_start|>"],
        vision_end_token_id=VISION_WORDS["<|vision_end|>"],
        tie_word_embeddings=False,
        eos_token_id=VL_EOS,
        pad_token_id=VL_PAD,
    )
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[VL_EOS] = 0.0
    return model.float().eval()


def save_vl_target(directory: Path, layout: str = "qwen3_vl", seed: int = 0) -> Path:
    """The tiny target saved as a user's checkpoint directory: weights, tokenizer, chat template, image settings."""
    directory.mkdir(parents=True, exist_ok=True)
    make_vl_model(layout, seed).save_pretrained(directory)
    (make_vl_bpe_tokenizer() if layout == "qwen3_5" else make_vl_tokenizer()).save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return directory


def draw_image(path: Path | None = None, size: tuple[int, int] = (48, 32), seed: int = 0) -> Image.Image:
    """A small picture (a shape on a coloured ground), saved to `path` when given. 48 x 32 is a grid of 4 x 6
    patches of 8: 6 placeholders after the 2 x 2 merge, and M-RoPE's row 0 advances by 3 across them."""
    g = torch.Generator().manual_seed(seed)
    colour = tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g))
    image = Image.new("RGB", size, colour)
    x, y = (int(v) for v in torch.randint(0, min(size) // 2, (2,), generator=g))
    ImageDraw.Draw(image).ellipse([x, y, x + size[0] // 2, y + size[1] // 2], fill=(255 - colour[0], 40, 200))
    if path is not None:
        image.save(path)
    return image
