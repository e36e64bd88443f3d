"""Packed training: rows of documents that train exactly what the same records train unpacked."""

import json

import pytest
import torch

from flashdraft.distributed import Dist
from flashdraft.drafter.run_dir import latest_checkpoint
from flashdraft.train.blocks import candidate_anchors
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import BatchSpec, OnlineRecords, make_batch
from flashdraft.train.loop import LoopOptions, train
from flashdraft.train.packing import balanced_rows, first_fit_decreasing, make_packed_batch, pack_plan
from flashdraft.train.step import forward_loss, global_batch, loss_spec, stream_order
from tests.conftest import MASK, make_dflash2_drafter, make_drafter, make_dspark_drafter
from tests.train.helpers import Record, make_records

LENGTHS = [30, 12, 25, 9, 18, 30, 14, 22]  # a mix: some rows hold one record, some three


def _cut(records, lengths=LENGTHS):
    return [
        Record(
            r.input_ids[:n],
            r.loss_mask[:n],
            r.context_features[:n],
            None if r.target_topk is None else tuple(t[:n] for t in r.target_topk),
            r.prompt_length,
        )
        for r, n in zip(records, lengths, strict=True)
    ]


@pytest.fixture(scope="module")
def varied(records):
    return _cut(records)


@pytest.fixture(scope="module")
def varied_with_logits(target):
    return _cut(make_records(target, n=8, topk=16))


def _spec(block_size=8, first_draft=1, num_anchors=3):
    return BatchSpec(
        seed=3, num_anchors=num_anchors, block_size=block_size, mask_token_id=MASK, first_draft=first_draft
    )


def test_first_fit_decreasing_places_the_longest_first_into_the_first_row_with_room_for_tokens_and_blocks():
    # order 9, 6, 5, 3, 2; the 3-token record has 3 blocks: the second row (2 blocks left) cannot take it
    rows = first_fit_decreasing([5, 9, 3, 6, 2], [1, 3, 3, 2, 1], length=10, capacity=4)
    assert rows == [[1], [3, 4], [0, 2]]
    assert first_fit_decreasing([5, 9, 3, 6, 2], [1, 3, 3, 2, 1], length=10, capacity=4) == rows


def test_balanced_rows_spread_records_over_a_given_number_of_rows_fewest_blocks_first_or_say_they_cannot():
    # order 9, 6, 5, 3, 2: the 3-token record goes to the row of 1 block (not 2), the 2-token one to the row of 2
    assert balanced_rows([5, 9, 3, 6, 2], [1, 3, 3, 2, 1], length=10, num_rows=3) == [[1], [3, 4], [0, 2]]
    assert balanced_rows([9, 9, 9], [1, 1, 1], length=10, num_rows=2) is None  # no room: first-fit's rows stay


def test_a_plan_fills_whole_global_batches_so_no_step_computes_an_empty_row(varied):
    first_fit = pack_plan(varied, 32, 3, None)
    multiple = len(first_fit.rows) + 1  # first-fit would leave one row of the global batch empty
    plan = pack_plan(varied, 32, 3, None, rows_multiple=multiple)
    assert len(plan.rows) == multiple and all(plan.rows)
    assert sorted(i for row in plan.rows for i in row) == list(range(len(varied)))
    assert all(sum(len(varied[i].input_ids) for i in row) <= 32 for row in plan.rows)
    assert plan.blocks <= first_fit.blocks  # the rows hold fewer blocks: every step's A is smaller or equal


def test_rows_too_short_for_tiles_to_pay_attend_densely_unless_tiles_are_asked_for(varied):
    dense = pack_plan(varied, 32, 3, None)  # L = 32 is one key tile: the tiled path would score more, not less
    assert dense.tile_pairs == 0 and make_packed_batch(varied, dense.rows, 0, _spec(), dense).context_tiles is None
    tiled = pack_plan(varied, 32, 3, None, tiles=True)
    assert tiled.tile_pairs > 0 and make_packed_batch(varied, tiled.rows, 0, _spec(), tiled).context_tiles is not None


def test_a_packed_row_restarts_positions_per_document_and_draws_each_documents_anchors_as_unpacked(varied):
    plan = pack_plan(varied, 32, 3, None)
    assert sorted(i for row in plan.rows for i in row) == list(range(len(varied)))  # each record in one row
    assert all(sum(len(varied[i].input_ids) for i in row) <= 32 for row in plan.rows)
    assert any(len(row) >= 2 for row in plan.rows)
    batch = make_packed_batch(varied, plan.rows, 1, _spec(), plan)
    anchor_documents, context_documents = batch.documents
    for r, row in enumerate(plan.rows):
        for d, index in enumerate(row):
            n = len(varied[index].input_ids)
            assert batch.context_positions[r][context_documents[r] == d].tolist() == list(range(n))
            alone = make_batch([varied[index]], [index], 1, _spec())
            k = min(3, len(candidate_anchors(varied[index].loss_mask)))  # the budget is per document
            assert (
                batch.anchor_positions[r][anchor_documents[r] == d].tolist() == alone.anchor_positions[0, :k].tolist()
            )


def test_every_packed_batch_of_a_run_has_one_shape(varied):
    cfg = TrainConfig(batch_size=2, num_anchors=3, pack_length=32, seed=1).recording(block_size=8, mask_token_id=MASK)
    plan = pack_plan(varied, 32, 3, None)
    steps_per_epoch = -(-len(plan.rows) // 2)
    shapes = set()
    for step in range(2 * steps_per_epoch):
        for b in global_batch(cfg, varied, step, steps_per_epoch, Dist(), plan).micro_batches:
            shapes.add((tuple(b.context_features.shape), tuple(b.block_ids.shape), tuple(b.documents[0].shape)))
    assert shapes == {((2, 32, varied[0].context_features.shape[1]), (2, plan.blocks * 8), (2, plan.blocks))}


def test_two_ranks_see_every_record_once_per_epoch_and_a_stream_yields_them_in_the_order_each_rank_reads(varied):
    cfg = TrainConfig(batch_size=1, num_anchors=3, pack_length=32).recording(block_size=8, mask_token_id=MASK)
    plan = pack_plan(varied, 32, 3, None)
    steps_per_epoch = -(-len(plan.rows) // 2)
    streams = {
        rank: stream_order(cfg, 8, range(2 * steps_per_epoch), steps_per_epoch, Dist(rank, 2), plan) for rank in (0, 1)
    }
    for epoch in (0, 1):
        seen = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            for rank in (0, 1):
                batches = global_batch(cfg, varied, step, steps_per_epoch, Dist(rank=rank, world=2), plan)
                read = [i for b in batches.micro_batches for i in b.record_indices]
                assert read == streams[rank][: len(read)]  # the engine is asked for them in this order
                streams[rank] = streams[rank][len(read) :]
                seen += read
        assert sorted(seen) == list(range(len(varied)))
    assert streams == {0: [], 1: []}

    class Streamed(list):  # an engine: its features' width known, no record read before the stream starts
        feature_dim = varied[0].context_features.shape[-1]
        records = varied  # the completions' sequences: their loss masks

        def __getitem__(self, index):
            raise AssertionError("read outside the stream")

    assert pack_plan(Streamed(varied), 32, 3, None) == plan


def _loss_and_grads(drafter, target, batches, spec):
    drafter.zero_grad()
    total = sum(forward_loss(drafter, target, b, spec).weighted_sum for b in batches)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


FAMILIES = {
    "dflash full + sliding": lambda: make_drafter(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6
    ),
    "dflash2": make_dflash2_drafter,
    "dspark": lambda: make_dspark_drafter(block_size=8),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_rows_loss_and_gradients_are_the_sum_of_its_documents_unpacked(
    family, target, varied, varied_with_logits
):
    drafter = FAMILIES[family]()
    records = varied_with_logits if family == "dspark" else varied
    cfg = TrainConfig(num_anchors=3, loss_weighting="dpace")
    spec = loss_spec(cfg, drafter)
    batch_spec = _spec(first_draft=drafter.config.first_draft_position)
    plan = pack_plan(records, 40, 3, None, tiles=True)  # the packed attention path (L = 40: dense where it pays)
    row = max(plan.rows, key=len)
    assert len(row) >= 2
    packed = make_packed_batch(records, [row], 0, batch_spec, plan)
    alone = [make_batch([records[i]], [i], 0, batch_spec) for i in row]
    packed_loss, packed_grads = _loss_and_grads(drafter, target, [packed], spec)
    loss, grads = _loss_and_grads(drafter, target, alone, spec)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == grads.keys()
    for name, grad in grads.items():  # two summation orders: equal to float rounding, relative to the gradient
        assert float((packed_grads[name] - grad).norm()) <= 1e-4 * float(grad.norm()) + 1e-7, name


def test_a_planted_document_changes_nothing_of_another_documents_blocks_under_the_dense_tiled_and_flex_masks(
    target, records
):
    drafter = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    kept, planted, other = _cut(records[:3], [12, 20, 20])
    plan = pack_plan([kept, planted], 40, 3, None, tiles=True)
    hidden = {}
    with torch.no_grad():  # flex attention has no backward on CPU
        for backend, name, crossing in [("sdpa", n, c) for n in ("planted", "other") for c in (False, True)] + [
            (backend, name, False) for backend in ("flex", "tiled") for name in ("planted", "other")
        ]:
            drafter.attention_backend = "sdpa" if backend == "tiled" else backend
            batch = make_packed_batch([kept, planted if name == "planted" else other], [[0, 1]], 0, _spec(), plan)
            hidden[backend, name, crossing] = drafter(
                target.embed(batch.block_ids),
                batch.anchor_positions,
                batch.context_features,
                batch.context_positions,
                documents=None if crossing else batch.documents,  # None: attention across documents
                context_tiles=batch.context_tiles if backend == "tiled" else None,  # only its document's tiles
            )[0, : 3 * 8]  # the kept document's 3 blocks come first
    torch.testing.assert_close(hidden["sdpa", "planted", False], hidden["sdpa", "other", False])
    assert not torch.allclose(hidden["sdpa", "planted", True], hidden["sdpa", "other", True])  # the plant would tell
    for name in ("planted", "other"):
        torch.testing.assert_close(hidden["flex", name, False], hidden["sdpa", name, False], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden["tiled", name, False], hidden["sdpa", name, False], rtol=1e-4, atol=1e-5)


def test_a_packed_run_resumes_exactly_and_reports_its_padding_share(target, varied, tmp_path, capsys):
    cfg = TrainConfig(
        max_steps=4, batch_size=1, lr=3e-3, num_anchors=3, save_every=2, log_every=1, pack_length=40, optimizer="adamw"
    )
    straight = train(cfg, make_drafter(), target, varied, tmp_path / "a")
    printed = capsys.readouterr()
    assert "pad=" in printed.out + printed.err  # the progress line

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, make_drafter(), target, varied, tmp_path / "b", options=LoopOptions(on_step=crash))
    assert latest_checkpoint(tmp_path / "b").name == "step-0000002"
    resumed = train(cfg, make_drafter(seed=9), target, varied, tmp_path / "b", options=LoopOptions(resume=True))
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= row["padding_share"] < 1 for row in rows)


def test_online_records_pack_as_their_cached_features_do_and_a_record_longer_than_l_is_cut(target, varied):
    online = OnlineRecords(varied, target, [0, 2])
    plan = pack_plan(online, 32, 3, None)
    assert plan.rows == pack_plan(varied, 32, 3, None).rows and plan.cut == 0
    live = make_packed_batch(online, plan.rows[:1], 0, _spec(), plan)
    cached = make_packed_batch(varied, plan.rows[:1], 0, _spec(), plan)
    torch.testing.assert_close(live.context_features, cached.context_features, rtol=1e-4, atol=1e-5)
    short = pack_plan(varied, 20, 3, None)  # records of 30, 25, 22 and 30 tokens are cut to 20, each alone
    assert short.cut == 4 and short.lines(len(varied))[0].endswith("(raise --pack-length to keep them)")
    batch = make_packed_batch(varied, short.rows, 0, _spec(), short)
    assert batch.context_features.shape[1] == 20 and int(batch.anchor_positions.max()) < 20
