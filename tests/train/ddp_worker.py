"""Run by `torchrun` in test_loop.py: train a few steps on a tiny random target."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from flashdraft.distributed import init_distributed  # noqa: E402
from flashdraft.train.loop import TrainConfig, train  # noqa: E402
from tests.conftest import make_drafter, make_target  # noqa: E402
from tests.train.helpers import make_records  # noqa: E402

if __name__ == "__main__":
    run_dir, batch_size, grad_accum = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fsdp = len(sys.argv) > 4 and sys.argv[4] == "fsdp"
    weighting = sys.argv[5] if len(sys.argv) > 5 else "decay"
    optimizer = sys.argv[6] if len(sys.argv) > 6 else "adamw"
    dist = init_distributed("cpu", collectives=True)
    target = make_target("hybrid")
    records = make_records(target, n=8)
    cfg = TrainConfig(max_steps=3, batch_size=batch_size, grad_accum=grad_accum, lr=3e-3, num_anchors=6,
                      save_every=100, log_every=1, fsdp=fsdp, loss_weighting=weighting,
                      optimizer=optimizer)  # fmt: skip
    train(cfg, make_drafter(block_size=4), target, records, run_dir, dist=dist)
    dist.close()
