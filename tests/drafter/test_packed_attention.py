"""Packed rows' attention over (block, context tile) pairs: the dense rule's result at a document's own cost."""

import pytest
import torch

from flashdraft.drafter.config import LayerAttention
from flashdraft.drafter.model import blockwise_attention, blockwise_mask
from flashdraft.drafter.packed_attention import ContextTiles, row_tile_pairs, tiled_attention, tiled_mask

BLOCK, TILE, BLOCK_TILE = 4, 8, 2
# two rows: documents of (context tokens, blocks); the second row shorter than C, padding after its documents
ROWS = [[(13, 3), (5, 2), (17, 2)], [(20, 4), (3, 1)]]
C, A = 40, 7


def test_a_documents_block_tiles_pair_with_exactly_the_key_tiles_overlapping_its_tokens():
    # tokens 0-12: key tiles 0, 1; tokens 13-17: 1, 2; tokens 18-34: 2, 3, 4
    # blocks 0-2: block tiles 0, 1; blocks 3-4: 1, 2; blocks 5-6: 2, 3
    pairs = row_tile_pairs([13, 5, 17], [3, 2, 2], TILE, BLOCK_TILE)
    expected = {(i, j) for i in (0, 1) for j in (0, 1)} | {(i, j) for i in (1, 2) for j in (1, 2)}
    expected |= {(i, j) for i in (2, 3) for j in (2, 3, 4)}
    assert pairs == sorted(expected)
    # a short document's blocks pay for its own tiles, not the row's: 2 key tiles of 5 for the first block tile
    assert [j for i, j in pairs if i == 0] == [0, 1]


def _row_layout():
    """context positions/documents [2, C], anchors/anchor documents [2, A] and the pairs of ROWS."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.full((2, C), 1 << 40, dtype=torch.long)
    context_documents = torch.full((2, C), -1, dtype=torch.long)
    anchors = torch.zeros(2, A, dtype=torch.long)
    anchor_documents = torch.full((2, A), -1, dtype=torch.long)
    for r, row in enumerate(ROWS):
        t = k = 0
        for d, (tokens, blocks) in enumerate(row):
            positions[r, t : t + tokens] = torch.arange(tokens)
            context_documents[r, t : t + tokens] = d
            anchors[r, k : k + blocks] = torch.randint(1, tokens, (blocks,), generator=generator).sort().values
            anchor_documents[r, k : k + blocks] = d
            t, k = t + tokens, k + blocks
    pairs = [row_tile_pairs([t for t, _ in row], [b for _, b in row], TILE, BLOCK_TILE) for row in ROWS]
    tiles = ContextTiles.of_rows(pairs, max(len(p) for p in pairs) + 3, TILE, BLOCK_TILE)  # padding pairs too
    return positions, (anchor_documents, context_documents), anchors, tiles


@pytest.mark.parametrize("attention", [LayerAttention(False, None), LayerAttention(True, 6)])
def test_tiled_attention_equals_the_dense_blockwise_rule_in_values_and_gradients(attention):
    positions, documents, anchors, tiles = _row_layout()
    query_positions = anchors.repeat_interleave(BLOCK, dim=1) + torch.arange(BLOCK).repeat(A)  # [2, A * B]
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    tensors = [
        torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()
        for shape in [(2, heads, A * BLOCK, dim)] + [(2, kv_heads, C, dim)] * 2 + [(2, kv_heads, A * BLOCK, dim)] * 2
    ]
    q, k_ctx, v_ctx, k_blk, v_blk = tensors
    query_documents = (documents[0].repeat_interleave(BLOCK, dim=1), documents[1])
    dense_mask = blockwise_mask(
        query_positions, anchors.repeat_interleave(BLOCK, dim=1), positions, BLOCK, attention, query_documents
    )
    mask = tiled_mask(tiles, query_positions, anchors, positions, documents, BLOCK, attention)
    real = (documents[0] >= 0).repeat_interleave(BLOCK, dim=1)[:, None, :, None]  # padding blocks: not compared
    outputs = []
    for out in (
        blockwise_attention(q, (k_ctx, v_ctx), (k_blk, v_blk), dense_mask),
        tiled_attention(q, (k_ctx, v_ctx), (k_blk, v_blk), mask),
    ):
        grads = torch.autograd.grad((out * real).square().sum(), tensors)
        outputs.append((out * real, grads))
    # both run the softmax in float32 (inputs float64): equal to float32 rounding
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-6)
    for tiled, dense in zip(outputs[1][1], outputs[0][1], strict=True):
        torch.testing.assert_close(tiled, dense, rtol=1e-5, atol=1e-6)


def test_a_row_with_more_pairs_than_the_plan_allows_is_refused():
    with pytest.raises(ValueError, match="more than the plan's 1"):
        ContextTiles.of_rows([[(0, 0), (0, 1)]], 1)


def test_tiled_attention_in_bfloat16_gives_the_dense_rule_to_bfloat16_rounding():
    # the fused CPU kernel takes its mask in q's dtype and returns its log-sum-exp in float32 for bfloat16
    positions, documents, anchors, tiles = _row_layout()
    attention = LayerAttention(True, None)
    query_positions = anchors.repeat_interleave(BLOCK, dim=1) + torch.arange(BLOCK).repeat(A)
    generator = torch.Generator().manual_seed(2)
    shapes = [(2, 4, A * BLOCK, 8)] + [(2, 2, C, 8)] * 2 + [(2, 2, A * BLOCK, 8)] * 2
    tensors = [torch.randn(shape, generator=generator).bfloat16().requires_grad_() for shape in shapes]
    q, k_ctx, v_ctx, k_blk, v_blk = tensors
    query_documents = (documents[0].repeat_interleave(BLOCK, dim=1), documents[1])
    dense_mask = blockwise_mask(
        query_positions, anchors.repeat_interleave(BLOCK, dim=1), positions, BLOCK, attention, query_documents
    )
    mask = tiled_mask(tiles, query_positions, anchors, positions, documents, BLOCK, attention)
    real = (documents[0] >= 0).repeat_interleave(BLOCK, dim=1)[:, None, :, None]
    results = []
    for attend, rule in ((blockwise_attention, dense_mask), (tiled_attention, mask)):
        out = attend(q, (k_ctx, v_ctx), (k_blk, v_blk), rule) * real
        assert out.dtype == torch.bfloat16
        results.append((out.float(), [g.float() for g in torch.autograd.grad(out.float().square().sum(), tensors)]))
    # bfloat16 keeps 8 bits of mantissa: values of order 1 agree to a few units of 2^-8
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0.05, atol=0.05)
    for tiled, dense in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(tiled, dense, rtol=0.05, atol=0.1)


def test_compiled_tiled_attention_keeps_the_padding_pairs_and_gives_the_eager_values_and_gradients():
    # aot_eager functionalizes the graph as inductor does (its in-place ops on views replayed), without inductor's
    # codegen; compiled, the padding pairs stay (fully hidden) where eager drops them: the results are the same
    positions, documents, anchors, tiles = _row_layout()
    attention = LayerAttention(False, None)
    query_positions = anchors.repeat_interleave(BLOCK, dim=1) + torch.arange(BLOCK).repeat(A)
    mask = tiled_mask(tiles, query_positions, anchors, positions, documents, BLOCK, attention)
    generator = torch.Generator().manual_seed(3)
    shapes = [(2, 4, A * BLOCK, 8)] + [(2, 2, C, 8)] * 2 + [(2, 2, A * BLOCK, 8)] * 2
    tensors = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    compiled = torch.compile(tiled_attention, backend="aot_eager", fullgraph=True, dynamic=False)
    results = []
    for attend in (tiled_attention, compiled):
        out = attend(tensors[0], tuple(tensors[1:3]), tuple(tensors[3:5]), mask)
        results.append((out, torch.autograd.grad(out.square().sum(), tensors)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for compiled_grad, eager_grad in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-6)
