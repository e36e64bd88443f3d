"""`flashdraft doctor PATH`: say what a file or directory flashdraft reads is, and everything
wrong with it, each finding with its fix.

PATH may be a hidden-state cache, a drafter directory (or the name of one shipped with
flashdraft, `tiny-drafter`), a training run directory (its newest complete checkpoint) or one
checkpoint of it, a bare `.pt`/`.safetensors` state dict, or a completions file. This module
recognises the kind and runs its checks; with `--target-model` and `--checkpoint` (a drafter) it
also checks PATH against them; with `--serving` (a drafter directory) it adds the serving rules
of vLLM and SGLang (`flashdraft.serving.checks`). Every check prints one line, `ok`, `warn ...; fix: ...`
or `FAIL ...; fix: ...`; facts (shapes, layer ids, fingerprints) are printed indented.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from flashdraft.drafter.checkpoint import STATE_DICT_SUFFIXES
from flashdraft.drafter.doctor_report import Checks
from flashdraft.drafter.server_fields import fields_set
from flashdraft.errors import FlashdraftError
from flashdraft.safe_load import UnsafeFileError
from flashdraft.target.model import TargetModel


def resolve(path: str | Path) -> Path:
    """PATH, or the directory of the drafter shipped with flashdraft by that name (`tiny-drafter`)."""
    from flashdraft.drafter.run_dir import resolve_drafter

    return resolve_drafter(path)


def kind_of(path: Path) -> str:
    """What PATH is: 'cache', 'drafter', 'run', 'checkpoint', 'state dict' or 'completions';
    raises naming what it is not."""
    from flashdraft.data.cache import MANIFEST, PROGRESS
    from flashdraft.data.completions import part_paths

    path = resolve(path)
    if not path.exists():
        if part_paths(path):
            return "completions"  # an unfinished generate run: only its parts exist
        raise FlashdraftError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / MANIFEST).exists() or (path / PROGRESS).is_dir():
            return "cache"
        if (path / "config.json").is_file():
            try:
                is_drafter = "dflash_config" in json.loads((path / "config.json").read_text())
            except (json.JSONDecodeError, TypeError):
                is_drafter = True  # a broken config.json: the drafter check says what is wrong with it
            if not is_drafter:
                raise FlashdraftError(
                    f"{path}: a model directory without dflash_config in config.json, not a DFlash drafter "
                    f"(a target? pass it as --target-model)"
                )
            return "drafter"
        if (path / "checkpoints").is_dir() or (path / "run_config.json").is_file():
            return "run"
        if (path / "drafter").is_dir() and ((path / "checksums.json").exists() or (path / "COMPLETE").exists()):
            return "checkpoint"
        if any(path.glob("*.safetensors")):
            return "drafter"  # weights without config.json: the drafter check says so
    elif path.suffix in STATE_DICT_SUFFIXES:
        return "state dict"
    elif path.suffix == ".json":
        return "completions"
    raise FlashdraftError(
        f"{path}: not something doctor can check; expected a hidden-state cache (with {MANIFEST}), a drafter "
        f"directory, a training run or checkpoint directory, a {'/'.join(STATE_DICT_SUFFIXES)} state dict or a "
        f"completions .json file"
    )


def load_target_for(path: str | Path, target_model: str | None) -> TargetModel | None:
    """The target `doctor PATH --target-model T` checks against: the whole model for a cache (its
    records are re-run through it), else only its shapes, tokenizer and fingerprint (a `TargetHead`);
    None without T. An unusable PATH is an error before the target is loaded."""
    from flashdraft.target.weights import TargetHead

    kind = kind_of(Path(path))
    load = TargetModel.load if kind == "cache" else TargetHead.load
    return load(target_model) if target_model else None


def run_doctor(
    path: str | Path,
    target: TargetModel | None = None,
    checkpoint: str | Path | None = None,
    samples: int = 4,
    tolerance: float | None = None,
    verify: bool = True,
    serving: bool = False,
    target_name: str | None = None,
    max_model_len: int | None = None,
    serving_command: str | None = None,
) -> bool:
    """Check PATH (and against `target` and the drafter `checkpoint`; with `serving`, a drafter
    directory against the servers' rules, commands naming `target_name`, long-context guards at
    `max_model_len` or the target's context); True when none fails."""
    path = resolve(path)
    kind = kind_of(path)
    if max_model_len is not None and not serving:
        raise FlashdraftError(
            f"--max-model-len {max_model_len}: the context a drafter is served at; expected --serving with it"
        )
    if serving and kind != "drafter":
        raise FlashdraftError(
            f"--serving: checks a drafter directory as vLLM and SGLang load it; {path} is a {kind} (for a run or "
            f"checkpoint, flashdraft export --checkpoint {path} --out DIR writes one, and prints these rules)"
        )
    if checkpoint is not None and kind not in ("cache", "completions"):
        raise FlashdraftError(
            f"--checkpoint {checkpoint}: names a drafter to check a cache or completions file against; {path} is "
            f"itself a {kind} (check it alone, or with --target-model)"
        )
    checks = Checks()
    if kind == "cache":
        from flashdraft.data.cache_doctor import doctor_cache

        layer_ids = _checkpoint_config(checkpoint).target_layer_ids if checkpoint else None
        doctor_cache(
            path, target=target, layer_ids=layer_ids, samples=samples, tolerance=tolerance, verify=verify, checks=checks
        )
    elif kind == "drafter":
        check_drafter_dir(path, target, checks, verify)
        if serving:
            from flashdraft.serving.checks import check_serving

            serving_checks = Checks(held=True)  # its verdict before its many rule lines
            check_serving(
                path, target, serving_checks, target_name, max_model_len=max_model_len, serving_command=serving_command
            )
            serving_checks.print_held("serving rules (vLLM and SGLang)", checks)
    elif kind in ("run", "checkpoint"):
        check_run(path, target, checks, verify, single=kind == "checkpoint")
    elif kind == "state dict":
        check_state_dict(path, target, checks)
    else:
        from flashdraft.data.completions_doctor import doctor_completions

        doctor_completions(path, target, _checkpoint_config(checkpoint) if checkpoint else None, checks)
    return checks.summary()


def _checkpoint_config(checkpoint: str | Path):
    from flashdraft.data.cache_run import drafter_layer_ids

    return drafter_layer_ids(checkpoint)[1]


# -- drafters ----------------------------------------------------------------------------------

NEW_DRAFTER = "train a drafter for this target (flashdraft init / flashdraft train --target-model T)"


def _describe_config(cfg) -> str:
    return (
        f"{cfg.describe_family()}, {cfg.num_hidden_layers} layers ({cfg.describe_layers()}), hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv heads x {cfg.head_dim}, intermediate "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size}, block size {cfg.block_size} ({cfg.describe_layout()}), "
        f"mask token "
        f"{cfg.mask_token_id}, target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers} target layers"
    )


def _shape_problems(cfg, found: dict[str, tuple[int, ...]]) -> list[str]:
    """Every missing, mis-shaped and unexpected tensor (the loader stops at the first)."""
    from flashdraft.drafter.checkpoint import expected_shapes

    expected = expected_shapes(cfg)
    problems = [f"tensor '{k}' is missing (expected {list(v)})" for k, v in expected.items() if k not in found]
    problems += [
        f"tensor '{k}' has shape {list(found[k])}, expected {list(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != v
    ]
    problems += [f"unexpected tensor '{k}' {list(v)}" for k, v in found.items() if k not in expected]
    return problems


def _fc_line(found: dict[str, tuple[int, ...]], hidden: int, layer_ids: list[int]) -> tuple[bool, str]:
    fc = found.get("fc.weight")
    if fc is None or len(fc) != 2:
        return False, f"fc.weight is {list(fc) if fc else 'missing'}; expected [{hidden}, n * {hidden}]"
    if fc[1] % hidden:
        return False, f"fc.weight {list(fc)}: in_features {fc[1]} is not a multiple of hidden size {hidden}"
    n = fc[1] // hidden
    return n == len(layer_ids), (
        f"fc.weight {list(fc)} holds {n} context layers; target_layer_ids {layer_ids} name {len(layer_ids)}"
    )


def _check_against_target(cfg, source: str, target: TargetModel | None, checks: Checks) -> None:
    if target is None:
        checks.about("no --target-model: hidden size, vocabulary and layer ids not checked against a target")
        return
    for name, found, expected in [
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("vocab_size", cfg.vocab_size, target.vocab_size),
        ("num_target_layers", cfg.num_target_layers, target.num_layers),
    ]:
        checks.check(
            found == expected,
            f"{name} {found} "
            + ("equals" if found == expected else "differs from")
            + f" the target's {expected} ({target.path})",
            f"the drafter was made for another target; evaluate it with its own target, or {NEW_DRAFTER}",
        )
    final = target.num_layers - 1
    checks.check(
        final not in cfg.target_layer_ids and max(cfg.target_layer_ids) < target.num_layers,
        f"target_layer_ids {cfg.target_layer_ids} within the target's layers 0..{final - 1} (not the final "
        f"layer, whose output makes the labels)",
        f"{NEW_DRAFTER} with --target-layer-ids below {final}",
    )
    mask = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id) if cfg.mask_token_id < target.vocab_size else None
    checks.check(
        cfg.mask_token_id not in target.stop_token_ids,
        f"mask token {cfg.mask_token_id} ({mask!r}) is not one of the target's stop tokens {target.stop_token_ids}",
        "use an unused special token as dflash_config.mask_token_id (flashdraft init picks one)",
    )


def check_drafter_dir(path: Path, target: TargetModel | None, checks: Checks, verify: bool = True) -> None:
    """A drafter directory: config, every tensor against it, finite weights, fc against the
    layer ids, and with a target hidden size, vocabulary, layers and mask token."""
    from safetensors import safe_open

    from flashdraft.drafter.checkpoint import weight_files
    from flashdraft.drafter.config import DrafterConfig

    fix_files = "copy the drafter directory again (or re-export it)"
    try:
        cfg = DrafterConfig.load(path / "config.json")
    except FlashdraftError as e:
        checks.fail(str(e), "correct config.json (see the public DFlash drafter format)")
        return
    checks.about(f"drafter directory {path}: {_describe_config(cfg)}")
    for field, value in fields_set(json.loads((path / "config.json").read_text())):
        done = {
            "honoured": "flashdraft computes it",
            "folded": "flashdraft folds it into the weights on load (the "
            "same drafter; export writes it in its own conventions, which both servers read alike)",
        }
        checks.about(
            f"config.json sets {field.name} = {json.dumps(value)}: {field.effect}; read by "
            f"{field.read_by}; {done.get(field.handling, 'refused')}"
        )
    try:
        where = weight_files(path)
    except FlashdraftError as e:
        checks.fail(str(e), fix_files)
        return
    found, finite, dtypes = {}, [], set()
    for key, f in sorted(where.items()):
        with safe_open(str(f), framework="pt") as sf:
            tensor = sf.get_tensor(key)
        found[key] = tuple(tensor.shape)
        dtypes.add(str(tensor.dtype).removeprefix("torch."))
        if not torch.isfinite(tensor).all():
            finite.append(key)
    files = sorted(set(where.values()))
    fingerprint = ""
    if verify:
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        fingerprint = f", weights sha256 {h.hexdigest()[:16]}"
    checks.about(
        f"{len(found)} tensors in {', '.join(f.name for f in files)} ({', '.join(sorted(dtypes))}){fingerprint}"
    )
    ok, line = _fc_line(found, cfg.hidden_size, cfg.target_layer_ids)
    checks.check(
        ok,
        line,
        "set dflash_config.target_layer_ids to the layers fc was trained on (as many as its "
        "context layers), or use the config.json that came with these weights",
    )
    problems = _shape_problems(cfg, found)
    checks.check(
        not problems,
        f"tensor names and shapes against config.json ({len(found)} tensors)"
        + (f": {len(problems)} problems: " + "; ".join(problems[:4]) if problems else ""),
        "the weights and config.json belong to different drafters; use the config.json saved with these weights",
    )
    checks.check(
        not finite,
        "weights finite" + (f": NaN/Inf in {', '.join(finite[:4])}" if finite else ""),
        "the drafter diverged or the file is damaged; use an earlier checkpoint",
    )
    _check_against_target(cfg, str(path), target, checks)


def check_state_dict(path: Path, target: TargetModel | None, checks: Checks) -> None:
    """A bare state dict: what its shapes say, and with a target whether it loads strictly."""
    from flashdraft.drafter.checkpoint import read_state_dict_file
    from flashdraft.drafter.run_dir import load_any_drafter

    try:
        state = read_state_dict_file(path)
    except UnsafeFileError:
        raise  # a file that would run code is refused outright (exit 2)
    except FlashdraftError as e:
        checks.fail(str(e), "copy the file again, or save the drafter's state_dict() with torch.save/safetensors")
        return
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    norm, fc = shapes.get("norm.weight"), shapes.get("fc.weight")
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    head_dim = shapes.get("layers.0.self_attn.q_norm.weight", (None,))[0]
    q, kv = shapes.get("layers.0.self_attn.q_proj.weight"), shapes.get("layers.0.self_attn.k_proj.weight")
    heads = f"{q[0] // head_dim} / kv heads {kv[0] // head_dim}" if q and kv and head_dim else "?"
    facts = (
        f"state dict {path}: {len(shapes)} tensors ({fc and state['fc.weight'].dtype}), hidden "
        f"{norm[0] if norm else '?'}, {len(layers)} layers, head_dim {head_dim}, heads {heads}"
    )
    if fc and norm and len(fc) == 2 and fc[1] % norm[0] == 0:
        facts += f"; fc.weight {list(fc)} holds {fc[1] // norm[0]} context layers"
    checks.about(facts)
    checks.about("a bare state dict stores no vocabulary, target layer ids, mask token or block size")
    ok = bool(fc and norm and len(fc) == 2 and fc[1] % norm[0] == 0 and layers)
    checks.check(
        ok,
        "fc.weight, norm.weight and layers.* present, fc in_features a multiple of hidden",
        "this is not a DFlash drafter state dict (or a truncated one)",
    )
    if target is None:
        checks.about("no --target-model: give one to check that it loads for that target")
        return
    try:
        loaded = load_any_drafter(path, target)
    except FlashdraftError as e:
        checks.fail(str(e), f"{NEW_DRAFTER}, or pass --target-layer-ids/--mask-token-id/--block-size to eval")
        return
    checks.ok(f"loads for target {target.path}: {_describe_config(loaded.drafter.config)}")
    for note in loaded.assumed:
        checks.about(f"assumed: {note}")
    _check_against_target(loaded.drafter.config, str(path), target, checks)


def check_run(path: Path, target: TargetModel | None, checks: Checks, verify: bool, single: bool = False) -> None:
    """A training run (its newest complete checkpoint) or one checkpoint directory: checksums,
    trainer state, the drafter, and run_config.json against the drafter."""
    from flashdraft.drafter.run_dir import COMPLETE, checkpoint_problems, load_trainer_state

    if single:
        step_dir, run_dir = path, path.parent.parent if path.parent.name == "checkpoints" else None
        checks.about(f"training checkpoint {path}")
        checks.check(
            (path / COMPLETE).is_file(),
            f"{COMPLETE} marker present",
            "this checkpoint was not finished writing; use an earlier one",
        )
    else:
        run_dir, root = path, path / "checkpoints"
        steps = sorted(root.glob("step-*")) if root.is_dir() else []
        complete = [d for d in steps if (d / COMPLETE).is_file()]
        partial = sorted(p.name for p in root.glob(".*-step-*")) if root.is_dir() else []
        partial += [d.name for d in steps if d not in complete]
        checks.about(
            f"training run {path}: complete checkpoints {[d.name for d in complete] or 'none'}"
            + (f"; unfinished (ignored, removed on resume): {partial}" if partial else "")
        )
        if not complete:
            checks.fail(
                f"{root}: no complete checkpoint",
                "the run was stopped before its first checkpoint: train "
                "again (without --resume), or lower --save-every",
            )
            return
        step_dir = complete[-1]
        checks.about(f"newest complete checkpoint: {step_dir.name}")

    if verify:
        problems = checkpoint_problems(step_dir)
        checks.check(
            not problems,
            f"{step_dir.name}: every file matches checksums.json"
            + (f": {len(problems)} do not; first: {problems[0]}" if problems else ""),
            "copy the checkpoint again, or delete it so that --resume and eval take the one before it",
        )
    else:
        checks.about("checksums not checked (--no-verify)")
    trainer = step_dir / "trainer.pt"
    if trainer.is_file():
        try:
            state = load_trainer_state(step_dir, verify=False)  # checked above; an unsafe pickle is exit 2
            step = int(step_dir.name.removeprefix("step-")) if step_dir.name.startswith("step-") else None
            checks.check(
                step is None or state.get("step") == step,
                f"trainer.pt: step {state.get('step')}, "
                f"{state.get('num_records')} records, world size {state.get('world_size')}",
                "trainer.pt belongs to another checkpoint; copy the checkpoint directory whole",
            )
        except UnsafeFileError:
            raise  # not a problem to list: a file that would run code is refused outright
        except FlashdraftError as e:
            checks.fail(str(e), "copy the checkpoint again; --resume needs it (eval and export do not)")
    else:
        checks.fail(f"{trainer}: missing", "copy the checkpoint directory whole; --resume needs it")
    drafter_dir = step_dir / "drafter"
    before = len(checks.failures)
    check_drafter_dir(drafter_dir, target, checks, verify)
    if len(checks.failures) > before:
        return
    if run_dir is None or not (run_dir / "run_config.json").is_file():
        checks.about("no run_config.json beside the checkpoint: settings of the run not checked")
        return
    _check_run_config(run_dir / "run_config.json", drafter_dir, target, checks)
    _check_learned(run_dir, checks)


def _check_learned(run_dir: Path, checks: Checks) -> None:
    """The run's last τ in metrics.jsonl (held-out, else the training estimate) against an untrained drafter's."""
    import json

    from flashdraft.evaluation.results import accepts_nothing_problem
    from flashdraft.train.learning import likely_causes

    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    for key, what in (("eval_tau", "held-out τ"), ("estimated_acceptance", "estimated τ (training batches)")):
        found = [r for r in rows if isinstance(r.get(key), (int, float))]
        if found:
            step, tau = found[-1].get("step"), float(found[-1][key])
            problem = accepts_nothing_problem(tau, f"{what} at step {step}")
            if problem is None:
                checks.ok(f"{what} {tau:.3f} at step {step} (metrics.jsonl): the drafter accepts drafts")
                return
            config = json.loads((run_dir / "run_config.json").read_text())
            causes, fixes = likely_causes(config.get("lr") or 0.0, int(step or 0), config.get("num_anchors") or 0, None)
            likely = f" (likely: {', '.join(causes)})" if causes else ""
            checks.fail(problem + likely, f"train again with {fixes}" if fixes else "check the data and the lr")
            return
    checks.about(f"{metrics}: no τ logged: whether the drafter learned is not checked")


def _check_run_config(config_path: Path, drafter_dir: Path, target: TargetModel | None, checks: Checks) -> None:
    from flashdraft.drafter.config import DrafterConfig

    try:
        run = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        checks.fail(f"{config_path}: not valid JSON ({e.msg})", "the run directory is damaged; copy it again")
        return
    cfg = DrafterConfig.load(drafter_dir / "config.json")
    checks.about(
        f"run_config.json: target fingerprint {run.get('target_fingerprint')}, data fingerprint "
        f"{run.get('data_fingerprint')}, lr {run.get('lr')}, batch {run.get('batch_size')} x "
        f"{run.get('grad_accum')}, loss decay gamma {run.get('loss_decay_gamma')}"
    )
    for name, want in [
        ("target_layer_ids", cfg.target_layer_ids),
        ("mask_token_id", cfg.mask_token_id),
        ("block_size", cfg.block_size),
    ]:
        found = run.get(name)
        checks.check(
            found == want,
            f"run_config.json {name} {found} "
            + ("equals" if found == want else "differs from")
            + f" the checkpoint drafter's {want}",
            "the checkpoint comes from another run: copy the run directory whole",
        )
    if target is not None and run.get("target_fingerprint"):
        fp = target.fingerprint()
        checks.check(
            run["target_fingerprint"] == fp,
            f"run's target fingerprint {run['target_fingerprint']} "
            + ("equals" if run["target_fingerprint"] == fp else f"differs from {target.path}'s {fp}"),
            "the run trained against another target (other weights or tokenizer): evaluate with that one",
        )
