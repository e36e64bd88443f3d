import pytest
import torch

from flashdraft.drafter.model import PAD_POSITION
from flashdraft.drafter.static_cache import StaticDrafterCache, block_hidden, write_context
from flashdraft.errors import FlashdraftError
from tests.conftest import make_dflash2_drafter, make_drafter

H, CTX, BLOCK = 64, 128, 4  # hidden size; 2 context layers * hidden; a short block keeps the sweep small
# the published layer shape (four sliding layers, then a full one), with a window shorter than the context
SLIDING = dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], num_hidden_layers=5, sliding_window=5)
# float32 on one thread: the two paths differ only by the summation order of softmax over masked rows
TOLERANCE = dict(atol=2e-5, rtol=1e-4)


def _drafters():
    return {
        "dflash sliding x4 + full": make_drafter(block_size=BLOCK, **SLIDING),
        "dflash2": make_dflash2_drafter(block_size=BLOCK),
    }


def _block(drafter, seed: int) -> torch.Tensor:
    return torch.randn(1, BLOCK, H, generator=torch.Generator().manual_seed(seed))  # [1, B, H]


def _steps(counts: list[int], start: int, seed: int = 0):
    """(features [1, c, CTX], positions [1, c], the next anchor's position) for steps committing `counts` tokens."""
    gen = torch.Generator().manual_seed(seed)
    position = start
    for c in counts:
        features = torch.randn(1, c, CTX, generator=gen)
        yield features, position + torch.arange(c)[None], position + c
        position += c


def _padded(features: torch.Tensor, positions: torch.Tensor, rows: int):
    """features and positions padded to `rows` (positions PAD_POSITION), as the compiled write takes them."""
    pad = rows - features.shape[1]
    features = torch.cat([features, torch.zeros(1, pad, CTX)], dim=1)
    positions = torch.cat([positions, torch.full((1, pad), PAD_POSITION)], dim=1)
    return features, positions


@pytest.mark.parametrize("name", ["dflash sliding x4 + full", "dflash2"])
def test_static_block_pass_equals_the_eager_cached_forward_at_every_step(name):
    # a prompt's context written at its own length, then steps committing 1 .. B + 1 tokens, padded to B + 1 rows:
    # every step's hidden states equal the eager drafter's over its growing cache
    drafter = _drafters()[name]
    eager_cache, static = drafter.new_cache(), StaticDrafterCache(drafter, 64, BLOCK, "cpu", torch.float32)
    counts = [11] + list(range(1, BLOCK + 2)) + [2, 1]
    with torch.no_grad():
        for i, (features, positions, anchor) in enumerate(_steps(counts, 0)):
            if features.shape[1] > BLOCK + 1:
                write_context(drafter, static, features, positions)
            else:
                write_context(drafter, static, *_padded(features, positions, BLOCK + 1))
            block = _block(drafter, i)
            expected = drafter(block, torch.tensor([[anchor]]), features, positions, cache=eager_cache)
            got = block_hidden(drafter, static, block, torch.tensor([[anchor]]))
            torch.testing.assert_close(got, expected, **TOLERANCE)
    assert int(static.length) == sum(counts) == len(eager_cache)


def test_padding_rows_and_unwritten_slots_change_nothing_the_block_sees():
    # the same context written once unpadded, once padded with garbage rows: identical hidden states
    drafter = _drafters()["dflash sliding x4 + full"]
    (features, positions, anchor), *_ = _steps([3], 0)
    garbage = torch.full((1, 5, CTX), 1e3)
    caches = [StaticDrafterCache(drafter, 32, BLOCK, "cpu", torch.float32) for _ in range(2)]
    with torch.no_grad():
        write_context(drafter, caches[0], features, positions)
        write_context(
            drafter,
            caches[1],
            torch.cat([features, garbage], dim=1),
            torch.cat([positions, torch.full((1, 5), PAD_POSITION)], dim=1),
        )
        outs = [block_hidden(drafter, c, _block(drafter, 0), torch.tensor([[anchor]])) for c in caches]
    assert int(caches[1].length) == 3
    torch.testing.assert_close(outs[0], outs[1], **TOLERANCE)


def test_a_block_of_another_length_is_refused_with_the_cache_block_named():
    drafter = _drafters()["dflash2"]
    cache = StaticDrafterCache(drafter, 16, BLOCK, "cpu", torch.float32)
    with pytest.raises(FlashdraftError, match=f"made for {BLOCK}"):
        block_hidden(drafter, cache, torch.zeros(1, BLOCK + 1, H), torch.tensor([[0]]))


@pytest.fixture(scope="module")
def compiled():
    """The published-shape drafter's write and block pass compiled (backend "eager": Dynamo's guards and graph breaks
    are those of inductor's), warmed up once each."""
    drafter = _drafters()["dflash sliding x4 + full"]
    cache = StaticDrafterCache(drafter, 96, BLOCK, "cpu", torch.float32)
    options = dict(fullgraph=True, dynamic=False, backend="eager")
    write = torch.compile(lambda f, p: write_context(drafter, cache, f, p), **options)
    block = torch.compile(lambda e, a: block_hidden(drafter, cache, e, a), **options)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        write(*_padded(torch.zeros(1, 1, CTX), torch.zeros(1, 1, dtype=torch.long), BLOCK + 1))
        block(_block(drafter, 0), torch.tensor([[1]]))
    return drafter, cache, write, block


def test_compiled_steps_recompile_for_no_accepted_length_or_position_and_keep_their_buffers(compiled):
    # every accepted length 0 .. B (a + 1 = 1 .. B + 1 committed) at positions from 1 to ~60, under fail_on_recompile,
    # equal to the eager cache's hidden states; the cache's buffers are the same storage throughout
    drafter, cache, write, block = compiled
    cache.reset()
    pointers = [b.data_ptr() for b in cache.buffers()]
    eager_cache = drafter.new_cache()
    counts = [1] + [a + 1 for _ in range(3) for a in range(BLOCK + 1)]
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        for i, (features, positions, anchor) in enumerate(_steps(counts, 0, seed=1)):
            write(*_padded(features, positions, BLOCK + 1))
            embeds, anchor_position = _block(drafter, i), torch.tensor([[anchor]])
            expected = drafter(embeds, anchor_position, features, positions, cache=eager_cache)
            torch.testing.assert_close(block(embeds, anchor_position), expected, **TOLERANCE)
    assert [b.data_ptr() for b in cache.buffers()] == pointers
    assert int(cache.length) == sum(counts)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
