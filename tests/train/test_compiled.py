"""The compiled training step: one graph per batch shape, nothing recompiled after warm-up, and the losses and
gradients of the eager step. Dynamo's guards and graph breaks are the same under backend="eager" as under inductor,
so these tests compile with it (inductor's own compile takes tens of seconds a graph on CPU: benchmarks/)."""

import json

import pytest
import torch

from flashdraft.distributed import Dist
from flashdraft.train.compiled import CompiledStep, batch_shape, compile_by_default
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, make_batch
from flashdraft.train.loop import LoopOptions, train
from flashdraft.train.packing import make_packed_batch, pack_plan
from flashdraft.train.step import forward_loss, global_batch, loss_spec
from tests.conftest import MASK, make_dflash2_drafter, make_drafter, make_dspark_drafter
from tests.train.helpers import make_records
from tests.train.test_packing import _cut

FAMILIES = {
    "dflash decay": (
        lambda: make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
        "decay",
    ),
    "dflash2 dpace": (make_dflash2_drafter, "dpace"),  # D-PACE's weights from the compiled forward's predictions
    "dspark": (lambda: make_dspark_drafter(block_size=8), "decay"),
}


@pytest.fixture(scope="module")
def varied_with_logits(target):
    return _cut(make_records(target, n=8, topk=16))


def _spec(drafter):
    return BatchSpec(
        seed=3, num_anchors=3, block_size=8, mask_token_id=MASK, first_draft=drafter.config.first_draft_position
    )


def _loss_and_grads(drafter, target, batch, spec, compiled=None):
    drafter.zero_grad()
    loss = forward_loss(drafter, target, batch, spec, compiled).weighted_sum
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _equal_to_eager(drafter, target, batch, spec, compiled):
    eager_loss, eager_grads = _loss_and_grads(drafter, target, batch, spec)
    loss, grads = _loss_and_grads(drafter, target, batch, spec, compiled)
    # backend="eager" runs the traced ops one by one; the chunk's padding rows change nothing but rounding
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_compiled_packed_step_has_the_eager_losses_and_gradients_and_compiles_once(
    family, target, varied_with_logits
):
    torch._dynamo.reset()  # graphs of earlier tests (same code, same shapes) would be reused: count from none
    make, weighting = FAMILIES[family]
    drafter = make().train()
    spec = loss_spec(TrainConfig(num_anchors=3, loss_weighting=weighting), drafter)
    plan = pack_plan(varied_with_logits, 40, 3, None, tiles=True)
    epochs = [make_packed_batch(varied_with_logits, plan.rows[:2], epoch, _spec(drafter), plan) for epoch in (0, 1)]
    compiled = CompiledStep(drafter, backend="eager")
    _equal_to_eager(drafter, target, epochs[0], spec, compiled)
    assert (compiled.compiles, compiled.recompiles) == (2, 0)  # the forward and the loss chunk
    with torch.compiler.set_stance("fail_on_recompile"):  # any new graph raises: another epoch's anchors, same shape
        _equal_to_eager(drafter, target, epochs[1], spec, compiled)
    assert (compiled.compiles, compiled.recompiles) == (2, 0)


def test_unpacked_length_buckets_compile_one_forward_each_and_nothing_again(target, varied_with_logits):
    torch._dynamo.reset()
    drafter = make_drafter().train()
    spec = loss_spec(TrainConfig(num_anchors=3, loss_weighting="dpace"), drafter)
    compiled = CompiledStep(drafter, backend="eager")
    pairs = [[1, 3], [0, 5], [1, 3]]  # records of 12 and 9 tokens, then 30 and 30: two buckets, the first again
    batches = [make_batch([varied_with_logits[i] for i in p], p, 0, _spec(drafter)) for p in pairs]
    assert batch_shape(batches[0]) != batch_shape(batches[1])
    for batch in batches[:2]:
        _equal_to_eager(drafter, target, batch, spec, compiled)
    assert (compiled.compiles, compiled.recompiles, len(compiled.shapes)) == (3, 0, 2)  # 2 forwards, 1 chunk
    with torch.compiler.set_stance("fail_on_recompile"):
        forward_loss(drafter, target, batches[2], spec, compiled).weighted_sum.backward()


def test_a_compiled_packed_run_compiles_once_recompiles_nothing_and_reports_it(target, varied_with_logits, tmp_path):
    cfg = TrainConfig(
        max_steps=6, batch_size=1, lr=3e-3, num_anchors=3, log_every=1, pack_length=40, optimizer="adamw", compile=True
    )
    torch._dynamo.reset()
    train(cfg, make_drafter(), target, varied_with_logits, tmp_path, options=LoopOptions(compile_backend="eager"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step_recompiles"] for row in rows] == [0] * 6
    assert [row["step_compiles"] for row in rows] == [2] * 6  # the forward and the loss chunk, both at step 1
    assert all("wait_s" in row for row in rows)


def test_compile_is_on_by_default_on_cuda_only_and_a_global_batch_keeps_its_shape():
    assert compile_by_default(torch.device("cuda")) and not compile_by_default(torch.device("cpu"))
    with pytest.raises(ValueError, match="compile backend 'cudagraph'"):
        CompiledStep(torch.nn.Linear(1, 1), backend="cudagraph")


def test_every_packed_global_batch_of_a_run_has_the_shape_the_compiled_step_saw_first(varied_with_logits):
    cfg = TrainConfig(batch_size=2, num_anchors=3, pack_length=40, seed=1).recording(block_size=8, mask_token_id=MASK)
    plan = pack_plan(varied_with_logits, 40, 3, None, rows_multiple=2)
    steps_per_epoch = len(plan.rows) // 2
    shapes = {
        batch_shape(global_batch(cfg, varied_with_logits, step, steps_per_epoch, Dist(), plan).micro_batches[0])
        for step in range(3 * steps_per_epoch)
    }
    assert len(shapes) == 1
