"""The drafter's configuration: exactly the public DFlash `config.json` (a Qwen3 config
plus `block_size`, `num_target_layers` and `dflash_config`), validated on load.

Attention per layer is resolved as the servers resolve it (vLLM 0.33.0
`qwen3_dflash.py` `_resolve_layer_attention`, SGLang 0.5.23 `models/dflash.py`, the z-lab
reference): a `sliding_attention` layer is causal within the block, a `full_attention` one
is not, unless the config says otherwise (`is_causal`, then `dflash_config.causal`);
`dflash_config.use_swa` / `swa_window_size` are other spellings of the layer types and the
window. On load every spelling is resolved into `layer_types`, `sliding_window` and
`is_causal` (`drafter.config_spellings` reads the dialects and spellings), and those are what flashdraft writes,
so no server has to guess. The family's facts (architecture, default block, layout) are `drafter.families`'."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.drafter.config_spellings import DFLASH2_FIELDS, REFERENCE_OPTIONS, config_fields
from flashdraft.drafter.families import DEFAULT_BLOCK_SIZE, FAMILIES, family
from flashdraft.drafter.rope import DEFAULT_MAX_POSITIONS, DRAFTER_THETA, as_scaling, check_scaling, rope_fields
from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError
from flashdraft.target.vision import POSITION_SCHEMES

LAYER_TYPES = ("full_attention", "sliding_attention")

DEFAULT_MASK_TOKEN = "<|MASK|>"  # SGLang's default dflash_config.mask_token


@dataclass(frozen=True)
class LayerAttention:
    """How one drafter layer attends. causal: a block query sees block keys at or before its
    own position only; window: keys with q - k < window (non-causal: |q - k| < window), None
    for full attention."""

    causal: bool
    window: int | None

    def describe(self) -> str:
        kind = "full" if self.window is None else f"sliding window {self.window}"
        return f"{kind}, {'causal' if self.causal else 'non-causal'} within the block"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Reference default: n = 1 gives [L // 2]; otherwise n ids spread from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise FlashdraftError(
            f"target has {num_target_layers} layers; the default layer ids need at least 4 "
            f"(give --draft-layers 1 or explicit ids)"
        )
    span = num_target_layers - 4
    ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    if len(set(ids)) < len(ids):
        raise FlashdraftError(
            f"the default target_layer_ids for {num_draft_layers} drafter layers on a {num_target_layers}-layer "
            f"target collide ({ids}); give --target-layer-ids or fewer --draft-layers"
        )
    return ids


# The servers' rule for target_layer_ids (vLLM 0.33.0 and SGLang 0.5.23 capture target
# layers in layer order), said the same way by every flag and field that takes layer ids.
LAYER_ORDER_RULE = "unique, strictly increasing ids: vLLM and SGLang capture target layers in layer order"


def strictly_increasing(ids: list[int]) -> bool:
    """True when `ids` are unique and in increasing order (the order servers capture layers in)."""
    return all(b > a for a, b in zip(ids, ids[1:], strict=False))


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = DRAFTER_THETA
    rope_scaling: dict | None = None
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # in-block causality of every layer; None: the servers' default (sliding causal, full not)
    is_causal: bool | None = None
    # a reduced drafter vocabulary with its own LM head and `d2t` (None: the target's LM head)
    draft_vocab_size: int | None = None
    # a name of `flashdraft.drafter.families.FAMILIES`; DFlash2's module sizes, 0 in the other families
    family: str = "dflash"
    conv_kernel_size: int = 0  # taps of the grouped dynamic causal convolution
    conv_group_size: int = 0  # channels sharing one dynamic kernel correction
    selector_rank: int = 0  # rank of the candidate selector's codebooks
    selector_top_k: int = 0  # unary candidates per position the selector chooses among
    # DSpark ("dspark"): the Markov head's rank (0 in the other families), the confidence head and whether it reads
    # the Markov embedding of the previous token, and vLLM's dspark_draft_topk (the Markov bias applied to the top-k
    # base candidates only, every other token excluded; None: the whole vocabulary)
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_head_with_markov: bool = False
    draft_top_k: int | None = None
    # RoPE rotates the first int(head_dim * factor) dims of each q/k head (vLLM get_rope, SGLang)
    partial_rotary_factor: float = 1.0
    # conventions of stored weights that flashdraft folds into its own on load (`server_fields`):
    # (1 + w) RMSNorms (SGLang use_gemma_norm) and GPT-J rotation (is_neox_style false)
    gemma_norm: bool = False
    rope_neox_style: bool = True
    # the longest context (tokens before the anchor + the block) flashdraft trained this drafter at, over every
    # stage; a field of flashdraft's own (servers ignore it); None: not recorded (trained elsewhere or before)
    trained_context_length: int | None = None
    # the positions the drafter was trained at beside its target (`flashdraft.target.vision`): "token-index", or
    # "mrope-row-0" as vLLM's DFlash proposer serves an M-RoPE (vision-language) target; flashdraft's own field,
    # servers ignore it; None: not recorded
    trained_positions: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rope_scaling = as_scaling(self.rope_scaling)  # rope_type default: native RoPE, stored as None
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    @property
    def architecture(self) -> str:
        """The `architectures` entry servers build this drafter from."""
        return family(self.family).architecture

    @property
    def first_draft_position(self) -> int:
        """The block position of the first draft, the family's (`Family.first_draft_position`): 1 fill-in (DFlash,
        DFlash2), 0 anchor-first (DSpark). The layout is part of the format: a drafter read in the other layout drafts
        every token one place off (accepted under 1 %, vLLM #56792)."""
        return family(self.family).first_draft_position

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block drafts: block_size - 1 (fill-in) or block_size (anchor-first)."""
        return family(self.family).drafts_per_block(self.block_size)

    def describe_layout(self) -> str:
        """The block layout in words (doctor, init, eval and export say it)."""
        if self.first_draft_position == 0:
            return (
                f"anchor-first (DSpark): the anchor and {self.block_size - 1} masks, every position drafting the "
                f"token after its own: {self.drafts_per_block} drafts per block"
            )
        return (
            f"fill-in (DFlash): the anchor and {self.block_size - 1} masks, each mask drafting the token at its "
            f"position: {self.drafts_per_block} drafts per block"
        )

    def describe_family(self) -> str:
        """The architecture and, for DFlash2 and DSpark, its module sizes (doctor, init and eval say it)."""
        if self.family == "dspark":
            confidence = "none"
            if self.confidence_head:
                confidence = "with the Markov input" if self.confidence_head_with_markov else "hidden state only"
            top_k = f"; Markov bias on the top-{self.draft_top_k} base candidates" if self.draft_top_k else ""
            return f"{self.architecture} (Markov head rank {self.markov_rank}; confidence head: {confidence}{top_k})"
        if self.family != "dflash2":
            return self.architecture
        return (
            f"{self.architecture} (conv kernel {self.conv_kernel_size}, group {self.conv_group_size}; selector "
            f"rank {self.selector_rank}, top-{self.selector_top_k})"
        )

    @property
    def rotary_dim(self) -> int:
        """Dims of each q/k head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def in_own_conventions(self) -> bool:
        """True when the weights follow flashdraft's conventions (plain RMSNorms, NeoX rotation)."""
        return not self.gemma_norm and self.rope_neox_style

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's attention, as vLLM, SGLang and the reference serve it."""
        return [
            LayerAttention(
                causal=(t == "sliding_attention") if self.is_causal is None else self.is_causal,
                window=self.sliding_window if t == "sliding_attention" else None,
            )
            for t in self.layer_types
        ]

    @property
    def causality_source(self) -> str:
        """Where the layers' causality comes from (for doctor/eval/export to say)."""
        if self.is_causal is not None:
            return f"is_causal: {str(self.is_causal).lower()}"
        return "no is_causal: the servers' default (sliding_attention causal, full_attention non-causal)"

    def describe_layers(self) -> str:
        """Each layer's attention as served, runs of equal layers grouped, e.g. '0-3 sliding 2048
        causal, 4 full non-causal; servers' default: no is_causal' (doctor, eval and export say it)."""
        runs: list[tuple[int, int, LayerAttention]] = []
        for i, a in enumerate(self.layer_attention):
            if runs and runs[-1][2] == a:
                runs[-1] = (runs[-1][0], i, a)
            else:
                runs.append((i, i, a))
        parts = [
            f"{first if first == last else f'{first}-{last}'} "
            f"{'full' if a.window is None else f'sliding {a.window}'} {'causal' if a.causal else 'non-causal'}"
            for first, last, a in runs
        ]
        source = "servers' default: no is_causal" if self.is_causal is None else self.causality_source
        return f"{', '.join(parts)}; {source}"

    @property
    def dflash_options(self) -> dict[str, Any]:
        """dflash_config fields beyond target_layer_ids and mask_token_id (mask_token, ...)."""
        return dict(self.extra.get("dflash_config") or {})

    @property
    def attention_value_scale(self) -> float | None:
        """dflash_config.attention_value_scale: every layer's attention values (block and context) times it, as
        vLLM 0.33.0 qwen3_dflash.py (v_scale) and SGLang 0.5.23 models/dflash.py compute them (None: unscaled)."""
        return (self.extra.get("dflash_config") or {}).get("attention_value_scale")

    def reference_option(self, name: str) -> Any:
        """input_embedding_scale, output_multiplier or final_logit_softcapping (default if unset)."""
        value = (self.extra.get("dflash_config") or {}).get(name)  # no copy: read on every drafting step
        return REFERENCE_OPTIONS[name] if value is None else value

    @property
    def mask_token(self) -> str | None:
        return self.dflash_options.get("mask_token")

    def validate(self, source: str = "config") -> None:
        def bad(field_name: str, found: Any, expected: str) -> FlashdraftError:
            return FlashdraftError(f"{source}: field '{field_name}' is {found!r}; expected {expected}")

        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_target_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "a positive integer")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad("block_size", self.block_size, "an integer >= 2 (the anchor plus at least one draft)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
            )
        ids = self.target_layer_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise bad("dflash_config.target_layer_ids", ids, "a non-empty list of layer indices")
        if any(not 0 <= i < self.num_target_layers for i in ids):
            raise bad(
                "dflash_config.target_layer_ids", ids, f"indices in 0..{self.num_target_layers - 1} (num_target_layers)"
            )
        if not strictly_increasing(ids):  # the servers' rule: other orders reach the drafter permuted or are refused
            raise bad("dflash_config.target_layer_ids", ids, f"{LAYER_ORDER_RULE} (e.g. {sorted(set(ids))})")
        self._validate_layers(bad)
        self._validate_rope(source, bad)
        self._validate_dflash2(bad)
        self._validate_dspark(bad)
        self._validate_options(bad)

    def _validate_layers(self, bad) -> None:
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("dflash_config.mask_token_id", self.mask_token_id, f"a token id in 0..{self.vocab_size - 1}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", self.layer_types, f"{self.num_hidden_layers} entries (num_hidden_layers)")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise bad("layer_types", t, f"one of {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise bad("sliding_window", self.sliding_window, "a positive integer (layer_types has sliding layers)")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise bad("is_causal", self.is_causal, "true, false or absent")
        if self.draft_vocab_size is not None and (
            not isinstance(self.draft_vocab_size, int) or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise bad("draft_vocab_size", self.draft_vocab_size, f"an integer in 1..{self.vocab_size} (vocab_size)")

    def _validate_rope(self, source: str, bad) -> None:
        check_scaling(self.rope_scaling, f"{source}: field 'rope_scaling'")
        reach = self.trained_context_length
        if reach is not None and (not isinstance(reach, int) or isinstance(reach, bool) or reach < 1):
            raise bad("trained_context_length", reach, "a positive integer or absent (not recorded)")
        if self.trained_positions is not None and self.trained_positions not in POSITION_SCHEMES:
            raise bad("trained_positions", self.trained_positions, f"one of {', '.join(POSITION_SCHEMES)} or absent")
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise bad("partial_rotary_factor", factor, "a number in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise bad(
                "partial_rotary_factor",
                factor,
                f"a factor giving an even rotary width of 2 or more (head_dim {self.head_dim} x {factor} = "
                f"{self.head_dim * factor:g})",
            )

    def _validate_dflash2(self, bad) -> None:
        if self.family not in FAMILIES:
            raise bad("architectures", self.family, f"one of {', '.join(f.architecture for f in FAMILIES.values())}")
        for name in DFLASH2_FIELDS:
            value = getattr(self, name)
            if self.family == "dflash2" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise bad(f"dflash_config.{name}", value, "a positive integer (a DFlash2DraftModel needs it)")
            if self.family == "dflash" and value:
                raise bad(
                    f"dflash_config.{name}",
                    value,
                    "absent in a DFlashDraftModel: a DFlash2 field (plain DFlash serving ignores it); a DFlash2 "
                    'drafter says architectures ["DFlash2DraftModel"]',
                )
        if self.family == "dflash2":
            if self.hidden_size % self.conv_group_size:
                raise bad(
                    "dflash_config.conv_group_size",
                    self.conv_group_size,
                    f"a divisor of hidden_size ({self.hidden_size})",
                )
            if self.selector_top_k > self.vocab_size:
                raise bad(
                    "dflash_config.selector_top_k", self.selector_top_k, f"at most vocab_size ({self.vocab_size})"
                )
            if self.draft_vocab_size is not None:
                raise bad(
                    "draft_vocab_size",
                    self.draft_vocab_size,
                    "absent in a DFlash2 drafter: its selector covers the full target vocabulary",
                )

    def _validate_options(self, bad) -> None:
        options = self.dflash_options
        for name in ("input_embedding_scale", "output_multiplier", "attention_value_scale"):
            value = options.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or value == float("inf")
            ):
                raise bad(f"dflash_config.{name}", value, "a positive finite number")
        cap = options.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap < 0):
            raise bad("dflash_config.final_logit_softcapping", cap, "a positive number, 0 or absent (no capping)")
        mask_token = options.get("mask_token")
        if mask_token is not None and (not isinstance(mask_token, str) or not mask_token):
            raise bad("dflash_config.mask_token", mask_token, "a non-empty string (the mask token's text)")

    def _validate_dspark(self, bad) -> None:
        if self.family != "dspark":
            for name, value in (
                ("markov_rank", self.markov_rank),
                ("enable_confidence_head", self.confidence_head),
                ("dspark_draft_topk", self.draft_top_k),
            ):
                if value:
                    raise bad(
                        name,
                        value,
                        f"absent in a {self.architecture}: a DSpark field; a DSpark drafter says "
                        f'architectures ["Qwen3DSparkModel"]',
                    )
            return
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 1:
            raise bad(
                "markov_rank",
                self.markov_rank,
                f"a positive integer (a DSpark drafter's Markov head; {VLLM} and {SGLANG} refuse 0)",
            )
        for name, value in (
            ("enable_confidence_head", self.confidence_head),
            ("confidence_head_with_markov", self.confidence_head_with_markov),
        ):
            if not isinstance(value, bool):
                raise bad(name, value, "true or false")
        top_k = self.draft_top_k
        if top_k is not None and (
            not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= self.vocab_size
        ):
            raise bad("dspark_draft_topk", top_k, f"an integer in 1..{self.vocab_size} (vocab_size) or absent")
        if self.draft_vocab_size is not None:
            raise bad(
                "draft_vocab_size",
                self.draft_vocab_size,
                "absent in a DSpark drafter: flashdraft builds its Markov head over the full target vocabulary",
            )
        for name in REFERENCE_OPTIONS:  # vLLM's qwen3_dspark.py reads none of them: it would serve another drafter
            value = self.dflash_options.get(name)
            if (
                value is not None
                and value != REFERENCE_OPTIONS[name]
                and not (name == "final_logit_softcapping" and value == 0)
            ):
                raise bad(
                    f"dflash_config.{name}",
                    value,
                    f"absent in a DSpark drafter ({VLLM} qwen3_dspark.py does not read it)",
                )
        if self.attention_value_scale not in (None, 1, 1.0):  # read by the DFlash models only
            raise bad(
                "dflash_config.attention_value_scale",
                self.attention_value_scale,
                f"absent in a DSpark drafter ({VLLM} qwen3_dspark.py and {SGLANG} models/dspark.py do not read it)",
            )

    # -- public config.json ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        own = asdict(self)
        own.pop("extra")
        own.pop("family")
        dflash = {"target_layer_ids": own.pop("target_layer_ids"), "mask_token_id": own.pop("mask_token_id")}
        for name in DFLASH2_FIELDS:
            value = own.pop(name)
            if self.family == "dflash2":  # as published: DFlash2's fields and its block in dflash_config
                dflash[name] = value
        for name in ("markov_rank", "confidence_head", "confidence_head_with_markov", "draft_top_k"):
            own.pop(name)
        if self.family == "dflash2":
            dflash["block_size"] = self.block_size
        if self.family == "dspark":
            # vLLM 0.33.0 reads these at the top level, DeepSpec too (with target_layer_ids and mask_token_id there);
            # both confidence fields are always written: absent, the servers differ (SGLang 0.5.23 builds a
            # confidence head and reads its Markov input as on, vLLM as off)
            dflash["block_size"] = self.block_size
            own.update(
                markov_rank=self.markov_rank,
                markov_head_type="vanilla",
                enable_confidence_head=self.confidence_head,
                confidence_head_with_markov=self.confidence_head and self.confidence_head_with_markov,
                sample_from_anchor=True,
                target_layer_ids=dflash["target_layer_ids"],
                mask_token_id=dflash["mask_token_id"],
            )
            if self.draft_top_k is not None:
                own["dspark_draft_topk"] = self.draft_top_k
        for name in ("is_causal", "draft_vocab_size", "trained_context_length", "trained_positions"):
            if own[name] is None:  # absent, not null: servers read a present null differently
                del own[name]
        # both schemas, saying the same: a reader of either keeps the scaling
        own.update(rope_fields(self.rope_theta, self.rope_scaling, self.partial_rotary_factor))
        # written only where they change something, in the spellings both servers read alike
        if own["partial_rotary_factor"] == 1.0:
            del own["partial_rotary_factor"]
        if own.pop("gemma_norm"):
            own["use_gemma_norm"] = True
        if not own.pop("rope_neox_style"):
            own["is_neox_style"] = own["rope_is_neox_style"] = False
        causal = {a.causal for a in self.layer_attention}
        if len(causal) == 1:  # say it when every layer shares one causality: no server has to guess
            own["is_causal"] = causal.pop()
        d.update(own)
        d.update(
            architectures=[self.architecture],
            model_type="qwen3",
            dflash_config={**d.get("dflash_config", {}), **dflash},
            use_sliding_window="sliding_attention" in self.layer_types,
            tie_word_embeddings=False,
        )
        return dict(sorted(d.items()))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """A config.json as written, in any dialect and spelling the servers read (`drafter.config_spellings`)."""
        fields_ = config_fields(d, source)
        try:
            return cls(**fields_)
        except FlashdraftError as e:  # name the file, not just "config"
            raise FlashdraftError(str(e).replace("config:", f"{source}:", 1)) from None
        except TypeError as e:
            raise FlashdraftError(f"{source}: a field has the wrong type ({e})") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DrafterConfig:
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FlashdraftError(f"{path}: no config.json; expected a drafter directory") from None
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(d, source=str(path))
