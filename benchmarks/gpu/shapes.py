"""The shapes the checks run at: the published Qwen3.6-27B and Qwen3-8B widths on a GPU (`GPU`), tiny ones in
--dry-run (`DRY`), both as a `Widths`: everything that differs between the real run and --dry-run.

The slice's widths that the reference doc gives (hidden 5120, intermediate 17408, vocab 248320)
are used as given; the attention and Gated DeltaNet head counts and dims are those of the
published Qwen3.5/3.6-27B config.json.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Widths:
    """Everything that differs between the real run and --dry-run."""

    slice: dict  # Qwen3_5TextConfig fields of the target slice
    drafters: dict  # name -> DrafterConfig fields (the published drafter shapes)
    target_for: dict  # drafter name -> (hidden, vocab) of the target it borrows embedding and LM head from
    parity_prompt_lengths: tuple[int, ...]
    prompt_tokens: int  # before verification and decoding
    new_tokens: int  # speculative decoding length
    seq_len: int  # training sequence (context tokens)
    num_anchors: int  # blocks per sequence
    train_steps: int
    repeats: int  # timing repeats (median)
    tiny_prompts: int  # prompts the built-in tiny target decodes
    context_for: dict  # drafter name -> context tokens where a shape is sized down from seq_len (said in its row)
    matmul_size: int  # the timed bf16 matmul's side
    packing_records: int  # records of the long-tailed mix
    packing_steps: int  # steps per packing window (after a warm-up)
    tree_slice: dict  # Qwen3Config fields of the dense target slice the draft trees run on
    tree_budgets: tuple[int, ...]


LAYERS_3_LINEAR_1_FULL = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5/3.6: full attention every 4th
QWEN36_27B_SLICE = dict(
    hidden_size=5120,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=LAYERS_3_LINEAR_1_FULL,
)
QWEN36_27B_DRAFTER = dict(
    hidden_size=5120,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=17408,
    vocab_size=248320,
    num_target_layers=64,
    target_layer_ids=[1, 16, 31, 46, 61],
    mask_token_id=248070,
    rope_theta=1e7,
    layer_types=["sliding_attention"] * 4 + ["full_attention"],
    sliding_window=2048,
)
# target_layer_ids by the reference default rule for 36 layers; any mask id does for synthetic data
QWEN3_8B_DRAFTER = dict(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    num_target_layers=36,
    target_layer_ids=[1, 9, 17, 25, 33],
    mask_token_id=151669,
)

QWEN3_8B_SLICE = dict(  # Qwen3-8B's published widths, 4 of its 36 layers
    hidden_size=4096,
    intermediate_size=12288,
    vocab_size=151936,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)

GPU = Widths(
    slice=QWEN36_27B_SLICE,
    drafters={"qwen3-8b-drafter": QWEN3_8B_DRAFTER, "qwen3.6-27b-drafter": QWEN36_27B_DRAFTER},
    target_for={"qwen3-8b-drafter": (4096, 151936), "qwen3.6-27b-drafter": (5120, 248320)},
    parity_prompt_lengths=(520, 133),  # odd lengths: the chunked kernels' partial last chunk
    prompt_tokens=1024,
    new_tokens=32,
    seq_len=4096,  # beyond the 2048 sliding window
    num_anchors=512,
    train_steps=2,
    repeats=5,
    tiny_prompts=4,
    context_for={},  # both shapes at 4,096 context tokens (about 0.3 s a step for the 27B one: see CAPS)
    matmul_size=8192,
    packing_records=64,
    packing_steps=6,
    tree_slice=QWEN3_8B_SLICE,
    tree_budgets=(16, 32, 64),
)
NEAR_TIE = 2**-5  # bf16: a greedy choice whose top-2 logit gap is within this share of the top logit is a near-tie
TINY_SLICE = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=LAYERS_3_LINEAR_1_FULL,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    num_target_layers=4,
    target_layer_ids=[0, 1, 2],
    mask_token_id=511,
)
DRY = Widths(
    slice=TINY_SLICE,
    drafters={
        "qwen3-8b-drafter": TINY,
        "qwen3.6-27b-drafter": TINY | dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32),
    },
    target_for={"qwen3-8b-drafter": (64, 512), "qwen3.6-27b-drafter": (64, 512)},
    parity_prompt_lengths=(70, 17),
    prompt_tokens=24,
    new_tokens=12,
    seq_len=96,
    num_anchors=6,
    train_steps=2,
    repeats=3,
    tiny_prompts=2,
    context_for={},
    matmul_size=256,
    packing_records=6,
    packing_steps=1,
    tree_slice={k: v for k, v in TINY.items() if k in QWEN3_8B_SLICE},  # 2 layers, the tiny drafter's widths
    tree_budgets=(16, 32, 64),
)
BLOCK = 16
BF16_TOLERANCE = 0.02  # relative L2 error allowed between two bf16 computations of the same thing
