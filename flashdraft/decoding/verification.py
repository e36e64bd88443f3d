"""How a speculative step verifies its drafts and keeps what it accepted: on the eager path (the reference:
`TargetModel.forward` over [anchor, drafts], then `TargetModel.rollback`) or on the target's static cache
(`flashdraft.target.static_cache`: the block padded to a fixed length, one compiled graph, commit by position and slot).
The decoding loop (`flashdraft.decoding.generate`) sees one interface either way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.decoding.static_proposer import CompiledDraft, unsupported_reason
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetCache, TargetModel, TargetOutput
from flashdraft.target.static_cache import CompileCounts, StaticVerifier, static_support, static_verifier

# compiled backends: "inductor" (CUDA graphs on CUDA), dynamo's tracing alone ("eager", "aot_eager": what tests use
# to prove one graph without paying inductor's compile), or None: the static cache run uncompiled
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", None)


def compile_by_default(device: torch.device) -> bool:
    """Whether decoding compiles when the user does not say (`SpeculativeConfig.compile` None): nowhere yet.

    On CPU it does not pay. Measured with `benchmarks/decode.py` on the built-in hybrid target (docs/benchmarks.md,
    "Compiled (static cache) against eager"): compiling makes speculative decoding faster than it is eagerly, but
    greedy decoding gains more (a compiled 1-token step loses most of its per-op cost, a 17-row verify is mostly
    compute-bound matmuls, about 2x the compiled 1-token step even with the Gated DeltaNet slots kept as the block's
    terms), so compiled speculative decoding stays well under compiled greedy decoding at the τ a CPU-trained drafter
    reaches (1.5). And the first compile is slow: inductor took 106 s for the verify and the drafter's step of a cold
    `eval --online --compile` on a shared 2-core CPU (tens of seconds quiet), more than a short generation takes,
    on top of the compiled greedy step it is set against. On CUDA it is where it should pay (one CUDA graph a step
    instead of thousands of launches), but no GPU has run it yet: until the GPU check measures it, `--compile` asks
    for it."""
    return False


def resolve_compile(compile: bool | None, target: TargetModel) -> bool:
    """`SpeculativeConfig.compile` decided: as given, else `compile_by_default` where the target has a static rule."""
    if compile is not None:
        return compile
    return compile_by_default(target.device) and static_support(target) is None


def compiled_drafting(drafter, backend: str | None, positions: int) -> CompiledDraft | None:
    """How the drafter drafts when decoding compiles (`flashdraft.decoding.static_proposer`): a DFlash-family drafter
    (alone or a hybrid's) in fixed shapes compiled with the verify's `backend`, its context cache holding `positions`;
    None (eagerly): any other proposer (n-gram: no neural pass), the static path run uncompiled (`backend` None), or a
    drafter with no fixed-shape form (`unsupported_reason`)."""
    dflash = drafter if isinstance(drafter, DFlashDrafter) else getattr(drafter, "drafter", None)
    if backend is None or not isinstance(dflash, DFlashDrafter) or unsupported_reason(dflash) is not None:
        return None
    return CompiledDraft(max_length=positions, backend=backend)


def max_drafts(proposer, block: int) -> int:
    """The most drafts `proposer` returns for `block` (the static verify holds that many plus the anchor): its own
    `max_drafts(block)` if it has one; a DFlash drafter's block less its first draft position (B - 1 fill-in, B
    anchor-first); an n-gram's B - 1; through a limit or the hybrid, the proposer inside; else B."""
    hook = getattr(proposer, "max_drafts", None)
    if callable(hook):
        return int(hook(block))
    drafter = getattr(proposer, "drafter", None)
    if drafter is not None and hasattr(drafter, "config"):
        return block - drafter.config.first_draft_position
    inner = [getattr(proposer, name) for name in ("inner", "dflash", "ngram") if hasattr(proposer, name)]
    if inner:
        return max(max_drafts(p, block) for p in inner)
    if type(proposer).__name__ == "NGramProposer":
        return block - 1
    return block


class EagerVerification:
    """The reference: the target's forward over [anchor, drafts] on its growing cache, rollback after."""

    static = False

    def __init__(self, target: TargetModel, cache: TargetCache) -> None:
        self.target, self.cache = target, cache
        self.counts = CompileCounts()

    def verify(self, anchor: torch.Tensor, draft: torch.Tensor) -> TargetOutput:
        return self.target.forward(torch.cat([anchor, draft])[None], self.cache)

    def commit(self, accepted: int) -> None:
        self.target.rollback(self.cache, accepted + 1)


@dataclass
class StaticVerification:
    """The static path: [anchor, drafts] padded (with the anchor) to the verifier's length; the outputs cut back to
    the k + 1 real rows; commit moves the position and selects the recurrent slot."""

    verifier: StaticVerifier
    static = True

    @property
    def counts(self) -> CompileCounts:
        return self.verifier.counts

    def verify(self, anchor: torch.Tensor, draft: torch.Tensor) -> TargetOutput:
        rows, length = draft.shape[0] + 1, self.verifier.verify_length
        if rows > length:
            raise FlashdraftError(f"a proposer drafted {rows - 1} tokens; the static verify holds {length - 1}")
        block = torch.cat([anchor, draft, anchor.expand(length - rows)])[None]  # [1, T]
        out = self.verifier.verify(block)
        features = out.context_features
        if features is not None:  # kept as drafter context past the next verify (which overwrites graph outputs)
            features = features[:, :rows].clone()
        return TargetOutput(out.hidden[:, :rows], features, out.lm_head, _logits=out.logits[:, :rows])

    def commit(self, accepted: int) -> None:
        self.verifier.commit(accepted)


def check_static(target: TargetModel, backend: str | None) -> None:
    """Refuse, in one line, a compile backend flashdraft does not know or a target without a static rule."""
    if backend not in COMPILE_BACKENDS:
        raise FlashdraftError(f"compile backend {backend!r}: expected one of {COMPILE_BACKENDS}")
    reason = static_support(target)
    if reason is not None:
        raise FlashdraftError(f"{target.path or 'the target'}: --compile refused: {reason}; use --no-compile")


def verification_for(
    target: TargetModel,
    cache: TargetCache,
    proposer,
    block: int,
    tokens: int,
    compile: bool,
    backend: str | None,
) -> EagerVerification | StaticVerification:
    """The verification a generation of at most `tokens` positions (prompt and new tokens) uses after its prefill
    (`cache`): static when `compile`, else eager. `compile` on a target without a static rule is refused in one line."""
    if not compile:
        return EagerVerification(target, cache)
    check_static(target, backend)
    length = max_drafts(proposer, block) + 1
    verifier = static_verifier(target, length, tokens + length, backend)  # tokens: the generation's positions
    verifier.start(cache, cache.length)
    return StaticVerification(verifier)
