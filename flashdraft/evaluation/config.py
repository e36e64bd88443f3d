"""What `flashdraft eval` evaluates, on which records, how (`EvalConfig`), and the drafters it evaluates as loaded
(`Candidate`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from flashdraft.decoding.hybrid import HybridDrafter
from flashdraft.decoding.proposers import Proposer
from flashdraft.decoding.serving_rules import (
    DEFAULT_RULE,
)
from flashdraft.decoding.tree import TreeRule
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError

PROPOSERS = ("dflash", "ngram", "hybrid")
NGRAM = "ngram"  # the n-gram baseline: --reference ngram, and its label in the results


@dataclass
class Candidate:
    """One drafter of an eval run, as evaluated."""

    label: str  # as given: a checkpoint, or "ngram"
    drafter: DFlashDrafter | HybridDrafter | Proposer
    block_size: int
    form: str  # the checkpoint's form ("drafter directory", ...) or the n-gram settings
    path: str | None  # what was loaded; None for the n-gram baseline


_CALL = {"call": True}  # an EvalConfig field `evaluate_drafter` sets from its own arguments, not an option


@dataclass(frozen=True)
class EvalConfig:
    """What `flashdraft eval` evaluates, on which records, how. The `proposer` evaluated: "dflash" (the DFlash-family
    drafter `checkpoint`), "ngram" (the n-gram baseline, prompt lookup of the last ngram_max..ngram_min tokens, with
    no checkpoint), or "hybrid" (the checkpoint together with that lookup under `HybridRule(hybrid_min_match,
    hybrid_ngram_prior)`). A `reference` "ngram" is the baseline too, with the drafter's block size. The fields are
    eval's options by name (`option_names`), except those `evaluate_drafter` sets from its own arguments (what is
    evaluated, where)."""

    checkpoint: str | None = field(metadata=_CALL)  # None with the n-gram proposer
    target_model: str = field(metadata=_CALL)
    proposer: str = field(default="dflash", metadata=_CALL)  # "dflash", "ngram" or "hybrid"
    hybrid_min_match: int | None = None  # None: HybridRule's default
    hybrid_ngram_prior: float | None = None
    # records: exactly one source
    cached_hidden_states: str | None = None
    completions: str | None = None
    prompts: str | None = None
    num_prompts: int | None = None
    # --prompts' chat mode (`data/chat_mode.py`): the template's kwargs and the enable_thinking shorthand
    chat_template_kwargs: dict | None = None
    enable_thinking: bool | None = None
    allow_foreign: bool = False
    long_prompts: str = "error"
    verify: bool = True
    # what is walked
    max_blocks: int | None = None
    max_new_tokens: int | None = None
    block_size: int | None = None
    online: bool = False
    # online: verify on the target's static cache, compiled once (None: where it pays, `decoding.verification`)
    compile: bool | None = None
    temperature: float = 0.0
    # at temperature > 0: the server's rule (`flashdraft.decoding.serving_rules`) and the request's filters (None: the
    # target's generation_config.json values unless use_generation_config is off)
    serving_rule: str = DEFAULT_RULE
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    use_generation_config: bool = True
    check_consistency: bool = False
    reference: str | None = None
    # verify fewer drafts per step, drafter and reference alike (`DraftLimit`)
    num_speculative_tokens: int | None = None
    adaptive_threshold: float | None = None
    # DSpark: cut each block before its first draft whose confidence-head estimate is under this
    confidence_threshold: float | None = None
    # draft trees (`flashdraft.evaluation.trees`): the rule, the node budgets evaluated, the width per depth
    tree: str | None = None
    tree_budget: list[int] | None = None
    tree_width: int | None = None
    # for a bare state dict, and for the baseline
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    device: str = field(default="cpu", metadata=_CALL)
    dtype: torch.dtype = field(default=torch.float32, metadata=_CALL)
    seed: int = 0
    # edges of the context-length buckets of `by_context` (None: powers of two spanning the records)
    context_buckets: list[int] | None = None
    # the drafter served by a real engine ("vllm", `evaluation.served`): started for the run from engine_python's
    # environment, or the running `server`; check_served makes a disagreement the exit status
    served: str | None = None
    check_served: bool = False
    verbose: bool = False  # a line per record while evaluating (its tokens, feature statistics, tokens to decode)
    server: str | None = None
    engine_python: str | None = None

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise FlashdraftError(f"proposer {self.proposer!r}: expected one of {', '.join(PROPOSERS)}")
        if (self.proposer == "ngram") != (self.checkpoint is None):
            raise FlashdraftError(
                "give a checkpoint for a DFlash drafter (alone or with the hybrid), or the n-gram proposer, "
                "which takes none"
            )
        self._check_tree()

    def _check_tree(self) -> None:
        """Refuse tree options that cannot go together, before anything loads."""
        if self.tree is None:
            if self.tree_budget or self.tree_width:
                raise FlashdraftError(
                    "--tree-budget and --tree-width go with --tree RULE, which this run does not give"
                )
            return
        if not self.tree_budget:
            raise FlashdraftError(
                f"--tree {self.tree}: expected --tree-budget N[,N...] (nodes verified beside the root)"
            )
        for budget in self.tree_budget:
            TreeRule(self.tree, budget, self.tree_width)  # the rule, budget and width checked
        given = [
            flag
            for flag, value in (
                ("--temperature", self.temperature > 0),
                ("--drafter", self.proposer != "dflash"),
                ("--num-speculative-tokens", self.num_speculative_tokens),
                ("--adaptive-threshold", self.adaptive_threshold),
                ("--confidence-threshold", self.confidence_threshold),
                ("--served", self.served),
            )
            if value
        ]
        if given:
            raise FlashdraftError(
                f"--tree with {', '.join(given)}: tree verification is evaluated greedy (T = 0), for a DFlash-family "
                f"drafter alone, every tree of --tree-budget nodes, offline and with flashdraft's own loop"
            )

    def compared(self) -> list[tuple[str, str, str | None]]:
        """(role, proposer, checkpoint) of what is evaluated: the drafter, then the reference when there is one (a
        `reference` of "ngram", as --reference takes it, is the n-gram baseline; anything else a checkpoint)."""
        roles = [("drafter", self.proposer, self.checkpoint)]
        if self.reference == NGRAM:
            roles.append(("reference", "ngram", None))
        elif self.reference:
            roles.append(("reference", "dflash", self.reference))
        return roles

    @property
    def label(self) -> str:
        """What the summary names as evaluated: the checkpoint as given, or "ngram"."""
        return self.checkpoint if self.checkpoint is not None else NGRAM

    @classmethod
    def option_names(cls) -> list[str]:
        """The fields a user chooses (`flashdraft eval` has an option for each, named alike)."""
        return [f.name for f in fields(cls) if not f.metadata.get("call")]
