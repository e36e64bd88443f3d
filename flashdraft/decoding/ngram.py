"""The training-free baseline: n-gram prompt lookup (vLLM's `ngram` method with
`prompt_lookup_max`/`prompt_lookup_min`, transformers' `prompt_lookup_num_tokens`).

To draft after the committed tokens (prompt + output so far), take their last n tokens,
n = max_ngram down to min_ngram, find the most recent earlier place where the same n tokens
occur, and propose the tokens that followed it. Code and chat repeat themselves (names,
indentation, quoted input), which is what this exploits; it needs no model and no target
features, so every τ flashdraft reports can be set next to it.

Two choices where the method leaves room, both about filling a fixed block of B - 1:
- When the match sits so close to the end that fewer than B - 1 tokens follow it, copying
  runs on through the tokens just copied (an LZ77 back-reference): a pattern whose period is
  shorter than the block is continued for the whole block instead of stopping after one
  period.
- With no match it proposes nothing, as vLLM's `ngram` method does: the step is then a plain
  greedy step (the target scores the anchor alone, its cheapest forward). On
  `builtin:code:heldout` about half of the steps find no match, and a guessed draft there
  (the anchor repeated) was accepted at 8 of 1,523 such steps while every one paid for
  verifying it.
"""

from __future__ import annotations

import torch

from flashdraft.errors import FlashdraftError


def lookup(tokens: list[int], num_draft: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int] | None:
    """The `num_draft` tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (max_ngram down to min_ngram tokens long), or None without a match."""
    found = lookup_match(tokens, num_draft, max_ngram, min_ngram)
    return found[0] if found is not None else None


def lookup_match(
    tokens: list[int], num_draft: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[list[int], int] | None:
    """`lookup`'s draft and the length of the suffix it matched, or None without a match."""
    end = len(tokens) - 1
    best_n, best_j = 0, -1
    # j: the last token of an earlier occurrence; scanning backwards, the first j to reach a
    # length is the most recent with that length
    for j in range(end - 1, -1, -1):
        if tokens[j] != tokens[end]:
            continue
        n = 1
        while n < max_ngram and j - n >= 0 and tokens[j - n] == tokens[end - n]:
            n += 1
        if n > best_n:
            best_n, best_j = n, j
            if n == max_ngram:
                break
    if best_n < min_ngram:
        return None
    draft: list[int] = []
    for k in range(num_draft):
        source = best_j + 1 + k  # < len(tokens) + k, so it is either committed or already copied
        draft.append(tokens[source] if source <= end else draft[source - end - 1])
    return draft, best_n


class NGramProposer:
    """A `flashdraft.decoding.proposers.Proposer` drafting by prompt lookup; deterministic and stateless,
    so one instance serves any number of sequences, online or offline."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise FlashdraftError(f"n-gram lengths {max_ngram}..{min_ngram}: expected 1 <= min <= max")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.context_layer_ids: list[int] = []  # tokens only: the target computes no features for it

    def __repr__(self) -> str:
        return f"ngram (prompt lookup, n = {self.max_ngram}..{self.min_ngram})"

    def draft(self, tokens: list[int], block: int) -> list[int]:
        """The B - 1 tokens to propose after `tokens` (which end with the anchor)."""
        return self.draft_and_match(tokens, block)[0]

    def draft_and_match(self, tokens: list[int], block: int) -> tuple[list[int], int]:
        """`draft` and the length of the suffix it matched (0: no match, and no draft)."""
        found = lookup_match(tokens, block - 1, self.max_ngram, self.min_ngram)
        return found if found is not None else ([], 0)

    def one_hot(self, draft: list[int], device: torch.device) -> torch.Tensor:
        """Logits [len(draft), V]: -inf off the drafted token, so greedy takes it and sampling
        sees q = 1 on it (speculative sampling with a deterministic drafter)."""
        logits = torch.full((len(draft), self.vocab_size), float("-inf"), device=device)
        return logits.scatter_(1, torch.tensor(draft, dtype=torch.long, device=device)[:, None], 0.0)

    def propose(
        self,
        tokens: list[int],
        anchor_pos: int,
        new_context: torch.Tensor | None,
        new_positions: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        """One-hot logits [k, V] of the draft (`one_hot`; k = block - 1, or 0 without a match), on
        the target's device: where the caller keeps positions and compares tokens."""
        return self.one_hot(self.draft(tokens, block), new_positions.device)
