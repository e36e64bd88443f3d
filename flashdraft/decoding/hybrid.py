"""The hybrid proposer: DFlash and n-gram prompt lookup together, choosing per step.

The two win on different steps: prompt lookup when the continuation repeats something
already in the context (an identifier, a repeated line, a copied block), the drafter
elsewhere. Speculative decoding is lossless whatever is proposed, so a proposer that picks,
each step, the draft more likely to be accepted keeps the target's output and can beat both.

The rule (`HybridRule`, parameters picked by measurement, see docs/benchmarks.md): each step, look
up the n-gram continuation and the length m of the suffix it matched (0 without a match);
- m >= `min_match`: the n-gram draft is proposed outright and the drafter's forward is
  skipped (its new context is kept and given to it at its next forward, which is exact: the
  drafter caches each context position's K/V on its own, so appending in one piece or two
  gives the same cache);
- otherwise the drafter runs, and the n-gram draft (when there is one) is proposed if the
  drafter's own expected accepted length of it, with each token's probability raised to at
  least `ngram_prior`, beats the expected accepted length of the drafter's draft:
  sum over k of prod_{j <= k} q(d_j), q the drafter's probabilities.
min_match 0 is plain prompt lookup; min_match above the lookup's longest n-gram with
ngram_prior 0 is plain DFlash (the drafter's own draft is never expected to do worse).

Offline == online holds as for any proposer: the choice depends only on the committed tokens
and the drafter's output, which the offline walk gives it exactly as decoding does. Sampling
stays lossless: the choice is made before any token is drawn, and the step then verifies the
chosen distribution (the drafter's, or the n-gram's one-hot) with the usual rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.decoding.acceptance import sample_drafts
from flashdraft.decoding.host_transfers import to_host
from flashdraft.decoding.ngram import NGramProposer
from flashdraft.decoding.proposers import DFlashProposer, new_dflash_proposer
from flashdraft.decoding.serving_rules import ServingRule
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.target.model import TargetModel

BRANCHES = ("ngram_lookup", "ngram_by_confidence", "dflash")  # what a step proposed, and why


@dataclass(frozen=True)
class HybridRule:
    min_match: int = 3  # n-gram suffix this long or longer: prompt lookup without running the drafter
    ngram_prior: float = 0.4  # floor of q(n-gram token) when comparing the two drafts (0: the drafter's q alone)

    def __str__(self) -> str:
        return f"min_match {self.min_match}, ngram_prior {self.ngram_prior}"

    def ngram_outright(self, match_length: int) -> bool:
        """Propose the n-gram draft without running the drafter (match_length 0: no match)."""
        return match_length >= self.min_match

    def prefers_ngram(self, q_ngram: torch.Tensor, q_dflash: torch.Tensor) -> bool:
        """q_ngram [k]: the drafter's probability of each n-gram token; q_dflash [k]: of its own
        (most likely) token at each position."""
        return to_host(expected_accepted(q_ngram.clamp(min=self.ngram_prior)) > expected_accepted(q_dflash))


def expected_accepted(probs: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts when each is right with probability probs [k], independently."""
    return probs.cumprod(0).sum()


class HybridProposer:
    """A `flashdraft.decoding.proposers.Proposer` for one sequence: the n-gram or the DFlash draft, by
    `HybridRule`. `skip_drafter=False` runs the drafter on every step (its output unused when
    the n-gram is taken outright): the same proposals, for checking that skipping is exact."""

    def __init__(
        self, dflash: DFlashProposer, ngram: NGramProposer, rule: HybridRule = HybridRule(), skip_drafter: bool = True
    ) -> None:
        self.dflash, self.ngram, self.rule, self.skip_drafter = dflash, ngram, rule, skip_drafter
        self.context_layer_ids = dflash.context_layer_ids
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # context not yet given to the drafter
        self.choices = dict.fromkeys(BRANCHES, 0)  # steps per branch
        self._proposed_dflash = False  # the last proposal was the drafter's (its `draw` then samples it)

    def __repr__(self) -> str:
        return f"hybrid (DFlash + {self.ngram!r}; {self.rule})"

    def _run_drafter(self, tokens: list[int], anchor_pos: int, block: int, device: torch.device) -> torch.Tensor:
        """The drafter's logits [B - 1, V], after giving it all context kept since its last forward."""
        if self._pending:
            context = torch.cat([c for c, _ in self._pending], dim=1)  # [1, C, n * H]
            positions = torch.cat([p for _, p in self._pending], dim=1)  # [1, C]
            self._pending = []
        else:
            context, positions = None, torch.zeros(1, 0, dtype=torch.long, device=device)
        return self.dflash.propose(tokens, anchor_pos, context, positions, block)

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        if new_context is not None and new_context.shape[1] > 0:
            self._pending.append((new_context, new_positions))
        device = new_positions.device
        self._proposed_dflash = False
        ngram_draft, match_length = self.ngram.draft_and_match(tokens, block)
        if self.rule.ngram_outright(match_length):
            if not self.skip_drafter:
                self._run_drafter(tokens, anchor_pos, block, device)
            self.choices["ngram_lookup"] += 1
            return self.ngram.one_hot(ngram_draft, device)
        logits = self._run_drafter(tokens, anchor_pos, block, device)  # [k, V]: B - 1 drafts, B anchor-first (DSpark)
        if match_length > 0:
            # the drafter's rows at the n-gram's positions (it drafts B - 1; a DSpark drafter one more, or fewer cut)
            probs = torch.softmax(logits[: len(ngram_draft)].float(), dim=-1)
            ngram_draft = ngram_draft[: probs.shape[0]]
            q_ngram = probs.gather(1, torch.tensor(ngram_draft, device=probs.device)[:, None])[:, 0]  # [k]
            if self.rule.prefers_ngram(q_ngram, probs.max(-1).values):
                self.choices["ngram_by_confidence"] += 1
                return self.ngram.one_hot(ngram_draft, device)
        self.choices["dflash"] += 1
        self._proposed_dflash = True
        return logits

    @property
    def family(self) -> str | None:
        """The family of the last proposal (None: the n-gram's, always the argmax with q one-hot): the serving rule
        decides from it how the step's drafts are drawn (`flashdraft.decoding.proposers.draw_drafts`)."""
        return self.dflash.family if self._proposed_dflash else None

    def draw(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's own draw for its proposals (DFlash2 samples its walk); the n-gram's one-hot as is."""
        if self._proposed_dflash:
            return self.dflash.draw(logits, temperature, generator)
        return sample_drafts(logits, temperature, generator)

    def path_distributions(self, j: int, path: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.dflash.path_distributions(j, path, temperature)


class HybridDrafter:
    """A DFlash drafter and prompt lookup under one rule; `flashdraft.decoding.proposers.as_proposer`
    asks it for a fresh `HybridProposer` (its own drafter cache) per sequence."""

    def __init__(self, drafter: DFlashDrafter, ngram: NGramProposer, rule: HybridRule = HybridRule()) -> None:
        self.drafter, self.ngram, self.rule = drafter, ngram, rule
        self.block_size = drafter.config.block_size
        self.context_layer_ids = drafter.config.target_layer_ids

    def __repr__(self) -> str:
        return f"hybrid (DFlash + {self.ngram!r}; {self.rule})"

    def new_proposer(self, target: TargetModel, rule: ServingRule | str | None = None, compiled=None) -> HybridProposer:
        """A proposer for one sequence; `compiled` (a `CompiledDraft`): its drafter drafts in compiled fixed shapes
        (the n-gram lookup has no neural pass and is unchanged)."""
        return HybridProposer(new_dflash_proposer(self.drafter, target, rule, compiled), self.ngram, self.rule)
