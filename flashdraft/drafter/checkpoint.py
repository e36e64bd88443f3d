"""Drafter checkpoints in the public DFlash format, loaded strictly.

A drafter directory is `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`), keys and shapes exactly as section 1 of the reference
doc. Loading never leaves a tensor randomly initialised: every missing, unexpected or
wrongly shaped tensor is an error that names it, with the shape found and expected.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE, DrafterConfig
from flashdraft.drafter.families import family
from flashdraft.drafter.model import DFlashDrafter, is_dflash2_parameter
from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError
from flashdraft.files import nbytes, write_atomic, write_text_atomic
from flashdraft.safe_load import load_tensors_only

if TYPE_CHECKING:
    from flashdraft.target.model import TargetModel

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every public tensor key with its shape, derived from the config alone."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_context_layers * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.bias": (h,),
            }
        if cfg.family == "dflash2":  # base_kernel without `.weight`, as published
            k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {
                    f"{p}{conv}.base_kernel": (2, k, h),
                    f"{p}{conv}.kernel_projection.weight": (2 * k * groups, h),
                }
    if cfg.family == "dflash2":  # the codebooks without `.weight`, as published
        r = cfg.selector_rank
        shapes |= {
            "candidate_selector.predecessor_codebook": (cfg.vocab_size, r),
            "candidate_selector.successor_codebook": (cfg.vocab_size, r),
            "candidate_selector.hidden_projection.weight": (r, h),
        }
    if cfg.family == "dspark":  # vLLM 0.33.0 qwen3_dspark.py: markov_w2 is [draft vocab, r]
        r, v = cfg.markov_rank, cfg.vocab_size
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
        if cfg.confidence_head:
            shapes |= {
                "confidence_head.proj.weight": (1, h + (r if cfg.confidence_head_with_markov else 0)),
                "confidence_head.proj.bias": (1,),
            }
    if cfg.draft_vocab_size is not None:  # an own LM head over a reduced vocabulary (vLLM's convention)
        shapes["lm_head.weight"] = (cfg.draft_vocab_size, h)
        if cfg.draft_vocab_size < cfg.vocab_size:
            shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


# EAGLE-3 drafters also ship t2d ([vocab] bool, target id -> in the draft vocabulary); vLLM skips it,
# flashdraft checks it agrees with d2t and drops it.
OPTIONAL_TENSORS = ("t2d",)
# A full-vocabulary embedding and LM head of the drafter's own (DeepSpec saves frozen copies of the target's):
# vLLM 0.33.0 uses them in place of the target's when present, so the drafter keeps them; SGLang 0.5.23's DSpark
# skips them (`doctor --serving` compares them with the target's)
OWN_VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def own_vocabulary_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, int]]:
    """The optional own embedding and LM head a checkpoint may carry, with their shapes ({} with a reduced
    vocabulary, whose lm_head is required and whose embedding is the target's)."""
    if cfg.draft_vocab_size is not None:
        return {}
    return dict.fromkeys(OWN_VOCABULARY_TENSORS, (cfg.vocab_size, cfg.hidden_size))


def check_vocabulary_map(cfg: DrafterConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """d2t must map draft ids to distinct target ids inside the vocabulary (and agree with t2d)."""
    d2t = state.get("d2t")
    if d2t is None:
        if "t2d" in state:
            raise FlashdraftError(f"{source}: tensor 't2d' without 'd2t'; expected both or neither")
        return
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise FlashdraftError(f"{source}: tensor 'd2t' has dtype {d2t.dtype}; expected an integer tensor")
    target_ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if bool(((target_ids < 0) | (target_ids >= cfg.vocab_size)).any()):
        bad = int(((target_ids < 0) | (target_ids >= cfg.vocab_size)).nonzero()[0])
        raise FlashdraftError(
            f"{source}: tensor 'd2t' maps draft id {bad} to target id {int(target_ids[bad])}; expected target ids "
            f"in 0..{cfg.vocab_size - 1} (target id = i + d2t[i])"
        )
    if target_ids.unique().numel() != target_ids.numel():
        raise FlashdraftError(f"{source}: tensor 'd2t' maps two draft ids to one target id; expected distinct ids")
    t2d = state.get("t2d")
    if t2d is not None:
        expected = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        expected[target_ids] = True
        if tuple(t2d.shape) != (cfg.vocab_size,) or not torch.equal(t2d.cpu().bool(), expected):
            raise FlashdraftError(
                f"{source}: tensor 't2d' (shape {list(t2d.shape)}) disagrees with 'd2t'; expected [{cfg.vocab_size}] "
                f"true exactly at the target ids d2t maps to"
            )


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` + `model.safetensors` in the public format (each file atomically)."""
    return save_drafter_state(model.config, model.state_dict(), out_dir, dtype)


def save_drafter_state(
    cfg: DrafterConfig, state_dict: dict[str, torch.Tensor], out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Like `save_drafter`, from a (full, gathered) state dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state_dict.items()}
    check_state_shapes(cfg, {k: tuple(v.shape) for k, v in state.items()}, "drafter being saved")
    config = cfg.to_dict()
    config["dtype"] = str(state["fc.weight"].dtype).removeprefix("torch.")
    # the weights first: a new directory never holds a config.json without its weights
    write_atomic(
        out / WEIGHTS_NAME,
        lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        "the drafter's weights",
        nbytes(state),
    )
    write_text_atomic(out / "config.json", json.dumps(config, indent=2) + "\n", "the drafter's config")
    return out


def weight_files(directory: Path) -> dict[str, Path]:
    """Map each tensor key to the safetensors file that holds it."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FlashdraftError(f"{index}: not a safetensors index (expected a 'weight_map' object)") from None
        files = sorted({directory / f for f in weight_map.values()})
    else:
        raise FlashdraftError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}; expected the drafter's weights there")
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    where[key] = f
        except FileNotFoundError:
            raise FlashdraftError(f"{f}: listed in {INDEX_NAME} but missing") from None
        except (SafetensorError, OSError) as e:
            raise FlashdraftError(f"{f}: not a readable safetensors file (truncated or corrupt: {e})") from None
    return where


def read_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, f in weight_files(directory).items():
        with safe_open(str(f), framework="pt") as sf:
            shapes[key] = tuple(sf.get_slice(key).get_shape())
    return shapes


def check_state_shapes(cfg: DrafterConfig, found: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise on the first inconsistency between found tensor shapes and the config."""
    fc = found.get("fc.weight")
    if fc is not None and len(fc) == 2:
        h = cfg.hidden_size
        if fc[1] % h:
            raise FlashdraftError(
                f"{source}: tensor 'fc.weight' has shape {list(fc)}; in_features {fc[1]} is not a multiple "
                f"of hidden_size {h}, expected [{h}, n * {h}]"
            )
        if fc[1] // h != cfg.num_context_layers:
            raise FlashdraftError(
                f"{source}: tensor 'fc.weight' has shape {list(fc)} ({fc[1] // h} context layers) but the config's "
                f"target_layer_ids {cfg.target_layer_ids} need {[h, cfg.num_context_layers * h]} "
                f"({cfg.num_context_layers} context layers)"
            )
    expected = expected_shapes(cfg)
    for key, shape in expected.items():
        if key not in found:
            why = " (DFlash2's: servers would not notice it missing and serve it random)" * is_dflash2_parameter(key)
            if key.startswith("confidence_head."):
                why = f" (enable_confidence_head is true: {SGLANG} refuses the checkpoint, {VLLM} drops the head)"
            raise FlashdraftError(f"{source}: tensor '{key}' is missing; expected shape {list(shape)}{why}")
        if tuple(found[key]) != shape:
            raise FlashdraftError(f"{source}: tensor '{key}' has shape {list(found[key])}; expected {list(shape)}")
    own = own_vocabulary_shapes(cfg)
    for key in found:
        if key in OPTIONAL_TENSORS and "d2t" in expected:
            continue
        if key in own:
            if tuple(found[key]) != own[key]:
                raise FlashdraftError(
                    f"{source}: tensor '{key}' has shape {list(found[key])}; expected "
                    f"{list(own[key])} (the drafter's own full-vocabulary copy)"
                )
            continue
        if key not in expected:
            raise FlashdraftError(
                f"{source}: unexpected tensor '{key}' with shape {list(found[key])}; "
                f"not part of a {cfg.num_hidden_layers}-layer {cfg.architecture}"
                + (
                    ' (a DFlash2 tensor: config.json would say architectures ["DFlash2DraftModel"])'
                    if is_dflash2_parameter(key) and cfg.family != "dflash2"
                    else ""
                )
                + (
                    ' (a DSpark tensor: config.json would say architectures ["Qwen3DSparkModel"], and '
                    "enable_confidence_head true for the confidence head)"
                    if key.startswith(("markov_head.", "confidence_head."))
                    else ""
                )
            )


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a drafter directory (this project's or any public DFlash drafter), strictly."""
    directory = Path(path)
    if not directory.is_dir():
        raise FlashdraftError(f"{directory}: not a directory; expected a drafter directory with config.json")
    cfg = DrafterConfig.load(directory / "config.json")
    where = weight_files(directory)
    found = read_shapes(directory)
    check_state_shapes(cfg, found, str(directory))
    state = {}
    for key, f in where.items():
        with safe_open(str(f), framework="pt") as sf:
            state[key] = sf.get_tensor(key)
    return _build(cfg, state, str(directory), device, dtype)


def fold_conventions(cfg: DrafterConfig, state: dict[str, torch.Tensor]) -> tuple[DrafterConfig, dict]:
    """The same drafter in flashdraft's conventions (`server_fields`: "folded"): a (1 + w) RMSNorm
    (use_gemma_norm) is a plain one with weight 1 + w; GPT-J rotation of a head's rotary dims
    (pairs 2i, 2i + 1) is NeoX rotation (pairs i, i + d/2) of the same dims permuted, so q/k rows
    and the q/k norm weights are permuted alike: attention scores are unchanged."""
    if cfg.in_own_conventions:
        return cfg, state
    state = dict(state)
    if cfg.gemma_norm:
        for key in [k for k in state if k.endswith("norm.weight")]:
            state[key] = state[key] + 1
    if not cfg.rope_neox_style:
        d, hd = cfg.rotary_dim, cfg.head_dim
        order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2), torch.arange(d, hd)])  # NeoX slot <- GPT-J
        for key in list(state):
            name = key.rsplit(".", 2)
            if len(name) == 3 and name[1] in ("q_proj", "k_proj"):  # [heads * hd, H] or [heads * hd]
                t = state[key]
                state[key] = t.view(-1, hd, *t.shape[1:])[:, order].reshape(t.shape)
            elif len(name) == 3 and name[1] in ("q_norm", "k_norm"):
                state[key] = state[key][order]
    return replace(cfg, gemma_norm=False, rope_neox_style=True), state


def drafter_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The module class of the drafter's family (`Family.model`; by default the one DFlash module, whose optional
    parts the family's fields switch on)."""
    return family(cfg.family).model or DFlashDrafter


def _build(
    cfg: DrafterConfig, state: dict[str, torch.Tensor], source: str, device: str | torch.device, dtype: torch.dtype
) -> DFlashDrafter:
    check_vocabulary_map(cfg, state, source)
    cfg, state = fold_conventions(cfg, state)
    state = {k: v for k, v in state.items() if k not in OPTIONAL_TENSORS}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    with torch.device("meta"):
        model = drafter_class(cfg)(
            cfg,
            own_embedding="embed_tokens.weight" in state,
            own_lm_head="lm_head.weight" in state and cfg.draft_vocab_size is None,
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary_emb = type(model.rotary_emb)(model.rotary_emb.config)  # buffers were on meta
    return model.to(device=device, dtype=dtype).eval()


def check_drafter_matches_target(cfg: DrafterConfig, target: TargetModel, source: str) -> None:
    """Refuse a drafter made for another target (each mismatch would draft garbage silently)."""
    checks = [
        ("hidden_size", cfg.hidden_size, target.hidden_size, "the target's hidden size"),
        ("vocab_size", cfg.vocab_size, target.vocab_size, "the target's LM head rows"),
        ("num_target_layers", cfg.num_target_layers, target.num_layers, "the target's decoder layers"),
    ]
    for name, found, expected, what in checks:
        if found != expected:
            raise FlashdraftError(
                f"{source}: field '{name}' is {found}; expected {expected} ({what}): the drafter was made for "
                f"another target"
            )
    if cfg.mask_token is not None:  # SGLang 0.5.23 refuses a mask_token string the tokenizer knows by another id
        vocab_id = target.tokenizer.get_vocab().get(cfg.mask_token)
        if vocab_id is not None and vocab_id != cfg.mask_token_id:
            raise FlashdraftError(
                f"{source}: field 'dflash_config.mask_token' is {cfg.mask_token!r}, token {vocab_id} in the target's "
                f"tokenizer; expected the token of dflash_config.mask_token_id {cfg.mask_token_id} (SGLang refuses "
                f"the pair)"
            )


# -- other checkpoint forms: a bare state dict, a training run directory ----------------

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
# Wrappers a training script may leave around a state dict: {"model": {...}} and key
# prefixes from DDP (`module.`), torch.compile (`_orig_mod.`) or a parent module.
_WRAPPER_KEYS = ("state_dict", "model", "drafter", "draft_model", "module")
_KEY_PREFIXES = ("module.", "_orig_mod.", "model.", "drafter.", "draft_model.")


def read_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a bare `.pt`/`.safetensors` drafter state dict, unwrapped and unprefixed."""
    path = Path(path)
    if not path.is_file():
        raise FlashdraftError(f"{path}: no such file; expected a drafter state dict ({', '.join(STATE_DICT_SUFFIXES)})")
    if path.suffix != ".safetensors":
        state = load_tensors_only(
            path, "save the weights as tensors alone (torch.save(drafter.state_dict())) or as safetensors"
        )
    else:
        try:
            with safe_open(str(path), framework="pt") as sf:
                state = {k: sf.get_tensor(k) for k in sf.keys()}
        except (SafetensorError, OSError, RuntimeError, EOFError) as e:
            raise FlashdraftError(f"{path}: not a readable state dict (truncated or corrupt: {e})") from None
    while isinstance(state, dict) and len(state) == 1 and next(iter(state)) in _WRAPPER_KEYS:
        state = next(iter(state.values()))
    if isinstance(state, dict):
        for wrapper in _WRAPPER_KEYS:  # a training state: {"model": {...}, "optimizer": {...}, "step": ...}
            if "fc.weight" not in state and isinstance(state.get(wrapper), dict):
                state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FlashdraftError(f"{path}: expected a mapping of tensor names to tensors (a drafter state dict)")
    for prefix in _KEY_PREFIXES:
        if "fc.weight" not in state and state and all(k.startswith(prefix) for k in state):
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def infer_drafter_config(
    shapes: dict[str, tuple[int, ...]],
    source: str,
    *,
    vocab_size: int,
    num_target_layers: int,
    target_layer_ids: list[int] | None,
    mask_token_id: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **fields,
) -> DrafterConfig:
    """The drafter config a bare state dict implies.

    From shapes: hidden size (norm), layer count, head_dim (q_norm), heads (q_proj / head_dim),
    kv heads (k_proj / head_dim), intermediate size (gate_proj), attention bias, and the
    number of context layers (fc in_features / hidden). What shapes cannot tell (vocabulary,
    target layer count and ids, mask token, block size, RoPE, layer types) is given by the
    caller; `target_layer_ids` must have as many ids as fc has context layers.
    `fields` are further DrafterConfig fields (rope_theta, rms_norm_eps, ...).
    """

    def need(key: str, ndim: int) -> tuple[int, ...]:
        shape = shapes.get(key)
        if shape is None:
            raise FlashdraftError(f"{source}: tensor '{key}' is missing; cannot infer the drafter's shape without it")
        if len(shape) != ndim:
            raise FlashdraftError(f"{source}: tensor '{key}' has shape {list(shape)}; expected {ndim} dimensions")
        return shape

    hidden = need("norm.weight", 1)[0]
    fc = need("fc.weight", 2)
    if fc[1] % hidden:
        raise FlashdraftError(
            f"{source}: tensor 'fc.weight' has shape {list(fc)}; in_features {fc[1]} is not a multiple "
            f"of hidden size {hidden} (from norm.weight), expected [{hidden}, n * {hidden}]"
        )
    num_context = fc[1] // hidden
    layer_indices = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if not layer_indices:
        raise FlashdraftError(f"{source}: no 'layers.{{i}}.*' tensors; not a DFlash drafter state dict")
    num_layers = max(layer_indices) + 1
    head_dim = need("layers.0.self_attn.q_norm.weight", 1)[0]
    q_out = need("layers.0.self_attn.q_proj.weight", 2)[0]
    kv_out = need("layers.0.self_attn.k_proj.weight", 2)[0]
    for name, out in (("q_proj", q_out), ("k_proj", kv_out)):
        if out % head_dim:
            raise FlashdraftError(
                f"{source}: tensor 'layers.0.self_attn.{name}.weight' has {out} output features, "
                f"not a multiple of head_dim {head_dim} (from q_norm.weight)"
            )
    if target_layer_ids is None:
        raise FlashdraftError(
            f"{source}: a bare state dict does not store target_layer_ids; give {num_context} ids "
            f"(fc.weight {list(fc)} has {num_context} context layers)"
        )
    if len(target_layer_ids) != num_context:
        raise FlashdraftError(
            f"{source}: tensor 'fc.weight' has shape {list(fc)} ({num_context} context layers) but "
            f"target_layer_ids {target_layer_ids} name {len(target_layer_ids)} layers"
        )
    try:
        return DrafterConfig(
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=q_out // head_dim,
            num_key_value_heads=kv_out // head_dim,
            head_dim=head_dim,
            intermediate_size=need("layers.0.mlp.gate_proj.weight", 2)[0],
            vocab_size=vocab_size,
            num_target_layers=num_target_layers,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            attention_bias="layers.0.self_attn.q_proj.bias" in shapes,
            **fields,
        )
    except FlashdraftError as e:  # name the file, not just "config"
        raise FlashdraftError(str(e).replace("config:", f"{source} (inferred config):", 1)) from None


def load_state_dict_drafter(
    state: dict[str, torch.Tensor],
    cfg: DrafterConfig,
    source: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A drafter from a state dict, strictly: every tensor checked against `cfg` first."""
    check_state_shapes(cfg, {k: tuple(v.shape) for k, v in state.items()}, source)
    return _build(cfg, state, source, device, dtype)
