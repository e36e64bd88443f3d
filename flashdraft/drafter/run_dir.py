"""A training run directory and its checkpoints: written atomically, verified on load, the
newest K kept; the one finder of the newest complete checkpoint; and loading a drafter from
any form a user may hand over (a drafter directory, a run, one of its checkpoints, a bare
state dict).

Layout: RUN/run_config.json, RUN/metrics.jsonl, RUN/.lock (`RunLock`),
RUN/checkpoints/step-0000123/
    drafter/            the drafter in the public format (vLLM/SGLang load it as is)
    trainer.pt          optimizer, scheduler, RNG and data-order state
    checksums.json      sha256 of every file above
    COMPLETE            written last, before the directory is renamed into place
RUN/best/               with --keep-best: the drafter (public format) of the best held-out
                        evaluation so far, and best.json (step, metric, value)

A checkpoint is first written under a temporary name, every file fsynced, then renamed:
a killed run leaves either a complete checkpoint or a temporary directory that is ignored
and cleaned up, never a partial checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from flashdraft.drafter.checkpoint import (
    STATE_DICT_SUFFIXES,
    infer_drafter_config,
    load_drafter,
    load_state_dict_drafter,
    read_state_dict_file,
    save_drafter_state,
    weight_files,
)
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE, DrafterConfig, default_target_layer_ids
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.rope import target_theta
from flashdraft.errors import FlashdraftError
from flashdraft.files import (
    DiskFullError,
    OutputLock,
    disk_full_is_an_error,
    fsync_path,
    nbytes,
    sha256_file,
    torch_save,
    write_atomic,
    write_text_atomic,
)
from flashdraft.safe_load import UnsafeFileError, load_tensors_only, to_plain
from flashdraft.target.model import pick_mask_token

# drafters shipped with flashdraft, loadable by name (`--checkpoint tiny-drafter`)
BUILTIN_DRAFTERS = {"tiny-drafter": Path(__file__).parents[1] / "assets" / "tiny-drafter"}
CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
BEST = "best"
BEST_RECORD = "best.json"


def save_checkpoint(
    run_dir: Path,
    step: int,
    drafter_config: DrafterConfig,
    drafter_state: dict[str, torch.Tensor],
    trainer_state: dict,
    keep: int,
) -> Path:
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter_state(drafter_config, drafter_state, tmp / "drafter")
        with disk_full_is_an_error(
            final / "trainer.pt", f"the trainer state of checkpoint step {step}", nbytes(trainer_state)
        ):
            # only what torch.load(weights_only=True) reads: a run can be resumed without trusting it
            torch_save(to_plain(trainer_state, f"the trainer state of step {step}"), tmp / "trainer.pt")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        sums = {str(p.relative_to(tmp)): sha256_file(p) for p in files}
        with disk_full_is_an_error(final, f"checkpoint step {step}'s checksums"):
            (tmp / "checksums.json").write_text(json.dumps(sums, indent=2))
            (tmp / COMPLETE).write_text(f"step {step}\n")
            for p in [*files, tmp / "checksums.json", tmp / COMPLETE, tmp / "drafter", tmp]:
                fsync_path(p)
    except DiskFullError as e:
        # nothing of this checkpoint is left (its space is given back); the newest complete one stands
        shutil.rmtree(tmp, ignore_errors=True)
        e.path = final / e.path.relative_to(tmp) if e.path.is_relative_to(tmp) else e.path
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # a re-run of the same step replaces it
        _remove(final)
    os.rename(tmp, final)
    fsync_path(root)
    remove_unfinished(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep]:
        _remove(old)
    return final


def save_best(
    run_dir: Path,
    step: int,
    drafter_config: DrafterConfig,
    drafter_state: dict[str, torch.Tensor],
    metric: str,
    value: float,
) -> Path:
    """Replace RUN/best/ with this drafter: written under a temporary name, fsynced, then
    swapped in, so a kill leaves the previous best or the new one, never a mix."""
    best, tmp, old = run_dir / BEST, run_dir / f".tmp-{BEST}", run_dir / f".old-{BEST}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter_state(drafter_config, drafter_state, tmp)
        with disk_full_is_an_error(best / BEST_RECORD, f"the best drafter's record (step {step})"):
            (tmp / BEST_RECORD).write_text(json.dumps({"step": step, "metric": metric, "value": value}) + "\n")
            for p in [*sorted(tmp.iterdir()), tmp]:
                fsync_path(p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous best stands
        raise
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        os.rename(best, old)
    os.rename(tmp, best)
    fsync_path(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return best


def read_best(run_dir: str | Path) -> dict | None:
    """best.json of RUN/best/ (step, metric, value, and `path`), or None without one. A kill
    between the two renames of `save_best` leaves the previous best as .old-best: it counts."""
    for d in (Path(run_dir) / BEST, Path(run_dir) / f".old-{BEST}"):
        if (d / BEST_RECORD).is_file() and (d / "config.json").is_file():
            return json.loads((d / BEST_RECORD).read_text()) | {"path": str(d)}
    return None


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint so that a kill midway never leaves a COMPLETE marker beside missing
    files: first rename it out of the step-* namespace (atomic), then delete."""
    doomed = checkpoint.with_name(".del-" + checkpoint.name)
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed)


def remove_unfinished(run_dir: Path) -> None:
    """Delete the temporary directories of checkpoint writes or deletions that were killed
    (only the trainer holding the run's lock may: a running trainer's are not stale)."""
    root = run_dir / CHECKPOINTS
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".del-step-*")] if root.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints RUN/checkpoints/step-NNNNNNN/, oldest first: those with a COMPLETE
    marker and a drafter (a checkpoint without the marker was interrupted while being written)."""
    root = Path(run_dir) / CHECKPOINTS
    steps = []
    for d in root.glob("step-*") if root.is_dir() else []:
        suffix = d.name.removeprefix("step-")
        if suffix.isdigit() and (d / COMPLETE).is_file() and (d / "drafter").is_dir():
            steps.append((int(suffix), d))
    return [d for _, d in sorted(steps)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint's directory, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def verify_checkpoint(path: Path, only: str = "") -> None:
    """Raise FlashdraftError if any file (under `only`, e.g. "drafter/") differs from checksums.json."""
    problems = checkpoint_problems(path, only)
    if problems:
        raise FlashdraftError(problems[0])


def checkpoint_problems(path: Path, only: str = "") -> list[str]:
    """Every file of a checkpoint (under `only`) that is missing or differs from checksums.json,
    each with the fix; empty when all verify."""
    fix = "copy it again, or delete this checkpoint directory so that --resume and eval take the one before it"
    sums_path = path / "checksums.json"
    if not sums_path.is_file():
        return [f"{path}: no checksums.json; expected a complete flashdraft checkpoint ({fix})"]
    try:
        sums = json.loads(sums_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{sums_path}: not valid JSON ({e.msg}); {fix}"]
    problems = []
    for name, expected in sorted(sums.items()):
        if not name.startswith(only):
            continue
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing; checksums.json lists it ({fix})")
            continue
        found = sha256_file(f)
        if found != expected:
            problems.append(
                f"{f}: sha256 {found[:12]}... differs from checksums.json {expected[:12]}... "
                f"(truncated or corrupted; {fix})"
            )
    return problems


def load_trainer_state(path: Path, verify: bool = True) -> dict:
    """The trainer state of checkpoint `path`, read without running anything it carries: a
    received run directory is data (a matching checksums.json proves nothing about who wrote it)."""
    if verify:
        verify_checkpoint(path)
    state = load_tensors_only(path / "trainer.pt", convert_hint(path))
    if not isinstance(state, dict):
        raise FlashdraftError(
            f"{path / 'trainer.pt'}: holds a {type(state).__name__}; expected the dict of a "
            f"flashdraft trainer state (step, optimizer, RNG)"
        )
    return state


def refuse_unsafe_trainer_state(path: Path) -> None:
    """Refuse checkpoint `path` when its trainer.pt is a pickle only executing code could load,
    though the command reads only the drafter: such a run is not one to keep using unawares."""
    if (path / "trainer.pt").is_file():
        load_tensors_only(path / "trainer.pt", convert_hint(path), mmap=True)


def _run_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint


def convert_hint(checkpoint: Path) -> str:
    """What to do with a refused trainer.pt: the command that converts the run, for a trusted run."""
    return f"if you made this run yourself or trust who did, convert it: flashdraft convert-run {_run_of(checkpoint)}"


def convert_run(path: str | Path) -> list[str]:
    """Rewrite each complete checkpoint's trainer.pt that only a full unpickle reads (an older
    state holding numpy values) as tensors and plain containers, its checksum updated; one line
    per checkpoint. `path`: a run or one checkpoint. The full unpickle runs whatever code the file
    carries: for runs the user trusts, who asked for this by running `flashdraft convert-run`."""
    path = Path(path)
    checkpoints = [path] if (path / COMPLETE).is_file() else complete_checkpoints(path)
    if not checkpoints:
        raise FlashdraftError(
            f"{path}: no complete checkpoint; expected a training run directory or one of its "
            f"{CHECKPOINTS}/step-NNNNNNN directories"
        )
    lock = RunLock(_run_of(checkpoints[0]))  # no trainer writes or deletes checkpoints meanwhile
    try:
        return [_convert_checkpoint(checkpoint) for checkpoint in checkpoints]
    finally:
        lock.release()


def _convert_checkpoint(checkpoint: Path) -> str:
    verify_checkpoint(checkpoint)  # a damaged file is not given a new checksum
    trainer = checkpoint / "trainer.pt"
    try:
        load_tensors_only(trainer)
        return f"{trainer}: already tensors and plain containers; left as it is"
    except UnsafeFileError:
        pass
    state = torch.load(trainer, map_location="cpu", weights_only=False)  # trusted: the user asked for it
    plain = to_plain(state, str(trainer), convert=True)
    write_atomic(trainer, lambda tmp: torch_save(plain, tmp), f"the converted {trainer}")
    sums_path = checkpoint / "checksums.json"
    sums = json.loads(sums_path.read_text()) | {"trainer.pt": sha256_file(trainer)}
    write_text_atomic(sums_path, json.dumps(sums, indent=2), f"the checksums of {checkpoint}")
    return f"{trainer}: converted to tensors and plain containers (checksums.json updated)"


class RunLock(OutputLock):
    """An exclusive lock on a run directory (RUN/.lock, naming pid and host): a second trainer on
    the same run is refused. flock is released by the kernel when the process dies, so a crash
    leaves no lock that blocks: its file is taken over with a message."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir / ".lock", run_dir, "trainer")


# -- a drafter from any form ----------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class LoadedDrafter:
    drafter: DFlashDrafter
    form: str  # "drafter directory", "training run", "training checkpoint" or "state dict"
    path: Path  # what was read: the drafter directory (newest complete one for a run) or the file
    stored_dtype: torch.dtype  # dtype of the weights on disk (the drafter itself is in the requested dtype)
    assumed: list[str] = field(default_factory=list)  # what a bare state dict could not tell, and where it came from

    def describe(self) -> str:
        """What was loaded, in words: for a run, which checkpoint, and where its best one is."""
        form = self.form
        if self.form == "training run":
            form += f", its newest checkpoint {self.path.parent.name}"
            best = read_best(self.path.parent.parent.parent)
            if best is not None:
                form += (
                    f"; the best by held-out {best['metric']} ({best['value']:.4g}, step {best['step']}) is "
                    f"--checkpoint {best['path']}"
                )
        return f"{self.path} ({form})"


def resolve_drafter(path: str | Path) -> Path:
    """PATH when it exists, else the directory of the drafter shipped with flashdraft by that
    name (`tiny-drafter`): the one name resolution of every option that takes a drafter. A local
    directory of that name wins (`export --out tiny-drafter` then `eval --checkpoint tiny-drafter`)."""
    given = Path(path)
    return BUILTIN_DRAFTERS[str(path)] if not given.exists() and str(path) in BUILTIN_DRAFTERS else given


def _drafter_directory(path: Path) -> tuple[str, Path]:
    """(form, drafter directory) of a drafter directory, a training run (its newest complete
    checkpoint) or one checkpoint; any other directory is returned as a drafter directory."""
    if not (path / "config.json").is_file() and (path / CHECKPOINTS).is_dir():
        last = latest_checkpoint(path)
        if last is None:
            raise FlashdraftError(
                f"{path}: no complete checkpoint (expected {path / CHECKPOINTS}/step-NNNNNNN/drafter/ with a "
                f"COMPLETE marker in step-NNNNNNN/)"
            )
        return "training run", last / "drafter"
    if not (path / "config.json").is_file() and (path / "drafter").is_dir() and (path / COMPLETE).is_file():
        return "training checkpoint", path / "drafter"
    return "drafter directory", path


def drafter_config_path(path: str | Path) -> Path:
    """The config.json of a drafter given in any directory form `load_any_drafter` takes (a
    drafter directory or a shipped drafter's name, a training run, one checkpoint), or PATH
    itself when it is a file (a config.json)."""
    path = resolve_drafter(path)
    return _drafter_directory(path)[1] / "config.json" if path.is_dir() else path


def _load_drafter_directory(path: Path, device, dtype: torch.dtype, verify: bool) -> LoadedDrafter:
    """A drafter directory, a training run (its newest complete checkpoint) or one checkpoint."""
    form, path = _drafter_directory(path)
    if form != "drafter directory":
        refuse_unsafe_trainer_state(path.parent)
        if verify:
            verify_checkpoint(path.parent, only="drafter/")
    drafter = load_drafter(path, device=device, dtype=dtype)
    where = weight_files(path)
    with safe_open(str(where["fc.weight"]), framework="pt") as sf:
        stored = _SAFETENSORS_DTYPES.get(sf.get_slice("fc.weight").get_dtype(), torch.float32)
    return LoadedDrafter(drafter, form, path, stored)


def load_any_drafter(
    path: str | Path,
    target=None,
    *,
    block_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> LoadedDrafter:
    """Load a drafter from any accepted form, strictly.

    - a drafter directory (config.json + safetensors, this project's or any public one), or the
      name of one shipped with flashdraft (`tiny-drafter`);
    - a training run directory: its newest complete checkpoint (`latest_checkpoint`),
      or one checkpoint directory of it (step-NNNNNNN/), its drafter files checked against the
      checkpoint's checksums.json unless not `verify`;
    - a bare `.pt`/`.safetensors` state dict: shapes give the architecture
      (`infer_drafter_config`); vocabulary and layer count come from `target`
      (a `TargetModel`), target_layer_ids from the argument else the reference default for
      fc's context-layer count, the mask token from the argument else the target's tokenizer,
      block size from the argument else 16 (the usual one); RoPE and norm eps from the target.
    """
    path = resolve_drafter(path)
    if path.is_dir():
        return _load_drafter_directory(path, device, dtype, verify)
    if path.suffix not in STATE_DICT_SUFFIXES:
        raise FlashdraftError(
            f"{path}: not a drafter directory, a training run directory or a state dict file "
            f"({', '.join(STATE_DICT_SUFFIXES)})"
        )
    state = read_state_dict_file(path)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if target is None:
        raise FlashdraftError(
            f"{path}: a bare state dict stores neither the vocabulary size nor the target's layers; give --target-model"
        )

    assumed = []
    fc, norm = shapes.get("fc.weight"), shapes.get("norm.weight")
    if target_layer_ids is None and fc is not None and norm is not None and len(fc) == 2 and fc[1] % norm[0] == 0:
        target_layer_ids = default_target_layer_ids(target.num_layers, fc[1] // norm[0])
        if len(set(target_layer_ids)) < len(target_layer_ids):
            raise FlashdraftError(
                f"{path}: a bare state dict does not store target_layer_ids and the reference default for "
                f"{len(target_layer_ids)} context layers of a {target.num_layers}-layer target repeats ids "
                f"({target_layer_ids}); give --target-layer-ids"
            )
        assumed.append(
            f"target_layer_ids {target_layer_ids}: reference default for {fc[1] // norm[0]} context layers "
            f"of a {target.num_layers}-layer target"
        )
    if mask_token_id is None:
        mask_token_id = pick_mask_token(target)
        assumed.append(f"mask token {mask_token_id}: the target tokenizer's")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
        assumed.append(f"block size {block_size}: the usual one (give --block-size if it was trained with another)")
    tc = target.config
    rope_theta = target_theta(tc)
    assumed.append(f"rope_theta {rope_theta}, rms_norm_eps {tc.rms_norm_eps}, all layers full attention: target's")
    cfg = infer_drafter_config(
        shapes,
        str(path),
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        rope_theta=rope_theta,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
    )
    stored = state["fc.weight"].dtype
    drafter = load_state_dict_drafter(state, cfg, str(path), device=device, dtype=dtype)
    return LoadedDrafter(drafter, "state dict", path, stored, assumed)
