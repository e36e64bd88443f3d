"""A draft tree's nodes on the device (`decoding.tree.tree_on_device`: [4, T] int64, rows TOKENS, PARENTS, DEPTHS,
FIRST) and what both tree verifies build from them there: the ancestor mask and the accepted path. The loops run a
given number of times (the tree's depth, or a bound on it: the same result), so the static tree verify
(`decoding.static_tree`) builds them inside its one graph."""

from __future__ import annotations

import torch

TOKENS, PARENTS, DEPTHS, FIRST = range(4)  # the rows of a tree on the device (`tree_on_device`)


def ancestor_mask(nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[T, T] bool on the device of `nodes`: row i sees column j when j is i or an ancestor of i
    (`DraftTree.ancestors`), built by following every node's parent `max_depth` times."""
    t = nodes.shape[1]
    parent = nodes[PARENTS].clamp(min=0)  # the root its own parent: it is every node's ancestor anyway
    rows = torch.arange(t, device=nodes.device)
    seen = torch.zeros(t, t, dtype=torch.bool, device=nodes.device)
    above = rows
    for _ in range(max_depth + 1):
        seen[rows, above] = True
        above = parent[above]
    return seen


def accepted_order(nodes: torch.Tensor, predicted: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(every node [T], the accepted path's nodes first, root first, then the rest in node order; the path's length
    [] int64), on the device, from the tree's `nodes` and the target's token after each node (`predicted` [T]): a
    node is on the path when it is the first child of its parent with the token the target predicts there, and so
    is its parent (`DraftTree.accepted_path`)."""
    parent = nodes[PARENTS].clamp(min=0)
    matches = (nodes[FIRST] == 1) & (nodes[TOKENS] == predicted[parent])
    matches[0] = True
    accepted = matches
    for _ in range(max_depth):
        accepted = matches & accepted[parent]
    # accepted nodes first, in node order (a parent before its child): the path root first
    return accepted.to(torch.uint8).sort(descending=True, stable=True).indices, accepted.sum()


def path_on_device(nodes: torch.Tensor, predicted: torch.Tensor, length: int, max_depth: int) -> torch.Tensor:
    """The accepted path's nodes [length], root first, on the device (`accepted_order`; the host knows the path's
    `length` from its own walk, so no read)."""
    return accepted_order(nodes, predicted, max_depth)[0][:length]
