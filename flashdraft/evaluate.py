"""How good is a drafter: τ offline (walking the target's own completions) and online (real
speculative decoding, checked lossless), with the figures the reference quotes.

Offline, a record is a prompt P (P tokens), the target's completion c[0..M-1] and context
features for every position of prompt + completion. The walk is exactly what serving does
when the target's output is c: the anchor index i starts at 0 (c[0] comes from the prefill);
the drafter drafts a block [c[i], mask x (B - 1)] from the features of positions < P + i;
a = the leading drafts equal to c[i + 1 ..]; the step commits n = min(a + 1, M - 1 - i)
tokens and i += n. So with greedy completions offline and online acceptance lengths are the
same lists, step for step (`--check-consistency` checks it). Offline needs no target
forward when the features come from a cache; all candidate anchors of a stretch of the
walk are drafted in one batched drafter forward (each block sees only context before its
own anchor, with the committed context kept in the drafter's KV cache between forwards).

Any other `Proposer` (the n-gram baseline, `flashdraft.ngram`) walks the same way, one
anchor at a time: it drafts from prompt + c[..i] (and, if it asks for them, the features of
positions < P + i, fed as online feeds them), and the same rule decides what a step commits.

Figures: τ = total committed / steps (pooled over prompts; its ceiling is B), the mean of
per-prompt τ, the histogram of committed lengths 1..B, and per-position acceptance: the
share of steps whose k-th draft was accepted (committed length > k), so τ = 1 + Σ_k of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashdraft.config import DrafterConfig
from flashdraft.decode import Proposer, greedy_generate, speculative_generate
from flashdraft.errors import FlashdraftError
from flashdraft.model import DFlashDrafter
from flashdraft.ngram import NGramProposer
from flashdraft.target import TargetModel

Log = Callable[[str], None]
NGRAM = "ngram"  # in place of a checkpoint (--drafter ngram, --reference ngram): the n-gram baseline
DEFAULT_BLOCK_SIZE = 16  # for a drafter without a block size of its own (as speculative_generate)


def _quiet(_: str) -> None:
    pass


# -- records and their context features ---------------------------------------------------


@dataclass
class EvalRecord:
    """A prompt and the target's completion, with context features when a cache holds them
    (as a tensor, or read only when needed through `load_features`: a cache can be large)."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    context_features: torch.Tensor | None = None  # [P + M, len(layer_ids) * H]
    layer_ids: list[int] = field(default_factory=list)  # target layers in the stored features, in order
    load_features: Callable[[], torch.Tensor] | None = None  # reads context_features on demand

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def stored_features(self) -> torch.Tensor | None:
        if self.context_features is not None:
            return self.context_features
        return self.load_features() if self.load_features is not None else None


def invalid_reason(record: EvalRecord, vocab_size: int) -> str | None:
    """Why a record cannot be evaluated, or None."""
    if not record.prompt_ids:
        return "empty prompt (the first anchor needs context before it)"
    if len(record.completion_ids) < 2:
        return f"completion has {len(record.completion_ids)} tokens; a step needs at least 2"
    bad = [t for t in record.input_ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the target's vocabulary (0..{vocab_size - 1})"
    return None


def select_layers(features: torch.Tensor, held: list[int], wanted: list[int], hidden: int) -> torch.Tensor:
    """The columns of `features` ([T, len(held) * H], layers in `held` order) for `wanted`."""
    if held == wanted:
        return features
    parts = [features[:, held.index(i) * hidden : (held.index(i) + 1) * hidden] for i in wanted]
    return torch.cat(parts, dim=-1)


class FeatureSource:
    """Context features of a record for given target layers: sliced from the record's own
    (a cache) when they hold every layer, else from one target forward over prompt +
    completion. Logs each record's token count and feature statistics the first time."""

    def __init__(self, target: TargetModel, log: Log = _quiet) -> None:
        self.target, self.log = target, log
        self.target_forwards = 0  # offline from a cache must leave this at 0
        self._logged: set[tuple[str, tuple[int, ...]]] = set()

    def __call__(self, record: EvalRecord, layer_ids: list[int]) -> torch.Tensor:
        hidden = self.target.hidden_size
        stored = record.stored_features() if record.layer_ids and set(layer_ids) <= set(record.layer_ids) else None
        if stored is not None:
            expected = [len(record.input_ids), len(record.layer_ids) * hidden]
            if list(stored.shape) != expected:
                raise FlashdraftError(
                    f"record {record.id}: stored context features have shape {list(stored.shape)}; expected "
                    f"{expected} ({len(record.input_ids)} tokens, {len(record.layer_ids)} layers x hidden {hidden})"
                )
            features, origin = select_layers(stored, record.layer_ids, layer_ids, hidden), "cache"
        else:
            self.target.set_context_layers(layer_ids)
            ids = torch.tensor([record.input_ids], device=self.target.device)
            features, origin = self.target.forward(ids).context_features[0], "target forward"
            self.target_forwards += 1
        key = (record.id, tuple(layer_ids))
        if key not in self._logged:
            self._logged.add(key)
            stats = features.float()
            if not torch.isfinite(stats).all():
                raise FlashdraftError(f"record {record.id}: context features for layers {layer_ids} contain NaN/Inf")
            self.log(
                f"record {record.id}: {len(record.prompt_ids)} prompt + {len(record.completion_ids)} completion "
                f"tokens, features {list(features.shape)} of layers {layer_ids} ({origin}) "
                f"mean {stats.mean():.4f} std {stats.std():.4f}"
            )
        return features


def records_from_cache(cache, num_records: int | None = None) -> list[EvalRecord]:
    """Records of a `flashdraft.data.cache.HiddenStateCache`: listing them reads token ids only;
    each record reads its features when it is evaluated, so memory holds one record's at a time."""
    records = []
    ids, prompt_lengths = cache.ids, cache.prompt_lengths
    for index in range(len(cache) if num_records is None else min(len(cache), num_records)):
        tokens, p = cache.token_ids(index).tolist(), prompt_lengths[index]
        records.append(
            EvalRecord(str(ids[index]), tokens[:p], tokens[p:], layer_ids=list(cache.layer_ids),
                       load_features=lambda index=index: cache.features(index))
        )  # fmt: skip
    return records


def records_from_prompts(
    target: TargetModel, prompts: list[tuple[str, list[int]]], max_new_tokens: int
) -> list[EvalRecord]:
    """Records whose completions are the target's greedy output for each (id, prompt_ids)."""
    return [EvalRecord(pid, ids, greedy_generate(target, ids, max_new_tokens).output_ids) for pid, ids in prompts]


def check_drafter_matches_target(cfg: DrafterConfig, target: TargetModel, source: str) -> None:
    """Refuse a drafter made for another target (each mismatch would draft garbage silently)."""
    checks = [
        ("hidden_size", cfg.hidden_size, target.hidden_size, "the target's hidden size"),
        ("vocab_size", cfg.vocab_size, target.vocab_size, "the target's LM head rows"),
        ("num_target_layers", cfg.num_target_layers, target.num_layers, "the target's decoder layers"),
    ]
    for name, found, expected, what in checks:
        if found != expected:
            raise FlashdraftError(
                f"{source}: field '{name}' is {found}; expected {expected} ({what}): the drafter was made for "
                f"another target"
            )


# -- results ------------------------------------------------------------------------------


@dataclass
class PromptResult:
    id: str
    acceptance_lengths: list[int]  # tokens committed per step
    output_ids: list[int] | None = None  # online: the speculative output
    lossless: bool | None = None  # online, greedy: output equals plain greedy decoding

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@dataclass
class EvalResult:
    mode: str  # "offline" or "online"
    block_size: int
    target_layer_ids: list[int]
    context_layers: int | None  # found in fc.weight; None for a drafter without context features (n-gram)
    per_prompt: list[PromptResult]
    temperature: float = 0.0
    speculative_tokens_per_s: float | None = None  # online
    greedy_tokens_per_s: float | None = None  # online

    @property
    def lengths(self) -> list[int]:
        return [n for p in self.per_prompt for n in p.acceptance_lengths]

    @property
    def num_steps(self) -> int:
        return len(self.lengths)

    @property
    def tau(self) -> float:
        return sum(self.lengths) / self.num_steps if self.num_steps else 0.0

    @property
    def tau_prompt_mean(self) -> float:
        taus = [p.tau for p in self.per_prompt if p.acceptance_lengths]
        return sum(taus) / len(taus) if taus else 0.0

    @property
    def histogram(self) -> list[int]:
        """counts[n - 1] = steps that committed n tokens, n = 1..B."""
        counts = [0] * self.block_size
        for n in self.lengths:
            counts[n - 1] += 1
        return counts

    @property
    def position_acceptance(self) -> list[float]:
        """[k - 1] = share of steps whose k-th draft was accepted, k = 1..B-1."""
        steps = max(self.num_steps, 1)
        return [sum(n > k for n in self.lengths) / steps for k in range(1, self.block_size)]

    @property
    def lossless(self) -> bool | None:
        flags = [p.lossless for p in self.per_prompt]
        return None if self.mode != "online" or None in flags else all(flags)

    @property
    def speedup(self) -> float | None:
        if self.speculative_tokens_per_s is None or not self.greedy_tokens_per_s:
            return None
        return self.speculative_tokens_per_s / self.greedy_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        per_prompt = []
        for p in self.per_prompt:
            row: dict[str, Any] = {"id": p.id, "acceptance_lengths": p.acceptance_lengths, "tau": p.tau,
                                   "num_steps": len(p.acceptance_lengths)}  # fmt: skip
            if self.mode == "online":
                row |= {"output_ids": p.output_ids, "lossless": p.lossless}
            per_prompt.append(row)
        return {
            "mode": self.mode,
            "block_size": self.block_size,
            "target_layer_ids": self.target_layer_ids,
            "context_layers": self.context_layers,
            "temperature": self.temperature,
            "tau": self.tau,
            "tau_prompt_mean": self.tau_prompt_mean,
            "num_steps": self.num_steps,
            "num_prompts": len(self.per_prompt),
            "histogram": self.histogram,
            "position_acceptance": self.position_acceptance,
            "lossless": self.lossless,
            "speedup": self.speedup,
            "speculative_tokens_per_s": self.speculative_tokens_per_s,
            "greedy_tokens_per_s": self.greedy_tokens_per_s,
            "per_prompt": per_prompt,
        }


def _pad(values: list, length: int, fill) -> list:
    return list(values) + [fill] * (length - len(values))


def first_difference(a: list, b: list) -> int | None:
    """Index of the first position where two lists differ (or one ends), None if equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def difference(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """result - reference, per figure and per prompt (of two `EvalResult.to_json()`)."""

    def sub(a, b):
        return None if a is None or b is None else a - b

    length = max(len(result["histogram"]), len(reference["histogram"]))
    hist_a, hist_b = _pad(result["histogram"], length, 0), _pad(reference["histogram"], length, 0)
    pos_a = _pad(result["position_acceptance"], length - 1, 0.0)
    pos_b = _pad(reference["position_acceptance"], length - 1, 0.0)
    ref_prompts = {p["id"]: p for p in reference["per_prompt"]}
    return {
        "tau": sub(result["tau"], reference["tau"]),
        "tau_prompt_mean": sub(result["tau_prompt_mean"], reference["tau_prompt_mean"]),
        "num_steps": result["num_steps"] - reference["num_steps"],
        "histogram": [a - b for a, b in zip(hist_a, hist_b, strict=True)],
        "position_acceptance": [a - b for a, b in zip(pos_a, pos_b, strict=True)],
        "speedup": sub(result["speedup"], reference["speedup"]),
        "per_prompt": [
            {
                "id": p["id"],
                "tau": sub(p["tau"], ref_prompts[p["id"]]["tau"]),
                "num_steps": p["num_steps"] - ref_prompts[p["id"]]["num_steps"],
            }  # fmt: skip
            for p in result["per_prompt"]
            if p["id"] in ref_prompts
        ],
    }


# -- offline -------------------------------------------------------------------------------


def _anchors_per_forward(block_size: int, vocab_size: int) -> int:
    # the LM head over K blocks makes K * (B - 1) * V logits: keep that under ~64 M floats
    return max(1, min(32, (1 << 26) // ((block_size - 1) * vocab_size)))


@torch.no_grad()
def offline_acceptance_lengths(
    drafter: DFlashDrafter,
    target: TargetModel,
    prompt_length: int,
    completion_ids: list[int],
    features: torch.Tensor,
    block_size: int,
    max_blocks: int | None = None,
) -> list[int]:
    """Walk one completion as the target's own output (module docstring); features:
    [P + M, n * H] context features of prompt + completion for the drafter's layers."""
    p, m, b = prompt_length, len(completion_ids), block_size
    device = target.device
    dtype = next(drafter.parameters()).dtype
    completion = torch.tensor(completion_ids, device=device)
    features = features.to(device=device, dtype=dtype)
    per_forward = _anchors_per_forward(b, target.vocab_size)
    cache = drafter.new_cache()
    in_cache = 0  # context positions [0, in_cache) are in the drafter's cache
    drafts: dict[int, torch.Tensor] = {}  # anchor index -> drafted tokens [B - 1]
    lengths: list[int] = []
    i = 0
    while i < m - 1 and (max_blocks is None or len(lengths) < max_blocks):
        if i not in drafts:
            # draft every anchor from i on in one forward; the walk uses those it lands on, and
            # it lands on at most (steps left) more anchors, so drafting more would be wasted
            k = per_forward if max_blocks is None else min(per_forward, max_blocks - len(lengths))
            anchors = torch.arange(i, min(i + k, m - 1), device=device)  # [K] completion indices
            positions = p + anchors  # [K] absolute anchor positions
            end = int(positions[-1])  # context strictly before the last anchor
            block_ids = torch.full((len(anchors), b), drafter.config.mask_token_id, device=device)
            block_ids[:, 0] = completion[anchors]  # [K, B]
            hidden = drafter(
                target.embed(block_ids.reshape(1, -1)), positions[None], features[None, in_cache:end],
                torch.arange(in_cache, end, device=device)[None], cache=cache,
            )  # fmt: skip
            in_cache = end
            tokens = target.lm_head(hidden.view(len(anchors), b, -1)[:, 1:]).argmax(-1)  # [K, B - 1]
            drafts = dict(zip(anchors.tolist(), tokens, strict=True))
        n = committed_length(drafts[i], completion, i, b)
        lengths.append(n)
        i += n
    return lengths


def committed_length(draft: torch.Tensor, completion: torch.Tensor, i: int, block_size: int) -> int:
    """What the step at anchor index i commits when the target's output is `completion` [M]:
    the drafts [B - 1] agreeing with completion[i + 1 ..] plus the bonus token, no more than
    the M - 1 - i tokens left (online stops at the same length)."""
    left = completion.shape[0] - 1 - i
    limit = min(block_size - 1, left)
    a = int((draft[:limit] == completion[i + 1 : i + 1 + limit]).int().cumprod(0).sum())
    return min(a + 1, left)


@torch.no_grad()
def proposer_acceptance_lengths(
    proposer: Proposer,
    target: TargetModel,
    prompt_ids: list[int],
    completion_ids: list[int],
    block_size: int,
    max_blocks: int | None = None,
    features: torch.Tensor | None = None,
) -> list[int]:
    """The offline walk for any `Proposer`, one anchor per call, fed exactly as
    `speculative_generate` feeds it: tokens up to the anchor, and the context features
    ([P + M, n * H], None when it wants none) of the positions committed since its last call.
    A proposer with state (a cache) must be a fresh one per completion."""
    p, m, device = len(prompt_ids), len(completion_ids), target.device
    tokens = prompt_ids + completion_ids
    completion = torch.tensor(completion_ids, device=device)
    if features is not None:
        features = features.to(device)
    lengths: list[int] = []
    i = fed = 0  # anchor index; context positions [0, fed) were given to the proposer
    while i < m - 1 and (max_blocks is None or len(lengths) < max_blocks):
        anchor = p + i
        new_context = features[None, fed:anchor] if features is not None else None
        positions = torch.arange(fed, anchor, device=device)[None]
        fed = anchor
        draft = proposer.propose(tokens[: anchor + 1], anchor, new_context, positions, block_size).argmax(-1)
        n = committed_length(draft, completion, i, block_size)
        lengths.append(n)
        i += n
    return lengths


def _shape(drafter: DFlashDrafter | Proposer, block_size: int | None) -> tuple[int, list[int], int | None]:
    """(block size, target layer ids, context layers) of a DFlash drafter or another Proposer."""
    if isinstance(drafter, DFlashDrafter):
        cfg = drafter.config
        return block_size or cfg.block_size, cfg.target_layer_ids, drafter.fc.weight.shape[1] // cfg.hidden_size
    ids = list(drafter.context_layer_ids)
    return block_size or DEFAULT_BLOCK_SIZE, ids, len(ids) or None


def evaluate_offline(
    drafter: DFlashDrafter | Proposer,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource | None = None,
    block_size: int | None = None,
    max_blocks: int | None = None,
) -> EvalResult:
    """Offline τ of `drafter` (a DFlash drafter, or a stateless `Proposer` such as the n-gram
    baseline) on `records`, each walked for at most `max_blocks` steps."""
    b, layer_ids, context_layers = _shape(drafter, block_size)
    features = features or FeatureSource(target)
    per_prompt = []
    for record in records:
        f = features(record, layer_ids) if layer_ids else None
        if isinstance(drafter, DFlashDrafter):
            lengths = offline_acceptance_lengths(
                drafter, target, len(record.prompt_ids), record.completion_ids, f, b, max_blocks
            )
        else:
            lengths = proposer_acceptance_lengths(drafter, target, record.prompt_ids, record.completion_ids, b,
                                                  max_blocks, f)  # fmt: skip
        per_prompt.append(PromptResult(record.id, lengths))
    return EvalResult("offline", b, layer_ids, context_layers, per_prompt)


# -- online --------------------------------------------------------------------------------


@dataclass
class GreedyRun:
    output_ids: list[int]
    seconds: float


def _max_new_tokens(record: EvalRecord, default: int) -> int:
    # with a completion, generate exactly as many tokens, so online walks the same steps
    return len(record.completion_ids) if record.completion_ids else default


def _generator(seed: int, index: int, target: TargetModel) -> torch.Generator:
    return torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + index)


def _sync(target: TargetModel) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


@torch.no_grad()
def greedy_baseline(
    target: TargetModel,
    records: list[EvalRecord],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[GreedyRun]:
    """Plain decoding of every record's prompt, timed after a warm-up run."""
    greedy_generate(target, records[0].prompt_ids, min(8, max_new_tokens), temperature, _generator(seed, -1, target))
    runs = []
    for index, record in enumerate(records):
        _sync(target)
        start = time.perf_counter()
        out = greedy_generate(
            target, record.prompt_ids, _max_new_tokens(record, max_new_tokens), temperature,
            _generator(seed, index, target),
        )  # fmt: skip
        _sync(target)
        runs.append(GreedyRun(out.output_ids, time.perf_counter() - start))
    return runs


@torch.no_grad()
def evaluate_online(
    drafter: DFlashDrafter | Proposer,
    target: TargetModel,
    records: list[EvalRecord],
    baseline: list[GreedyRun],
    block_size: int | None = None,
    max_blocks: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
) -> EvalResult:
    """Online τ: real speculative decoding of every record's prompt, timed after a warm-up,
    each output checked against plain greedy decoding (`baseline`) when temperature is 0.
    Acceptance lengths are cut to the first `max_blocks` steps (the output is not)."""
    b, layer_ids, context_layers = _shape(drafter, block_size)
    speculative_generate(target, drafter, records[0].prompt_ids, min(8, max_new_tokens), temperature, b,
                         _generator(seed, -1, target))  # fmt: skip
    per_prompt, seconds = [], 0.0
    for index, (record, plain) in enumerate(zip(records, baseline, strict=True)):
        _sync(target)
        start = time.perf_counter()
        out = speculative_generate(
            target, drafter, record.prompt_ids, _max_new_tokens(record, max_new_tokens), temperature, b,
            _generator(seed, index, target),
        )  # fmt: skip
        _sync(target)
        seconds += time.perf_counter() - start
        lossless = out.output_ids == plain.output_ids if temperature <= 0 else None
        lengths = out.acceptance_lengths[:max_blocks] if max_blocks is not None else out.acceptance_lengths
        per_prompt.append(PromptResult(record.id, lengths, out.output_ids, lossless))
    spec_tokens = sum(len(p.output_ids) for p in per_prompt)
    greedy_tokens = sum(len(r.output_ids) for r in baseline)
    greedy_seconds = sum(r.seconds for r in baseline)
    return EvalResult(
        "online", b, layer_ids, context_layers, per_prompt, temperature,
        speculative_tokens_per_s=spec_tokens / seconds if seconds > 0 else None,
        greedy_tokens_per_s=greedy_tokens / greedy_seconds if greedy_seconds > 0 else None,
    )  # fmt: skip


def consistency_mismatches(
    records: list[EvalRecord], baseline: list[GreedyRun], offline: EvalResult, online: EvalResult
) -> list[str]:
    """Why offline and online τ are not the same walk, one line per record (empty if they are):
    a completion that is not the target's greedy output, or acceptance lengths that differ."""
    mismatches = []
    for record, run, off, on in zip(records, baseline, offline.per_prompt, online.per_prompt, strict=True):
        k = first_difference(run.output_ids, record.completion_ids)
        if k is not None:
            mismatches.append(
                f"record {record.id}: its completion is not the target's greedy output (first differs at token "
                f"{k}); the check needs greedy completions"
            )
            continue
        k = first_difference(off.acceptance_lengths, on.acceptance_lengths)
        if k is not None:
            x = off.acceptance_lengths[k] if k < len(off.acceptance_lengths) else "nothing"
            y = on.acceptance_lengths[k] if k < len(on.acceptance_lengths) else "nothing"
            mismatches.append(f"record {record.id} step {k + 1}: offline committed {x}, online {y}")
    return mismatches


# -- the eval command -----------------------------------------------------------------------


@dataclass
class Candidate:
    """One drafter of an eval run, as evaluated."""

    label: str  # as given: a checkpoint, or "ngram"
    drafter: DFlashDrafter | Proposer
    block_size: int
    form: str  # the checkpoint's form ("drafter directory", ...) or the n-gram settings
    path: str | None  # what was loaded; None for the n-gram baseline


def _describe_drafter(label: str, loaded, block_size: int, target: TargetModel) -> list[str]:
    cfg, fc = loaded.drafter.config, list(loaded.drafter.fc.weight.shape)
    mask = target.tokenizer.convert_ids_to_tokens(cfg.mask_token_id)
    lines = [
        f"{label} {loaded.path} ({loaded.form}): {cfg.num_hidden_layers} layers "
        f"({', '.join(sorted(set(cfg.layer_types)))}), {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} "
        f"kv heads x {cfg.head_dim}, intermediate {cfg.intermediate_size}; fc.weight {fc} holds "
        f"{fc[1] // cfg.hidden_size} context layers, target_layer_ids {cfg.target_layer_ids} of "
        f"{cfg.num_target_layers}; block size {cfg.block_size} (evaluating with {block_size}); "
        f"mask token {cfg.mask_token_id} {mask!r}"
    ]
    return lines + [f"  assumed: {note}" for note in loaded.assumed]


def load_records(
    target: TargetModel,
    *,
    cached_hidden_states: str | None = None,
    completions: str | None = None,
    prompts: str | None = None,
    num_prompts: int | None = None,
    verify: bool = True,
    allow_foreign: bool = False,
) -> tuple[list[EvalRecord], str]:
    """Records from a hidden-state cache (its sha256 checked unless not `verify`), a completions
    file (another target's refused unless `allow_foreign`) or a prompt source (then without
    completions: the caller decodes them). Returns (records, source description)."""
    given = [x for x in (cached_hidden_states, completions, prompts) if x is not None]
    if len(given) != 1:
        raise FlashdraftError(
            "give exactly one record source: --cached-hidden-states DIR, --completions C.json or --prompts P "
            f"(found {len(given)})"
        )
    if cached_hidden_states is not None:
        from flashdraft.data.cache import HiddenStateCache

        cache = HiddenStateCache(cached_hidden_states, verify=verify)
        cache.check_compatible(target, cache.layer_ids)
        records = records_from_cache(cache, num_prompts)
        return records, f"hidden-state cache {cached_hidden_states} (layers {list(cache.layer_ids)})"
    if completions is not None:
        from flashdraft.data.completions import load_completions

        # prints the valid count and each skip
        loaded = load_completions(completions, target, allow_foreign=allow_foreign).records
        if num_prompts is not None:
            loaded = loaded[:num_prompts]
        records = [EvalRecord(str(r.id), list(r.prompt_ids), list(r.completion_ids)) for r in loaded]
        return records, f"completions {completions}"
    from flashdraft.data.prompts import encode_text, has_chat_template, load_prompts, render_conversation

    tok = target.tokenizer
    chat = has_chat_template(tok)
    records = []
    for prompt in load_prompts(prompts, num_prompts, quiet=True):
        # the first user turn: later turns need the target's earlier answers in the prompt
        text = render_conversation(tok, prompt.conversation([]), chat)
        records.append(EvalRecord(prompt.id, encode_text(tok, text, chat), []))
    return records, f"prompts {prompts} ({'chat template' if chat else 'no chat template'})"


def _fit_prompts(
    records: list[EvalRecord], target: TargetModel, max_new_tokens: int, policy: str, source: str, log: Log
) -> list[EvalRecord]:
    """Records still to be decoded (no completion) whose prompt leaves no room for
    `max_new_tokens` in the target's context: refused, skipped or truncated (`--long-prompts`)."""
    from flashdraft.data.prompts import describe_long_prompts, fit_prompt, prompt_token_limit

    if all(r.completion_ids for r in records):
        return records
    limit = prompt_token_limit(target.context_length, max_new_tokens)
    stats: dict[str, int] = {}
    kept = []
    for r in records:
        ids = r.prompt_ids if r.completion_ids else fit_prompt(r.id, r.prompt_ids, limit, policy, stats, source)
        if ids is not None:
            r.prompt_ids = ids
            kept.append(r)
    note = describe_long_prompts(stats, limit)
    if note:
        log(f"{note} (--long-prompts {policy})")
    return kept


def run_eval(
    checkpoint: str,
    target_model: str,
    *,
    cached_hidden_states: str | None = None,
    completions: str | None = None,
    prompts: str | None = None,
    num_prompts: int | None = None,
    max_blocks: int | None = None,
    max_new_tokens: int | None = None,
    block_size: int | None = None,
    online: bool = False,
    temperature: float = 0.0,
    check_consistency: bool = False,
    reference: str | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    ngram_max: int = 3,
    ngram_min: int = 1,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    verify: bool = True,
    allow_foreign: bool = False,
    long_prompts: str = "error",
    log: Log = print,
) -> dict[str, Any]:
    """`flashdraft eval`: load, print what was loaded, evaluate (and the reference on the same
    records and step budget), and return the summary that `--json` writes. `checkpoint` or
    `reference` "ngram" is the n-gram baseline (prompt lookup of the last ngram_max..ngram_min
    tokens), with the DFlash drafter's block size when set against one."""
    from flashdraft.checkpoint import load_any_drafter

    if temperature > 0 and (not online or check_consistency):
        raise FlashdraftError(
            f"--temperature {temperature}: offline τ and --check-consistency are defined for greedy decoding; "
            f"use --online without --check-consistency for sampling"
        )
    from flashdraft.target_weights import TargetHead

    # offline from a cache needs no target forward: only tokenizer, config, embeddings and LM head
    offline_only = cached_hidden_states is not None and not (online or check_consistency)
    target = (TargetHead if offline_only else TargetModel).load(target_model, device=device, dtype=dtype)
    tok = target.tokenizer
    log(
        f"target {target.path}: {target.num_layers} layers, hidden {target.hidden_size}; tokenizer "
        f"{type(tok).__name__} with {len(tok)} tokens, LM head vocabulary {target.vocab_size}"
    )
    specs = [("drafter", checkpoint)] + ([("reference", reference)] if reference else [])
    loaded_by_role = {}
    for role, path in specs:
        if path != NGRAM:
            loaded = load_any_drafter(path, target, block_size=block_size, target_layer_ids=target_layer_ids,
                                      mask_token_id=mask_token_id, device=device, dtype=dtype,
                                      verify=verify)  # fmt: skip
            check_drafter_matches_target(loaded.drafter.config, target, str(loaded.path))
            loaded_by_role[role] = loaded
    # the n-gram baseline drafts blocks as long as the DFlash drafter's it is set against
    ngram_block = block_size or next((x.drafter.config.block_size for x in loaded_by_role.values()),
                                     DEFAULT_BLOCK_SIZE)  # fmt: skip
    drafters: list[Candidate] = []
    for role, path in specs:
        if path == NGRAM:
            proposer = NGramProposer(target.vocab_size, ngram_max, ngram_min)
            log(f"{role} {proposer!r}: no model, no context features; block size {ngram_block}")
            drafters.append(Candidate(NGRAM, proposer, ngram_block, repr(proposer), None))
            continue
        loaded = loaded_by_role[role]
        b = block_size or loaded.drafter.config.block_size
        for line in _describe_drafter(role, loaded, b, target):
            log(line)
        drafters.append(Candidate(str(path), loaded.drafter, b, loaded.form, str(loaded.path)))

    records, source = load_records(target, cached_hidden_states=cached_hidden_states, completions=completions,
                                   prompts=prompts, num_prompts=num_prompts, verify=verify,
                                   allow_foreign=allow_foreign)  # fmt: skip
    if not records:
        raise FlashdraftError(f"{source}: no records")
    if max_new_tokens is None:  # enough for max_blocks steps of the largest block
        max_new_tokens = max_blocks * max(c.block_size for c in drafters) + 1 if max_blocks else 256
    records = _fit_prompts(records, target, max_new_tokens, long_prompts, str(prompts), log)
    run_online = online or check_consistency  # the check compares both walks
    baseline = None
    if run_online or not records[0].completion_ids:
        baseline = greedy_baseline(target, records, max_new_tokens, temperature, seed)
        for record, run in zip(records, baseline, strict=True):
            if not record.completion_ids and temperature <= 0:
                record.completion_ids = list(run.output_ids)  # the target's greedy output
    valid, valid_baseline = [], []
    for index, record in enumerate(records):
        reason = invalid_reason(record, target.vocab_size)
        if reason is not None and not (online and temperature > 0 and not record.completion_ids):
            log(f"  skipped record {record.id}: {reason}")
            continue
        valid.append(record)
        if baseline is not None:
            valid_baseline.append(baseline[index])
    steps = f"at most {max_blocks} steps each" if max_blocks else "every step of each completion"
    log(f"records: {len(valid)} valid of {len(records)} from {source}; {steps}")
    if not valid:
        raise FlashdraftError(f"{source}: none of the {len(records)} records can be evaluated")

    features = FeatureSource(target, log)  # logs each record's tokens and feature statistics offline
    if online and not check_consistency:
        for record in valid:
            log(f"record {record.id}: {len(record.prompt_ids)} prompt tokens, "
                f"{_max_new_tokens(record, max_new_tokens)} new tokens to decode")  # fmt: skip
    if cached_hidden_states is not None:
        for c in drafters:
            ids = _shape(c.drafter, c.block_size)[1]
            if not set(ids) <= set(valid[0].layer_ids):
                if c is drafters[0]:
                    raise FlashdraftError(
                        f"{cached_hidden_states}: the cache holds target layers {valid[0].layer_ids}; the drafter "
                        f"needs target_layer_ids {ids} (re-run flashdraft cache with these layers)"
                    )
                log(f"reference target_layer_ids {ids} are not all in the cache: its features come from a "
                    f"fresh target forward")  # fmt: skip

    results = []
    for c in drafters:
        offline = online_result = None
        if not online or check_consistency:
            offline = evaluate_offline(c.drafter, target, valid, features, c.block_size, max_blocks)
        if run_online:
            online_result = evaluate_online(c.drafter, target, valid, valid_baseline, c.block_size, max_blocks,
                                            max_new_tokens, temperature, seed)  # fmt: skip
        summary = (online_result if online else offline).to_json()
        summary |= {"checkpoint": c.label, "checkpoint_form": c.form, "drafter_path": c.path,
                    "drafter_type": "dflash" if isinstance(c.drafter, DFlashDrafter) else NGRAM}  # fmt: skip
        if check_consistency:
            mismatches = consistency_mismatches(valid, valid_baseline, offline, online_result)
            summary["consistency"] = {"identical": not mismatches, "mismatches": mismatches,
                                      "offline_tau": offline.tau, "online_tau": online_result.tau}  # fmt: skip
        results.append(summary)
    main = results[0] | {"target": str(target_model), "records_source": source, "max_blocks": max_blocks,
                         "max_new_tokens": max_new_tokens if online else None,
                         "target_forwards_offline": features.target_forwards}  # fmt: skip
    if reference:
        main["reference"] = results[1]
        main["difference"] = difference(results[0], results[1])
    return main
