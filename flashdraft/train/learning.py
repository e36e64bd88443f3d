"""Whether a run learns. A drafter whose τ stays within noise of 1.0 (what an untrained drafter gets: it accepts
nothing) past the warm-up is said in one line, with the causes the run's own settings show and the flags that would
fix them: a run can "train" for hours at 99 % of nothing, and only its τ says so."""

from __future__ import annotations

from flashdraft.evaluation.results import accepts_nothing_problem

SMALL_LR = 1e-4  # below this the recipe's drafters barely move in a short run (the recipe: 6e-4; tiny: 6e-3)
FEW_STEPS = 500  # the demo needs some hundreds of steps on tiny; the published recipe runs tens of thousands


def mean_record_length(records) -> float | None:
    """Tokens per training record (prompt + completion), from a cache's manifest or online records' ids."""
    if hasattr(records, "lengths"):  # a HiddenStateCache
        lengths = records.lengths
    else:
        lengths = [len(r.input_ids) for r in getattr(records, "records", [])]
    return sum(lengths) / len(lengths) if lengths else None


def likely_causes(lr: float, total_steps: int, num_anchors: int, mean_length: float | None) -> tuple[list[str], str]:
    """What in the run's settings could keep it from learning, and the flags that would change it."""
    causes, fixes = [], []
    if lr < SMALL_LR:
        causes.append(f"--lr {lr:g} is small")
        fixes.append("--lr 6e-4")
    if total_steps < FEW_STEPS:
        causes.append(f"only {total_steps} optimizer steps")
        fixes.append(f"--max-steps {max(1000, 10 * total_steps)}")
    if mean_length is not None and num_anchors * 2 > mean_length:
        causes.append(
            f"--num-anchors {num_anchors} for records of {mean_length:.0f} tokens (nearly every position "
            f"an anchor: each step is one big batch, and the run takes few of them)"
        )
        fixes.append(f"--num-anchors {max(8, int(mean_length) // 32)}")
    return causes, " ".join(fixes)


def learning_problem(
    tau: float, what: str, step: int, lr: float, total_steps: int, num_anchors: int, mean_length: float | None
) -> str | None:
    """One warning line when τ at `step` is within noise of an untrained drafter's, naming the likely causes and a
    fix; None when the drafter accepts something."""
    problem = accepts_nothing_problem(tau, what)
    if problem is None:
        return None
    causes, fixes = likely_causes(lr, total_steps, num_anchors, mean_length)
    why = f"; likely: {', '.join(causes)}" if causes else "; check the data (flashdraft doctor) and the learning rate"
    fix = f"; try: flashdraft train ... {fixes}" if fixes else ""
    return f"warning: step {step}: {problem}{why}{fix}"


class LearningCheck:
    """Watches the run's τ: held-out τ where the run has held-out records, else the training estimate. Warns once,
    at the first figure past the warm-up and a quarter of the run that is still an untrained drafter's, and gives
    the run's last word on it (`verdict`)."""

    def __init__(
        self,
        lr: float,
        total_steps: int,
        warmup_steps: int,
        num_anchors: int,
        mean_length: float | None,
        held_out: bool,
    ) -> None:
        self.settings = dict(lr=lr, total_steps=total_steps, num_anchors=num_anchors, mean_length=mean_length)
        self.start = max(warmup_steps, total_steps // 4)
        self.what = "held-out τ" if held_out else "estimated τ (training batches)"
        self.held_out, self.warned = held_out, False
        self.last: tuple[int, float] | None = None

    def see(self, step: int, tau: float | None, held_out: bool) -> str | None:
        """A figure at `step`; returns the warning line the first time one past `start` learned nothing."""
        if tau is None or held_out != self.held_out:
            return None
        self.last = (step, tau)
        if self.warned or step < self.start:
            return None
        warning = learning_problem(tau, self.what, step, **self.settings)
        self.warned = warning is not None
        return warning

    def verdict(self) -> str | None:
        """The run's summary line: its last τ against an untrained drafter's, as a problem where it learned nothing."""
        if self.last is None:
            return None
        step, tau = self.last
        problem = learning_problem(tau, self.what, step, **self.settings)
        if problem is not None:
            return "problem: " + problem.removeprefix("warning: ")
        return f"{self.what} {tau:.3f} at step {step} (an untrained drafter: 1.0)"
