"""`flashdraft doctor` on a training run or one of its checkpoints: the checkpoints complete and verified, the
run's configuration against its drafter and a target, and whether the run learned anything. The run directory's
facts are `drafter/run_dir.py`'s; the report is `flashdraft.drafter.doctor_report.Checks`."""

from __future__ import annotations

import json
from pathlib import Path

from flashdraft.drafter.checkpoint_doctor import check_drafter_dir
from flashdraft.drafter.doctor_report import Checks
from flashdraft.errors import FlashdraftError
from flashdraft.safe_load import UnsafeFileError
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import Quantisation, mismatch


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
    recorded = Quantisation.from_record(run.get("target_quantisation"))
    if recorded is not None:
        checks.about(f"run_config.json: trained on the states of a target quantised {recorded.describe()}")
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
        quantised = mismatch(recorded, getattr(target, "quantisation", None))
        if quantised is not None:  # a drafter evaluated against its target served quantised: said, not refused
            checks.about(f"the run's target states were {quantised}: τ against it is the quantised τ")
