"""`flashdraft doctor` on a hidden-state cache: the manifest and every shard file, the records' layout and
finite features, and with a target its fingerprint and the alignment of sampled records with a fresh forward
(saying which layer or token shift mismatching features match instead)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from flashdraft.data.cache import DEFAULT_TOLERANCE, DTYPE_NAMES, MANIFEST, PROGRESS, relative_error
from flashdraft.data.cache_reader import HiddenStateCache
from flashdraft.drafter.config import LAYER_ORDER_RULE, strictly_increasing
from flashdraft.drafter.doctor_report import Checks
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import mismatch


def _diagnose(target: TargetModel, tokens: torch.Tensor, cached: torch.Tensor, layer: int, tol: float) -> str:
    """Say what a mismatching layer block matches instead: another layer, or shifted tokens."""
    hidden = target.model(input_ids=tokens[None], output_hidden_states=True).hidden_states  # L + 1 x [1, T, H]
    for k, h in enumerate(hidden):
        if k != layer + 1 and relative_error(cached, h[0]) <= tol:
            return f"; it matches hidden_states[{k}] instead of hidden_states[{layer + 1}] (layer offset off by one?)"
    fresh = hidden[layer + 1][0]
    for shift in (1, -1):
        a, b = (cached[shift:], fresh[:-shift]) if shift > 0 else (cached[:shift], fresh[-shift:])
        if relative_error(a, b) <= tol:
            return f"; it matches the fresh features shifted by {shift} token (token alignment off by one?)"
    return ""


@torch.no_grad()
def _check_layout(cache: HiddenStateCache, checks: Checks, rebuild: str) -> None:
    """Dtypes and loss masks of every record as the manifest says; features finite."""
    layout_errors, nonfinite = [], []
    for s in cache.shards:
        with cache.open_shard(s["file"]) as f:
            for name, dtype in (("input_ids", "I32"), ("loss_mask", "BOOL")):
                if f.get_slice(name).get_dtype() != dtype:
                    layout_errors.append(f"{s['file']} {name} is {f.get_slice(name).get_dtype()}, expected {dtype}")
    for i in range(len(cache)):
        r = cache[i]
        expected = torch.arange(len(r.input_ids)) >= r.prompt_length
        if not torch.equal(r.loss_mask, expected) or r.context_features.dtype != cache.dtype:
            layout_errors.append(f"record {r.id}: loss mask or dtype disagrees with the manifest")
        try:
            cache.features(i)
        except FlashdraftError as e:
            nonfinite.append(str(e).split(": ", 1)[1])
    layout = "record layout (dtypes, loss masks)" + (": " + "; ".join(layout_errors[:3]) if layout_errors else "")
    checks.check(not layout_errors, layout, rebuild)
    checks.check(
        not nonfinite,
        f"context features finite in all {len(cache)} records"
        + (f": {len(nonfinite)} records are not; first: {nonfinite[0]}" if nonfinite else ""),
        rebuild + " (with --dtype bf16 if fp16 overflowed)",
    )


def _check_alignment(
    cache: HiddenStateCache,
    target: TargetModel,
    checks: Checks,
    samples: int,
    tolerance: float | None,
    seed: int,
    rebuild: str,
) -> None:
    """`samples` random records against a fresh target forward, layer by layer."""
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[DTYPE_NAMES[cache.dtype]]
    picks = sorted(random.Random(seed).sample(range(len(cache)), min(samples, len(cache))))
    target.set_context_layers(cache.layer_ids)
    worst, problems = 0.0, []
    for i in picks:
        r = cache[i]
        tokens = r.input_ids.to(target.device)
        fresh = target.forward(tokens[None]).context_features[0].cpu()  # [T, n * H]
        for j, layer in enumerate(cache.layer_ids):
            block = slice(j * cache.hidden_size, (j + 1) * cache.hidden_size)
            err = relative_error(r.context_features[:, block], fresh[:, block])
            worst = max(worst, err)
            if err > tol:
                hint = _diagnose(target, tokens, r.context_features[:, block].to(target.device), layer, tol)
                problems.append(f"record {r.id} layer {layer}: relative error {err:.2e}{hint}")
    checks.check(
        not problems,
        f"alignment of {len(picks)} records with a fresh forward: worst relative "
        f"error {worst:.2e} (tolerance {tol:.0e})" + ("; " + "; ".join(problems[:3]) if problems else ""),
        f"the features are not this target's layers {cache.layer_ids}: {rebuild} (a cache built on "
        f"GPU in bf16 and checked on CPU may need a larger --tolerance)",
    )


def _about_engine(computed_with: dict, dtype: torch.dtype, checks: Checks) -> None:
    """What captured the states, when a serving engine did (`cache --engine`), and where its settings differ from
    what serving and training read."""
    engine = computed_with.get("engine")
    if not engine:
        return
    verified = engine.get("verification") or {}
    chunked = {None: "the engine's default", True: "on", False: "off"}[engine.get("chunked_prefill")]
    checks.about(
        f"captured by {engine['engine']} {engine['version']}: {engine['dtype']}, TP "
        f"{engine['tensor_parallel_size']}, prefix caching {'on' if engine['prefix_caching'] else 'off'}, "
        f"chunked prefill {chunked}, aux layer ids {engine['aux_layer_ids']}; verified against the target: "
        f"{len(verified.get('samples_recomputed', []))} sequences recomputed (the probe first), worst "
        f"relative error {verified.get('worst_relative_error', float('nan')):.2e}"
    )
    if engine["prefix_caching"]:
        checks.warn(
            "captured with prefix caching on: engines have returned fewer states than tokens under it (vLLM "
            "#44485); every sample's length was checked at capture",
            "capture without --enable-prefix-caching for a cache nobody needs to re-check",
        )
    if engine["dtype"] != DTYPE_NAMES[dtype]:
        checks.warn(
            f"the engine computed in {engine['dtype']}, the cache stores {DTYPE_NAMES[dtype]}: offline τ is "
            f"then within rounding of served τ, not equal",
            "capture with --dtype auto for the engine's own precision",
        )


def _about_quantisation(cache: HiddenStateCache, target: TargetModel | None, checks: Checks) -> None:
    """The quantisation the cache's states were captured under; with a target, whether it is quantised alike."""
    recorded = cache.target_quantisation
    if target is None:
        checks.about(
            "target quantisation: "
            + (recorded.describe() if recorded else "not recorded (a cache written before flashdraft recorded it)")
        )
        return
    quantised = mismatch(recorded, getattr(target, "quantisation", None))
    checks.check(
        quantised is None,
        "target quantisation: "
        + (quantised or f"the cache's and {target.path}'s agree ({target.quantisation.scheme})"),
        "cache the states of the target you evaluate against (flashdraft cache --target-model it), or give the "
        "target the cache was captured from",
    )


def doctor_cache(
    directory: str | Path,
    target: TargetModel | None = None,
    layer_ids: list[int] | None = None,
    samples: int = 4,
    tolerance: float | None = None,
    seed: int = 0,
    verify: bool = True,
    checks=None,
) -> bool:
    """Check a cache: manifest, every shard's size and (with `verify`) sha256, record layout,
    finite features, and with a target its fingerprint and the alignment of `samples` records
    against a fresh forward; with a drafter's `layer_ids`, that they equal the cache's. Prints
    one line per check (`flashdraft.drafter.doctor_report.Checks`); returns True when all pass."""
    directory = Path(directory)
    own = checks is None
    checks = checks or Checks()
    rebuild = "re-run flashdraft cache with the same arguments into a new --out"
    try:
        cache = HiddenStateCache(directory, verify=False)
    except FlashdraftError as e:
        unfinished = not (directory / MANIFEST).exists() and (directory / PROGRESS).is_dir()
        checks.fail(
            str(e), "re-run the same flashdraft cache command: it keeps the finished shards" if unfinished else rebuild
        )
        return checks.summary() if own else False
    checks.about(
        f"hidden-state cache {directory}: {len(cache)} records, {cache.num_tokens} tokens, "
        f"{len(cache.shards)} shards of {cache.manifest.get('records_per_shard')} records; layers "
        f"{cache.layer_ids} (context-layer count {len(cache.layer_ids)}), hidden {cache.hidden_size}, "
        f"{DTYPE_NAMES[cache.dtype]}, target top-k {cache.topk or 'none'}"
    )
    completions = cache.manifest.get("completions") or {}
    checks.about(
        f"fingerprints: target {cache.target_fingerprint} ({cache.manifest['target'].get('path')}), "
        f"completions {completions.get('file')} made by {completions.get('target_fingerprint')}"
    )
    _about_quantisation(cache, None, checks)
    _about_engine(cache.manifest.get("computed_with") or {}, cache.dtype, checks)
    checks.ok(f"{directory / MANIFEST}: shard sizes and record layout agree with the manifest")
    files = [(s["file"], s["sha256"]) for s in cache.shards]
    files += [(s["topk_file"], s["topk_sha256"]) for s in cache.shards if cache.topk]
    if verify:
        bad = [name for name, sha in files if sha256_file(directory / name) != sha]
        checks.check(
            not bad,
            f"sha256 of {len(files)} shard files" + (f": {', '.join(bad)} differ" if bad else ""),
            f"the files were corrupted or replaced; copy the cache again or {rebuild}",
        )
    else:
        checks.about(f"sha256 of {len(files)} shard files not checked (--no-verify)")

    _check_layout(cache, checks, rebuild)
    # a cache written before the rule (--layers 2,0) feeds no drafter a server would run
    ordered = strictly_increasing(cache.layer_ids)
    checks.check(
        ordered,
        f"layer ids {cache.layer_ids} " + ("are" if ordered else "are not") + f" {LAYER_ORDER_RULE}",
        f"re-run flashdraft cache with --layers {','.join(map(str, sorted(set(cache.layer_ids))))} into a new --out",
    )

    if layer_ids is not None:
        same = list(layer_ids) == cache.layer_ids
        checks.check(
            same,
            f"layer ids {cache.layer_ids} "
            + ("equal" if same else "differ from")
            + f" the drafter's target_layer_ids {list(layer_ids)}",
            f"flashdraft cache --layers {','.join(map(str, layer_ids or []))} for this drafter",
        )
    if target is not None:
        try:
            _about_quantisation(cache, target, checks)
            cache.check_compatible(target)
            checks.ok(f"target fingerprint {cache.target_fingerprint} and hidden size match {target.path}")
        except FlashdraftError as e:
            checks.fail(str(e), "use the target that built the cache, or cache this target's own completions")
        else:
            _check_alignment(cache, target, checks, samples=samples, tolerance=tolerance, seed=seed, rebuild=rebuild)
    return checks.summary() if own else not checks.failures
