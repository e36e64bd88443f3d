"""Proposers: what drafts a step, behind one interface (`Proposer`) that live decoding and the offline walk share.
The DFlash drafter's (`DFlashProposer`: inference blocks `[anchor, mask, ...]`, many anchors per forward, DFlash2's
selector walk and DSpark's Markov walk), `DraftLimit` (verify the first k drafts, or those before the first the
drafter is unsure of: a wrapper of any proposer, serving both paths alike), `as_proposer` (a fresh proposer per
sequence), and how a step draws its drafts under a serving rule (`draw_drafts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from flashdraft.decoding.acceptance import sample_drafts
from flashdraft.decoding.host_transfers import to_host
from flashdraft.decoding.serving_rules import ServingRule, serving_rule
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.drafter.families import family_of
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel


class Proposer(Protocol):
    """What speculative decoding needs of a drafter: logits for the drafts after the anchor."""

    context_layer_ids: list[int]  # target layers whose features it wants as context (may be empty)

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        """tokens: everything committed, ending with the anchor (at anchor_pos); new_context:
        features [1, C, n * H] of tokens committed since the last call, at new_positions [1, C].
        Returns logits [k, V] for the k <= block drafts to verify (one-hot rows for a
        deterministic drafter); the step verifies exactly these k."""
        ...


@runtime_checkable
class BatchProposer(Proposer, Protocol):
    """A proposer that drafts several anchors in one call (used by the offline walk)."""

    def anchors_per_call(self, block: int) -> int: ...

    def propose_anchors(
        self,
        anchor_tokens: list[int],
        anchor_positions: list[int],
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> list[torch.Tensor]:
        """Logits [k_j, V] of each anchor j; block j sees only context before its own anchor."""
        ...


@runtime_checkable
class ProposerFactory(Protocol):
    """A drafter with state per sequence (a drafter cache): `as_proposer` asks it for a fresh
    proposer for each sequence (the hybrid proposer, `flashdraft.decoding.hybrid`)."""

    block_size: int  # its default block
    context_layer_ids: list[int]

    def new_proposer(self, target: TargetModel, rule: ServingRule | str | None = None) -> Proposer: ...


# -- how a step draws its drafts --------------------------------------------------------------


def draw_drafts(
    proposer: Proposer,
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    rule: ServingRule | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a step verifies of a proposal [k, V] under the serving rule: the argmax walk (the rows' argmax, q None:
    one-hot) at temperature 0 or where the rule drafts the argmax at T > 0; else sampled, by the proposer's own
    `draw` when it has one (DFlash2 and DSpark walk, each draft given the one sampled before), else
    `sample_drafts`. Returns drafts [k] and q [k, V] or None."""
    if temperature <= 0 or not serving_rule(rule).samples_drafts(family_of(proposer)):
        return logits.argmax(-1), None
    return sampled_draw(proposer, logits, temperature, generator)


def sampled_draw(
    proposer: Proposer, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled drafts [k] and their q [k, V]: the proposer's own `draw`, else `sample_drafts`."""
    draw = getattr(proposer, "draw", None)
    return draw(logits, temperature, generator) if draw is not None else sample_drafts(logits, temperature, generator)


# -- the DFlash drafter as a proposer ------------------------------------------------------


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """values [K] as a tensor on `device`; a single value (decoding's one anchor) is written there by a fill kernel,
    since on CUDA a copy from the host's pageable memory waits for all queued work, as a read does."""
    if len(values) == 1:
        return torch.full((1,), values[0], dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, device=device)


def inference_blocks(anchor_tokens: torch.Tensor, block: int, mask_token_id: int) -> torch.Tensor:
    """The blocks a drafter fills at inference: [anchor, mask x (B - 1)] per anchor [K] -> [K, B]."""
    blocks = torch.full((anchor_tokens.shape[0], block), mask_token_id, device=anchor_tokens.device)
    blocks[:, 0] = anchor_tokens
    return blocks


UNSURE_CHUNK = 4  # rows of the drafter's LM head computed at a time under an adaptive limit


def confident_prefix(confidence: torch.Tensor, threshold: float | None) -> int:
    """How many leading drafts a confidence cut keeps: those before the first whose confidence [k] is under the
    threshold (DeepSpec's `_confident_prefix_length`; None or 0: all of them)."""
    if not threshold:
        return confidence.shape[0]
    return to_host((confidence >= threshold).int().cumprod(0).sum())


def draft_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The drafter's top probability at each draft position: logits [k, V] -> [k]."""
    return torch.softmax(logits.float(), -1).amax(-1)


def anchors_per_forward(block_size: int, vocab_size: int) -> int:
    # the LM head over K blocks makes K * (B - 1) * V logits: keep that under ~64 M floats
    return max(1, min(32, (1 << 26) // ((block_size - 1) * vocab_size)))


def walk_rows(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.Tensor,
    use_selector: bool,
    honour_draft_top_k: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows [K, k, V] blocks propose from the drafter's hidden states [K, k, H] and logits [K, k, V] at their
    draft positions, anchors [K], and DSpark's confidence [K, k] of each (None without its head): DFlash the logits;
    DFlash2 (with `use_selector`) the rows of its selector's greedy walk; DSpark those of its greedy Markov walk, each
    draft's logits corrected by the draft before it. Device work only, no read: the compiled step runs it in its
    graph."""
    if drafter.candidate_selector is not None and use_selector:
        return drafter.candidate_selector.walk(hidden, logits, anchors)[1], None
    if drafter.markov_head is None:
        return logits, None
    _, rows, previous = drafter.markov_walk(logits, anchors, honour_draft_top_k=honour_draft_top_k)
    return rows, None if drafter.confidence_head is None else drafter.confidence(hidden, previous)


class DFlashProposer:
    """Drafts blocks with a DFlash drafter, keeping committed context in its KV cache."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, rule: ServingRule | str | None = None) -> None:
        self.drafter, self.target = drafter, target
        self.context_layer_ids = drafter.config.target_layer_ids
        self.cache = drafter.new_cache()
        # a DFlash2 drafter drafts its selector's walk; False: the unary argmax (what the selector adds, by comparison)
        self.use_selector = True
        # DSpark: dspark_draft_topk as the serving rule's server reads it (vLLM: honoured; SGLang: ignored)
        self.honour_draft_top_k = serving_rule(rule).honours_draft_top_k
        self._last_walk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # every block of the last call: hidden [K, k, H], base logits [K, k, V], anchors [K] (`path_distributions`)
        self._blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # DSpark: the confidence [K, k] of each draft of the last proposal's greedy walk (None without the head)
        self.last_confidence: torch.Tensor | None = None
        self._walk_length = 0  # DSpark: drafts of the last proposal before its confidence cut
        # drafts the limit never verifies get no logits (the LM head is costly): none past its k, and
        # under an adaptive p, `propose` stops after the chunk of rows holding the first unsure draft
        self.limit: DraftLimit | None = None

    @property
    def family(self) -> str:
        """The family it drafts as (a DFlash2 drafter without its selector drafts as DFlash)."""
        family = self.drafter.config.family
        return "dflash" if family == "dflash2" and not self.use_selector else family

    def anchors_per_call(self, block: int) -> int:
        return anchors_per_forward(block, self.target.vocab_size)

    def propose_anchors(
        self,
        anchor_tokens: list[int],
        anchor_positions: list[int],
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
        committed_context: bool = False,
    ) -> list[torch.Tensor]:
        """Logits [k, V] after each anchor (k: the drafts of a block, B - 1 or, anchor-first, B), all blocks in one
        drafter forward; DFlash2 and DSpark: the rows of their greedy walks (a DSpark confidence cut shortens them).
        `committed_context`: all context is before every anchor (live decoding), which the drafter then need not
        check on the device."""
        drafts = self._block_hidden(  # [K, k, H]
            anchor_tokens, anchor_positions, new_context, new_positions, block, committed_context=committed_context
        )
        # contiguous rows: the LM head as one matmul (on a strided 3-D view torch takes a bmm, 2-3x slower on CPU)
        logits = self.drafter.logits(drafts.reshape(-1, drafts.shape[-1]), self.target.lm_head)
        logits = logits.view(*drafts.shape[:2], -1)  # [K, k, V]
        anchors = on_device(anchor_tokens, logits.device)
        rows, confidence = walk_rows(self.drafter, drafts, logits, anchors, self.use_selector, self.honour_draft_top_k)
        return self.proposal(drafts, logits, anchors, rows, confidence)

    def proposal(
        self,
        drafts: torch.Tensor,
        logits: torch.Tensor,
        anchors: torch.Tensor,
        rows: torch.Tensor,
        confidence: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """The rows [k, V] each block proposes, from its hidden states `drafts` [K, k, H], the drafter's logits
        [K, k, V], the anchors [K] and `walk_rows`'s rows and confidence; kept for `draw`, `path_distributions` and
        the tree (the compiled step, `flashdraft.decoding.static_proposer`, hands in what its graph computed)."""
        self._blocks = (drafts, logits, anchors)
        self._last_walk = (drafts[-1:], logits[-1:], anchors[-1:])  # what `draw` re-walks when sampling
        self._walk_length = rows.shape[1]
        if confidence is None:
            return list(rows)
        self.last_confidence = confidence  # [K, k]
        threshold = self.limit.confidence_threshold if self.limit is not None else None
        return [r[: confident_prefix(c, threshold)] for r, c in zip(rows, confidence, strict=True)]

    def draw(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts of the last proposal and the distribution q [k, V] each was drawn from. A DFlash2
        drafter samples its selector's walk: each draft from softmax(score / T) over its K candidates,
        given the draft sampled before it; q is that sparse distribution, which verification uses."""
        if temperature <= 0 or (
            self.drafter.markov_head is None and (self.drafter.candidate_selector is None or not self.use_selector)
        ):
            return sample_drafts(logits, temperature, generator)
        hidden, base, anchor = self._last_walk
        k = logits.shape[0]  # a limit may verify fewer drafts than were proposed
        if self.drafter.markov_head is None:
            drafts, q = self.drafter.candidate_selector.walk(hidden[:, :k], base[:, :k], anchor, temperature, generator)
            return drafts[0], q[0]
        # DSpark: the Markov walk sampled, each draft given the one sampled before it; a confidence cut is the
        # sampled walk's own (the greedy walk's cut of `logits` does not apply to it)
        threshold = self.limit.confidence_threshold if self.limit is not None else None
        if threshold is not None:
            k = self._walk_length
        drafts, q, previous = self.drafter.markov_walk(
            base[:, :k], anchor, temperature, generator, honour_draft_top_k=self.honour_draft_top_k
        )
        if threshold is not None:
            n = confident_prefix(self.drafter.confidence(hidden[0, :k], previous[0]), threshold)
            drafts, q = drafts[:, :n], q[:, :n]
        return drafts[0], q[0]

    def path_distributions(self, j: int, path: torch.Tensor, temperature: float) -> torch.Tensor:
        """q [k, V]: the distribution the sampled walk of block j of the last call draws each draft from when the
        drafts before it are path [k]'s tokens (the first from the anchor): what the offline walk at T > 0 needs
        along a completion. DFlash: softmax(logits / T) per position, independent of the path."""
        hidden, base, anchors = self._blocks
        k = path.shape[0]
        hidden, base, anchors, path = hidden[j : j + 1, :k], base[j : j + 1, :k], anchors[j : j + 1], path[None]
        if self.drafter.markov_head is not None:
            return self.drafter.markov_walk(
                base, anchors, temperature, path=path, honour_draft_top_k=self.honour_draft_top_k
            )[1][0]
        if self.drafter.candidate_selector is not None and self.use_selector:
            return self.drafter.candidate_selector.walk(hidden, base, anchors, temperature, path=path)[1][0]
        return torch.softmax(base[0].float() / temperature, -1)

    def path_confidence(self, j: int, path: torch.Tensor) -> torch.Tensor | None:
        """DSpark: the confidence [k] of each draft of block j of the last call when the drafts before it are path
        [k]'s tokens (the first after the anchor): what a walk that reached each position along a completion
        estimated there, greedy or sampled alike (a draft's confidence reads the token before it, not its own).
        None without a confidence head."""
        if self.drafter.confidence_head is None:
            return None
        hidden, _, anchors = self._blocks
        k = path.shape[0]
        previous = torch.cat([anchors[j : j + 1], path])[:k]  # [k]: the anchor, then path's tokens
        return self.drafter.confidence(hidden[j, :k], previous)

    def block_drafts(self, j: int) -> int:
        """Drafts block j of the last call holds before any confidence cut."""
        return self._blocks[0].shape[1]

    def block_distributions(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block j of the last call before any walk: the drafter's final hidden states [k, H] and its own logits
        [k, V] at the draft positions (DFlash2: the selector's unary logits), what a draft tree is built from
        (`flashdraft.decoding.tree`)."""
        hidden, logits, _ = self._blocks
        return hidden[j], logits[j]

    def _block_hidden(
        self,
        anchor_tokens: list[int],
        anchor_positions: list[int],
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
        committed_context: bool = False,
    ) -> torch.Tensor:
        """The drafter's final hidden states [K, k, H] at the first k (the limit's, else all) draft positions: block
        positions 1.. in the fill-in layout, 0.. in the anchor-first one (`DrafterConfig.first_draft_position`)."""
        device = self.target.device
        blocks = inference_blocks(on_device(anchor_tokens, device), block, self.drafter.config.mask_token_id)
        if new_context is not None:
            new_context = new_context.to(next(self.drafter.parameters()).dtype)
        hidden = self.drafter(  # [1, K * B, H]
            self.drafter.embed(blocks.reshape(1, -1), self.target),
            on_device(anchor_positions, device)[None],
            new_context,
            new_positions,
            cache=self.cache,
            context_before_anchors=committed_context,
        )
        first = self.drafter.config.first_draft_position
        k = self.limit.num_speculative_tokens if self.limit is not None else None
        end = None if k is None else first + k
        return hidden.view(len(anchor_tokens), block, -1)[:, first:end]

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        """Logits [k, V] for the positions after the anchor (tokens[-1] at anchor_pos): the first k
        the limit allows (default: every draft of the block), and under an adaptive limit only up to the chunk of rows
        that holds the first draft the drafter is unsure of."""
        threshold = self.limit.adaptive_threshold if self.limit is not None else None
        walks = self.drafter.candidate_selector is not None or self.drafter.markov_head is not None
        if threshold is None or walks:  # a walk needs every row before its own
            return self.propose_anchors(
                [tokens[-1]], [anchor_pos], new_context, new_positions, block, committed_context=True
            )[0]
        hidden = self._block_hidden(  # [k, H]
            [tokens[-1]], [anchor_pos], new_context, new_positions, block, committed_context=True
        )[0]
        rows = []
        for start in range(0, hidden.shape[0], UNSURE_CHUNK):  # a read per chunk: an adaptive limit's cost
            rows.append(self.drafter.logits(hidden[start : start + UNSURE_CHUNK], self.target.lm_head))
            if to_host((draft_confidence(rows[-1]) < threshold).any()):
                break
        return torch.cat(rows)


# -- verifying fewer drafts -----------------------------------------------------------------


@dataclass(frozen=True)
class DraftLimit:
    """How many of a proposer's drafts a step verifies: at most `num_speculative_tokens` (vLLM's
    name), and, with `adaptive_threshold` p, only those before the first draft whose top drafter
    probability is under p (none when the first is: the step is then a plain greedy step). Both
    read only the drafter's logits, never the target, so decoding stays lossless: a step just
    verifies fewer drafts."""

    num_speculative_tokens: int | None = None
    adaptive_threshold: float | None = None
    # DSpark: verify only the drafts before the first whose confidence head estimate is under this (the servers'
    # DeepSpec's evaluator's threshold cut, not the servers' adaptive verification; applied by the drafter's proposer)
    confidence_threshold: float | None = None

    def count(self, logits: torch.Tensor) -> int:
        """How many leading drafts of logits [k, V] to verify (0 .. k)."""
        k = logits.shape[0]
        if self.num_speculative_tokens is not None:
            k = min(k, self.num_speculative_tokens)
        if self.adaptive_threshold is not None:
            k = to_host((draft_confidence(logits[:k]) >= self.adaptive_threshold).int().cumprod(0).sum())
        return k

    def wrap(self, proposer: Proposer) -> Proposer:
        """`proposer` verifying only the drafts this limit keeps (a batched proposer stays batched)."""
        return (LimitedBatchProposer if isinstance(proposer, BatchProposer) else LimitedProposer)(proposer, self)


class LimitedProposer:
    """A proposer whose drafts are cut to the leading ones a `DraftLimit` keeps."""

    def __init__(self, inner: Proposer, limit: DraftLimit) -> None:
        self.inner, self.limit = inner, limit
        self.context_layer_ids = inner.context_layer_ids

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        logits = self.inner.propose(tokens, anchor_pos, new_context, new_positions, block)
        return logits[: self.limit.count(logits)]

    @property
    def family(self) -> str | None:
        return family_of(self.inner)

    def draw(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sampled_draw(self.inner, logits, temperature, generator)

    def path_distributions(self, j: int, path: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.inner.path_distributions(j, path, temperature)

    def path_confidence(self, j: int, path: torch.Tensor) -> torch.Tensor | None:
        return self.inner.path_confidence(j, path)

    def block_drafts(self, j: int) -> int:
        return self.inner.block_drafts(j)


class LimitedBatchProposer(LimitedProposer):
    """`LimitedProposer` of a `BatchProposer`: the offline walk still drafts many anchors per call."""

    def anchors_per_call(self, block: int) -> int:
        return self.inner.anchors_per_call(block)

    def propose_anchors(
        self,
        anchor_tokens: list[int],
        anchor_positions: list[int],
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> list[torch.Tensor]:
        logits = self.inner.propose_anchors(anchor_tokens, anchor_positions, new_context, new_positions, block)
        return [x[: self.limit.count(x)] for x in logits]


def as_proposer(
    drafter: DFlashDrafter | ProposerFactory | Proposer,
    target: TargetModel,
    limit: DraftLimit | None = None,
    use_selector: bool = True,
    rule: ServingRule | str | None = None,
    compiled=None,
) -> Proposer:
    """A fresh proposer for one sequence: a DFlash drafter gets its own KV cache, a
    `ProposerFactory` makes one; a stateless proposer serves every sequence itself. With a
    `limit`, it verifies only the drafts the limit keeps. `use_selector` False: a DFlash2 drafter
    drafts its unary argmax (what it would without its selector, for comparison). `rule`: the serving rule
    (`flashdraft.decoding.serving_rules`) whose reading of the drafter's fields it drafts with. `compiled` (a
    `flashdraft.decoding.static_proposer.CompiledDraft`): a DFlash-family drafter, or a hybrid's, drafts in fixed
    shapes through compiled graphs; a proposer without a neural pass (n-gram) is unchanged."""
    if isinstance(drafter, DFlashDrafter):
        proposer = new_dflash_proposer(drafter, target, rule, compiled)
        proposer.use_selector = use_selector
        if limit is not None:  # drafts the limit never verifies need no logits
            proposer.limit = limit
    elif isinstance(drafter, ProposerFactory):
        extra = {} if compiled is None else {"compiled": compiled}
        proposer = drafter.new_proposer(target, rule, **extra)
    else:
        proposer = drafter
    return limit.wrap(proposer) if limit is not None else proposer


def new_dflash_proposer(
    drafter: DFlashDrafter, target: TargetModel, rule: ServingRule | str | None = None, compiled=None
) -> DFlashProposer:
    """A DFlash-family proposer for one sequence: eager, or with `compiled`
    (`flashdraft.decoding.static_proposer.CompiledDraft`, which builds on this module) its fixed-shape one."""
    return DFlashProposer(drafter, target, rule) if compiled is None else compiled.new_proposer(drafter, target, rule)


def default_block_size(drafter: DFlashDrafter | ProposerFactory | Proposer) -> int:
    """The block a drafter was made for (a stateless proposer has none: DEFAULT_BLOCK_SIZE, DFlash's)."""
    if isinstance(drafter, DFlashDrafter):
        return drafter.config.block_size
    return drafter.block_size if isinstance(drafter, ProposerFactory) else DEFAULT_BLOCK_SIZE
