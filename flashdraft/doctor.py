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

import json
from dataclasses import dataclass
from pathlib import Path

from flashdraft.drafter.checkpoint import STATE_DICT_SUFFIXES
from flashdraft.drafter.checkpoint_doctor import check_drafter_dir, check_state_dict
from flashdraft.drafter.doctor_report import Checks
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.train.run_doctor import check_run


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


@dataclass(frozen=True)
class ServingQuery:
    """`doctor --serving`'s question: the servers' rules for a drafter directory, their commands naming `target_name`,
    the long-context guards at `max_model_len` (None: the target's context), the sampling rule of `serving_command`
    (None: both servers' defaults)."""

    target_name: str | None = None
    max_model_len: int | None = None
    serving_command: str | None = None


def run_doctor(
    path: str | Path,
    target: TargetModel | None = None,
    checkpoint: str | Path | None = None,
    samples: int = 4,
    tolerance: float | None = None,
    verify: bool = True,
    serving: ServingQuery | None = None,
) -> bool:
    """Check PATH (and against `target` and the drafter `checkpoint`; with `serving`, a drafter directory against
    the servers' rules); True when none fails."""
    path = resolve(path)
    kind = kind_of(path)
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
    if target is not None and hasattr(target, "quantisation"):
        checks.about(f"target {target.path}: quantisation {target.quantisation.describe()}")
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
                path,
                target,
                serving_checks,
                serving.target_name,
                max_model_len=serving.max_model_len,
                serving_command=serving.serving_command,
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
