"""Batched decoding with the target alone: many prompts at once, left-padded, as `flashdraft generate` runs the
target locally.

Greedy output equals `flashdraft.decoding.generate.autoregressive_generate` token for token; sampled output draws
each row from its own generator, so a row's tokens do not depend on the batch it is in.

With `CompiledBatch` (`generate --compile`) every token after the prefill is one 1-token step on the target's static
cache (`flashdraft.target.static_cache`: every layer kind in preallocated buffers written at a device position),
at a fixed batch width (rows past the prompts fill it and are dropped), compiled once (`StaticBatchStep`): the same
tokens as the eager loop, the same draws from the same generators.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flashdraft.decoding.host_transfers import to_host
from flashdraft.decoding.serving_rules import GREEDY, SamplingParams, target_probs
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetCache, TargetModel, decoding_attention
from flashdraft.target.static_cache import CompileCounts, StaticVerifier, _static_address, capacity_for


@dataclass
class CompiledBatch:
    """`generate_batch` on the target's static cache: every call's rows filled up to `width` (one batch shape for
    all), each token after the prefill one 1-token step compiled once by `backend` ("inductor": CUDA graphs on CUDA;
    "eager" / "aot_eager": dynamo's tracing alone; None: the static path uncompiled); what compiled is added to
    `counts` call by call."""

    width: int
    backend: str | None = "inductor"
    counts: CompileCounts = field(default_factory=CompileCounts)


@dataclass
class StaticBatchStep(StaticVerifier):
    """The target's 1-token step over `batch` left-padded rows on a static cache: row i's first `pads[i]` columns
    are padding (never seen), its rotary position the column less its padding; every row writes the same column."""

    batch: int = 1
    pads: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pads = _static_address(torch.zeros(self.batch, dtype=torch.long, device=self.target.device))  # [B]

    def start_batch(self, eager_cache, width: int, pads: torch.Tensor) -> None:
        """Take over the prefill's cache (a transformers cache over `width` columns) and the rows' padding [B]."""
        self.start(TargetCache(kv=eager_cache), width)
        self.pads.copy_(pads)

    def _forward(self, input_ids: torch.Tensor):
        """input_ids [B, 1] -> (logits [B, 1, V], hidden [B, 1, H], features or None)."""
        position, columns = self.cache.position, self._key_positions[None, :]  # [], [1, L]
        self.cache.write_positions.copy_(position + self._offsets)
        seen = ((columns <= position) & (columns >= self.pads[:, None]))[:, None]  # [B, 1, L]
        sliding = None
        if self._window and "sliding_attention" in self.target.layer_types:
            sliding = seen & (position - columns < self._window)[:, None]
        return self._decode(input_ids, (position - self.pads)[:, None], self.additive(seen, sliding))

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows' next-token logits [B, V] after input_ids [B, 1]; the position advances by one."""
        logits, _, _ = self.counted(self._step, input_ids)
        self.cache.commit(0)
        return logits[:, -1]


def static_batch_step(target: TargetModel, batch: int, tokens: int, backend: str | None) -> StaticBatchStep:
    """The target's batched step for `batch` rows, made once and kept on the target (its buffers and graph serve
    every later call that fits); a larger one replaces it when `tokens` columns do not fit, of twice the columns at
    least: `generate` answers its prompts shortest first, so a run compiles about log2(longest / shortest) times."""
    steps = target.__dict__.setdefault("_static_batch_steps", {})
    key = (batch, backend, target.device, target.dtype, tuple(target._context_layer_ids))
    step = steps.get(key)
    if step is None or step.capacity < tokens:
        capacity = capacity_for(max(tokens, 2 * step.capacity if step is not None else 0))
        step = StaticBatchStep(target, 1, capacity, backend, batch=batch)
        steps[key] = step
    return step


def _draw(logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator] | None) -> torch.Tensor:
    """Each row's token [B] of logits [B, V]: the argmax, or a draw from its own generator (rows past the
    generators, a compiled batch's filling, take the argmax)."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, sampling.temperature, sampling.filters)  # [B, V]
    drawn = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(drawn + [logits[len(drawn) :].argmax(-1)])


@torch.no_grad()
def generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    generators: list[torch.Generator] | None = None,
    compiled: CompiledBatch | None = None,
) -> list[tuple[list[int], str]]:
    """Decode every prompt with the target's cache (at temperature > 0 sampled from the target's p with the
    sampling's filters, as the servers sample, each row from its own generator); returns (completion ids, stop
    reason) each. `compiled`: every step after the prefill on the static cache, compiled once.

    Prompts are left-padded to one width; the attention mask hides the padding and position
    ids count only real tokens, so each row decodes as it would alone. Rows that stopped
    keep being fed (their output is frozen) until every row has stopped.
    """
    from transformers import DynamicCache

    n = len(prompts)
    if compiled is not None and n > compiled.width:
        raise FlashdraftError(f"a batch of {n} prompts; the compiled batch holds {compiled.width}")
    rows = prompts + prompts[:1] * (compiled.width - n if compiled is not None else 0)  # filling, dropped
    device, width = target.device, max(len(p) for p in prompts)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)  # [N, W]
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # [N, W]
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, W]
    padded = any(len(p) < width for p in prompts)
    stop_ids = set(target.stop_token_ids)
    cache = DynamicCache(config=target.config)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    step = None  # the static step, from the second token on
    with decoding_attention(device):  # no per-length kernel builds on CUDA
        for _ in range(max_new_tokens):
            if step is not None:
                logits = step.step(ids)  # [N, V]
            else:
                logits = target.model(
                    input_ids=ids,
                    attention_mask=mask if padded else None,  # no mask without padding: the kernels of one prompt
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,  # the prompt's other positions need no [W, V] logits
                ).logits[:, -1]  # [N, V]
            drawn = _draw(logits, sampling, generators)  # [N]
            tokens = to_host(drawn)  # the step's one read of the device
            for i, token in enumerate(tokens[:n]):
                if reasons[i] == "length" and len(outputs[i]) < max_new_tokens:
                    outputs[i].append(token)
                    if token in stop_ids:
                        reasons[i] = "eos"
            if all(r == "eos" for r in reasons):
                break
            ids = drawn[:, None]  # [N, 1]
            if compiled is not None and step is None:  # the prefill's cache taken over by the static step
                step = static_batch_step(target, len(rows), width + max_new_tokens, compiled.backend)
                before = replace(step.counts)
                step.start_batch(cache, width, width - mask.sum(-1))
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            positions = positions[:, -1:] + 1
    if step is not None:
        compiled.counts.add(_counts_since(step, before))
    return list(zip(outputs, reasons, strict=True))


def _counts_since(step: StaticBatchStep, before: CompileCounts) -> CompileCounts:
    """What the step compiled since `before` (a copy of its counts), as `CompileCounts.add` takes a generation."""
    now = step.counts
    return CompileCounts(
        now.compiles - before.compiles,
        now.recompiles - before.recompiles,
        now.graph_breaks - before.graph_breaks,
        now.compile_seconds - before.compile_seconds,
    )
