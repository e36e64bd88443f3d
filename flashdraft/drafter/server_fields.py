"""Every config.json field vLLM 0.33.0 or SGLang 0.5.23 reads that changes what a drafter
computes, and what flashdraft does with it (section 9 of the reference doc; the servers' files:
vLLM `model_executor/models/qwen3_dflash.py`, `qwen3_dflash2.py`, `layers/rotary_embedding.py`
`get_rope`; SGLang `srt/models/dflash.py`; the z-lab reference `dflash/model.py`).

A field that changes the computation is either honoured (training, the offline walk, live
decoding and export compute what the server computes) or refused on load with one line naming
the field, its value and the server that reads it. Nothing loads silently: an offline τ of a
drafter other than the one served is the failure this table exists to prevent.

- "honoured": flashdraft computes it, and writes it in the one spelling every server reads alike.
- "folded": flashdraft converts the weights on load into its own convention, which computes the
  same drafter, so nothing is written that a server could read differently (a (1 + w) RMSNorm
  becomes a plain one with weight 1 + w; GPT-J rotation becomes NeoX rotation of permuted q/k rows).
- "refused": flashdraft does not build it; a non-neutral value is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashdraft.errors import FlashdraftError

VLLM, SGLANG, REFERENCE = "vLLM 0.33.0", "SGLang 0.5.23", "the z-lab reference"


@dataclass(frozen=True)
class ServerField:
    name: str  # as written in config.json; "dflash_config.x" / "rope_scaling.x" / "rope_parameters.x" for nested
    read_by: str  # which server reads it, and where
    handling: str  # "honoured", "folded" or "refused"
    effect: str  # what a non-neutral value does to the drafter
    neutral: tuple = (None,)  # values that change nothing (None: absent)
    example: Any = None  # a non-neutral value (the table test uses it)
    family: str | None = None  # a field of one drafter family only ("dspark"); None: every family's
    # values of a refused field that are read, not refused, though not neutral: a family they name ("dspark")
    read_as_family: tuple = ()


SERVER_FIELDS: tuple[ServerField, ...] = (
    # -- RoPE --
    ServerField(
        "rope_theta",
        f"{VLLM} get_rope, {SGLANG} get_rope (also as rope_parameters.rope_theta)",
        "honoured",
        "RoPE base frequency (absent: transformers' 10000)",
        (None, 1e4, 10000),
        5e5,
    ),
    ServerField(
        "rope_scaling",
        f"{VLLM} get_rope, {SGLANG} get_rope (transformers' rope types; transformers 5 reads "
        f"the same dict as rope_parameters, and takes rope_scaling when both are given)",
        "honoured",
        "scaled RoPE (linear, dynamic, yarn, ...); flashdraft reads either key, refuses the two disagreeing, "
        "and writes both",
        (None, {}),
        {"rope_type": "linear", "factor": 4.0},
    ),
    ServerField(
        "rope_parameters.partial_rotary_factor",
        f"{VLLM} get_rope (transformers 5 rope_parameters)",
        "honoured",
        "RoPE rotates only the first factor x head_dim dims of each q/k head",
        (None, 1.0),
        0.5,
    ),
    ServerField(
        "partial_rotary_factor",
        f"{SGLANG} models/dflash.py (transformers folds it into rope_parameters, which {VLLM} reads)",
        "honoured",
        "as rope_parameters.partial_rotary_factor",
        (None, 1.0),
        0.5,
    ),
    ServerField(
        "rope_scaling.rope_dim",
        f"{SGLANG} models/dflash.py (supersedes partial_rotary_factor; {VLLM} does not read it)",
        "honoured",
        "the rotary width in dims of each q/k head; flashdraft writes it "
        "as partial_rotary_factor, which both servers read",
        (None,),
        8,
    ),
    ServerField(
        "is_neox_style",
        f"{VLLM} / {SGLANG} get_rope(is_neox_style)",
        "folded",
        "false: GPT-J rotation (interleaved pairs) instead of NeoX (halves)",
        (None, True),
        False,
    ),
    ServerField("rope_is_neox_style", f"{SGLANG} models/dflash.py", "folded", "as is_neox_style", (None, True), False),
    # -- norms and MLP --
    ServerField(
        "use_gemma_norm",
        f"{SGLANG} models/dflash.py (GemmaRMSNorm; {VLLM} does not read it)",
        "folded",
        "every RMSNorm (layer, final, hidden, q/k) multiplies by 1 + w instead of w",
        (None, False),
        True,
    ),
    ServerField(
        "hidden_act",
        f"{VLLM} Qwen3 MLP (silu only), {SGLANG} SiluAndMul",
        "refused",
        "the MLP's activation; both servers run silu",
        (None, "silu"),
        "gelu",
    ),
    ServerField(
        "swiglu_limit", f"{SGLANG} models/dflash.py", "refused", "clamps the SwiGLU's gate and up inputs", (None,), 7.0
    ),
    ServerField("swiglu_alpha", f"{SGLANG} models/dflash.py", "refused", "the SwiGLU's sigmoid slope", (None,), 1.702),
    ServerField(
        "attention_bias",
        f"{VLLM} / {SGLANG} QKVParallelLinear(bias)",
        "honoured",
        "q/k/v/o projections with biases",
        (None, False),
        True,
    ),
    ServerField(
        "rms_norm_eps", f"{VLLM} / {SGLANG} RMSNorm", "honoured", "every RMSNorm's epsilon", (None, 1e-6), 1e-2
    ),
    # -- attention --
    ServerField(
        "layer_types",
        f"{VLLM} _resolve_layer_attention, {SGLANG} DECODER/ENCODER_ONLY",
        "honoured",
        "sliding_attention layers: a window, causal in the block",
        (None,),
        ["sliding_attention"] * 2,
    ),
    ServerField(
        "sliding_window", f"{VLLM} / {SGLANG} (sliding layers)", "honoured", "the keys a sliding layer sees", (None,), 3
    ),
    ServerField(
        "is_causal",
        f"{VLLM} _dflash_layer_causal, {SGLANG} (top level only)",
        "honoured",
        "every layer's in-block causality",
        (None,),
        True,
    ),
    ServerField(
        "dflash_config.causal",
        f"{VLLM} _dflash_layer_causal ({SGLANG} reads only is_causal: flashdraft writes is_causal)",
        "honoured",
        "as is_causal",
        (None,),
        True,
    ),
    ServerField(
        "dflash_config.use_swa",
        f"{VLLM} _resolve_layer_attention",
        "honoured",
        "every layer sliding when layer_types has none (written as layer_types)",
        (None, False),
        True,
    ),
    ServerField(
        "dflash_config.swa_window_size",
        f"{VLLM} _resolve_layer_attention",
        "honoured",
        "the sliding window, over sliding_window (written as sliding_window)",
        (None,),
        3,
    ),
    ServerField(
        "add_swa_attention_sink_bias",
        f"{VLLM} qwen3_dflash.py",
        "refused",
        "a learned per-head sink logit on sliding layers",
        (None, False),
        True,
    ),
    ServerField(
        "attention_sink_bias",
        f"{SGLANG} models/dflash.py",
        "refused",
        "a learned per-head sink logit on sliding layers",
        (None, False),
        True,
    ),
    # -- logits --
    ServerField(
        "logit_scale",
        f"{VLLM} LogitsProcessor(scale) ({SGLANG} does not read it: the servers would sample differently)",
        "refused",
        "multiplies the drafter's logits",
        (None, 1.0, 1),
        2.0,
    ),
    ServerField(
        "dflash_config.output_multiplier",
        f"{VLLM} qwen3_dflash2.py, {REFERENCE} (also read at the top level)",
        "honoured",
        "multiplies the drafter's logits",
        (None, 1.0, 1),
        2.0,
    ),
    ServerField(
        "dflash_config.final_logit_softcapping",
        f"{VLLM} qwen3_dflash2.py, {REFERENCE} (also read at the top level)",
        "honoured",
        "cap * tanh(logits / cap)",
        (None, 0, 0.0),
        3.0,
    ),
    ServerField(
        "dflash_config.input_embedding_scale",
        f"{VLLM} qwen3_dflash2.py, {REFERENCE} (also read at the top level)",
        "honoured",
        "multiplies the block's input embeddings",
        (None, 1.0, 1),
        2.0,
    ),
    ServerField(
        "dflash_config.attention_value_scale",
        f"{VLLM} qwen3_dflash.py v_scale (DFlash, DFlash2), {SGLANG} "
        f"models/dflash.py (MiMo drafters; neither server's DSpark model reads it: refused there)",
        "honoured",
        "every layer's attention values, block and context, times the scale",
        (None, 1.0, 1),
        3.0,
    ),
    ServerField(
        "draft_vocab_size",
        f"{VLLM} compute_logits (d2t); {SGLANG} does not serve it",
        "honoured",
        "an own LM head over a reduced vocabulary",
        (None,),
        32,
    ),
    # -- family switches --
    ServerField(
        "architectures",
        f"{VLLM} models/registry.py, {SGLANG} models/dflash.py / dspark.py",
        "honoured",
        "DFlashDraftModel, DFlash2DraftModel or Qwen3DSparkModel (its modules and block layout; SpecForge's "
        "DSparkDraftModel is read as Qwen3DSparkModel); any other family is refused",
        (None, ["DFlashDraftModel"]),
        ["Qwen3DSparkModel"],
    ),
    ServerField(
        "projector_type",
        f"{SGLANG} models/dflash.py",
        "refused",
        "another projector family in place of fc + hidden_norm ('dspark', SpecForge's DSpark spelling, is read "
        "as the DSpark family)",
        (None,),
        "domino",
        read_as_family=("dspark",),
    ),
    ServerField(
        "dflash_config.projector_type",
        f"{SGLANG} models/dflash.py (SpecForge writes it here)",
        "refused",
        "as projector_type",
        (None,),
        "domino",
        read_as_family=("dspark",),
    ),
    # -- DSpark (vLLM qwen3_dspark.py and v1/worker/gpu/spec_decode/dspark/; SGLang models/dspark.py and
    # speculative/dspark_components/dspark_config.py, which also reads dflash_config.X, dspark_config.X, dspark_X) --
    ServerField(
        "markov_rank",
        f"{VLLM} qwen3_dspark.py DSparkMarkovHead, {SGLANG} build_markov_head",
        "honoured",
        "the rank of the Markov head: each draft's logits get W2 W1[previous draft]",
        (None, 0),
        4,
        "dspark",
    ),
    ServerField(
        "enable_confidence_head",
        f"{VLLM} qwen3_dspark.py (absent: off), {SGLANG} build_confidence_head (absent: on)",
        "honoured",
        "a confidence head estimating each draft's acceptance; written always",
        (None, False),
        True,
        "dspark",
    ),
    ServerField(
        "confidence_head_with_markov",
        f"{VLLM} qwen3_dspark.py (absent: false), {SGLANG} build_confidence_head (absent: markov_rank > 0)",
        "honoured",
        "the confidence head also reads the previous draft's Markov embedding; written always",
        (None, False),
        True,
        "dspark",
    ),
    ServerField(
        "dspark_draft_topk",
        f"{VLLM} dspark/speculator.py _sample_sequential_topk ({SGLANG} does not read it)",
        "honoured",
        "the Markov bias is added to the top-k base candidates only; the rest are excluded",
        (None,),
        2,
        "dspark",
    ),
    ServerField(
        "markov_head_type",
        f"{SGLANG} build_markov_head ({VLLM} builds the vanilla head only)",
        "refused",
        "a gated or recurrent Markov head (gate_proj / joint_proj tensors)",
        (None, "vanilla"),
        "gated",
    ),
    ServerField(
        "sample_from_anchor",
        f"{VLLM} dspark/speculator.py ({SGLANG} always drafts anchor-first)",
        "refused",
        "false: the fill-in layout (1 + N queries), which SGLang would serve anchor-first",
        (None, True),
        False,
    ),
    ServerField(
        "speculators_model_type",
        f"{SGLANG} models/dspark.py (refused there)",
        "refused",
        "'dspark': the speculators layout (slot j drafts anchor + j, slot 0 unused)",
        (None,),
        "dspark",
    ),
)

BY_NAME = {f.name: f for f in SERVER_FIELDS}


def value_of(d: dict[str, Any], name: str) -> Any:
    """The value of a (possibly dotted) field in a raw config.json, None when absent."""
    head, _, rest = name.partition(".")
    value = d.get(head)
    if rest:
        return value.get(rest) if isinstance(value, dict) else None
    return value


def is_neutral(field: ServerField, value: Any) -> bool:
    return (
        any(value == n and type(value) is not bool or value is n for n in field.neutral) if value is not None else True
    )


def refuse_unsupported(d: dict[str, Any], source: str) -> None:
    """One line for the first refused field whose value would change the drafter."""
    for field in SERVER_FIELDS:
        if field.handling != "refused":
            continue
        value = value_of(d, field.name)
        if not is_neutral(field, value) and value not in field.read_as_family:
            raise FlashdraftError(
                f"{source}: field '{field.name}' is {value!r}; read by {field.read_by}: {field.effect}, which "
                f"flashdraft does not build (expected {_neutral_words(field)})"
            )


def _neutral_words(field: ServerField) -> str:
    values = [repr(v) for v in field.neutral if v is not None]
    return "absent" + (f" or {' / '.join(values)}" if values else "")


def fields_set(d: dict[str, Any]) -> list[tuple[ServerField, Any]]:
    """The table's fields a raw config.json sets to a non-neutral value (doctor lists them)."""
    return [(f, value_of(d, f.name)) for f in SERVER_FIELDS if not is_neutral(f, value_of(d, f.name))]
