"""A drafter's RoPE fields in both config.json schemas: the legacy `rope_theta` + `rope_scaling`
(transformers 4 and the readers built on it) and transformers 5's `rope_parameters` (what
transformers 5.23 `save_pretrained` writes, and what vLLM 0.33.0 `get_rope` is given).

Read as transformers 5.23 `Qwen3Config` reads them: the scaling from either key (`rope_scaling`
null or {} reads as absent), `rope_theta` from `rope_parameters`, `rope_scaling` or the top level,
`original_max_position_embeddings` filled from `max_position_embeddings` where a scaling type
needs it. Where both keys are given and disagree, transformers silently takes `rope_scaling` and a
reader of the other key would serve another drafter: refused, one line naming both. Written in
both schemas (reference doc section 10: a reader of the legacy key alone otherwise serves a YaRN
drafter without YaRN)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError

# The scaled RoPE types flashdraft computes (transformers' ROPE_INIT_FUNCTIONS, which the drafter's rotary
# embedding calls), with the keys transformers 5.23's validators require and the ones they accept besides.
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("attention_factor", "factor")),
}
# types whose original_max_position_embeddings transformers 5 fills in from max_position_embeddings
_FILLED = ("yarn", "llama3", "longrope")
# keys of the rotary width, not of the scaling: resolved by `resolve_rotary_width`
_WIDTH = ("partial_rotary_factor", "rope_dim")
DEFAULT_THETA = 10_000.0  # transformers 5.23 RotaryEmbeddingConfigMixin.default_theta: a config without rope_theta
DEFAULT_MAX_POSITIONS = 40960  # DrafterConfig's max_position_embeddings when a config has none
# a drafter's rope_theta when nothing names one: DrafterConfig's default, and a fresh drafter's when its target's config
# names none (a config.json read without one takes transformers' DEFAULT_THETA, as the servers read it)
DRAFTER_THETA = 1e6
EXAMPLE = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}'


@dataclass(frozen=True)
class Rope:
    """A drafter's RoPE: the base frequency, the scaling (None: native RoPE) and the rotated fraction of a head."""

    theta: float
    scaling: dict | None
    partial_rotary_factor: float


def normalized(scaling: Any, where: str) -> Any:
    """`scaling` with transformers' legacy `type` read as `rope_type` (rope_type "default" when absent); None for
    null and {} (transformers reads `rope_scaling or rope_parameters`). Non-dicts are returned for the caller to
    refuse."""
    if not isinstance(scaling, dict) or not scaling:
        return None if scaling in (None, {}) else scaling
    out = dict(scaling)
    legacy = out.pop("type", None)
    if legacy is not None and out.get("rope_type", legacy) != legacy:
        raise FlashdraftError(f"{where} has rope_type {out['rope_type']!r} and type {legacy!r}; expected one type")
    out["rope_type"] = out.get("rope_type", legacy or "default")
    return out


def as_scaling(scaling: Any, where: str = "rope_scaling") -> Any:
    """A DrafterConfig's rope_scaling: normalized, None for native RoPE (rope_type default and nothing else)."""
    out = normalized(scaling, where)
    return None if out == {"rope_type": "default"} else out


def check_scaling(scaling: Any, where: str, strict: bool = False) -> None:
    """Refuse a scaling flashdraft cannot compute as the servers do: an unknown rope_type, a missing required key
    (transformers 5.23's validators), a factor that is not a positive number; `strict` (a flag): keys
    transformers does not know too (it would only warn and ignore them)."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise FlashdraftError(f"{where} is {scaling!r}; expected an object such as {EXAMPLE}")
    kind = scaling.get("rope_type")
    if kind == "default":
        return
    if kind not in ROPE_TYPES:
        raise FlashdraftError(
            f"{where} is {json.dumps(scaling)}: rope_type {kind!r}; expected one of default, "
            f"{', '.join(ROPE_TYPES)} (transformers' RoPE types)"
        )
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise FlashdraftError(
            f"{where} is {json.dumps(scaling)}; expected {', '.join(missing)} too (rope_type "
            f"{kind} needs {', '.join(required)})"
        )
    factor = scaling.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0):
        raise FlashdraftError(f"{where} is {json.dumps(scaling)}: factor {factor!r}; expected a positive number")
    unknown = [k for k in scaling if k not in ("rope_type", *required, *optional, *_WIDTH)]
    if strict and unknown:
        raise FlashdraftError(
            f"{where} is {json.dumps(scaling)}: unknown key {unknown[0]!r}; rope_type {kind} "
            f"takes {', '.join((*required, *optional))}"
        )


def parse_rope_scaling(text: str) -> dict:
    """A scaling as a flag gives it (JSON), checked strictly; {"rope_type": "default"} means native RoPE (it
    removes a scaling the drafter has). Raises FlashdraftError saying what was found and expected."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise FlashdraftError(
            f"{text!r} is not valid JSON ({e.msg} at column {e.colno}); expected an object such as {EXAMPLE}"
        ) from None
    if not isinstance(value, dict) or not value:
        raise FlashdraftError(f"{text!r}: expected a JSON object such as {EXAMPLE}")
    if "rope_theta" in value:  # one base frequency per drafter: the config's rope_theta (init --rope-theta)
        raise FlashdraftError(
            f"{text!r}: rope_theta is not a scaling key; expected it left out (the drafter keeps "
            f"its rope_theta; init --rope-theta sets it)"
        )
    wrong = [k for k in _WIDTH if k in value]
    if wrong:
        raise FlashdraftError(f"{text!r}: {wrong[0]} is the rotary width, not a scaling key; expected it left out")
    scaling = normalized(value, "the scaling")
    check_scaling(scaling, "the scaling", strict=True)
    return scaling


def _filled(scaling: dict | None, max_positions: Any) -> dict | None:
    if isinstance(scaling, dict) and scaling.get("rope_type") in _FILLED:
        scaling.setdefault("original_max_position_embeddings", max_positions)
    return scaling


def _differences(legacy: dict, params: dict) -> list[str]:
    """The keys on which rope_scaling and rope_parameters disagree (rope_theta compared apart; a rotary-width key
    only when both give it: the top-level partial_rotary_factor is the legacy schema's spelling)."""
    keys = sorted(set(legacy) | set(params))
    return [
        k
        for k in keys
        if k != "rope_theta"
        and not (k in _WIDTH and (k not in legacy or k not in params))
        and legacy.get(k) != params.get(k)
    ]


def read_rope(d: dict[str, Any], source: str) -> Rope:
    """The RoPE of a raw config.json (see the module docstring); refuses schemas that disagree."""
    found = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = d.get(name)
        if value is not None and not isinstance(value, dict):
            raise FlashdraftError(f"{source}: field '{name}' is {value!r}; expected an object or absent")
        max_positions = d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
        found[name] = _filled(normalized(value, f"{source}: field '{name}'"), max_positions)
    legacy, params = found["rope_scaling"], found["rope_parameters"]
    thetas = [
        (name, value)
        for name, value in (
            ("rope_parameters.rope_theta", (params or {}).get("rope_theta")),
            ("rope_scaling.rope_theta", (legacy or {}).get("rope_theta")),
            ("rope_theta", d.get("rope_theta")),
        )
        if value is not None
    ]
    other = next((t for t in thetas[1:] if t[1] != thetas[0][1]), None)
    if other is not None:
        raise FlashdraftError(
            f"{source}: fields '{thetas[0][0]}' ({thetas[0][1]!r}) and '{other[0]}' ({other[1]!r}) "
            f"disagree; expected one RoPE base frequency (transformers 5.23 takes the nested one, "
            f"a reader of the other field serves another drafter)"
        )
    if legacy is not None and params is not None:
        bad = _differences(legacy, params)
        if bad:
            raise FlashdraftError(
                f"{source}: fields 'rope_scaling' ({json.dumps(legacy)}) and 'rope_parameters' ({json.dumps(params)}) "
                f"disagree on {', '.join(bad)}; expected one RoPE scaling (transformers 5.23 silently takes "
                f"rope_scaling, a reader of rope_parameters alone serves another drafter)"
            )
    chosen = "rope_scaling" if legacy is not None else "rope_parameters"
    scaling = legacy if legacy is not None else params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    scaling, partial = resolve_rotary_width(d, scaling, source)
    check_scaling(scaling, f"{source}: field '{chosen}'")
    return Rope(thetas[0][1] if thetas else DEFAULT_THETA, scaling, partial)


def resolve_rotary_width(d: dict[str, Any], rope_scaling: dict | None, source: str) -> tuple[dict | None, float]:
    """(rope_scaling without the rotary-width keys, partial_rotary_factor) from every spelling the servers
    read: rope_parameters.partial_rotary_factor (vLLM get_rope), the top-level partial_rotary_factor
    (SGLang; transformers folds it into rope_parameters), rope_scaling.rope_dim (SGLang, the rotary
    width itself, over the factor). Spellings that disagree are refused: the servers would differ."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    nested, top = params.get("partial_rotary_factor"), d.get("partial_rotary_factor")
    if nested is not None and top is not None and nested != top:
        raise FlashdraftError(
            f"{source}: field 'rope_parameters.partial_rotary_factor' is {nested!r} but 'partial_rotary_factor' is "
            f"{top!r}; expected one value ({VLLM} reads the first, {SGLANG} the second)"
        )
    factor = nested if nested is not None else top
    scaling = dict(rope_scaling) if isinstance(rope_scaling, dict) else rope_scaling
    rope_dim = None
    if isinstance(scaling, dict):
        rope_dim = scaling.pop("rope_dim", None)
        inner = scaling.pop("partial_rotary_factor", None)
        factor = inner if factor is None else factor
        scaling = scaling if scaling.get("rope_type", "default") != "default" else None
    if rope_dim is not None:
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or not 0 < rope_dim <= head_dim:
            raise FlashdraftError(
                f"{source}: field 'rope_scaling.rope_dim' is {rope_dim!r}; expected an integer in "
                f"1..{head_dim} (head_dim)"
            )
        if factor is not None and int(head_dim * factor) != rope_dim:
            raise FlashdraftError(
                f"{source}: field 'rope_scaling.rope_dim' is {rope_dim} but partial_rotary_factor {factor} gives "
                f"{int(head_dim * factor)} rotary dims; expected them to agree ({SGLANG} rotates rope_dim dims, "
                f"{VLLM} head_dim x partial_rotary_factor)"
            )
        factor = rope_dim / head_dim
    return scaling, 1.0 if factor is None else factor


def rope_fields(theta: float, scaling: dict | None, partial_rotary_factor: float) -> dict[str, Any]:
    """The RoPE fields flashdraft writes: rope_theta and rope_scaling (legacy) and rope_parameters (transformers 5:
    the scaling with rope_type and rope_theta, and partial_rotary_factor where it is not 1), saying the same."""
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    if partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = partial_rotary_factor
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None, "rope_parameters": params}


def scaling_key(scaling: dict | None) -> tuple:
    """(rope_type, factor, original_max_position_embeddings): what two scalings are compared by."""
    s = scaling or {}
    return s.get("rope_type", "default"), s.get("factor"), s.get("original_max_position_embeddings")


def describe_scaling(scaling: dict | None) -> str:
    """'native (no scaling)' or e.g. 'yarn factor 4, original_max_position_embeddings 1024'."""
    kind, factor, original = scaling_key(scaling)
    if kind == "default":
        return "native (no scaling)"
    parts = [f"factor {factor:g}" if factor is not None else ""] + (
        [f"original_max_position_embeddings {original}"] if original is not None else []
    )
    return f"{kind} {', '.join(p for p in parts if p)}".strip()


def target_rope(config: Any) -> tuple[float | None, dict | None]:
    """(rope_theta, scaling) of a target's transformers config (transformers 5 rope_parameters, flat or per layer
    type: its full-attention layers'; else the legacy fields); rope_theta None when it names none. The one reader of a
    target's RoPE: init copies its rope_theta (`target_theta`), the long-context guards compare against both."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return theta, as_scaling(scaling or None, "the target's rope_parameters")


def target_theta(config: Any) -> float:
    """The target's rope_theta (`target_rope`), DRAFTER_THETA when its config names none: what a drafter made for
    it starts with."""
    theta = target_rope(config)[0]
    return DRAFTER_THETA if theta is None else theta
