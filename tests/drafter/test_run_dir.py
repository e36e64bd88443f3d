"""The run directory's trainer state: written only as what torch.load(weights_only=True) reads,
and an older run's state (numpy values, which need a full unpickle) refused on resume with the
command that converts it; converted, the run resumes bit-identically."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flashdraft.drafter.run_dir import latest_checkpoint, save_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from flashdraft.train.config import TrainConfig
from flashdraft.train.loop import LoopOptions, train
from tests.conftest import make_drafter, make_drafter_config, make_target, run_cli
from tests.train.helpers import make_records


def _cfg() -> TrainConfig:
    return TrainConfig(epochs=10, max_steps=4, batch_size=2, lr=3e-3, num_anchors=6, save_every=2, log_every=1)


def _age(checkpoint) -> None:
    """Rewrite a checkpoint's trainer.pt as an older flashdraft might have: numpy values in it."""
    trainer = checkpoint / "trainer.pt"
    state = torch.load(trainer, weights_only=True)
    state |= {
        "step": np.int64(state["step"]),
        "torch_rng": state["torch_rng"].numpy(),
        "numpy_rng": np.random.RandomState(0).get_state(),
    }
    torch.save(state, trainer)
    sums = json.loads((checkpoint / "checksums.json").read_text())
    (checkpoint / "checksums.json").write_text(json.dumps(sums | {"trainer.pt": sha256_file(trainer)}))


def test_an_older_trainer_state_is_refused_on_resume_then_converted_resumes_bit_identically(tmp_path, capsys):
    target = make_target("hybrid")
    records = make_records(target, n=8)
    straight = train(_cfg(), make_drafter(), target, records, tmp_path / "a")

    def crash(step):
        if step == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint

    with pytest.raises(KeyboardInterrupt):
        train(_cfg(), make_drafter(), target, records, tmp_path / "b", options=LoopOptions(on_step=crash))
    checkpoint = latest_checkpoint(tmp_path / "b")
    _age(checkpoint)
    with pytest.raises(
        FlashdraftError,
        match=rf"trainer.pt: a pickle that names numpy\..*flashdraft convert-run "
        rf"{tmp_path / 'b'}$",
    ):
        train(_cfg(), make_drafter(), target, records, tmp_path / "b", options=LoopOptions(resume=True))

    rc, out, _ = run_cli(capsys, "convert-run", tmp_path / "b")
    assert rc == 0 and f"{checkpoint / 'trainer.pt'}: converted" in out, out
    converted = (checkpoint / "trainer.pt").read_bytes()
    rc, out, _ = run_cli(capsys, "convert-run", checkpoint)  # a converted run is left as it is
    assert rc == 0 and "left as it is" in out and (checkpoint / "trainer.pt").read_bytes() == converted
    resumed = train(_cfg(), make_drafter(seed=99), target, records, tmp_path / "b", options=LoopOptions(resume=True))
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_a_trainer_state_that_torch_load_could_not_read_safely_is_never_written(tmp_path):
    drafter = make_drafter()
    with pytest.raises(FlashdraftError, match=r"the trainer state of step 1\['loss'\]: a numpy.float32"):
        save_checkpoint(tmp_path, 1, make_drafter_config(), drafter.state_dict(), {"loss": np.float32(1.5)}, keep=3)
    assert latest_checkpoint(tmp_path) is None and not list((tmp_path / "checkpoints").iterdir())
