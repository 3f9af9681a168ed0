"""Draft trees: how a tree of drafted tokens is laid out, in one place.

A tree of n drafted tokens is given by `parents`: node i's parent index among the
nodes, -1 for a child of the root (the last committed token), parents before their
children. Siblings keep the order given (a proposer puts its preferred candidate
first). A chain is the tree whose node i has parent i - 1.

The verify pass feeds the root together with the nodes, so its segment has n + 1 rows:
row 0 is the root and row i + 1 node i (`with_root`, `path_rows`).

This module sits below everything that handles trees (proposers' `Draft`, the
decoder's tree pass, rejection's tree walk, the scheduler) and imports nothing of
speculant's.
"""

from __future__ import annotations

from collections.abc import Sequence


def tree_depths(parents: Sequence[int], n: int | None = None) -> list[int]:
    """Depth of every node (0 for children of the root), validating the layout: every
    parent comes before its child, and, when `n` is given, there is one parent per node."""
    if n is not None and len(parents) != n:
        raise ValueError(f"{len(parents)} parents for {n} tree nodes")
    depth: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come first")
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    return depth


def check_parents(parents: Sequence[int], n: int | None = None) -> None:
    """Raise ValueError unless `parents` is a valid tree layout (of `n` nodes if given)."""
    tree_depths(parents, n)


def tree_depth(parents: Sequence[int]) -> int:
    """Tokens on the longest root-to-leaf path (0 for an empty tree)."""
    return max(tree_depths(parents), default=-1) + 1


def chain_parents(n: int) -> list[int]:
    """The layout of a chain of n nodes: each follows the one before."""
    return list(range(-1, n - 1))


def children(parents: Sequence[int], n: int | None = None) -> list[list[int]]:
    """Each row's child nodes, by verify row (row 0 the root, row i + 1 node i), in the
    order given; validates the layout."""
    check_parents(parents, n)
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf paths of a tree (one per leaf, in node order), each a chain of
    node indices; a tree with several roots (-1 parents) is a forest of chains."""
    check_parents(parents)
    has_child = [False] * len(parents)
    for parent in parents:
        if parent >= 0:
            has_child[parent] = True
    paths = []
    for leaf in (i for i, c in enumerate(has_child) if not c):
        path = []
        node = leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def with_root(parents: Sequence[int]) -> list[int]:
    """The verify segment's layout: the root at row 0 (parent -1), then the nodes, each
    parent shifted by one row."""
    return [-1, *[p + 1 for p in parents]]


def path_rows(path: Sequence[int]) -> list[int]:
    """The verify rows of an accepted path (node indices, root to leaf), root first: the
    rows whose keys and values the cache keeps, and whose logits scored each emitted
    token."""
    return [0, *[j + 1 for j in path]]
