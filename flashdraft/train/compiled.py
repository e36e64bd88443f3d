"""The training step compiled (`train --compile`): the drafter's training forward and each chunk of the loss's
logit terms under `torch.compile(fullgraph=True, dynamic=False)`, one graph per batch shape.

What is compiled and why there: the forward is one graph per batch shape (packed: the run's one shape; unpacked: one
per length bucket). The loss picks the trained positions of a batch, a number that changes every step, so it is
not one graph: its logit terms (the LM head, cross-entropy, the family's terms) run `LOGIT_CHUNK_ROWS` rows at a
time, and the compiled chunk always sees a full chunk (the last one padded, its padding rows dropped after), so it
is one graph for the run; the per-position weights and sums around it are a few small ops on [M] tensors and stay
eager. The target's embedding (frozen, no grad) stays outside.

Counted: the graphs compiled (`compiles`) and the recompiles, a compile on a batch shape the step has already run
(a guard that failed: a bug, never expected; 0 after warm-up), both written to metrics.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from flashdraft.train.loss import DraftHeads, LossSpec, chunk_terms

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # inductor: the real one; the others prove graphs (tests)
RECOMPILE_LIMIT = 64  # dynamo's graphs per function before it gives up and runs eagerly (8 by default): buckets


def compile_by_default(device: torch.device) -> bool:
    """Where compiling pays when --compile is not given: on CUDA. On CPU inductor's compile (tens of seconds a
    graph on 2 cores) outweighs what it saves on a run of the sizes trained there (benchmarks/compiled_train.py)."""
    return device.type == "cuda"


def graphs_compiled() -> int:
    """The graphs torch.compile has built in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class CompiledStep:
    """The compiled forward and loss chunk of one run, and what they compiled."""

    model: torch.nn.Module  # what the step calls (the drafter, or its DDP wrapper)
    backend: str = "inductor"
    forward: object = field(init=False)
    chunk: object = field(init=False)
    shapes: set = field(default_factory=set)  # the batch shapes run so far
    compiles: int = 0  # graphs compiled by this step
    recompiles: int = 0  # of them, on a batch shape already run
    _heads: tuple | None = None

    def __post_init__(self) -> None:
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile backend {self.backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        options = dict(fullgraph=True, dynamic=False, backend=self.backend)
        self.forward = torch.compile(self.model, **options)
        self.chunk = torch.compile(chunk_terms, **options)

    def heads(self, drafter, target) -> DraftHeads:
        """The run's `DraftHeads`, made once: a new one each step would be a new object for the guards."""
        if self._heads is None or self._heads[0] is not target:
            self._heads = (target, DraftHeads.of(drafter, target.lm_head))
        return self._heads[1]

    def chunk_fn(self, heads: DraftHeads, spec: LossSpec):
        """The compiled chunk as `loss.logit_terms` calls it (rows padded to a full chunk there)."""
        return partial(self.chunk, heads, spec)

    def count(self, shape: tuple, graphs_before: int) -> None:
        """After a micro-batch of `shape`: the graphs it compiled, as compiles, and as recompiles where the shape had
        run before."""
        new = graphs_compiled() - graphs_before
        self.compiles += new
        if shape in self.shapes:
            self.recompiles += new
        self.shapes.add(shape)


def batch_shape(batch) -> tuple:
    """The shapes that select a compiled graph: the batch's tensors' (and its packed tiles')."""
    tiles = batch.context_tiles
    return (
        tuple(batch.context_features.shape),
        tuple(batch.block_ids.shape),
        None if tiles is None else tuple(tiles.block_tile.shape),
        None if batch.target_topk is None else tuple(batch.target_topk[0].shape),
    )
