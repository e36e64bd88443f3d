"""The served check's walk over the engine's own computation, for a quantised target.

A quantised target's kernels in the engine (vLLM's int8 GEMM, activations quantised per token inside it) round
otherwise than transformers' compressed-tensors forward: the states the served drafter reads and the greedy tokens
past each output's end are the engine's, not the transformers target's. So for a quantised target the served check
walks the engine's outputs with the engine's own states (captured by `data.engine_capture`, the same capture as
`cache --engine vllm`) and counts the last step's overrun over the engine's own greedy continuation (a second,
greedy request per output, sent to the same server after the measured ones).

What still differs is the drafter's own arithmetic: the engine runs it in bf16 with its own kernels, reading the
states it computed step by step, flashdraft in the target's dtype with PyTorch's, reading the captured prefill's. A
draft whose top two logits lie within `NEAR_TIE_ULPS` bf16 spacings of its top logit can go either way, so a request
whose counters differ is explained (not a failure) where flashdraft's walk verified such a draft (`near_ties`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.data.engine_capture import EngineSettings, check_sample, load_captured, run_capture
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.decoding.proposers import as_proposer
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.offline import draft_anchors
from flashdraft.evaluation.records import EvalRecord, FeatureSource
from flashdraft.target.model import TargetModel

STATES_ENGINE = "the engine's captured states"
STATES_TRANSFORMERS = "the transformers target's forward"
NEAR_TIE_ULPS = 2  # top-1 minus top-2 logit within 2 bf16 spacings of the top logit (8 significant bits): a tie


@dataclass
class EngineWalk:
    """The served outputs with the engine's states, and the same extended by the engine's greedy continuation."""

    outputs: list[EvalRecord]  # prompt + served output, context features the engine's
    extended: list[EvalRecord]  # prompt + served output + the engine's continuation, context features the engine's
    continuations: list[list[int]]


def engine_continuations(base_url: str, requests, drafts: int, seed: int) -> list[list[int]]:
    """Each served output's next `drafts` greedy tokens as the engine computes them (stop tokens ignored, as the
    engine verifies the last step's drafts past a stop): one request of prompt + output per served request, sent
    after the measured ones so their counters are untouched."""
    client = OpenAIClient(base_url)
    out = []
    for r in requests:
        choice = client.complete(r.prompt_ids + r.output_ids, drafts, 0.0, seed, {"ignore_eos": True})
        ids = choice.get("token_ids")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise FlashdraftError(f"the engine returned no token ids for request {r.id}'s continuation")
        out.append(ids)
    return out


def engine_walk_records(
    python: Path,
    target: TargetModel,
    layer_ids: list[int],
    requests,
    continuations: list[list[int]],
    directory: Path,
    log=print,
) -> EngineWalk:
    """The engine's states of every served prompt + output + continuation (one capture run, the target's dtype),
    each checked for length, token ids and finite non-zero values, as records the offline walk reads."""
    sequences = {r.id: r.prompt_ids + r.output_ids + c for r, c in zip(requests, continuations, strict=True)}
    run_capture(python, target, layer_ids, sequences=sequences, directory=directory, settings=EngineSettings(), log=log)
    outputs, extended = [], []
    for r, c in zip(requests, continuations, strict=True):
        states, engine_tokens = load_captured(directory, r.id)  # [T, n_layers, H]
        check_sample(r.id, sequences[r.id], states, engine_tokens, layer_ids, target.hidden_size)
        features = states.reshape(states.shape[0], -1)  # [T, n_layers * H]: as a cache stores them
        n = len(r.prompt_ids) + len(r.output_ids)
        outputs.append(EvalRecord(r.id, r.prompt_ids, r.output_ids, context_features=features[:n], layer_ids=layer_ids))
        extended.append(
            EvalRecord(r.id, r.prompt_ids, r.output_ids + c, context_features=features, layer_ids=layer_ids)
        )
    return EngineWalk(outputs, extended, continuations)


@dataclass(frozen=True)
class NearTie:
    """A draft flashdraft's walk verified whose top two logits are within `NEAR_TIE_ULPS` bf16 spacings."""

    step: int  # 0 = the request's first drafting step
    position: int  # 0 = the step's first draft
    gap: float  # top-1 minus top-2 logit
    spacing: float  # bf16's spacing at the top logit


@torch.no_grad()
def near_ties(drafter, target: TargetModel, record: EvalRecord, lengths: list[int], block: int) -> list[NearTie]:
    """The near ties among the drafts the walk of `record` (committing `lengths` per step) verified: each step's
    accepted drafts and its first rejected one, drafted again as the walk drafts them."""
    proposer = as_proposer(drafter, target)
    features = FeatureSource(target)(record, list(drafter.config.target_layer_ids)).to(target.device)
    tokens, p = record.input_ids, len(record.prompt_ids)
    fed, anchor, ties = 0, 0, []
    for step, n in enumerate(lengths):
        logits, fed = draft_anchors(
            proposer, [anchor], tokens, p=p, features=features, fed=fed, block=block, device=target.device
        )
        top = logits[0].float().topk(2, dim=-1).values  # [drafts, 2]
        spacing = 2.0 ** (torch.floor(torch.log2(top[:, 0].abs().clamp_min(1e-30))) - 7)  # bf16: 8 significant bits
        for k in range(min(n, top.shape[0])):  # the accepted drafts and the first rejected one
            gap = float(top[k, 0] - top[k, 1])
            if gap <= NEAR_TIE_ULPS * float(spacing[k]):
                ties.append(NearTie(step, k, gap, float(spacing[k])))
        anchor += n
    return ties


def explain_near_ties(
    problems: list[str],
    request_ids: list[str],
    walk: EngineWalk,
    uncut: list[list[int]],
    drafter,
    target: TargetModel,
    block: int,
) -> tuple[list[str], list[str]]:
    """The served check's problems split into those left and those a near tie explains (each named with the
    tie's step and draft): a request's problem is explained where flashdraft's uncut walk of it (`uncut`)
    verified a near tie."""
    left, explained = [], []
    for problem in problems:
        i = next((i for i, rid in enumerate(request_ids) if problem.startswith(f"request {rid}:")), None)
        ties = [] if i is None else near_ties(drafter, target, walk.extended[i], uncut[i], block)
        if not ties:
            left.append(problem)
            continue
        t = ties[0]
        explained.append(
            f"{problem}: flashdraft's walk verified a near tie at step {t.step + 1} draft {t.position + 1} (top two "
            f"logits {t.gap:.3f} apart, bf16 spacing there {t.spacing:.3f}; {len(ties)} near ties in the request)"
        )
    return left, explained
