"""Suffix decoding: draft what followed the same suffix before, with no model at all.

Two suffix tries over token ids, with occurrence counts at their nodes:

* a per-request trie over the request's prompt and its output so far, extended as the
  committed context grows (committed tokens are never rolled back);
* a global trie over the outputs (optionally the prompts too) of earlier requests served
  by this proposer object, a FIFO of whole requests capped at `max_tree_tokens` tokens.

Every suffix of every indexed sequence is inserted up to `max_depth` tokens, so a node's
count is the number of occurrences of its path. To keep the tries small, a path that
occurs once is not spelled out node by node: the node where it becomes unique (count 1,
a "tail head") keeps a reference into its sequence, and the tokens below it are read
from there. A node is materialised only when a second occurrence walks through it, so
the node count grows with repeated content, not with the sequence length.

Proposing: take the longest suffix of the context (at most max_depth - 1 tokens) seen
before with a continuation, then walk the most frequent continuation, multiplying the
empirical conditional probabilities count(child) / count(occurrences that continue),
until the product falls below `min_prob`, the walk ends, or k tokens are drafted.

Drafts are deterministic, so the proposer returns q_probs=None. That is still lossless:
q is a point mass on the drafted token x, and the engine's rule accepts x with
probability min(1, p(x) / 1) = p(x) and, on rejection, resamples from p with x removed
and renormalised, which is exactly max(0, p - q) normalised. Each emitted token is thus
distributed as p, whatever was drafted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from speculant.proposers.base import Draft, register
from speculant.sampling import SamplingParams

if TYPE_CHECKING:
    from speculant.models.model import Model

# Safety cap on materialised global-trie nodes, per token of max_tree_tokens. A node is
# a repeated substring of at most max_depth tokens (or the unique tail hanging off one),
# so ordinary text needs a few per token; only content that repeats in long runs needs
# more, and then the oldest requests are evicted early rather than memory growing.
NODES_PER_TOKEN = 8


class _Node:
    """One trie node: the path from the root to it is a token string of length `depth`.

    count: occurrences of the path (suffix start positions passing through it).
    cont: occurrences that continue into a materialised child (sum of child counts).
    children: materialised children by token, or None. A node with count 1 never has
        children: its single occurrence continues implicitly in `seq` from `end`.
    best: cached most frequent child (ties: the most recently counted), None = recompute.
    seq, end: an occurrence of the path ends just before seq[end]; for count >= 2 nodes
        it is the occurrence from the newest sequence (what eviction relies on).
    stamp: when the node was last counted (tie-break of `best`).
    """

    __slots__ = ("best", "children", "cont", "count", "depth", "end", "seq", "stamp", "tok")

    def __init__(self, tok: int, depth: int, seq: list[int], end: int, stamp: int) -> None:
        self.tok = tok
        self.depth = depth
        self.count = 1
        self.cont = 0
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None
        self.seq = seq
        self.end = end
        self.stamp = stamp


# A position in a trie: a node and how many tokens further down its implicit tail (only
# for count-1 nodes; 0 otherwise). Its depth is node.depth + extra.
Cursor = tuple[_Node, int]


class _Trie:
    """Suffix trie of bounded depth over one or more token sequences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, 0, [], 0, 0)
        self.root.count = 0  # never counted: the root is always materialised
        self.nodes = 0  # materialised nodes, root excluded
        self.stamp = 0

    # -- building -----------------------------------------------------------------------

    def extend(self, seq: list[int], actives: list[_Node], token: int) -> list[_Node]:
        """Append `token` to `seq` and count the suffixes ending at it.

        actives: the nodes (longest first) of the suffixes of seq that occur more than
        once, i.e. that still need explicit work; every other suffix lives in a tail and
        extends for free. Returns the new actives. O(len(actives)) <= O(max_depth).
        """
        seq.append(token)
        n = len(seq)
        self.stamp += 1
        stamp = self.stamp
        out: list[_Node] = []
        for node in (*actives, self.root):
            node.cont += 1
            children = node.children
            child = children.get(token) if children is not None else None
            if child is None:
                # First time this path is seen: a tail head; the suffix goes implicit.
                child = _Node(token, node.depth + 1, seq, n, stamp)
                if children is None:
                    node.children = {token: child}
                else:
                    children[token] = child
                self.nodes += 1
                self._touch(node, child)
                continue
            if child.count == 1:
                self._push_down(child)
            child.count += 1
            child.seq = seq
            child.end = n
            child.stamp = stamp
            self._touch(node, child)
            if child.depth < self.max_depth:
                out.append(child)
        return out

    def _push_down(self, node: _Node) -> None:
        """A second occurrence enters a tail head: materialise the first one's next token."""
        seq, end = node.seq, node.end
        if node.depth < self.max_depth and end < len(seq):
            child = _Node(seq[end], node.depth + 1, seq, end + 1, node.stamp)
            node.children = {child.tok: child}
            node.cont = 1
            node.best = child
            self.nodes += 1

    @staticmethod
    def _touch(node: _Node, child: _Node) -> None:
        """Keep node.best the max-count child, ties to the most recently counted."""
        best = node.best
        if best is not None and (best is child or child.count >= best.count):
            node.best = child

    def add(self, tokens: Sequence[int]) -> list[int]:
        """Index a whole sequence; returns the list the trie references (for `remove`)."""
        seq: list[int] = []
        actives: list[_Node] = []
        for token in tokens:
            actives = self.extend(seq, actives, int(token))
        return seq

    def remove(self, seq: list[int]) -> None:
        """Uncount every suffix of `seq`, which must be the oldest sequence indexed.

        A node left with count 1 becomes a tail head again: its remaining occurrence is
        the one it references, because references always point at the newest sequence
        through the node and every older one is gone (FIFO). If that reference is `seq`
        itself, the remaining occurrence is another of seq's, removed later in this loop.
        """
        depth = self.max_depth
        length = len(seq)
        for start in range(length):
            node = self.root
            for i in range(start, min(start + depth, length)):
                assert node.children is not None
                tok = seq[i]
                child = node.children[tok]
                node.cont -= 1
                child.count -= 1
                if node.best is child:
                    node.best = None  # maybe no longer the most frequent: recompute lazily
                if child.count == 0:
                    del node.children[tok]
                    if not node.children:
                        node.children = None
                    self.nodes -= 1
                    break
                if child.count == 1:
                    if child.children is not None:
                        self.nodes -= _subtree_size(child)
                        child.children = None
                        child.best = None
                        child.cont = 0
                    break
                node = child

    # -- reading ------------------------------------------------------------------------

    def _implicit(self, node: _Node, extra: int, tail: Sequence[int]) -> int | None:
        """The token after (node, extra) on a count-1 node's single occurrence.

        tail: tokens taken to follow the end of node.seq (the drafts so far, for the
        request's own trie: an occurrence that reaches the present runs on into them)."""
        if node.depth + extra >= self.max_depth:
            return None
        i = node.end + extra
        seq = node.seq
        if i < len(seq):
            return seq[i]
        i -= len(seq)
        return tail[i] if i < len(tail) else None

    def step(self, cur: Cursor, token: int, tail: Sequence[int] = ()) -> Cursor | None:
        node, extra = cur
        if node.count == 1:
            return (node, extra + 1) if self._implicit(node, extra, tail) == token else None
        children = node.children
        child = children.get(token) if children is not None else None
        return (child, 0) if child is not None else None

    def descend(self, tokens: Sequence[int], tail: Sequence[int] = ()) -> Cursor | None:
        cur: Cursor | None = (self.root, 0)
        for token in tokens:
            assert cur is not None
            cur = self.step(cur, token, tail)
            if cur is None:
                return None
        return cur

    def has_continuation(self, cur: Cursor, tail: Sequence[int] = ()) -> bool:
        node, extra = cur
        if node.count == 1:
            return self._implicit(node, extra, tail) is not None
        return node.children is not None and node.cont > 0

    def next_token(self, cur: Cursor, tail: Sequence[int]) -> tuple[int, float, Cursor] | None:
        """The most frequent next token, its conditional probability, and the new cursor."""
        node, extra = cur
        if node.count == 1:
            tok = self._implicit(node, extra, tail)
            return None if tok is None else (tok, 1.0, (node, extra + 1))
        if node.children is None or node.cont <= 0:
            return None
        best = node.best
        if best is None:
            best = max(node.children.values(), key=lambda c: (c.count, c.stamp))
            node.best = best
        return best.tok, best.count / node.cont, (best, 0)


def _subtree_size(node: _Node) -> int:
    """Materialised nodes strictly below `node`."""
    size = 0
    stack = list(node.children.values()) if node.children else []
    while stack:
        n = stack.pop()
        size += 1
        if n.children:
            stack.extend(n.children.values())
    return size


def _depth(cur: Cursor) -> int:
    return cur[0].depth + cur[1]


class _Request:
    """Per-request state: the request's own trie and where its context sits in both."""

    def __init__(self, max_depth: int, prompt_len: int) -> None:
        self.trie = _Trie(max_depth)
        self.seq: list[int] = []  # every committed token seen so far
        self.actives: list[_Node] = []  # repeated suffixes of seq in self.trie, longest first
        self.cursors: list[Cursor] = []  # suffixes of seq found in the global trie, longest first
        self.prompt_len = prompt_len


@register("suffix")
class SuffixProposer:
    """Model-free drafting from suffix tries of this request and of earlier ones.

    max_depth: longest suffix indexed (and longest match used: max_depth - 1 tokens).
    max_tree_tokens: tokens the global trie holds at most (oldest requests evicted
        first); 0 disables cross-request memory. Materialised global nodes are also
        capped at NODES_PER_TOKEN per token (max_tree_nodes overrides).
    min_prob: stop drafting once the product of conditional probabilities drops below.
    max_spec: draft at most this many tokens per step (the engine's k caps it too).
    index_prompts: also put prompts (not only outputs) in the global trie.

    Tie rules: the request's own trie is used when its match is at least as long as the
    global one's (the global one is tried if that walk drafts nothing, and vice versa);
    among continuations with equal counts the most recently seen one wins.
    """

    name = "suffix"

    def __init__(
        self,
        target: Model | None = None,
        draft: Model | None = None,
        *,
        max_depth: int = 64,
        max_tree_tokens: int = 200_000,
        min_prob: float = 0.1,
        max_spec: int | None = None,
        max_tree_nodes: int | None = None,
        index_prompts: bool = False,
        **_: Any,
    ) -> None:
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth={max_depth!r} is out of range: use an integer >= 2")
        if not isinstance(max_tree_tokens, int) or max_tree_tokens < 0:
            raise ValueError(
                f"max_tree_tokens={max_tree_tokens!r} is out of range: use an integer >= 0"
            )
        if not isinstance(min_prob, int | float) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob={min_prob!r} is out of range: use a number in [0, 1]")
        if max_spec is not None and (not isinstance(max_spec, int) or max_spec < 0):
            raise ValueError(f"max_spec={max_spec!r} is out of range: use an integer >= 0")
        if max_tree_nodes is None:
            max_tree_nodes = NODES_PER_TOKEN * max_tree_tokens
        if not isinstance(max_tree_nodes, int) or max_tree_nodes < 0:
            raise ValueError(
                f"max_tree_nodes={max_tree_nodes!r} is out of range: use an integer >= 0"
            )
        self.target = target
        self.max_depth = max_depth
        self.max_tree_tokens = max_tree_tokens
        self.max_tree_nodes = max_tree_nodes
        self.min_prob = float(min_prob)
        self.max_spec = max_spec
        self.index_prompts = index_prompts
        self._global = _Trie(max_depth)
        self._held: deque[list[int]] = deque()  # global sequences, oldest first
        self._held_tokens = 0
        self._req: _Request | None = None

    # -- memory figures (for tests and reports) ---------------------------------------------

    @property
    def global_tokens(self) -> int:
        return self._held_tokens

    @property
    def global_nodes(self) -> int:
        return self._global.nodes

    @property
    def global_requests(self) -> int:
        return len(self._held)

    # -- protocol ---------------------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        self._req = _Request(self.max_depth, len(prompt_ids))
        self._ingest([int(t) for t in prompt_ids])

    def spawn(self) -> SuffixProposer:
        """Same settings, its own memory: concurrent requests would invalidate each
        other's cursors into a shared trie. The server reuses proposers from a pool,
        so each one still accumulates the requests it served."""
        return SuffixProposer(
            self.target,
            max_depth=self.max_depth,
            max_tree_tokens=self.max_tree_tokens,
            min_prob=self.min_prob,
            max_spec=self.max_spec,
            max_tree_nodes=self.max_tree_nodes,
            index_prompts=self.index_prompts,
        )

    def end(self, tokens: Sequence[int] = ()) -> None:
        req = self._req
        if req is not None and len(tokens) > len(req.seq):
            self._ingest([int(t) for t in tokens[len(req.seq) :]])  # the last step's tokens
        self._req = None
        if req is None:
            return
        tokens = req.seq if self.index_prompts else req.seq[req.prompt_len :]
        self._remember(tokens)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        if self.max_spec is not None:
            k = min(k, self.max_spec)
        if k <= 0:
            return Draft([])
        req = self._req
        n = len(context)
        if (
            req is None
            or n < len(req.seq)
            or (req.seq and context[len(req.seq) - 1] != req.seq[-1])
        ):
            # Not begun, or a context that is not an extension of what we indexed: start over.
            self._req = req = _Request(self.max_depth, req.prompt_len if req else n)
        self._ingest([int(t) for t in context[len(req.seq) :]])

        local_depth = req.actives[0].depth if req.actives else 0
        glob: Cursor | None = next(
            (c for c in req.cursors if self._global.has_continuation(c)), None
        )
        global_depth = _depth(glob) if glob is not None else 0
        tries: list[tuple[_Trie, Cursor, bool]] = []
        if local_depth:
            tries.append((req.trie, (req.actives[0], 0), True))
        if glob is not None and global_depth:
            tries.insert(
                0 if global_depth > local_depth else len(tries), (self._global, glob, False)
            )
        for trie, cur, own in tries:
            ids = self._walk(trie, cur, req.seq, k, own)
            if ids:
                return Draft(ids)  # q_probs=None: a point mass, still lossless (see top)
        return Draft([])

    # -- internals --------------------------------------------------------------------------

    def _ingest(self, tokens: list[int]) -> None:
        """Index newly committed tokens: O(max_depth) each, in both tries."""
        req = self._req
        assert req is not None
        trie, seq = req.trie, req.seq
        for token in tokens:
            req.actives = trie.extend(seq, req.actives, token)
        if not self._held:
            req.cursors = []
            return
        glob = self._global
        if len(tokens) >= self.max_depth:
            # Cursors only see the last max_depth tokens: rebuild from those.
            req.cursors = []
            tokens = seq[-self.max_depth :]
        cursors = req.cursors
        for token in tokens:
            nxt: list[Cursor] = []
            for cur in (*cursors, (glob.root, 0)):
                stepped = glob.step(cur, token)
                if stepped is not None:
                    nxt.append(stepped)
            cursors = nxt
        req.cursors = cursors

    def _walk(self, trie: _Trie, cur: Cursor, context: list[int], k: int, own: bool) -> list[int]:
        """Greedy walk of the most frequent continuation from `cur`: O(depth + k).

        own: `trie` is the request's own, whose occurrences reaching the present run on
        into the drafts (so periodic text keeps its period). At the depth cap the walk
        re-anchors on the last max_depth // 2 tokens of context + drafts."""
        ids: list[int] = []
        prob = 1.0
        tail: list[int] = ids if own else []
        anchor = max(1, self.max_depth // 2)
        while len(ids) < k:
            step = trie.next_token(cur, tail)
            if step is None:
                if _depth(cur) < self.max_depth:
                    break  # the walk ends: nothing ever followed this
                recent = (context[-anchor:] + ids)[-anchor:]
                found = trie.descend(recent, tail)
                if found is None:
                    break
                cur = found
                continue
            token, p, nxt = step
            if prob * p < self.min_prob:
                break
            prob *= p
            ids.append(token)
            cur = nxt
        return ids

    def _remember(self, tokens: list[int]) -> None:
        """Move a finished request's tokens into the global trie, evicting FIFO."""
        if not tokens or self.max_tree_tokens <= 0:
            return
        tokens = tokens[-self.max_tree_tokens :]
        while self._held and self._held_tokens + len(tokens) > self.max_tree_tokens:
            self._evict()
        self._held.append(self._global.add(tokens))
        self._held_tokens += len(tokens)
        while self._held and self._global.nodes > self.max_tree_nodes:
            self._evict()

    def _evict(self) -> None:
        seq = self._held.popleft()
        self._global.remove(seq)
        self._held_tokens -= len(seq)
