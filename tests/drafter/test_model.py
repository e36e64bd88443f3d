import pytest
import torch

from flashdraft.drafter.config import LayerAttention
from flashdraft.drafter.model import PAD_POSITION, attention_mask, blockwise_attention, blockwise_mask
from tests.conftest import (
    DFLASH2,
    DSPARK,
    make_dflash2_drafter,
    make_drafter,
    make_dspark_drafter,
    make_reduced_vocab_drafter,
)

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
    drafter = make_drafter(
        num_hidden_layers=num_layers, layer_types=["sliding_attention"] * num_layers, sliding_window=2048
    )
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
        drafter = make_drafter(
            layer_types=["sliding_attention", "full_attention"], sliding_window=2048, is_causal=is_causal
        )
        assert [a.causal for a in drafter.config.layer_attention] == [is_causal, is_causal]
        same = torch.allclose(
            _block_outputs(drafter, changed, anchors, ctx, pos)[:, :4],
            _block_outputs(drafter, blocks, anchors, ctx, pos)[:, :4],
            atol=1e-6,
        )
        assert same == is_causal


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_all_blocks_in_one_forward_equal_each_block_alone(family):
    # DFlash2: the context features bypass the convolutions and no block's taps reach another block
    drafter = make_dflash2_drafter(block_size=8) if family == "dflash2" else make_drafter(block_size=8)
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
    torch.testing.assert_close(
        _block_outputs(scaled, blocks, anchors, ctx, pos), _block_outputs(plain, blocks * 2.5, anchors, ctx, pos)
    )


# -- DFlash2: the grouped dynamic causal convolution and the candidate selector ------------------


def test_dflash2_conv_output_at_block_position_j_ignores_block_inputs_after_j():
    # full, non-causal attention would mix the block: a one-layer attention-free check isolates the conv
    drafter = make_dflash2_drafter()
    conv = drafter.layers[0].attention_conv
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2 * 8, H, generator=gen)  # two blocks of 8
    y, delta = conv.prepare(x, 8)
    out = conv.finish(y, delta, 8)
    for j in range(8):
        changed = x.clone()
        changed[:, j + 1 : 8] += torch.randn(1, 7 - j, H, generator=gen)  # block 0 after j
        changed[:, 8:] += torch.randn(1, 8, H, generator=gen)  # all of block 1
        y2, delta2 = conv.prepare(changed, 8)
        out2 = conv.finish(y2, delta2, 8)
        torch.testing.assert_close(out2[:, : j + 1], out[:, : j + 1], rtol=0, atol=0)
        assert not torch.allclose(out2[:, 8:], out[:, 8:])


def test_dflash2_conv_never_reads_another_block_the_first_row_of_each_block_sees_zeros_before_it():
    drafter = make_dflash2_drafter()
    conv = drafter.layers[0].mlp_conv
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3 * 8, H, generator=gen)
    y, _ = conv.prepare(x, 8)
    for k in range(3):  # each block convolved alone equals its rows of the three convolved together
        alone, _ = conv.prepare(x[:, k * 8 : (k + 1) * 8], 8)
        torch.testing.assert_close(y[:, k * 8 : (k + 1) * 8], alone, rtol=1e-6, atol=1e-6)
    # the written-out rule at the anchor row and one inner row (kernel size 2: taps 0 and 1)
    delta = conv.kernel_projection(x).view(1, 24, 2, 2, conv.groups)[..., 0, :, :]
    per_channel = delta.repeat_interleave(conv.group_size, dim=-1)  # [1, 24, K, H]
    w0, w1 = conv.base_kernel[0, 0] + per_channel[:, :, 0], conv.base_kernel[0, 1] + per_channel[:, :, 1]
    torch.testing.assert_close(y[:, 8], w0[:, 8] * x[:, 8])  # anchor of block 1: nothing before it
    torch.testing.assert_close(y[:, 11], w0[:, 11] * x[:, 11] + w1[:, 11] * x[:, 10])


def test_dflash2_neutral_start_computes_exactly_the_dflash_backbone():
    dflash2 = make_drafter(seed=3, **DFLASH2)  # identity convs, neutral selector: as `init` makes it
    dflash = make_drafter(seed=3)
    backbone = {k: v for k, v in dflash2.state_dict().items() if k in dflash.state_dict()}
    assert all(torch.equal(backbone[k], v) for k, v in dflash.state_dict().items())  # the same draws
    ctx, anchors, blocks = _inputs()
    pos = torch.arange(ctx.shape[1])[None]
    torch.testing.assert_close(dflash2(blocks, anchors, ctx, pos), dflash(blocks, anchors, ctx, pos), rtol=0, atol=0)


def _plain_walk(selector, hidden, unary, anchor):
    """The selector's greedy walk written out: one position, one candidate at a time."""
    drafts, predecessor = [], anchor
    for t in range(hidden.shape[0]):
        values, ids = unary[t].topk(selector.top_k)
        best, best_score = None, float("-inf")
        for value, c in zip(values.tolist(), ids.tolist(), strict=True):
            pair = float(
                (
                    selector.predecessor_codebook[predecessor]
                    * selector.hidden_projection(hidden[t])
                    * selector.successor_codebook[c]
                ).sum()
            )
            if value + pair > best_score:
                best, best_score = c, value + pair
        drafts.append(best)
        predecessor = best
    return drafts


def test_dflash2_selector_greedy_walk_equals_a_plain_loop_over_positions_and_candidates():
    drafter = make_dflash2_drafter()
    selector = drafter.candidate_selector
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 7, H, generator=gen)
    unary = torch.randn(3, 7, 64, generator=gen) * 3
    anchors = torch.tensor([5, 17, 40])
    with torch.no_grad():
        drafts, rows = selector.walk(hidden, unary, anchors)
        for n in range(3):
            assert drafts[n].tolist() == _plain_walk(selector, hidden[n], unary[n], int(anchors[n]))
        assert torch.equal(rows.argmax(-1), drafts)
        assert int(torch.isfinite(rows).sum(-1).max()) == selector.top_k  # scores only for the top-K
        unary_path = unary.argmax(-1)
    assert not torch.equal(drafts, unary_path)  # this selector changes the draft


def test_dflash2_sampled_walk_draws_each_position_from_its_sparse_q_given_the_draft_before():
    drafter = make_dflash2_drafter()
    selector = drafter.candidate_selector
    gen = torch.Generator().manual_seed(4)
    hidden, unary, anchor = torch.randn(1, 3, H, generator=gen), torch.randn(1, 3, 64, generator=gen), torch.tensor([9])
    with torch.no_grad():
        drafts, q = selector.walk(hidden, unary, anchor, temperature=0.7, generator=gen)
        torch.testing.assert_close(q.sum(-1), torch.ones(1, 3))
        assert int((q > 0).sum(-1).max()) <= selector.top_k
        assert bool((q[0, torch.arange(3), drafts[0]] > 0).all())
        # position 1's q is softmax(score / T) given the token drawn at position 0
        values, ids = unary[0, 1].topk(selector.top_k)
        scores = values + selector.pair_scores(selector.hidden_projection(hidden[0, 1]), drafts[0, 0], ids)
        torch.testing.assert_close(q[0, 1, ids], torch.softmax(scores / 0.7, -1))


# -- DSpark -----------------------------------------------------------------------------------------


def _dspark_block(drafter, seed=0):
    """Base logits [2, 7, V] and hidden states [2, 7, H] of two DSpark blocks, and their anchors [2]."""
    gen = torch.Generator().manual_seed(seed)
    blocks, anchors = torch.randn(1, 14, 64, generator=gen), torch.tensor([[5, 12]])
    ctx, pos = torch.randn(1, 17, 128, generator=gen), torch.arange(17)[None]
    with torch.no_grad():
        hidden = drafter(blocks, anchors, ctx, pos).view(2, 7, -1)
    base = (hidden @ torch.randn(64, drafter.config.vocab_size, generator=gen)).float()  # a stand-in LM head
    return base, hidden, torch.tensor([3, 9])


def test_dspark_greedy_walk_adds_to_each_position_the_markov_bias_of_the_draft_before_it():
    drafter = make_dspark_drafter()
    base, _, anchors = _dspark_block(drafter)
    drafts, rows, previous = drafter.markov_walk(base, anchors)
    w1, w2 = drafter.markov_head.markov_w1.weight.detach(), drafter.markov_head.markov_w2.weight.detach()
    before = anchors
    for t in range(7):  # a plain loop: position t's logits get W2 W1[draft t - 1], the anchor's at t = 0
        logits = base[:, t] + w1[before] @ w2.T  # [2, V]
        assert torch.equal(previous[:, t], before)
        torch.testing.assert_close(rows[:, t], logits, rtol=1e-5, atol=1e-5)
        before = logits.argmax(-1)
        assert torch.equal(drafts[:, t], before)
    assert not torch.equal(drafts, base.argmax(-1))  # the bias changes what is drafted


def test_dspark_markov_bias_never_reads_a_later_position_changing_one_leaves_every_draft_before_it():
    drafter = make_dspark_drafter()
    base, _, anchors = _dspark_block(drafter)
    drafts, rows, _ = drafter.markov_walk(base, anchors)
    changed = base.clone()
    changed[:, 4:] = torch.randn(changed[:, 4:].shape)
    drafts2, rows2, _ = drafter.markov_walk(changed, anchors)
    assert torch.equal(drafts2[:, :4], drafts[:, :4]) and torch.equal(rows2[:, :4], rows[:, :4])


def test_dspark_sampled_walk_draws_each_position_from_the_q_it_returns_given_the_draft_sampled_before():
    drafter = make_dspark_drafter()
    base, _, anchors = _dspark_block(drafter)
    drafts, q, previous = drafter.markov_walk(base, anchors, 1.5, torch.Generator().manual_seed(0))
    assert torch.equal(previous[:, 1:], drafts[:, :-1]) and torch.equal(previous[:, 0], anchors)
    with torch.no_grad():
        expected = torch.softmax((base + drafter.markov_head.bias(previous)) / 1.5, -1)
    torch.testing.assert_close(q, expected, rtol=1e-5, atol=1e-6)


def test_dspark_draft_topk_biases_only_the_base_top_k_and_never_drafts_another_token():
    drafter = make_dspark_drafter(draft_top_k=3)
    base, _, anchors = _dspark_block(drafter)
    top = base.topk(3, dim=-1).indices
    for temperature in (0.0, 1.0):
        drafts, rows, _ = drafter.markov_walk(base, anchors, temperature, torch.Generator().manual_seed(1))
        assert bool((drafts[..., None] == top).any(-1).all())
        outside = torch.ones_like(rows, dtype=torch.bool).scatter(-1, top, False)
        assert bool((rows[outside] == (float("-inf") if temperature == 0 else 0.0)).all())


@pytest.mark.parametrize("with_markov", [True, False])
def test_dspark_confidence_is_the_sigmoid_of_its_linear_head_over_hidden_and_markov_embedding(with_markov):
    drafter = make_dspark_drafter(confidence_head_with_markov=with_markov)
    _, hidden, _ = _dspark_block(drafter)
    previous = torch.randint(0, drafter.config.vocab_size, (2, 7))
    proj = drafter.confidence_head.proj
    features = hidden
    if with_markov:
        features = torch.cat([hidden, drafter.markov_head.markov_w1.weight[previous]], -1)
    with torch.no_grad():
        expected = torch.sigmoid(features @ proj.weight[0] + proj.bias[0])
        torch.testing.assert_close(drafter.confidence(hidden, previous), expected, rtol=1e-5, atol=1e-6)
    assert proj.weight.shape == (1, 64 + (8 if with_markov else 0))


def test_dspark_neutral_start_has_no_markov_bias_and_the_same_backbone_as_a_dflash_drafter_of_the_seed():
    dspark, dflash = make_drafter(3, **DSPARK), make_drafter(3, block_size=7)
    for name, p in dflash.state_dict().items():
        assert torch.equal(dspark.state_dict()[name], p), name
    assert not dspark.markov_head.markov_w2.weight.any() and dspark.markov_head.markov_w1.weight.std() > 0
    base, hidden, anchors = _dspark_block(dspark)
    assert torch.equal(dspark.markov_walk(base, anchors)[0], base.argmax(-1))
    assert torch.equal(dspark.confidence(hidden, torch.zeros(2, 7, dtype=torch.long)), torch.full((2, 7), 0.5))


@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda a: a.describe())
def test_blockwise_attention_equals_the_dense_mask_over_context_and_every_block_with_documents(attention):
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim, blocks, block, context = 2, 4, 2, 8, 3, 4, 10
    context_positions = torch.tensor([list(range(6)) + list(range(4)), list(range(8)) + [PAD_POSITION] * 2])
    anchors = torch.tensor([[2, 5, 3], [1, 4, 7]])  # row 0: the third block is the second document's
    anchor_documents = torch.tensor([[0, 0, 1], [0, 0, 0]])
    context_documents = torch.tensor([[0] * 6 + [1] * 4, [0] * 8 + [-1] * 2])
    query_anchor = anchors.repeat_interleave(block, dim=1)
    query_positions = query_anchor + torch.arange(block).repeat(blocks)
    query_block = torch.arange(blocks).repeat_interleave(block)
    documents = (anchor_documents.repeat_interleave(block, dim=1), context_documents)
    q = torch.randn(n, heads, blocks * block, dim, generator=gen)
    k_ctx, v_ctx = (torch.randn(n, kv_heads, context, dim, generator=gen) for _ in range(2))
    k_blk, v_blk = (torch.randn(n, kv_heads, blocks * block, dim, generator=gen) for _ in range(2))
    dense = attention_mask(query_positions, query_block, query_anchor, context_positions, attention, documents)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), attn_mask=dense, enable_gqa=True
    )
    mask = blockwise_mask(query_positions, query_anchor, context_positions, block, attention, documents)
    torch.testing.assert_close(blockwise_attention(q, (k_ctx, v_ctx), (k_blk, v_blk), mask), expected)
