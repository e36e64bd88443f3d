"""Tune the hybrid proposer's rule offline: sweep `HybridRule` on one record set, report the
best on another, with DFlash and n-gram prompt lookup side by side on the same tokens.

    .venv/bin/python benchmarks/hybrid.py --checkpoint RUN_OR_DRAFTER --tune SET --report SET
        [--num-records N] [--max-ngram 3 ...] [--threads 1]

A SET is a hidden-state cache directory (no target forward) or a completions file (one
target forward per record for its context features). Per record, the drafter drafts every
anchor of the completion once (batched, as the offline walk does) and the n-gram lookup runs
at every anchor; a rule's walk then only reads these tables, so a sweep costs seconds. The
decisions are `HybridRule`'s own, on the same inputs as `HybridProposer`; a last check walks
the chosen rule with the real proposer on the report set and requires the same lengths.

Prints JSON lines: one per rule on the tuning set, then per set the chosen rule's τ next to
τ(DFlash), τ(n-gram), their ratio tau(hybrid) / max(...), the share of steps per branch, and
"tau_oracle": a walk that takes, each step, whichever draft commits more (a ceiling for
rules that choose one of the two drafts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from dataclasses import dataclass

import torch

from flashdraft.decoding.acceptance import committed_length, tau_of
from flashdraft.decoding.hybrid import BRANCHES, HybridDrafter, HybridRule
from flashdraft.decoding.ngram import NGramProposer, lookup_match
from flashdraft.decoding.proposers import DFlashProposer
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.run_dir import load_any_drafter
from flashdraft.evaluation.offline import offline_acceptance_lengths
from flashdraft.evaluation.records import EvalRecord, FeatureSource, invalid_reason, load_eval_records
from flashdraft.target.model import TargetModel

NEVER = 10**6  # a min_match no lookup reaches
NO_DRAFT = -1  # no token: without a match prompt lookup proposes nothing, so the step commits the bonus only


@dataclass
class AnchorTable:
    """What every rule needs at each anchor i of one completion (A = M - 1 anchors, k = B - 1)."""

    completion: torch.Tensor  # [M]
    dflash_draft: torch.Tensor  # [A, k] the drafter's argmax
    q_dflash: torch.Tensor  # [A, k] its probability
    ngram_draft: dict[int, torch.Tensor]  # max_ngram -> [A, k] prompt lookup's draft (without match: NO_DRAFT)
    match_length: dict[int, list[int]]  # max_ngram -> [A] matched suffix length, 0 without a match
    q_ngram: dict[int, torch.Tensor]  # max_ngram -> [A, k] the drafter's probability of the n-gram tokens


@torch.no_grad()
def anchor_table(
    drafter: DFlashDrafter, target: TargetModel, record: EvalRecord, features: torch.Tensor, max_ngrams: list[int]
) -> AnchorTable:
    block = drafter.config.block_size
    p, m = len(record.prompt_ids), len(record.completion_ids)
    proposer = DFlashProposer(drafter, target)
    per_call = proposer.anchors_per_call(block)
    probs = []  # per anchor [k, V]
    for start in range(0, m - 1, per_call):
        anchors = list(range(start, min(start + per_call, m - 1)))
        fed, end = p + start - 1 if start else 0, p + anchors[-1]  # context strictly before the last anchor
        logits = proposer.propose_anchors(
            [record.completion_ids[a] for a in anchors],
            [p + a for a in anchors],
            features[None, fed:end],
            torch.arange(fed, end)[None],
            block,
        )
        probs += [torch.softmax(x.float(), -1) for x in logits]
    probs = torch.stack(probs)  # [A, k, V]
    q_dflash, dflash_draft = probs.max(-1)
    tokens = record.input_ids
    ngram_draft, match_length, q_ngram = {}, {}, {}
    for n in max_ngrams:
        drafts, lengths = [], []
        for i in range(m - 1):
            found = lookup_match(tokens[: p + i + 1], block - 1, n, 1)
            drafts.append(found[0] if found else [NO_DRAFT] * (block - 1))
            lengths.append(found[1] if found else 0)
        ngram_draft[n] = torch.tensor(drafts)
        match_length[n] = lengths
        q_ngram[n] = probs.gather(2, ngram_draft[n].clamp(min=0)[:, :, None])[:, :, 0]  # read only where matched
    return AnchorTable(torch.tensor(record.completion_ids), dflash_draft, q_dflash, ngram_draft, match_length, q_ngram)


def walk(t: AnchorTable, rule: HybridRule | None, max_ngram: int) -> tuple[list[int], dict[str, int]]:
    """The offline walk of one completion under `rule` (None: each step the draft committing more)."""
    counts = dict.fromkeys(BRANCHES, 0)
    lengths, i = [], 0
    while i < t.completion.shape[0] - 1:
        ngram, dflash = t.ngram_draft[max_ngram][i], t.dflash_draft[i]
        m = t.match_length[max_ngram][i]
        if rule is None:
            branch = (
                "ngram_lookup"
                if committed_length(ngram, t.completion, i) > committed_length(dflash, t.completion, i)
                else "dflash"
            )
        elif rule.ngram_outright(m):
            branch = "ngram_lookup"
        elif m > 0 and rule.prefers_ngram(t.q_ngram[max_ngram][i], t.q_dflash[i]):
            branch = "ngram_by_confidence"
        else:
            branch = "dflash"
        counts[branch] += 1
        lengths.append(committed_length(dflash if branch == "dflash" else ngram, t.completion, i))
        i += lengths[-1]
    return lengths, counts


def evaluate(tables: list[AnchorTable], rule: HybridRule | None, max_ngram: int) -> tuple[float, dict[str, float]]:
    """τ over all records' steps and the share of steps per branch."""
    lengths, counts = [], dict.fromkeys(BRANCHES, 0)
    for t in tables:
        one, c = walk(t, rule, max_ngram)
        lengths += one
        counts = {b: counts[b] + c[b] for b in BRANCHES}
    return tau_of(lengths), {b: round(c / len(lengths), 3) for b, c in counts.items()}


def load_set(target: TargetModel, source: str, num_records: int | None) -> list[EvalRecord]:
    kind = "cached_hidden_states" if not source.endswith(".json") else "completions"
    records, _ = load_eval_records(target, **{kind: source})
    records = [r for r in records if invalid_reason(r, target.vocab_size) is None]  # as eval skips them
    return records[:num_records] if num_records else records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="the DFlash drafter (directory or training run)")
    ap.add_argument("--target-model", default="tiny")
    ap.add_argument("--tune", required=True, help="cache directory or completions file the rule is chosen on")
    ap.add_argument("--report", required=True, help="cache directory or completions file it is reported on")
    ap.add_argument("--num-records", type=int, default=None, help="first N records of each set")
    ap.add_argument("--max-ngram", type=int, nargs="+", default=[3, 4, 6], help="longest n-gram lookups to sweep")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(args.target_model)
    loaded = load_any_drafter(args.checkpoint, target)
    drafter = loaded.drafter
    target.set_context_layers(drafter.config.target_layer_ids)
    features = FeatureSource(target)
    common = {
        "benchmark": "hybrid",
        "target": str(target.path),
        "drafter": str(loaded.path),
        "block_size": drafter.config.block_size,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
    }

    tables, records = {}, {}
    for role, source in (("tune", args.tune), ("report", args.report)):
        t0 = time.perf_counter()
        records[role] = load_set(target, source, args.num_records)
        tables[role] = [
            anchor_table(drafter, target, r, features(r, drafter.config.target_layer_ids), args.max_ngram)
            for r in records[role]
        ]
        print(
            json.dumps(
                {
                    **common,
                    "set": role,
                    "source": source,
                    "records": len(records[role]),
                    "table_seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )

    # the sweep: (max_ngram, min_match, ngram_prior) on the tuning set
    priors = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0]
    results = []
    for n in args.max_ngram:
        for min_match, prior in itertools.product(range(1, n + 2), priors):
            rule = HybridRule(min_match, prior)
            tau, shares = evaluate(tables["tune"], rule, n)
            results.append((tau, n, rule))
            print(
                json.dumps(
                    {
                        **common,
                        "set": "tune",
                        "max_ngram": n,
                        "min_match": min_match,
                        "ngram_prior": prior,
                        "tau": round(tau, 3),
                        "shares": shares,
                    }
                )
            )
    _, best_n, best = max(results, key=lambda x: x[0])

    for role in ("tune", "report"):
        tau_dflash, _ = evaluate(tables[role], HybridRule(NEVER, 0.0), best_n)
        tau_ngram, _ = evaluate(tables[role], HybridRule(0, 0.0), best_n)
        tau_ngram_3, _ = evaluate(tables[role], HybridRule(0, 0.0), 3) if 3 in args.max_ngram else (None, None)
        tau, shares = evaluate(tables[role], best, best_n)
        tau_oracle, oracle_shares = evaluate(tables[role], None, best_n)
        print(
            json.dumps(
                {
                    **common,
                    "set": role,
                    "chosen": {"max_ngram": best_n, "min_match": best.min_match, "ngram_prior": best.ngram_prior},
                    "records": len(tables[role]),
                    "tau_dflash": round(tau_dflash, 3),
                    "tau_ngram": round(tau_ngram, 3),
                    "tau_ngram_max3": tau_ngram_3 and round(tau_ngram_3, 3),
                    "tau_hybrid": round(tau, 3),
                    "ratio": round(tau / max(tau_dflash, tau_ngram), 3),
                    "shares": shares,
                    "tau_oracle": round(tau_oracle, 3),
                    "oracle_shares": oracle_shares,
                }
            ),
            flush=True,
        )

    # the tables decide as the proposer does: walk the chosen rule with the real proposer
    hybrid = HybridDrafter(drafter, NGramProposer(target.vocab_size, best_n, 1), best)
    same = all(
        offline_acceptance_lengths(
            hybrid.new_proposer(target),
            r.prompt_ids,
            r.completion_ids,
            drafter.config.block_size,
            features(r, drafter.config.target_layer_ids),
        )
        == walk(t, best, best_n)[0]
        for r, t in zip(records["report"], tables["report"], strict=True)
    )
    print(json.dumps({**common, "set": "report", "proposer_walk_equals_table_walk": same}))


if __name__ == "__main__":
    main()
