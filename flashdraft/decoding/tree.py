"""Draft trees: a tree of drafts built from one drafter forward, verified in one target forward under an
ancestor-only mask (greedy), its accepted path's cache kept and the rest dropped.

One DFlash-family forward gives a distribution at every draft position of the block. Chain verification uses its
argmax path; a tree spends the same forward on branches, built by one of the servers' rules (`TreeRule`):

- "ddtree": DDTree (Ringel & Romano, arXiv 2604.12989; vLLM PR #42910 `ddtree.py` `build_ddtree_tree`): a
  best-first heap over the per-position top-k (k = the budget) by cumulative log-probability; each popped node
  pushes its next sibling (same parent, next rank) and its first child (next depth, rank 0); `budget` nodes.
- "topk": SGLang PR #31069 (DFlash EAGLE-style tree): per depth every frontier node is expanded to the `width` best
  tokens of that position, cumulative log-probabilities; the `width` best expansions are the next frontier; the
  `budget` best of all expansions (every depth) are verified.
- "beam": SGLang PR #36196 (DFlash2 selector beam tree, greedy only): the DFlash2 candidate selector scores each
  top-K candidate given its predecessor; a beam of `width` per depth by cumulative selector log-probability; the
  `budget` best beam nodes by that score, ancestors kept.

Cumulative log-probabilities never rise along a path, so taking the best nodes in (score, depth) order keeps every
node's ancestors (ancestor closure). Width 1 ("topk", "beam") is the chain: the argmax path (DFlash) or the
selector's greedy walk (DFlash2). Under greedy verification the accepted path is the longest root path whose every
node is the target's argmax after its parent (`DraftTree.accepted_path`), so the offline walk over the target's
greedy completion (`evaluation.trees`) gives exactly what this loop commits.

Device-to-host reads (`decoding.host_transfers`, counted in `GenerationResult.host_transfers`): a step reads the
device at most twice, whatever the rule: once for the tree's ranked tokens ("ddtree", "topk": the per-position
top-k log-probabilities and tokens together; "beam": every depth's beam, built on the device, together) and once
for the target's argmax after every node ([N + 1]), from which the host walks the accepted path and its bonus token.
Host-to-device copies (on CUDA a copy from pageable memory waits for all queued work, as a read does): one per step,
`tree_on_device`'s [4, N + 1] of the tree's tokens, parents, depths and first-child flags (pinned, not waiting, on
CUDA); the positions (anchor + depth), the ancestor mask and the accepted path's index are built from it on the
device, as are a Gated DeltaNet layer's (`tree_block_forward`) node indices.

With `SpeculativeConfig(compile=True)` the tree is verified on the target's static cache (`decoding.static_tree`):
padded to the budget, one compiled verify and one compiled commit of the accepted path a step, the same tokens, the
same reads and copy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from flashdraft.decoding.generate import GenerationResult, SpeculativeConfig
from flashdraft.decoding.host_transfers import TRANSFERS, to_host
from flashdraft.decoding.proposers import DFlashProposer, Proposer, as_proposer, default_block_size
from flashdraft.decoding.static_proposer import draft_counts
from flashdraft.decoding.static_tree import StaticTreeVerifier, static_tree_verifier
from flashdraft.decoding.tree_nodes import DEPTHS, PARENTS, TOKENS, ancestor_mask, path_on_device
from flashdraft.decoding.verification import check_static, compiled_drafting, max_drafts, resolve_compile
from flashdraft.drafter.families import family_of
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.errors import FlashdraftError
from flashdraft.target.linear_attention import TreeNodes
from flashdraft.target.model import TargetModel, TargetOutput, decoding_attention
from flashdraft.target.static_cache import CompileCounts, dynamo_totals

TREE_RULES = ("ddtree", "topk", "beam")
CHAIN_STEP = SpeculativeConfig()  # the drafter's block, features as computed
DEFAULT_WIDTH = 4  # "topk" and "beam" when no width is given (SGLang's smallest fused top-k, 4)


@dataclass(frozen=True)
class TreeRule:
    """How a step's tree is built: `name` one of TREE_RULES, at most `budget` nodes beside the root, `width` nodes
    kept per depth ("topk", "beam"; None: DEFAULT_WIDTH; "ddtree" has none: its heap ranks the top `budget`)."""

    name: str
    budget: int
    width: int | None = None

    def __post_init__(self) -> None:
        if self.name not in TREE_RULES:
            raise FlashdraftError(f"--tree {self.name!r}: expected one of {', '.join(TREE_RULES)}")
        if self.budget < 1:
            raise FlashdraftError(f"--tree-budget {self.budget}: expected at least 1 node")
        if self.width is not None and (self.name == "ddtree" or self.width < 1):
            raise FlashdraftError(
                f"--tree-width {self.width}: expected a width >= 1 with --tree topk or beam (ddtree has no width: "
                f"its heap ranks the top `budget` tokens of every depth)"
            )

    @property
    def beam_width(self) -> int:
        return self.width or DEFAULT_WIDTH


@dataclass
class DraftTree:
    """Nodes 1..N drafted after the root (node 0, the anchor), each after its parent; a parent comes before its
    children. tokens [N], parents and depths [N + 1] (parents[0] = -1, depths[0] = 0)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    children: list[dict[int, int]] = field(default_factory=list)  # per node: token -> child node

    def __post_init__(self) -> None:
        self.children = [{} for _ in self.parents]
        for node in range(1, len(self.parents)):
            self.children[self.parents[node]].setdefault(self.tokens[node - 1], node)

    @property
    def size(self) -> int:
        """Nodes beside the root."""
        return len(self.tokens)

    def ancestors(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: row i sees column j when j is i or an ancestor of i."""
        seen = torch.zeros(self.size + 1, self.size + 1, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                seen[node] = seen[parent]
            seen[node, node] = True
        return seen

    def accepted_path(self, predicted: Callable[[int], int | None]) -> list[int]:
        """The nodes accepted, root first: from the root, while the target's token after the current node
        (`predicted(node)`; None: none) is one of its children, move to that child."""
        path = [0]
        while (token := predicted(path[-1])) is not None and token in self.children[path[-1]]:
            path.append(self.children[path[-1]][token])
        return path


def _root_only() -> DraftTree:
    return DraftTree([], [-1], [0])


def _ranked(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The k best log-probabilities [k_pos][k] and their tokens of logits [k_pos, V] on the host, in one read, ties
    in token order (the first of equal values first, as an argmax takes it)."""
    logp = torch.log_softmax(logits.float(), -1)
    values, tokens = logp.sort(dim=-1, descending=True, stable=True)
    # one read: float64 holds the float32 values and every token id exactly
    values, tokens = to_host(torch.stack((values[..., :k].double(), tokens[..., :k].double())))
    return values, [[int(token) for token in row] for row in tokens]


def ddtree(logits: torch.Tensor, budget: int) -> DraftTree:
    """DDTree's best-first heap (vLLM #42910 `build_ddtree_tree`) over logits [k, V] at the k draft positions:
    entries (-cumulative log-probability, ranks along the path, parent, depth, rank); `budget` pops."""
    if logits.shape[0] == 0:
        return _root_only()
    top = min(budget, logits.shape[-1])
    logp, ids = _ranked(logits, top)
    tokens, parents, depths = [], [-1], [0]
    heap = [(-logp[0][0], (0,), 0, 1, 0)]
    while heap and len(tokens) < budget:
        neg, ranks, parent, depth, rank = heapq.heappop(heap)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        node = len(tokens)
        if rank + 1 < top:  # the next sibling: same parent, next rank at this depth
            sibling = neg + logp[depth - 1][rank] - logp[depth - 1][rank + 1]
            heapq.heappush(heap, (sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < len(logp):  # the first child: one depth further, rank 0
            heapq.heappush(heap, (neg - logp[depth][0], ranks + (0,), node, depth + 1, 0))
    return DraftTree(tokens, parents, depths)


@dataclass(frozen=True)
class _Candidate:
    score: float  # cumulative log-probability
    token: int
    parent: int  # index among the candidates; -1: the root
    depth: int


def _best_closed(candidates: list[_Candidate], budget: int) -> DraftTree:
    """The `budget` best candidates by (score, depth, order) as a tree. A child never scores above its parent and
    comes at a greater depth, so each chosen node's parent is chosen before it."""
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i].score, candidates[i].depth, i))[:budget]
    node_of = {-1: 0}
    tokens, parents, depths = [], [-1], [0]
    for i in order:
        c = candidates[i]
        node_of[i] = len(tokens) + 1
        tokens.append(c.token)
        parents.append(node_of[c.parent])
        depths.append(c.depth)
    return DraftTree(tokens, parents, depths)


def topk_tree(logits: torch.Tensor, budget: int, width: int) -> DraftTree:
    """SGLang #31069's EAGLE-style expand + top-k over logits [k, V]: each depth's frontier (the `width` best
    expansions of the depth before) expanded by that position's `width` best tokens; the `budget` best of all."""
    if logits.shape[0] == 0:
        return _root_only()
    logp, ids = _ranked(logits, min(width, logits.shape[-1]))
    candidates: list[_Candidate] = []
    frontier = [-1]  # candidate indices expanded at the next depth (the root first)
    for depth in range(1, len(logp) + 1):
        start = len(candidates)
        for parent in frontier:
            base = candidates[parent].score if parent >= 0 else 0.0
            for value, token in zip(logp[depth - 1], ids[depth - 1], strict=True):
                candidates.append(_Candidate(base + value, token, parent, depth))
        expanded = range(start, len(candidates))
        frontier = sorted(expanded, key=lambda i: (-candidates[i].score, i))[:width]
    return _best_closed(candidates, budget)


def beam_tree(selector, hidden: torch.Tensor, unary: torch.Tensor, anchor: int, budget: int, width: int) -> DraftTree:
    """SGLang #36196's DFlash2 beam tree: hidden [k, H] and unary logits [k, V] at the draft positions; at each depth
    every beam node p scores the position's top-K candidates c as unary(c) + < P[p] * W h, S[c] > (the selector's
    score, candidates in token order as its walk takes them), log-softmax over the K; the `width` best cumulative
    expansions are the depth's beam; the `budget` best beam nodes of all depths are verified. The beams are built on
    the device and read in one read."""
    if unary.shape[0] == 0:
        return _root_only()
    device = unary.device
    unary_top, candidates = unary.float().topk(selector.top_k, dim=-1)  # [k, K]
    candidates, order = candidates.sort(-1)
    unary_top = unary_top.gather(-1, order)
    top_k = candidates.shape[-1]
    projected = selector.hidden_projection(hidden).float()  # [k, r]
    beam_tokens = torch.full((1,), anchor, dtype=torch.long, device=device)  # [W]: each beam node's token
    beam_scores = torch.zeros(1, dtype=torch.float64, device=device)  # [W]: cumulative log-probabilities
    beam_nodes = torch.full((1,), -1, dtype=torch.long, device=device)  # [W]: candidate indices (-1: the root)
    kept_rows, depths = [], []  # per depth: [3, W] (score, token, parent), and the depth of each node
    for t in range(unary.shape[0]):
        rows = projected[t].expand(len(beam_tokens), -1)  # [W, r]
        pair = selector.pair_scores(rows, beam_tokens, candidates[t].expand(len(beam_tokens), -1)).float()  # [W, K]
        logp = torch.log_softmax(unary_top[t] + pair, -1).double()  # [W, K]
        # parent-major, candidates in token order: a stable sort ranks ties as the selector's greedy walk's argmax
        expansions = (beam_scores[:, None] + logp).flatten()  # [W * K]
        kept = expansions.sort(descending=True, stable=True).indices[:width]  # [W']
        beam_scores, beam_tokens = expansions[kept], candidates[t][kept % top_k]
        kept_rows.append(torch.stack((beam_scores, beam_tokens.double(), beam_nodes[kept // top_k].double())))
        beam_nodes = len(depths) + torch.arange(len(kept), device=device)
        depths += [t + 1] * len(kept)
    scores, tokens, parents = to_host(torch.cat(kept_rows, 1))  # [3, M]: one read
    nodes = [
        _Candidate(score, int(token), int(parent), depth)
        for score, token, parent, depth in zip(scores, tokens, parents, depths, strict=True)
    ]
    return _best_closed(nodes, budget)


# -- building a step's tree from a proposer ----------------------------------------------------------------------


def check_tree_drafter(rule: TreeRule, drafter) -> None:
    """Refuse a drafter the rule does not apply to, in one line."""
    family = family_of(drafter)
    if not isinstance(drafter, DFlashDrafter) and not isinstance(drafter, DFlashProposer) and family is None:
        if rule.name == "beam":
            raise FlashdraftError("--tree beam: a DFlash2 drafter's candidate selector builds the beam; none given")
        return  # a plain proposer (tests, baselines): its rows are the per-position distributions
    if family == "dspark":
        raise FlashdraftError(
            "--tree: a DSpark drafter's Markov head makes each draft's distribution depend on the draft before it, "
            "so it has no per-position distributions to branch on, and no server builds a tree for it; expected a "
            "DFlash or DFlash2 drafter"
        )
    if rule.name == "beam" and family != "dflash2":
        raise FlashdraftError(
            f"--tree beam: SGLang #36196's beam tree is built by a DFlash2 drafter's candidate selector; this "
            f"drafter is {family}: expected --tree ddtree or topk"
        )


def build_tree(rule: TreeRule, proposer: Proposer, rows: torch.Tensor, j: int, anchor: int) -> DraftTree:
    """The tree of block j of the proposer's last call (rows [k, V]: its proposal). A DFlash-family proposer's trees
    are built from the drafter's own logits at the draft positions (DFlash2: the selector's unary logits, and "beam"
    its selector scores); another proposer's from its rows."""
    inputs = getattr(getattr(proposer, "inner", proposer), "block_distributions", None)
    hidden, logits = inputs(j) if inputs is not None else (None, rows)
    if rule.name == "ddtree":
        return ddtree(logits, rule.budget)
    if rule.name == "topk":
        return topk_tree(logits, rule.budget, rule.beam_width)
    selector = getattr(proposer, "inner", proposer).drafter.candidate_selector
    return beam_tree(selector, hidden, logits, anchor, rule.budget, rule.beam_width)


# -- verifying a tree in one target forward --------------------------------------------------------------------


def _unable_layers(target: TargetModel) -> list[int]:
    """The recurrent layers that cannot run a tree's nodes each along its root path."""
    return [i for i, mixer in target.linear_mixers.items() if not hasattr(mixer, "tree_parents")]


def tree_verifiable(target: TargetModel) -> bool:
    return not _unable_layers(target)


def check_tree_target(target: TargetModel) -> None:
    """Refuse a target whose layers cannot verify a tree in one forward, in one line."""
    unable = _unable_layers(target)
    if unable:
        raise FlashdraftError(
            f"{target.path or 'the target'}: tree verification is refused on its recurrent layers {unable} "
            f"({target.linear_backend} backend): only flashdraft's torch Gated DeltaNet runs a recurrence along each "
            f"node's root path; Mamba-2 mixers and fla's kernels run it through every branch in node order"
        )


def tree_on_device(tree: DraftTree, tokens: list[int], device: torch.device, length: int | None = None) -> torch.Tensor:
    """[4, T] int64 on `device` (T = N + 1, or `length` when given: the static verify's fixed node count), in one
    copy from the host: the forward's tokens ([anchor, nodes]), parents (-1: the root), depths, and 1 where a node is
    the first child of its parent with its token (the child `accepted_path` follows). Padding nodes are the anchor's
    token as children of the root that no path follows (first 0). On CUDA from pinned memory without waiting: a
    pageable copy waits for all queued work, as a read does."""
    first = [0] + [
        int(tree.children[parent][token] == node)
        for node, (parent, token) in enumerate(zip(tree.parents[1:], tree.tokens, strict=True), start=1)
    ]
    pad = (length or len(tokens)) - len(tokens)
    if pad < 0:
        raise FlashdraftError(f"a draft tree of {len(tokens)} nodes; the static tree verify holds {length}")
    rows = [tokens + tokens[:1] * pad, tree.parents + [0] * pad, tree.depths + [1] * pad, first + [0] * pad]
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(rows, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)


def tree_attention_mask(
    target: TargetModel, past: int, nodes: torch.Tensor, max_depth: int
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask [1, 1, N + 1, keys] of a tree forward after `past` cached tokens, built on the device from
    the tree's `nodes` (`tree_on_device`): each node sees the past and its ancestors (itself included); a
    sliding-window layer (window W) sees a key only when its position is within W of the node's (node position =
    past + depth), of its past only the W - 1 it keeps. A dict by layer kind where the target has sliding or
    recurrent layers (transformers takes a prepared mask per kind), else the one mask."""
    dtype, device = target.dtype, nodes.device
    seen = ancestor_mask(nodes, max_depth)  # [T, T]
    t = seen.shape[0]
    depths = nodes[DEPTHS]
    full = torch.cat([torch.ones(t, past, dtype=torch.bool, device=device), seen], 1)
    masks: dict[str, torch.Tensor | None] = {"full_attention": full}
    window = getattr(target.config, "sliding_window", None)
    if "sliding_attention" in target.layer_types and window:
        kept = min(past, window - 1)
        key_positions = torch.cat([torch.arange(past - kept, past, device=device), past + depths])  # [kept + T]
        near = (past + depths)[:, None] - key_positions[None, :] < window
        masks["sliding_attention"] = torch.cat([torch.ones(t, kept, dtype=torch.bool, device=device), seen], 1) & near
    additive = {
        kind: torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)[None, None]
        for kind, mask in masks.items()
    }
    if target.linear_layers:  # recurrent layers take no mask: their tree is `tree_parents`
        additive["linear_attention"] = None
    return additive if len(additive) > 1 else additive["full_attention"]


def tree_forward(target: TargetModel, cache, nodes: torch.Tensor, tree: DraftTree, anchor_pos: int) -> TargetOutput:
    """The target's one forward over [anchor, nodes] (`nodes`: `tree_on_device`) after the cache: node positions
    anchor + depth, the ancestor-only mask, recurrent layers along each node's root path (`tree_parents`)."""
    mask = tree_attention_mask(target, cache.length, nodes, max(tree.depths))
    for mixer in target.linear_mixers.values():
        mixer.tree_parents = TreeNodes(nodes[PARENTS], nodes[DEPTHS], max(tree.depths))
    try:
        return target.forward(
            nodes[TOKENS][None], cache, position_ids=anchor_pos + nodes[DEPTHS][None], attention_mask=mask
        )
    finally:
        for mixer in target.linear_mixers.values():
            mixer.tree_parents = None


def keep_path(target: TargetModel, cache, path: torch.Tensor, tree_tokens: int) -> None:
    """Keep only the accepted path's nodes (`path` [P] on the device) of the last forward (a tree of `tree_tokens`
    nodes with its root) in the cache: their keys and values (recurrent layers: their inputs) moved to the front of
    the block, then the rest cut as a rollback cuts (recurrent layers: their states before the forward, the path
    re-run)."""
    kept = path.shape[0]
    for i, layer in enumerate(getattr(cache.kv, "layers", [])):
        if i in target.linear_mixers:
            inputs = cache.linear_inputs[i]  # [1, tree_tokens, hidden]
            inputs[:, :kept] = inputs[:, path]
            continue
        keys, values = layer.keys, layer.values
        start = keys.shape[-2] - tree_tokens  # a sliding layer keeps fewer past tokens than a full one
        keys[..., start : start + kept, :] = keys[..., start + path, :]
        values[..., start : start + kept, :] = values[..., start + path, :]
    mode, target.rollback_mode = target.rollback_mode, "recompute"  # "deferred" would re-feed the tree's order
    try:
        target.rollback(cache, kept)
    finally:
        target.rollback_mode = mode


class EagerTreeVerification:
    """The reference: the tree's forward on the target's growing cache (`tree_forward`), the accepted path kept by
    `keep_path`."""

    static = False

    def __init__(self, target: TargetModel, cache) -> None:
        self.target, self.cache, self.counts = target, cache, CompileCounts()

    def verify(self, tree: DraftTree, tokens: list[int], anchor_pos: int) -> tuple[TargetOutput, torch.Tensor]:
        """(the forward over [anchor, nodes], the target's argmax after each node [N + 1] on the device)."""
        self.tree, self.nodes = tree, tree_on_device(tree, tokens, self.target.device)  # the step's one copy
        self.verified = tree_forward(self.target, self.cache, self.nodes, tree, anchor_pos)
        self.predicted = self.verified.logits[0].argmax(-1)
        return self.verified, self.predicted

    def path(self, length: int) -> torch.Tensor:
        """The accepted path's nodes [length] on the device."""
        self.kept = path_on_device(self.nodes, self.predicted, length, max(self.tree.depths))
        return self.kept

    def commit(self) -> None:
        keep_path(self.target, self.cache, self.kept, self.tree.size + 1)


class StaticTreeVerification:
    """The static path (`decoding.static_tree`): the tree padded to the verifier's node count, one compiled verify and
    one compiled commit a step, the accepted path chosen and kept on the device."""

    static = True

    def __init__(self, verifier: StaticTreeVerifier) -> None:
        self.verifier = verifier

    @property
    def counts(self) -> CompileCounts:
        return self.verifier.counts

    def verify(self, tree: DraftTree, tokens: list[int], anchor_pos: int) -> tuple[TargetOutput, torch.Tensor]:
        nodes = tree_on_device(tree, tokens, self.verifier.target.device, self.verifier.verify_length)  # [4, T]
        self.verdict = self.verifier.verify_tree(nodes)
        return self.verdict.output, self.verdict.predicted

    def path(self, length: int) -> torch.Tensor:
        return self.verdict.order[:length]

    def commit(self) -> None:
        self.verifier.commit_tree(self.verdict)


def tree_verification_for(
    target: TargetModel, cache, rule: TreeRule, depth: int, tokens: int, speculative: SpeculativeConfig
) -> EagerTreeVerification | StaticTreeVerification:
    """The tree verification a generation of at most `tokens` positions uses after its prefill (`cache`): static
    when `speculative.compile` (trees of the rule's budget, at most `depth` deep), else eager. A backend or a target
    without a static rule is refused in one line, as the chain's `verification_for` refuses it."""
    if not speculative.compile:
        return EagerTreeVerification(target, cache)
    check_static(target, speculative.compile_backend)
    nodes = rule.budget + 1
    verifier = static_tree_verifier(target, nodes, min(depth, rule.budget), tokens + nodes, speculative.compile_backend)
    verifier.start(cache, cache.length)
    return StaticTreeVerification(verifier)


@dataclass
class TreeGeneration(GenerationResult):
    """A tree-verified generation: also the nodes each step verified (besides the root)."""

    nodes_per_step: list[int] = field(default_factory=list)


def _committed(tokens: list[int], budget: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """New tokens cut at the budget or just after the first stop token (as chain decoding cuts them)."""
    cut = next((i + 1 for i, t in enumerate(tokens[:budget]) if t in stop_ids), None)
    return (tokens[:cut], True) if cut is not None else (tokens[:budget], False)


@torch.no_grad()
def tree_generate(
    target: TargetModel,
    drafter: DFlashDrafter | Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    rule: TreeRule,
    speculative: SpeculativeConfig = CHAIN_STEP,
) -> TreeGeneration:
    """Greedy speculative decoding with a draft tree per step: the drafter's one forward, the tree built by `rule`,
    one target forward over [anchor, nodes] with node positions anchor + depth under the ancestor-only mask, the
    longest root path the target's argmax follows plus its bonus token committed, the path's cache kept. Output
    equals plain greedy decoding; each step's committed count equals the offline tree walk's
    (`evaluation.trees`). A step reads the device at most twice (`host_transfers`; the module's docstring)."""
    check_tree_target(target)
    check_tree_drafter(rule, drafter)
    block = speculative.block_size or default_block_size(drafter)
    compile = resolve_compile(speculative.compile, target)
    positions = max(len(prompt_ids) + max_new_tokens, speculative.static_positions or 0)
    compiled = None  # the drafter in fixed shapes when the generation compiles
    if compile:
        compiled = compiled_drafting(drafter, speculative.compile_backend, positions + block + 1)
    proposer = as_proposer(drafter, target, rule=speculative.rule, compiled=compiled)
    target.set_context_layers(proposer.context_layer_ids)
    speculative = replace(speculative, block_size=block, compile=compile, static_positions=positions)
    with decoding_attention(target.device):
        return _tree_steps(target, proposer, prompt_ids, max_new_tokens, rule, speculative)


def _tree_steps(
    target: TargetModel,
    proposer: Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    rule: TreeRule,
    speculative: SpeculativeConfig,
) -> TreeGeneration:
    """The prefill and the steps of `tree_generate` (the proposer made, `speculative`'s block and compile resolved)."""
    stop_ids, device, block = set(target.stop_token_ids), target.device, speculative.block_size
    cache = target.new_cache()
    prefill = target.forward(torch.tensor([prompt_ids], device=device), cache)
    depth = max_drafts(proposer, block)  # the deepest a tree can be: one node per draft position
    verification = tree_verification_for(target, cache, rule, depth, speculative.static_positions, speculative)
    counts_before, graphs_before = replace(verification.counts), dynamo_totals()
    result = TreeGeneration([to_host(prefill.logits_at(-1, None)[0, 0].argmax())], static=verification.static)
    if result.output_ids[0] in stop_ids:
        result.stop_reason = "eos"
        return result
    new_context = _rounded(prefill.context_features, speculative.round_context_to)
    # the drafter's positions as served: the token index, or M-RoPE's row 0 beside images (`target.vision`)
    new_positions = target.drafter_positions(torch.arange(len(prompt_ids), device=device)[None], cache)
    shift = target.drafter_position_shift(cache)
    anchor_pos, reads_before = len(prompt_ids), TRANSFERS.reads
    while len(result.output_ids) < max_new_tokens:
        tokens = prompt_ids + result.output_ids
        rows = proposer.propose(tokens, anchor_pos + shift, new_context, new_positions, block)  # [k, V]
        tree = build_tree(rule, proposer, rows, 0, tokens[-1])
        verified, argmax = verification.verify(tree, tokens[-1:] + tree.tokens, anchor_pos)  # argmax [N + 1 or T]
        predicted = to_host(argmax)  # the target's token after each node
        path = tree.accepted_path(predicted.__getitem__)
        budget = max_new_tokens - len(result.output_ids)
        committed, stopped = _committed(
            [tree.tokens[n - 1] for n in path[1:]] + [predicted[path[-1]]], budget, stop_ids
        )
        result.output_ids += committed
        result.acceptance_lengths.append(len(committed))
        result.nodes_per_step.append(tree.size)
        if stopped:
            result.stop_reason = "eos"
            break
        kept = verification.path(len(path))  # [P] on the device
        features = verified.context_features  # gathered before the commit (the next graph may reuse its memory)
        new_context = _rounded(features[:, kept] if features is not None else None, speculative.round_context_to)
        verification.commit()
        new_positions = anchor_pos + shift + torch.arange(len(path), device=device)[None]
        anchor_pos += len(path)
    result.host_transfers = TRANSFERS.reads - reads_before
    _count_compiles(result, verification.counts, counts_before, graphs_before, draft_counts(proposer))
    return result


def _count_compiles(
    result: TreeGeneration, counts: CompileCounts, before: CompileCounts, graphs_before, drafted: CompileCounts
) -> None:
    """What torch.compile did during the generation, as the chain reports it: graphs compiled (the verify's and the
    commit's, the drafter's), of them the drafter's, recompiles after warm-up, graph breaks, compile seconds."""
    graphs = dynamo_totals()
    result.compiles, result.graph_breaks = graphs[0] - graphs_before[0], graphs[1] - graphs_before[1]
    result.draft_compiles = drafted.compiles
    result.recompiles = counts.recompiles - before.recompiles + drafted.recompiles
    result.compile_seconds = counts.compile_seconds - before.compile_seconds + drafted.compile_seconds


def _rounded(features: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`features` as a cache in `dtype` stores them (cast and back), or as computed."""
    return features if features is None or dtype is None else features.to(dtype).to(features.dtype)
