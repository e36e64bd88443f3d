"""Drafting in fixed shapes, compiled once: the DFlash-family proposer over a `StaticDrafterCache`
(`flashdraft.drafter.static_cache`), a step one graph under `torch.compile(fullgraph=True, dynamic=False)` (on CUDA
`mode="reduce-overhead"`: CUDA graphs) that does, in order:
- the context write: the step's new context (a + 1 rows) padded to R = B + 1 rows (the most a step commits: B drafts
  anchor-first, plus the bonus) and written at the cache's device position (all R rows padding when the step brings
  no new context, or brought more than R rows, written before it uncompiled: the prompt);
- the draft: the block [anchor, mask x (B - 1)] embedded, the drafter's pass over it, the LM head at the draft
  positions and the family's greedy walk (DFlash2's selector, DSpark's Markov head and confidence).
One graph, not one for the write and one for the draft: each compiled call pays Dynamo's frame entry and guards
(~0.3 ms on a CPU, where the tiny drafter's whole step is ~3 ms).
Every input a graph reads lives in a buffer of the state (staged there by `copy_`/`fill_`, no host-to-device copy),
so CUDA graphs copy nothing in; after the first step, a generation compiles nothing more whatever
its accepted lengths and positions. What needs the host stays outside, as eagerly: a DSpark confidence cut, a
sampled walk (`draw`), an adaptive limit's count (here over all rows: the graph computes them at once).

`CompiledDraft` is the switch: `as_proposer(drafter, target, compiled=CompiledDraft(max_length=...))` gives a
`StaticDFlashProposer` (a hybrid's drafter likewise; an n-gram proposer has no neural pass and is used as is). The
proposer keeps `Proposer`'s interface, so a decoding loop calls it exactly as the eager one. The buffers and compiled
graphs (`StaticDraftState`) belong to the drafter and are reused by every later sequence of the same shape; one
sequence at a time uses them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from flashdraft.decoding.proposers import DFlashProposer, on_device, walk_rows
from flashdraft.decoding.serving_rules import ServingRule
from flashdraft.drafter.model import PAD_POSITION, DFlashDrafter
from flashdraft.drafter.static_cache import StaticDrafterCache, block_hidden, write_context
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.target.static_cache import CompileCounts, compile_step, dynamo_totals

CAPACITY_STEP = 256  # context capacity is rounded up to this: nearby lengths share one state (and its graphs)


@dataclass(frozen=True)
class CompiledDraft:
    """The compiled, fixed-shape drafting switch. max_length: the most tokens (prompt + generated) a sequence will
    hold, which sizes the drafter's context cache; backend/mode: `torch.compile`'s ("auto" mode: "reduce-overhead",
    i.e. CUDA graphs, on CUDA, the default elsewhere). backend "eager"/"aot_eager" traces the same graphs without
    code generation (tests prove the graphs' shapes with them)."""

    max_length: int
    backend: str | None = "inductor"  # None: the fixed-shape functions run uncompiled (the static path's reference)
    mode: str | None = "auto"

    def new_proposer(
        self, drafter: DFlashDrafter, target: TargetModel, rule: ServingRule | str | None = None
    ) -> StaticDFlashProposer:
        """A proposer for one sequence drafting with these settings (what `as_proposer(compiled=...)` calls)."""
        return StaticDFlashProposer(drafter, target, self, rule)

    def compile_mode(self, device: torch.device) -> str | None:
        if self.mode != "auto":
            return self.mode
        return "reduce-overhead" if device.type == "cuda" and self.backend == "inductor" else None


def unsupported_reason(drafter: DFlashDrafter) -> str | None:
    """Why this drafter cannot draft in fixed shapes (None: it can). Dynamic NTK RoPE recomputes its frequencies
    from the largest position it is given, a branch on the device's data that no fixed graph holds."""
    if getattr(drafter.rotary_emb, "rope_type", "default") == "dynamic":
        return "its RoPE is 'dynamic' (frequencies chosen by a branch on the positions): draft with compile off"
    return None


@dataclass(frozen=True)
class StepShape:
    """What a state's graphs are specialised to: the block, the drafts per block it computes logits for and the
    walk options the proposer drafts with."""

    block: int
    drafts: int  # k: rows from the first draft position
    use_selector: bool
    honour_draft_top_k: bool


class StaticDraftState:
    """A `StaticDrafterCache` for one drafter, target and `StepShape`, the staging buffers its graph reads, and the
    compiled step (see the module docstring). Counts its compiles: `compiles` grows only when a graph is traced."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: TargetModel,
        shape: StepShape,
        capacity: int,
        settings: CompiledDraft,
    ) -> None:
        reason = unsupported_reason(drafter)
        if reason is not None:
            raise FlashdraftError(f"compiled drafting: this drafter cannot draft in fixed shapes: {reason}")
        self.drafter, self.target, self.shape, self.settings = drafter, target, shape, settings
        device, dtype = target.device, next(drafter.parameters()).dtype
        self.device, self.dtype = device, dtype  # what its graphs were made for (`static_state` matches them)
        self.rows = shape.block + 1  # R: the most context one step commits (a + 1 <= k + 1 <= B + 1)
        # context capacity: the cache holds `capacity` committed tokens plus one padded write past them
        self.cache = StaticDrafterCache(drafter, capacity + self.rows, shape.block, device, dtype)
        self.capacity = capacity
        width = drafter.fc.in_features
        self.features = torch.zeros(1, self.rows, width, device=device, dtype=dtype)  # [1, R, n_ctx * H]
        self.positions = torch.full((1, self.rows), PAD_POSITION, dtype=torch.long, device=device)  # [1, R]
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)  # [1]: the anchor token
        self.anchor_position = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]
        for buffer in (self.features, self.positions, self.anchor, self.anchor_position):
            torch._dynamo.mark_static_address(buffer)
        self._step = self._write_and_draft
        if settings.backend is not None:
            mode = settings.compile_mode(torch.device(device))
            self._step = compile_step(self._write_and_draft, settings.backend, mode)
        # each state's graph its own (`with_own_code`: Dynamo's recompile limit is per code object); the first graph
        # is its warm-up, any later one a recompile
        self.counts = CompileCounts()
        self._warmed_up: set[str] = set()
        self._staged = False  # new context staged in `features`/`positions` for the next step's write
        self.written = 0  # context tokens in the cache (the host's count; the graphs read `cache.length`)
        self.owner = None  # the proposer whose sequence is in the cache

    # -- the graph ------------------------------------------------------------------------------------------------

    def _write_and_draft(
        self, features: torch.Tensor, positions: torch.Tensor, anchor: torch.Tensor, anchor_position: torch.Tensor
    ) -> tuple:
        """Write the staged context (features [1, R, n_ctx * H] at positions [1, R], PAD_POSITION rows padding), then
        draft from `anchor` [1] at anchor_position [1, 1]: hidden [1, k, H], logits [1, k, V], the walk's rows
        [1, k, V] and DSpark's confidence [1, k] (or None)."""
        write_context(self.drafter, self.cache, features, positions)
        drafter, shape = self.drafter, self.shape
        masks = torch.full((1, shape.block - 1), drafter.config.mask_token_id, dtype=torch.long, device=anchor.device)
        blocks = torch.cat([anchor[None], masks], dim=1)  # [1, B]: [anchor, mask x (B - 1)]
        hidden = block_hidden(drafter, self.cache, drafter.embed(blocks, self.target), anchor_position)
        first = drafter.config.first_draft_position
        hidden = hidden[:, first : first + shape.drafts]  # [1, k, H]
        logits = drafter.logits(hidden.reshape(-1, hidden.shape[-1]), self.target.lm_head).view(1, hidden.shape[1], -1)
        rows, confidence = walk_rows(drafter, hidden, logits, anchor, shape.use_selector, shape.honour_draft_top_k)
        return hidden, logits, rows, confidence

    @property
    def compiles(self) -> int:
        return self.counts.compiles

    def _counted(self, step: str, function, *args):
        """function(*args), its compiles, recompiles, graph breaks and compile seconds counted in `counts`."""
        if self.settings.backend is None:
            return function(*args)
        graphs, breaks = dynamo_totals()
        start = time.perf_counter()
        out = function(*args)
        compiled, broken = dynamo_totals()
        if compiled > graphs:
            self.counts.compile_seconds += time.perf_counter() - start
            self.counts.recompiles += compiled - graphs - (step not in self._warmed_up)
            self.counts.compiles += compiled - graphs
            self._warmed_up.add(step)
        self.counts.graph_breaks += broken - breaks
        return out

    # -- a sequence's steps ----------------------------------------------------------------------------------------

    def start(self, owner) -> None:
        """A new sequence (drafted by `owner`) in the state's buffers."""
        self.cache.reset()
        self.written, self.owner, self._staged = 0, owner, False

    def write(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append context features [1, C, n_ctx * H] at positions [1, C]: C <= R staged for the next `draft`'s graph
        (padded to R), a longer context (a prompt) written now by the same function uncompiled at its own length."""
        count = features.shape[1]
        if self.written + count > self.capacity:
            raise FlashdraftError(
                f"compiled drafting: {self.written + count} context tokens; the drafter's cache was sized for "
                f"{self.capacity} (CompiledDraft.max_length)"
            )
        if self._staged:  # two writes before a draft: the first one's rows go in now
            write_context(self.drafter, self.cache, self.features, self.positions)
            self._staged = False
        if count > self.rows:
            write_context(self.drafter, self.cache, features.to(self.features.dtype), positions)
        else:
            self.features[:, :count].copy_(features)  # the padding rows keep stale values: their positions hide them
            self.positions.fill_(PAD_POSITION)
            self.positions[:, :count].copy_(positions)
            self._staged = True
        self.written += count

    def draft(self, anchor: int, anchor_position: int) -> tuple:
        """The compiled step from `anchor` at `anchor_position`: the staged context written (none staged: R rows of
        padding), then the draft over the cached context (see `_write_and_draft`)."""
        if not self._staged:
            self.positions.fill_(PAD_POSITION)
        self._staged = False
        self.anchor.fill_(anchor)  # fills, not copies from the host: no wait on the device's queue
        self.anchor_position.fill_(anchor_position)
        return self._counted("step", self._step, self.features, self.positions, self.anchor, self.anchor_position)


def static_state(
    drafter: DFlashDrafter, target: TargetModel, shape: StepShape, settings: CompiledDraft
) -> StaticDraftState:
    """The drafter's state for this target, step shape and settings with room for settings.max_length tokens, on the
    models' device and dtype: the smallest it already has (its graphs compiled), else a new one (capacity rounded up
    to CAPACITY_STEP)."""
    states: list[StaticDraftState] = drafter.__dict__.setdefault("_static_draft_states", [])
    fitting = [
        s
        for s in states
        if s.target is target and s.shape == shape and s.settings.backend == settings.backend
        if s.settings.mode == settings.mode and s.capacity >= settings.max_length
        if (s.device, s.dtype) == (target.device, next(drafter.parameters()).dtype)  # a model moved or cast: new graphs
    ]
    if fitting:
        return min(fitting, key=lambda s: s.capacity)
    capacity = math.ceil(settings.max_length / CAPACITY_STEP) * CAPACITY_STEP
    states.append(StaticDraftState(drafter, target, shape, capacity, settings))
    return states[-1]


def draft_counts(proposer) -> CompileCounts:
    """What torch.compile did for the drafting of `proposer`'s sequence (a `StaticDFlashProposer`, or one wrapped by
    a `DraftLimit` or a hybrid): graphs compiled since it took its state (a first sequence's warm-up among them),
    recompiles, graph breaks, compile seconds; zeros for a proposer that drafts eagerly."""
    if isinstance(proposer, StaticDFlashProposer):
        if proposer.state is None:
            return CompileCounts()
        now, start = proposer.state.counts, proposer.counts_at_start
        return CompileCounts(
            compiles=now.compiles - start.compiles,
            recompiles=now.recompiles - start.recompiles,
            graph_breaks=now.graph_breaks - start.graph_breaks,
            compile_seconds=now.compile_seconds - start.compile_seconds,
        )
    inner = getattr(proposer, "inner", None) or getattr(proposer, "dflash", None)
    return CompileCounts() if inner is None else draft_counts(inner)


class StaticDFlashProposer(DFlashProposer):
    """`DFlashProposer` drafting through a `StaticDraftState`: the same proposals (within float tolerance: the
    attention reads a masked fixed buffer), in fixed shapes. Binds its state at the first `propose`, once the block,
    the limit and the selector option are known."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: TargetModel,
        compiled: CompiledDraft,
        rule: ServingRule | str | None = None,
    ) -> None:
        super().__init__(drafter, target, rule)
        self.compiled = compiled
        self.state: StaticDraftState | None = None
        self.counts_at_start = CompileCounts()  # the state's counts when this sequence took it

    @property
    def compiles(self) -> int:
        """Graphs compiled for this proposer's state so far (by every sequence that used it)."""
        return 0 if self.state is None else self.state.counts.compiles

    def anchors_per_call(self, block: int) -> int:
        return 1

    def _bind(self, block: int) -> StaticDraftState:
        if self.state is None:
            drafts = block - self.drafter.config.first_draft_position
            if self.limit is not None and self.limit.num_speculative_tokens is not None:
                drafts = min(drafts, self.limit.num_speculative_tokens)
            shape = StepShape(block, drafts, self.use_selector, self.honour_draft_top_k)
            self.state = static_state(self.drafter, self.target, shape, self.compiled)
            self.state.start(self)
            self.counts_at_start = replace(self.state.counts)
        elif self.state.owner is not self:
            raise FlashdraftError("compiled drafting: its state now holds another sequence (one at a time)")
        elif self.state.shape.block != block:
            raise FlashdraftError(f"compiled drafting: a block of {block}; this sequence drafts {self.state.shape}")
        return self.state

    def propose_anchors(
        self,
        anchor_tokens: list[int],
        anchor_positions: list[int],
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
        committed_context: bool = False,
    ) -> list[torch.Tensor]:
        """One anchor's proposal (its only row of the list); the context must be committed before it, as in
        decoding (the fixed-shape pass drafts one block at a time)."""
        if len(anchor_tokens) != 1:
            raise FlashdraftError(f"compiled drafting drafts one anchor a call; given {len(anchor_tokens)}")
        state = self._bind(block)
        # the last step's graph outputs are overwritten by this replay (CUDA graphs): hold none of them past it
        self._blocks = self._last_walk = self.last_confidence = None
        if new_context is not None and new_context.shape[1] > 0:
            state.write(new_context, new_positions)
        hidden, logits, rows, confidence = state.draft(anchor_tokens[0], anchor_positions[0])
        anchors = on_device(anchor_tokens, logits.device)
        return self.proposal(hidden, logits, anchors, rows, confidence)

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        """`DFlashProposer.propose`, compiled: every row at once (an adaptive limit counts them afterwards)."""
        return self.propose_anchors([tokens[-1]], [anchor_pos], new_context, new_positions, block)[0]
