"""The drafter's configuration: exactly the public DFlash `config.json` (a Qwen3 config
plus `block_size`, `num_target_layers` and `dflash_config`), validated on load."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16  # the anchor + 15 drafts: the public drafters' block

# Fields this class owns; anything else found in a config.json is kept in `extra` and
# written back unchanged, so a public config survives a load/save round trip.
_OWN = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "num_target_layers", "block_size", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "attention_bias",
    "layer_types", "sliding_window", "use_sliding_window", "hidden_act", "dflash_config",
    "architectures", "model_type", "tie_word_embeddings",
}  # fmt: skip


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
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    def validate(self, source: str = "config") -> None:
        def bad(field_name: str, found: Any, expected: str) -> FlashdraftError:
            return FlashdraftError(f"{source}: field '{field_name}' is {found!r}; expected {expected}")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "num_target_layers"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "a positive integer")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad("block_size", self.block_size, "an integer >= 2 (the anchor plus at least one draft)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", self.num_key_value_heads,
                      f"a divisor of num_attention_heads ({self.num_attention_heads})")  # fmt: skip
        ids = self.target_layer_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise bad("dflash_config.target_layer_ids", ids, "a non-empty list of layer indices")
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_target_layers for i in ids):
            raise bad("dflash_config.target_layer_ids", ids,
                      f"distinct indices in 0..{self.num_target_layers - 1} (num_target_layers)")  # fmt: skip
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

    # -- public config.json ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        own = asdict(self)
        own.pop("extra")
        dflash = {"target_layer_ids": own.pop("target_layer_ids"), "mask_token_id": own.pop("mask_token_id")}
        d.update(own)
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            dflash_config={**d.get("dflash_config", {}), **dflash},
            use_sliding_window="sliding_attention" in self.layer_types,
            tie_word_embeddings=False,
        )
        return dict(sorted(d.items()))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        if not isinstance(d, dict):
            raise FlashdraftError(f"{source}: expected a JSON object, found {type(d).__name__}")
        dflash = d.get("dflash_config")
        if not isinstance(dflash, dict):
            raise FlashdraftError(f"{source}: field 'dflash_config' is {dflash!r}; expected an object with "
                                  f"target_layer_ids and mask_token_id (is this a DFlash drafter?)")  # fmt: skip
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "vocab_size", "num_target_layers"]  # fmt: skip
        for name in required:
            if name not in d:
                raise FlashdraftError(f"{source}: field '{name}' is missing; expected an integer")
        for name in ("target_layer_ids", "mask_token_id"):
            if name not in dflash:
                raise FlashdraftError(f"{source}: field 'dflash_config.{name}' is missing")
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
            # transformers 5 writes rope_parameters instead of rope_theta/rope_scaling
            params = dict(d["rope_parameters"])
            rope_theta = params.pop("rope_theta", 1e6)
            rope_scaling = params if params.get("rope_type", "default") != "default" else None
        if "sliding_attention" in (d.get("layer_types") or []) and d.get("use_sliding_window") is False:
            warnings.warn(
                f"{source}: layer_types has sliding_attention layers but use_sliding_window is false; "
                f"transformers-based loaders would run them as FULL attention. flashdraft honours "
                f"layer_types (window {d.get('sliding_window')}); check what your server does.",
                stacklevel=2,
            )
        heads = d["num_attention_heads"]
        try:
            return cls(
                hidden_size=d["hidden_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                intermediate_size=d["intermediate_size"],
                vocab_size=d["vocab_size"],
                num_target_layers=d["num_target_layers"],
                target_layer_ids=list(dflash["target_layer_ids"])
                if isinstance(dflash["target_layer_ids"], list)
                else dflash["target_layer_ids"],
                mask_token_id=dflash["mask_token_id"],
                block_size=d.get("block_size", DEFAULT_BLOCK_SIZE),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta if rope_theta is not None else 1e6,
                rope_scaling=rope_scaling,
                max_position_embeddings=d.get("max_position_embeddings", 40960),
                attention_bias=d.get("attention_bias", False),
                layer_types=list(d.get("layer_types") or []),
                sliding_window=d.get("sliding_window"),
                hidden_act=d.get("hidden_act", "silu"),
                extra={k: v for k, v in d.items() if k not in _OWN},
            )
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
