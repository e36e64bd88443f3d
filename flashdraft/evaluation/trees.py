"""`eval --tree RULE --tree-budget N[,N...]`: τ under tree verification, offline and exact, per budget; the
speed-up each budget predicts from the step-cost model `bench` and eval use, and the best budget; online, the tree
loop checked against the offline walk step for step.

Offline walk (greedy): for a prompt and the target's greedy completion c[0..M-1], at anchor index i the drafter's one
forward gives block j's per-position distributions, the rule builds its tree (`decoding.tree`), and the accepted path
is the longest root path whose node at depth d holds c[i + d] (the target's argmax after a node is the completion's
next token exactly when every node before it on the path was); the step commits n = min(a + 1, M - 1 - i). This is
what the online loop commits (`decoding.tree.tree_generate`), so the two agree step for step.

Predicted speed-up of a budget N: τ_N x t(plain step) / (t(draft) + t(tree build) + t(verify of N + 1 tokens)), as
`results.speedup_bound`, each cost measured here on the target (median of repeats at the first record's context);
the chain's beside it with t(verify of B tokens).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.decoding.generate import SpeculativeConfig
from flashdraft.decoding.proposers import Proposer, as_proposer
from flashdraft.decoding.tree import (
    DraftTree,
    TreeRule,
    build_tree,
    check_tree_drafter,
    check_tree_target,
    tree_forward,
    tree_generate,
    tree_on_device,
    tree_verifiable,
)
from flashdraft.drafter.families import drafts_per_block
from flashdraft.errors import FlashdraftError
from flashdraft.evaluation.categories import TurnCounts, by_category
from flashdraft.evaluation.config import Candidate, EvalConfig
from flashdraft.evaluation.modes import by_segment
from flashdraft.evaluation.offline import draft_anchors, drafter_shape
from flashdraft.evaluation.online import GreedyRun
from flashdraft.evaluation.records import EvalRecord, FeatureSource
from flashdraft.evaluation.results import EvalResult, PromptResult, speedup_bound
from flashdraft.target.image_files import record_images
from flashdraft.target.model import TargetModel
from flashdraft.target.static_cache import CompileCounts

COST_REPEATS = 7  # timed rounds per cost; the median is used


# -- the offline walk -------------------------------------------------------------------------------------------


def _accepted(tree: DraftTree, completion: list[int], i: int) -> int:
    """Drafts the tree's accepted path holds when the target's output is `completion` after anchor index i."""

    def predicted(node: int) -> int | None:
        at = i + 1 + tree.depths[node]
        return completion[at] if at < len(completion) else None

    return len(tree.accepted_path(predicted)) - 1


@dataclass(frozen=True)
class TreeWalk:
    """One completion walked under a tree rule: each step's committed tokens and the nodes it verified."""

    lengths: list[int]
    nodes: list[int]


@torch.no_grad()
def tree_walk(
    proposer: Proposer,
    rule: TreeRule,
    record: EvalRecord,
    block: int,
    features: torch.Tensor | None,
    device: torch.device | str,
    max_blocks: int | None = None,
) -> TreeWalk:
    """The offline tree walk of one record (module docstring), the anchors drafted many per call as the chain's walk
    drafts them (`evaluation.offline.draft_anchors`). `proposer`: a fresh one."""
    prompt, completion = record.prompt_ids, record.completion_ids
    tokens, p, m = prompt + completion, len(prompt), len(completion)
    per_call = getattr(proposer, "anchors_per_call", lambda _: 1)(block)
    drafts: dict[int, tuple[int, torch.Tensor]] = {}
    lengths, nodes = [], []
    i = fed = 0
    while i < m - 1 and (max_blocks is None or len(lengths) < max_blocks):
        if i not in drafts:
            anchors = list(range(i, min(i + per_call, m - 1)))
            logits, fed = draft_anchors(
                proposer,
                anchors,
                tokens,
                p=p,
                features=features,
                fed=fed,
                block=block,
                device=device,
                positions=record.drafter_positions(),  # as served: M-RoPE's row 0 beside images
            )
            drafts = {a: (j, x) for j, (a, x) in enumerate(zip(anchors, logits, strict=True))}
        j, rows = drafts[i]
        tree = build_tree(rule, proposer, rows, j, completion[i])
        left = m - 1 - i
        n = min(_accepted(tree, completion, i) + 1, left)
        lengths.append(n)
        nodes.append(tree.size)
        i += n
    return TreeWalk(lengths, nodes)


def walk_budget(
    c: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource,
    rule: TreeRule,
    max_blocks: int | None = None,
) -> tuple[list[TreeWalk], EvalResult]:
    """Every record walked under `rule`, and the walks as an `EvalResult` (its τ, histogram and by-context
    figures)."""
    block, layer_ids, context_layers = drafter_shape(c.drafter, c.block_size)
    walks = []
    for record in records:
        f = features(record, layer_ids) if layer_ids else None
        proposer = as_proposer(c.drafter, target)
        walks.append(tree_walk(proposer, rule, record, block, f, target.device, max_blocks))
    result = EvalResult(
        "offline",
        block,
        layer_ids,
        context_layers,
        [PromptResult(r.id, w.lengths, prompt_length=len(r.prompt_ids)) for r, w in zip(records, walks, strict=True)],
        drafts_per_block=drafts_per_block(c.drafter, block),
    )
    return walks, result


# -- step costs --------------------------------------------------------------------------------------------------


def _interleaved_medians(runs: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Median seconds of each run over COST_REPEATS rounds that time every run once each (after a warm-up round),
    so a slow-down of a shared machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(COST_REPEATS + 1):
        for name, run in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


@torch.no_grad()
def step_costs(c: Candidate, target: TargetModel, record: EvalRecord, rule_of: dict[int, TreeRule]) -> dict[str, Any]:
    """Seconds of a plain step, a drafter block, each budget's tree build and verify forward (N + 1 tokens under
    the tree mask; a target without a tree forward: causal) and the chain's verify (B tokens, causal), at `record`'s
    whole context on this machine."""
    block, layer_ids, _ = drafter_shape(c.drafter, c.block_size)
    device = target.device
    target.set_context_layers(layer_ids)
    context = record.prompt_ids + record.completion_ids[:-1]
    cache = target.new_cache()
    prefill = target.forward(torch.tensor([context], device=device), cache)
    proposer = as_proposer(c.drafter, target)
    positions = torch.arange(len(context) - 1, device=device)[None]
    features = prefill.context_features[:, :-1] if prefill.context_features is not None else None
    rows = proposer.propose(context, len(context) - 1, features, positions, block)  # fills the drafter's cache

    def draft() -> None:  # one block on the cached context, as a decoding step drafts
        proposer.propose(context, len(context) - 1, None, positions[:, :0], block)

    def forward(tokens: int, tree: DraftTree | None = None):
        if tree is None or not tree_verifiable(target):  # no tree forward (Mamba, fla): N + 1 tokens, causal
            ids = torch.tensor([context[-1:] * tokens], device=device)
            return lambda: (target.forward(ids, cache), target.rollback(cache, 0))
        return lambda: (
            tree_forward(target, cache, tree_on_device(tree, context[-1:] * tokens, device), tree, cache.length),
            target.rollback(cache, 0),
        )

    runs = {"plain_step_s": forward(1), "draft_s": draft, "chain_verify_s": forward(block)}
    sizes = {}
    for budget, rule in rule_of.items():
        tree = build_tree(rule, proposer, rows, 0, context[-1])
        sizes[budget] = tree.size
        runs[f"build {budget}"] = lambda rule=rule: build_tree(rule, proposer, rows, 0, context[-1])
        runs[f"verify {budget}"] = forward(tree.size + 1, tree)
    seconds = _interleaved_medians(runs, device)
    costs = {name: seconds[name] for name in ("plain_step_s", "draft_s", "chain_verify_s")}
    costs["budgets"] = {
        n: {"nodes": size, "build_s": seconds[f"build {n}"], "verify_s": seconds[f"verify {n}"]}
        for n, size in sizes.items()
    }
    return costs


# -- the report --------------------------------------------------------------------------------------------------


def evaluate_trees(
    cfg: EvalConfig,
    c: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    features: FeatureSource,
    chain: dict[str, Any],
    baseline: list[GreedyRun] | None = None,
    log=print,
) -> dict[str, Any]:
    """The `trees` figures of `eval --tree`: per budget the offline τ, histogram, nodes verified per step, by context
    and by segment, the predicted speed-up, and online (--online / --check-consistency) the tree loop's τ, whether
    its output is the target's greedy output (`baseline`: each record's plain greedy decoding; None: its completion)
    and its acceptance lengths the offline walk's; the chain's figures beside them and the best budget."""
    check_tree_drafter(TreeRule(cfg.tree, 1, cfg.tree_width), c.drafter)
    rules = {budget: TreeRule(cfg.tree, budget, cfg.tree_width) for budget in cfg.tree_budget}
    costs = None
    if isinstance(target, TargetModel):  # a target head alone (offline from a cache) has no forward to time
        if cfg.online or cfg.check_consistency:
            check_tree_target(target)  # the tree loop refuses what it cannot verify; the offline walk is exact
        with record_images(target, records[0]):  # timed at its context, its images bound
            costs = step_costs(c, target, records[0], rules)
        if not tree_verifiable(target):
            costs["note"] = "no tree forward on this target's recurrent layers: verify timed causal, N + 1 tokens"
    plain = costs["plain_step_s"] if costs else None
    chain_predicted = speedup_bound(chain["tau"], plain, costs["draft_s"], costs["chain_verify_s"]) if costs else None
    rows = []
    for budget, rule in rules.items():
        walks, result = walk_budget(c, target, records, features, rule, cfg.max_blocks)
        steps = max(result.num_steps, 1)
        row = {
            "budget": budget,
            "tau": result.tau,
            "num_steps": result.num_steps,
            "histogram": result.histogram,
            "nodes_per_step": sum(sum(w.nodes) for w in walks) / steps,
            "by_context": result.by_context,
            "by_segment": by_segment(result, records, target.tokenizer),
            # SPEED-Bench: per category, each step's drafted tokens the nodes it verified
            "by_category": by_category(
                records,
                [TurnCounts.of_lengths(w.lengths, result.max_drafts, sum(w.nodes)) for w in walks],
                budget,
            ),
            "per_prompt": [w.lengths for w in walks],
        }
        if costs:
            cost = costs["budgets"][budget]
            row["predicted_speedup"] = speedup_bound(
                result.tau, plain, costs["draft_s"] + cost["build_s"], cost["verify_s"]
            )
        if cfg.online or cfg.check_consistency:
            greedy = [run.output_ids for run in baseline] if baseline else [r.completion_ids for r in records]
            row["online"] = _online(c, target, records, rule, walks=walks, greedy=greedy, compile=cfg.compile)
        log(
            f"tree {cfg.tree} budget {budget}: tau {result.tau:.3f} (chain {chain['tau']:.3f}), "
            f"{row['nodes_per_step']:.1f} nodes per step"
            + (f", predicted speed-up {row['predicted_speedup']:.2f}x" if row.get("predicted_speedup") else "")
            + (f"; online: {_verdict(row['online'])}" if "online" in row else "")
        )
        rows.append(row)
    predicted = [r for r in rows if r.get("predicted_speedup") is not None]
    best = max(predicted, key=lambda r: r["predicted_speedup"]) if predicted else None
    if best is not None:
        log(
            f"tree {cfg.tree}: best budget {best['budget']} (predicted {best['predicted_speedup']:.2f}x; the chain's "
            f"{chain_predicted:.2f}x), step costs timed on {target.device.type}"
        )
    return {
        "rule": cfg.tree,
        "width": rules[cfg.tree_budget[0]].beam_width if cfg.tree != "ddtree" else None,
        "chain": {"tau": chain["tau"], "histogram": chain["histogram"], "predicted_speedup": chain_predicted},
        "budgets": rows,
        "step_costs": costs,
        "best_budget": best["budget"] if best else None,
        "best_beats_chain": (best["predicted_speedup"] > chain_predicted) if best and chain_predicted else None,
        "costs_note": None if costs else "no target forward in this run (offline from a cache): no step costs",
    }


def _online(
    c: Candidate,
    target: TargetModel,
    records: list[EvalRecord],
    rule: TreeRule,
    walks: list[TreeWalk],
    greedy: list[list[int]],
    compile: bool | None = None,
) -> dict[str, Any]:
    """The tree loop on every record (as many tokens as its completion), against the offline walk; `compile`: the
    tree verified on the target's static cache (`decoding.static_tree`) sized for the longest record, so one verify
    graph serves them all, and what compiled is counted under "compile"."""
    lengths, mismatches, lossless = [], [], True
    positions = max(len(r.prompt_ids) + len(r.completion_ids) for r in records) if records else None
    speculative = SpeculativeConfig(block_size=c.block_size, compile=compile, static_positions=positions)
    compiled, static = CompileCounts(), False
    for record, walk, plain in zip(records, walks, greedy, strict=True):
        with record_images(target, record):  # its images, where it has any
            out = tree_generate(
                target,
                c.drafter,
                record.prompt_ids,
                len(record.completion_ids),
                rule,
                speculative,
            )
        compiled.add(out)
        static |= out.static
        lossless &= out.output_ids == plain
        lengths += out.acceptance_lengths
        if out.acceptance_lengths[: len(walk.lengths)] != walk.lengths:
            mismatches.append(record.id)
    return {
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "lossless": lossless,
        "identical": not mismatches,
        "mismatches": mismatches,
        "compile": compiled.as_dict() | {"static": static},
    }


def _verdict(online: dict[str, Any]) -> str:
    same = "the offline walk's acceptance lengths" if online["identical"] else f"differs on {online['mismatches']}"
    return f"tau {online['tau']:.3f}, {'lossless' if online['lossless'] else 'NOT the greedy output'}, {same}"


def require_tree_consistent(summary: dict[str, Any]) -> None:
    """Refuse a `--check-consistency --tree` summary whose tree loop and offline walk differ."""
    for row in (summary.get("trees") or {}).get("budgets", []):
        online = row.get("online")
        if online and not (online["identical"] and online["lossless"]):
            raise FlashdraftError(
                f"--tree budget {row['budget']}: the tree loop's output is "
                f"{'' if online['lossless'] else 'not '}the target's greedy output and its acceptance lengths "
                f"differ from the offline walk on records {online['mismatches']}"
            )
