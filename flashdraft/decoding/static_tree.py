"""A draft tree's verify on the target's static cache (`flashdraft.target.static_cache`): every step the same shapes,
so it compiles once (`torch.compile(fullgraph=True, dynamic=False)`; on CUDA a CUDA graph) whatever the tree.

The eager tree verify (`decoding.tree.tree_forward`, `keep_path`) runs [anchor, nodes] on a growing cache and keeps
the accepted path by cropping and re-running. Here, as vLLM's and SGLang's static tree verifies do it:

- the tree is padded to T = budget + 1 nodes (`tree_on_device(length=T)`: padding nodes are children of the root
  that no path follows), its parents and depths copied into fixed buffers in the graph;
- node i's K/V is written at buffer row `position + i` (its rotary position is `position + depth_i`): a node sees the
  committed rows and the rows of its ancestors (`tree_nodes.ancestor_mask`, built in the graph with the depth bound),
  on a sliding layer those whose rotary position is within the window of its own;
- a Gated DeltaNet layer keeps the state after every node in that node's slot and the nodes' conv inputs after the K
  before them (`static_cache.gated_deltanet_tree_static_forward`; the tree loop refuses Mamba-2 targets eagerly, and so
  here);
- the graph also returns the target's argmax after each node and every node in accepted-path-first order with the
  path's length (`tree_nodes.accepted_order`), so the commit needs nothing from the host: a second graph of fixed
  shapes moves the path's K/V rows to `position .. position + P - 1` and its recurrent slots and conv columns to the
  front, selects slot P - 1, and advances the position by P.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdraft.decoding.tree_nodes import DEPTHS, PARENTS, TOKENS, accepted_order, ancestor_mask
from flashdraft.target.linear_attention import TreeNodes
from flashdraft.target.model import TargetModel, TargetOutput
from flashdraft.target.static_cache import (
    PositionedKVLayer,
    StaticVerifier,
    _static_address,
    capacity_for,
    compile_step,
)


@dataclass
class TreeVerdict:
    """One static tree verify: the target's forward over the padded nodes (`output`, rows [1, T, ..]), its argmax
    after each node (`predicted` [T]), every node in accepted-path-first order (`order` [T]) and the path's length
    (`length` [] int64), all on the device."""

    output: TargetOutput
    predicted: torch.Tensor
    order: torch.Tensor
    length: torch.Tensor


@dataclass
class StaticTreeVerifier(StaticVerifier):
    """The target's verify of a draft tree padded to `verify_length` nodes (the root and the tree budget) whose nodes
    are at most `max_depth` deep, on a `StaticTargetCache` of `capacity` positions, compiled with `backend` (as
    `StaticVerifier`); two graphs: the verify and the commit."""

    max_depth: int = 1
    _commit_step: object = field(init=False, default=None)

    def __post_init__(self) -> None:
        super().__post_init__()
        t, device = self.verify_length, self.target.device
        parents = _static_address(torch.zeros(t, dtype=torch.long, device=device))
        depths = _static_address(torch.zeros(t, dtype=torch.long, device=device))
        self.cache.tree = TreeNodes(parents, depths, self.max_depth)
        self._commit_step = self._commit
        if self.backend is not None:
            self._commit_step = compile_step(self._commit, self.backend, self._mode)

    def _tree_masks(self, nodes: torch.Tensor, positions: torch.Tensor):
        """The additive masks [1, 1, T, L] of the nodes at rotary `positions` [T]: the committed rows (before
        `position`) and the rows of the node's ancestors (`position + j`); on sliding layers only keys whose rotary
        position is within the window of the node's."""
        t, position = self.verify_length, self.cache.position
        rows = self._key_positions  # [L]: buffer rows
        seen = ancestor_mask(nodes, self.max_depth)  # [T, T]
        in_tree = (rows >= position) & (rows < position + t)  # [L]
        node_of_row = (rows - position).clamp(0, t - 1)  # [L]
        visible = (rows < position)[None, :] | (seen[:, node_of_row] & in_tree[None, :])  # [T, L]
        sliding = None
        if self._window and "sliding_attention" in self.target.layer_types:
            key_positions = torch.where(in_tree, position + nodes[DEPTHS][node_of_row], rows)  # [L]: rotary
            sliding = visible & (positions[:, None] - key_positions[None, :] < self._window)
        return self.additive(visible, sliding)

    def _forward(self, nodes: torch.Tensor):
        """nodes [4, T] (`tree_on_device`) -> (logits [1, T, V], hidden [1, T, H], features [1, T, n * H] or None,
        the argmax after each node [T], the accepted-path-first order [T], the path's length [])."""
        cache = self.cache
        cache.write_positions.copy_(cache.position + self._offsets)  # node i at row position + i
        cache.tree.parents.copy_(nodes[PARENTS])
        cache.tree.depths.copy_(nodes[DEPTHS])
        positions = cache.position + nodes[DEPTHS]  # [T]: rotary positions
        logits, hidden, features = self._decode(nodes[TOKENS][None], positions, self._tree_masks(nodes, positions))
        predicted = logits[0].argmax(-1)  # [T]
        order, length = accepted_order(nodes, predicted, self.max_depth)
        return logits, hidden, features, predicted, order, length

    def _commit(self, order: torch.Tensor, length: torch.Tensor) -> None:
        """Keep the accepted path (`order`'s first `length` nodes): its K/V rows moved to the rows after the committed
        ones, its recurrent slots and conv columns to the front; the position advances by `length`."""
        cache = self.cache
        rows = cache.position + self._offsets  # [T]: the tree's rows
        sources = cache.position + order  # [T]: the path's rows first
        for layer in cache.layers:
            if isinstance(layer, PositionedKVLayer) and layer.is_initialized:
                layer.keys.index_copy_(2, rows, layer.keys.index_select(2, sources))
                layer.values.index_copy_(2, rows, layer.values.index_select(2, sources))
        for slots in cache.recurrent.values():
            kernel = slots.window.shape[-1] - self.verify_length
            slots.states.copy_(slots.states.index_select(0, order))
            slots.window[..., kernel:] = slots.window[..., kernel:].index_select(-1, order)
        cache.commit(length - 1)  # slot P - 1 (the path's last node, now in front); the position advances by P

    @torch.no_grad()
    def verify_tree(self, nodes: torch.Tensor) -> TreeVerdict:
        """The target over the padded tree `nodes` [4, verify_length] at the committed position (commit next)."""
        if nodes.shape != (4, self.verify_length):
            raise ValueError(f"static tree verify of {tuple(nodes.shape)} nodes, expected (4, {self.verify_length})")
        logits, hidden, features, predicted, order, length = self.counted(self._step, nodes, graphs_per_warm_up=2)
        return TreeVerdict(
            TargetOutput(hidden, features, self.target.target_logits, _logits=logits), predicted, order, length
        )

    @torch.no_grad()
    def commit_tree(self, verdict: TreeVerdict) -> None:
        """Keep the verdict's accepted path (on the device: nothing read)."""
        self.counted(self._commit_step, verdict.order, verdict.length, graphs_per_warm_up=2, new_step=False)


def static_tree_verifier(
    target: TargetModel, nodes: int, max_depth: int, tokens: int, backend: str | None
) -> StaticTreeVerifier:
    """The target's tree verifier for trees of `nodes` (the root included) at most `max_depth` deep, made once and kept
    on the target (as `static_cache.static_verifier`); a larger one replaces it when `tokens` do not fit. One per set
    of context layers too: the features its graph returns are theirs."""
    verifiers = target.__dict__.setdefault("_static_tree_verifiers", {})
    key = (nodes, max_depth, backend, target.device, target.dtype, tuple(target._context_layer_ids))
    verifier = verifiers.get(key)
    if verifier is None or verifier.capacity < tokens:
        verifier = StaticTreeVerifier(target, nodes, capacity_for(tokens), backend, max_depth=max_depth)
        verifiers[key] = verifier
    return verifier
