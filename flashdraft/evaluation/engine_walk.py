"""The served check's walk over the engine's own computation, for a quantised target.

A quantised target's kernels in the engine (vLLM's int8 GEMM, activations quantised per token inside it) round
otherwise than transformers' compressed-tensors forward: the states the served drafter reads and the greedy tokens
past each output's end are the engine's, not the transformers target's. So for a quantised target the served check
walks the engine's outputs with the engine's own states (captured by `data.engine_capture`, the same capture as
`cache --engine vllm`) and counts the last step's overrun over the engine's own greedy continuation (a second,
greedy request per output, sent to the same server after the measured ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashdraft.data.engine_capture import EngineSettings, check_sample, load_captured, run_capture
from flashdraft.data.openai_client import OpenAIClient
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.records import EvalRecord
from flashdraft.target.model import TargetModel

STATES_ENGINE = "the engine's captured states"
STATES_TRANSFORMERS = "the transformers target's forward"


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
