import pytest
import torch

from flashdraft.config import LayerAttention
from flashdraft.model import PAD_POSITION, attention_mask
from tests.conftest import make_drafter, make_reduced_vocab_drafter

H, CTX = 64, 128  # hidden size; 2 context layers * hidden


def _inputs(seq_len=40, num_blocks=3, block=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, seq_len, CTX, generator=gen)
    anchors = torch.tensor([[7, 19, 30][:num_blocks]])
    blocks = torch.randn(1, num_blocks * block, H, generator=gen)
    return ctx, anchors, blocks


ATTENTIONS = [LayerAttention(causal, window) for causal in (False, True) for window in (None, 6)]


@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda a: a.describe())
def test_mask_follows_the_reference_rule_entry_by_entry(attention):
    """Section 2 of the reference doc, written out: context strictly before the anchor, the own
    block only (a causal layer: keys at or before the query), window |q - k| < W."""
    b = 4
    anchors = torch.tensor([[3, 9, 10]])
    ctx_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, PAD_POSITION]])
    q_anchor = anchors.repeat_interleave(b, 1)
    q_pos = q_anchor + torch.arange(b).repeat(3)
    q_block = torch.arange(3).repeat_interleave(b)
    mask = attention_mask(q_pos, q_block, q_anchor, ctx_pos, attention)[0, 0]
    keys = ctx_pos[0].tolist() + q_pos[0].tolist()
    visible = 0
    for qi in range(q_pos.shape[1]):
        qp = int(q_pos[0, qi])
        for ki, kp in enumerate(keys):
            if ki < ctx_pos.shape[1]:
                rule = kp < q_anchor[0, qi]
            else:
                rule = q_block[ki - ctx_pos.shape[1]] == q_block[qi] and (not attention.causal or kp <= qp)
            if attention.window is not None:
                rule = rule and abs(qp - kp) < attention.window
            assert bool(mask[qi, ki]) == bool(rule), (attention, qi, ki)
            visible += bool(rule)
    assert visible > 0


def _block_outputs(drafter, block_inputs, anchors, ctx, pos):
    return drafter(block_inputs, anchors, ctx[:, : int(anchors[0, 0])], pos[:, : int(anchors[0, 0])])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_sliding_layer_output_at_block_position_j_ignores_block_inputs_after_j(num_layers):
    drafter = make_drafter(num_hidden_layers=num_layers, layer_types=["sliding_attention"] * num_layers,
                           sliding_window=2048)  # fmt: skip
    assert all(a.causal for a in drafter.config.layer_attention)
    ctx, anchors, blocks = _inputs(num_blocks=1)
    pos = torch.arange(ctx.shape[1])[None]
    out = _block_outputs(drafter, blocks, anchors, ctx, pos)
    j = 3
    changed = blocks.clone()
    changed[:, j + 1 :] += torch.randn_like(changed[:, j + 1 :])
    later = _block_outputs(drafter, changed, anchors, ctx, pos)
    torch.testing.assert_close(later[:, : j + 1], out[:, : j + 1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(later[:, j + 1 :], out[:, j + 1 :])


def test_a_full_layer_output_at_block_position_j_sees_block_inputs_after_j():
    drafter = make_drafter(num_hidden_layers=1)
    assert not drafter.config.layer_attention[0].causal
    ctx, anchors, blocks = _inputs(num_blocks=1)
    pos = torch.arange(ctx.shape[1])[None]
    out = _block_outputs(drafter, blocks, anchors, ctx, pos)
    changed = blocks.clone()
    changed[:, 4:] += 1.0
    assert not torch.allclose(_block_outputs(drafter, changed, anchors, ctx, pos)[:, :4], out[:, :4])


def test_is_causal_false_makes_every_layer_non_causal_and_true_every_layer_causal():
    ctx, anchors, blocks = _inputs(num_blocks=1)
    pos = torch.arange(ctx.shape[1])[None]
    changed = blocks.clone()
    changed[:, 4:] += 1.0
    for is_causal in (False, True):
        drafter = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=2048,
                               is_causal=is_causal)  # fmt: skip
        assert [a.causal for a in drafter.config.layer_attention] == [is_causal, is_causal]
        same = torch.allclose(_block_outputs(drafter, changed, anchors, ctx, pos)[:, :4],
                              _block_outputs(drafter, blocks, anchors, ctx, pos)[:, :4], atol=1e-6)  # fmt: skip
        assert same == is_causal


def test_all_blocks_in_one_forward_equal_each_block_alone():
    drafter = make_drafter(block_size=8)
    ctx, anchors, blocks = _inputs()
    pos = torch.arange(ctx.shape[1])[None]
    together = drafter(blocks, anchors, ctx, pos)
    for k in range(anchors.shape[1]):
        a = int(anchors[0, k])
        alone = drafter(blocks[:, k * 8 : (k + 1) * 8], anchors[:, k : k + 1], ctx[:, :a], pos[:, :a])
        torch.testing.assert_close(together[:, k * 8 : (k + 1) * 8], alone, rtol=1e-5, atol=1e-5)


def test_cached_context_equals_context_given_at_once():
    drafter = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    ctx, anchors, blocks = _inputs(num_blocks=1)
    a = int(anchors[0, 0])
    pos = torch.arange(a)[None]
    at_once = drafter(blocks, anchors, ctx[:, :a], pos)
    cache = drafter.new_cache()
    drafter(blocks, torch.tensor([[3]]), ctx[:, :3], pos[:, :3], cache=cache)  # an earlier step
    step = drafter(blocks, anchors, ctx[:, 3:a], pos[:, 3:a], cache=cache)
    torch.testing.assert_close(step, at_once, rtol=1e-5, atol=1e-5)
    assert len(cache) == a  # only context is kept, never the block


def test_sliding_window_hides_exactly_the_keys_outside_it():
    window = 4
    drafter = make_drafter(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=window)
    ctx, anchors, blocks = _inputs(num_blocks=1)
    a = int(anchors[0, 0])  # 7; last query at 7 + 7 = 14 sees keys > 10 only, first query keys > 3
    pos = torch.arange(a)[None]
    out = drafter(blocks, anchors, ctx[:, :a], pos)
    far = ctx.clone()
    far[:, : a - window + 1] += 10.0  # positions 0..3: outside every query's window
    torch.testing.assert_close(drafter(blocks, anchors, far[:, :a], pos), out)
    near = ctx.clone()
    near[:, a - 1] += 10.0  # position 6 is inside the anchor query's window
    assert not torch.allclose(drafter(blocks, anchors, near[:, :a], pos)[:, 0], out[:, 0])
    # a full-attention drafter does see the far context
    full = make_drafter(num_hidden_layers=1)
    assert not torch.allclose(full(blocks, anchors, far[:, :a], pos), full(blocks, anchors, ctx[:, :a], pos))


def test_padding_context_is_never_seen():
    drafter = make_drafter()
    ctx, anchors, blocks = _inputs(num_blocks=1)
    a = int(anchors[0, 0])
    pos = torch.arange(a)[None]
    padded_ctx = torch.cat([ctx[:, :a], torch.randn(1, 5, CTX)], dim=1)
    padded_pos = torch.cat([pos, torch.full((1, 5), PAD_POSITION)], dim=1)
    torch.testing.assert_close(
        drafter(blocks, anchors, padded_ctx, padded_pos), drafter(blocks, anchors, ctx[:, :a], pos)
    )


@torch.no_grad()  # flex attention has no CPU backward; the GPU path compiles the same rule
def test_block_sparse_flex_attention_equals_the_dense_mask_path():
    drafter = make_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    ctx, anchors, blocks = _inputs()
    pos = torch.arange(ctx.shape[1])[None]
    dense = drafter(blocks, anchors, ctx, pos)
    drafter.attention_backend = "flex"
    torch.testing.assert_close(drafter(blocks, anchors, ctx, pos), dense, rtol=1e-5, atol=1e-5)


def test_a_reduced_vocabulary_maps_draft_ids_through_d2t_and_leaves_other_target_ids_at_minus_infinity():
    target_ids = [2, 5, 9, 30, 63]
    drafter = make_reduced_vocab_drafter(target_ids)
    hidden = torch.randn(3, H)
    own = drafter.lm_head(hidden)  # [3, 5]
    logits = drafter.logits(hidden, target_lm_head=None)  # never the target's head
    assert logits.shape == (3, 64)
    torch.testing.assert_close(logits[:, target_ids], own)
    others = [i for i in range(64) if i not in target_ids]
    assert bool(torch.isneginf(logits[:, others]).all())


@torch.no_grad()
def test_reference_output_multiplier_and_softcapping_shape_the_logits_as_the_reference_does():
    head = torch.nn.Linear(H, 64, bias=False)
    hidden = torch.randn(4, H) * 50
    plain = make_drafter().logits(hidden, head)
    scaled = make_drafter(extra={"dflash_config": {"output_multiplier": 0.5, "final_logit_softcapping": 3.0}})
    torch.testing.assert_close(scaled.logits(hidden, head), 3.0 * torch.tanh(plain * 0.5 / 3.0))
    assert float(scaled.logits(hidden, head).abs().max()) <= 3.0


def test_input_embedding_scale_multiplies_the_block_embeddings():
    ctx, anchors, blocks = _inputs(num_blocks=1)
    pos = torch.arange(ctx.shape[1])[None]
    plain = make_drafter()
    scaled = make_drafter(extra={"dflash_config": {"input_embedding_scale": 2.5}})
    torch.testing.assert_close(_block_outputs(scaled, blocks, anchors, ctx, pos),
                               _block_outputs(plain, blocks * 2.5, anchors, ctx, pos))  # fmt: skip
