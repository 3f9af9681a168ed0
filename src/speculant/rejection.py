"""The lossless accept / resample / bonus rule (Leviathan et al. 2023; Chen et al. 2023).

For draft token x drawn from q and target distribution p at the same position:
accept with probability min(1, p(x) / q(x)); at the first rejection emit a token drawn
from normalize(max(0, p - q)) and stop; if all k drafts are accepted emit a bonus token
drawn from the target's next distribution. The emitted sequence is distributed exactly
as if drawn from p token by token.

A proposer with no distribution (prompt lookup, suffix matching: deterministic drafts)
is a point mass q = one_hot(x). The rule still applies unchanged: accept with p(x),
and on rejection draw from p with x removed and renormalised. Lossless either way.

Greedy and seeded requests use the coupled rule instead (`Coupled`, see
speculant.sampling): the target's token at each position is its argmax (greedy) or its
seeded draw there, whatever was drafted, and a draft is kept exactly when it equals that
token. Every emitted token is then an exact draw from p, and the text does not depend on
the proposer or on k. (For greedy this is what the rule above reduces to with one-hot
rows; the coupled form needs only each row's argmax.)

A draft is a chain or a tree (`parents`, see speculant.tree); `verify` takes either.
A tree is verified by recursive rejection over siblings (SpecInfer, Miao et al. 2024):
at a node, each child x in turn is accepted with min(1, p(x) / q(x)), and after a
rejection p becomes normalize(max(0, p - q)) for the next sibling; a chain is the tree
with one child per node, checked in one vectorised step. Both share the residual, the
correction draw (with its fallback to p when rounding leaves no mass) and the bonus.
This module is where a draft is verified; the scheduler only calls `verify`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from speculant.sampling import Coupled, sample
from speculant.tree import chain_parents, path_rows
from speculant.tree import children as tree_children


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a draft (a chain or a tree).

    path: indices of the accepted drafts, root to leaf (empty when none was accepted;
        0..n-1 for a chain that kept its first n).
    token_ids: their tokens followed by exactly one new token (the correction drawn
        where acceptance stopped, or the bonus after the last accepted draft): length
        num_accepted + 1.
    """

    path: list[int]
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def rows(self) -> list[int]:
        """The verify rows behind the emitted tokens, root first (row 0 the last
        committed token, row i + 1 draft i): row j's logits scored token_ids[j], and
        these are the rows the cache keeps (`KVCache.commit`)."""
        return path_rows(self.path)


def verify(
    draft_ids: Sequence[int],
    q_draft: Tensor | None,
    p_target: Tensor,
    generator: torch.Generator | None,
    coupled: Coupled | None = None,
    parents: Sequence[int] | None = None,
) -> Verdict:
    """Apply the lossless rule to one draft: a chain, or a tree when `parents` is given.

    draft_ids: n drafted tokens (one per tree node).
    q_draft: [n, vocab_q] the distributions the drafts were sampled from (after the same
        temperature / top-k / top-p as p; a tree's siblings drawn independently from
        their parent's q), or None for deterministic drafts (point masses: prompt
        lookup, suffix match, top-k tree expansion as EAGLE-2 does). vocab_q may be
        smaller than the target's vocab (missing ids have q = 0).
    p_target: [n + 1, vocab] processed target distributions: row 0 after the last
        committed token, row i + 1 after draft i (a tree node: the tokens on its path);
        after a chain's last draft, row n gives the bonus distribution.
    coupled: a greedy or seeded request's coupled rule (q is then not needed: a draft
        is kept exactly when it is the target's own choice at its position; in a tree
        the walk follows the child holding that token).
    parents: None for a chain; for a tree, each node's parent index, -1 for children
        of the root (speculant.tree). Siblings are tried in the order given (put the
        draft's preferred candidate first).
    """
    n = len(draft_ids)
    children = tree_children(chain_parents(n) if parents is None else parents, n)
    if p_target.shape[0] != n + 1:
        raise ValueError(
            f"p_target has {p_target.shape[0]} rows, expected n + 1 = {n + 1} "
            "(one after the last committed token, one after each draft)"
        )
    if coupled is not None:
        return _coupled(draft_ids, children, p_target, coupled)
    if n == 0:
        return Verdict([], [_bonus(p_target, 0, generator)])
    vocab = p_target.shape[-1]
    q_rows = None if q_draft is None else _pad_vocab(q_draft.float(), vocab)  # [n, vocab]
    if parents is None:
        return _chain(draft_ids, q_rows, p_target, generator)
    return _tree(draft_ids, children, q_rows, p_target, generator)


def _coupled(
    draft_ids: Sequence[int], children: list[list[int]], p_target: Tensor, coupled: Coupled
) -> Verdict:
    """The coupled walk: the target's token at each row is its argmax or seeded draw at
    the row's depth; the walk descends into the child holding it (a chain's next draft
    when it equals it) and stops, emitting that token, where no child does."""
    path: list[int] = []
    row = 0
    while True:
        token = coupled.pick(p_target[row], len(path))
        match = [c for c in children[row] if int(draft_ids[c]) == token]
        if not match:
            return Verdict(path, [int(draft_ids[i]) for i in path] + [token])
        path.append(match[0])
        row = match[0] + 1


def _chain(
    draft_ids: Sequence[int],
    q_rows: Tensor | None,
    p_target: Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """The fast path for a chain: every draft's test in one vectorised step, one
    uniform per draft."""
    k = len(draft_ids)
    drafts = torch.tensor(list(draft_ids), dtype=torch.long)  # [k]
    p_at = p_target[:k].gather(-1, drafts[:, None]).squeeze(-1)  # [k]
    if q_rows is None:
        q_at = torch.ones(k)
    else:
        q_at = q_rows.gather(-1, drafts[:, None]).squeeze(-1)  # [k]
        _check_sampled(draft_ids, q_at)
    # u < p/q  <=>  u * q < p (q > 0, checked above)
    u = torch.rand(k, generator=generator)  # [k]
    accepted = (u * q_at < p_at).tolist()
    n = 0
    while n < k and accepted[n]:
        n += 1
    path = list(range(n))
    kept = [int(t) for t in draft_ids[:n]]
    if n == k:
        return Verdict(path, kept + [_bonus(p_target, k, generator)])
    q = None if q_rows is None else q_rows[n]
    residual = _residual(p_target[n], int(draft_ids[n]), q)
    return Verdict(path, kept + [_correction(residual, p_target[n], generator)])


def _tree(
    tokens: Sequence[int],
    children: list[list[int]],
    q_rows: Tensor | None,
    p_target: Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Recursive rejection over siblings. At a node with target distribution p, each
    child x in turn is accepted with probability min(1, p(x) / q(x)); after a rejection
    p becomes the residual normalize(max(0, p - q)) (for a point mass: p with x
    removed). If a child is accepted, descend into it; if none is, draw the correction
    from the remaining p. The token emitted at every node is therefore distributed
    exactly as p, so the output is the target's distribution. Greedy (one-hot p)
    reduces to following the child equal to the target's argmax."""
    path: list[int] = []
    row = 0
    while True:
        p = p_target[row].float()  # what is left of the row's distribution (unnormalised)
        accepted = None
        for child in children[row]:
            x = int(tokens[child])
            total = float(p.sum())
            if total <= 0:
                break
            if q_rows is None:
                ratio = float(p[x]) / total  # a point mass: q(x) = 1
                if float(torch.rand(1, generator=generator)) < ratio:
                    accepted = child
                    break
                p = _residual(p, x, None)
            else:
                q = q_rows[child]
                _check_sampled([x], q[x : x + 1])
                if float(torch.rand(1, generator=generator)) * float(q[x]) * total < float(p[x]):
                    accepted = child
                    break
                p = _residual(p / total, x, q)
        if accepted is None:
            fix = _correction(p, p_target[row].float(), generator)
            return Verdict(path, [int(tokens[i]) for i in path] + [fix])
        path.append(accepted)
        row = accepted + 1
        if not children[row]:
            bonus = _bonus(p_target, row, generator)
            return Verdict(path, [int(tokens[i]) for i in path] + [bonus])


def _residual(p: Tensor, x: int, q: Tensor | None) -> Tensor:
    """What is left of p [vocab] once draft x is rejected: max(0, p - q) for a draft
    drawn from q [vocab], p with x removed for a point mass (q None)."""
    if q is None:
        left = p.clone()
        left[x] = 0.0
        return left
    return (p - q).clamp_min(0.0)


def _correction(residual: Tensor, p: Tensor, generator: torch.Generator | None) -> int:
    """The token emitted where acceptance stopped: a draw from normalize(residual), or
    from p itself when no mass is left (only reachable through rounding when p == q,
    and p is then the answer)."""
    total = residual.sum()
    if total <= 0:
        residual, total = p, p.sum()
    return int(sample((residual / total)[None], generator)[0])


def _bonus(p_target: Tensor, row: int, generator: torch.Generator | None) -> int:
    """The token after the last accepted draft: a draw from the target's row."""
    return int(sample(p_target[row : row + 1], generator)[0])


def _check_sampled(draft_ids: Sequence[int], q_at: Tensor) -> None:
    """A draft token must have q > 0 under the distribution it was drawn from: u * q < p
    would otherwise accept it whenever p > 0, and the output would no longer follow p."""
    zero = (q_at <= 0).nonzero().reshape(-1)
    if zero.numel():
        i = int(zero[0])
        raise ValueError(
            f"draft token {int(draft_ids[i])} at draft position {i} has probability "
            f"{float(q_at[i])} under the q it was reported as sampled from: a proposer "
            "must sample its drafts from exactly the q it returns"
        )


def _pad_vocab(q: Tensor, vocab: int) -> Tensor:
    """q: [k, vocab_q] -> [k, vocab] with zeros for ids the draft cannot emit."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        raise ValueError(f"draft vocab {q.shape[-1]} is larger than the target vocab {vocab}")
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
