"""Run by `torchrun` in test_loop.py: train a few steps on a tiny random target.

    ddp_worker.py RUN_DIR BATCH GRAD_ACCUM [ddp|fsdp] [decay|dpace] [adamw|muon] [full|stop|resume]
    ddp_worker.py --plan PLAN.json

DRAFTER_FAMILY=dflash2 in the environment trains a DFlash2 drafter (convolutions and selector). The last
argument makes a 4-step run that saves every 2 steps: `full` runs it through, `stop`
leaves it after its step-2 checkpoint (a preempted job), `resume` continues it with --resume.

`--plan` runs many variants in one 2-rank launch (a launch costs two interpreters importing torch): a JSON list
of {"run_dir", "procs", "batch", "accum", "fsdp", "weighting", "optimizer", "family"} (and "pack": --pack-length).
The 1-process runs go first, split between the two ranks, each before any process group exists (exactly what a
1-process torchrun runs: rank 0 of 1, nothing wrapped, no collectives); then the group is made and the 2-rank runs
follow, one after another. Every run starts from a freshly made target and records (its seeds), as in a fresh
process.
"""

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from flashdraft.distributed import Dist, init_distributed  # noqa: E402
from flashdraft.drafter.run_dir import latest_checkpoint  # noqa: E402
from flashdraft.train.config import TrainConfig  # noqa: E402
from flashdraft.train.loop import LoopOptions, train  # noqa: E402
from tests.conftest import make_dflash2_drafter, make_drafter, make_dspark_drafter, make_target  # noqa: E402
from tests.train.helpers import make_records  # noqa: E402


class Preempted(Exception):
    pass


@dataclass(frozen=True)
class WorkerRun:
    """One training run of the worker: where, its batch layout, loss weighting, optimizer, stop mode and family."""

    run_dir: Path
    batch: int
    accum: int
    fsdp: bool = False
    weighting: str = "decay"
    optimizer: str = "adamw"
    mode: str | None = None  # None, "full", "stop" or "resume"
    family: str = "dflash"
    pack: int | None = None  # --pack-length (batch then counts rows)

    @classmethod
    def from_row(cls, row: dict) -> "WorkerRun":
        """A --plan row (its "procs" says where it runs, not what; "pack" and "mode" optional)."""
        names = ("batch", "accum", "fsdp", "weighting", "optimizer", "family")
        fields = {name: row[name] for name in names}
        return cls(Path(row["run_dir"]), **fields, pack=row.get("pack"), mode=row.get("mode"))


def run(job: WorkerRun, dist: Dist) -> None:
    run_dir, mode, family = job.run_dir, job.mode, job.family
    steps = dict(max_steps=4, save_every=2) if mode else dict(epochs=1, save_every=100)  # 8 records: 2 steps an epoch
    target = make_target("hybrid")
    records = make_records(target, n=8, topk=16 if family == "dspark" else 0)  # DSpark's loss: the target's logits
    cfg = TrainConfig(
        batch_size=job.batch,
        grad_accum=job.accum,
        lr=3e-3,
        num_anchors=6,
        log_every=1,
        fsdp=job.fsdp,
        loss_weighting=job.weighting,
        optimizer=job.optimizer,
        pack_length=job.pack,
        **steps,
    )

    def preempt(step: int) -> None:
        if mode == "stop" and step == 2:  # after the step-2 checkpoint, before step 3's
            raise Preempted

    try:
        new_drafter = {"dflash": make_drafter, "dflash2": make_dflash2_drafter, "dspark": make_dspark_drafter}[family]
        train(
            cfg,
            new_drafter(block_size=4),
            target,
            records,
            run_dir,
            options=LoopOptions(resume=mode == "resume", on_step=preempt),
            dist=dist,
        )
    except Preempted:  # what the stopped run left on disk, for the test to read
        if dist.is_main:
            (run_dir / "stopped-at").write_text(latest_checkpoint(run_dir).name)


def run_plan(plan: list[dict]) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    ones = [p for p in plan if p["procs"] == 1]
    for p in ones[rank::world]:  # before the process group: all_reduce and FSDP see one process
        run(WorkerRun.from_row(p), Dist())
    dist = init_distributed("cpu", collectives=True)
    for p in plan:
        if p["procs"] != 1:
            assert p["procs"] == dist.world, p
            run(WorkerRun.from_row(p), dist)
    dist.close()


if __name__ == "__main__":
    if sys.argv[1] == "--plan":
        run_plan(json.loads(Path(sys.argv[2]).read_text()))
        sys.exit(0)
    job = WorkerRun(
        run_dir=Path(sys.argv[1]),
        batch=int(sys.argv[2]),
        accum=int(sys.argv[3]),
        fsdp=len(sys.argv) > 4 and sys.argv[4] == "fsdp",
        weighting=sys.argv[5] if len(sys.argv) > 5 else "decay",
        optimizer=sys.argv[6] if len(sys.argv) > 6 else "adamw",
        mode=sys.argv[7] if len(sys.argv) > 7 else None,
        family=os.environ.get("DRAFTER_FAMILY", "dflash"),
    )
    dist = init_distributed("cpu", collectives=True)
    run(job, dist)
    dist.close()
