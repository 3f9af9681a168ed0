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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from speculant.sampling import Coupled, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one chain of drafts.

    num_accepted: how many leading drafts were kept (0..k).
    token_ids: the accepted drafts followed by exactly one new token (the resampled
        correction, or the bonus when all k were accepted): length num_accepted + 1.
    """

    num_accepted: int
    token_ids: list[int]


def verify_chain(
    draft_ids: Sequence[int],
    q_draft: Tensor | None,
    p_target: Tensor,
    generator: torch.Generator | None,
    coupled: Coupled | None = None,
) -> Verdict:
    """Apply the lossless rule to one chain.

    draft_ids: k drafted tokens.
    q_draft: [k, vocab_q] the distributions the drafts were sampled from (after the same
        temperature / top-k / top-p as p), or None for deterministic drafts (point mass).
        vocab_q may be smaller than the target's vocab (missing ids have q = 0).
    p_target: [k + 1, vocab] processed target distributions; row i scores draft i,
        row k gives the bonus distribution.
    coupled: a greedy or seeded request's coupled rule (q is then not needed: a draft
        is kept exactly when it is the target's own choice at its position).
    """
    k = len(draft_ids)
    if p_target.shape[0] != k + 1:
        raise ValueError(f"p_target has {p_target.shape[0]} rows, expected k + 1 = {k + 1}")
    if coupled is not None:
        kept: list[int] = []
        for i in range(k + 1):
            token = coupled.pick(p_target[i], i)
            if i == k or token != int(draft_ids[i]):
                return Verdict(i, kept + [token])
            kept.append(token)
    if k == 0:
        return Verdict(0, [int(sample(p_target[:1], generator)[0])])
    vocab = p_target.shape[-1]
    drafts = torch.tensor(list(draft_ids), dtype=torch.long)  # [k]
    p_at = p_target[:k].gather(-1, drafts[:, None]).squeeze(-1)  # [k]
    if q_draft is None:
        q_rows = None
        q_at = torch.ones(k)
    else:
        q_rows = _pad_vocab(q_draft.float(), vocab)  # [k, vocab]
        q_at = q_rows.gather(-1, drafts[:, None]).squeeze(-1)  # [k]
        _check_sampled(draft_ids, q_at)
    # u < p/q  <=>  u * q < p (q > 0, checked above)
    u = torch.rand(k, generator=generator)  # [k]
    accepted = (u * q_at < p_at).tolist()
    n = 0
    while n < k and accepted[n]:
        n += 1
    kept = [int(t) for t in draft_ids[:n]]
    if n == k:
        return Verdict(k, kept + [int(sample(p_target[k : k + 1], generator)[0])])
    if q_rows is None:
        residual = p_target[n].clone()
        residual[drafts[n]] = 0.0
    else:
        residual = (p_target[n] - q_rows[n]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # only reachable through rounding when p == q; p is then the answer
        residual = p_target[n]
        total = residual.sum()
    fix = sample((residual / total)[None], generator)
    return Verdict(n, kept + [int(fix[0])])


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


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a draft tree.

    path: indices of the accepted nodes, root to leaf (empty when none was accepted).
    token_ids: their tokens followed by exactly one new token (the correction drawn at
        the node where acceptance stopped, or the bonus below an accepted leaf).
    """

    path: list[int]
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    p_target: Tensor,
    generator: torch.Generator | None,
    q_nodes: Tensor | None = None,
    coupled: Coupled | None = None,
) -> TreeVerdict:
    """Apply the lossless rule to a tree of drafts (recursive rejection over siblings,
    as in SpecInfer, Miao et al. 2024).

    tokens: n drafted tokens, one per node; parents: each node's parent index, -1 for
        children of the root (the last committed token). Siblings are tried in the
        order given (put the draft's preferred candidate first).
    p_target: [n + 1, vocab]: row 0 is the target's distribution after the root,
        row i + 1 the distribution after node i (the tree's tokens on its path).
    q_nodes: [n, vocab_q] the distribution each node's token was drawn from (siblings
        drawn independently from their parent's q), or None for deterministic
        candidates (top-k expansion, as EAGLE-2 does): point masses.

    At a node with target distribution p, each child x in turn is accepted with
    probability min(1, p(x) / q(x)); after a rejection p becomes normalize(max(0, p - q))
    (for a point mass: p with x removed). If a child is accepted, descend into it; if
    none is, draw the correction from the remaining p. The token emitted at every node
    is therefore distributed exactly as p, so the output is the target's distribution.
    Greedy (one-hot p) reduces to following the child equal to the target's argmax.
    With `coupled` (a greedy or seeded request), the target's token at each node is its
    argmax or seeded draw at the node's depth, and the walk follows the child holding it.
    """
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"{len(parents)} parents for {n} tree nodes")
    if p_target.shape[0] != n + 1:
        raise ValueError(f"p_target has {p_target.shape[0]} rows, expected n + 1 = {n + 1}")
    children: list[list[int]] = [[] for _ in range(n + 1)]  # by row: 0 = root
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must come first")
        children[parent + 1].append(i)
    path: list[int] = []
    row = 0
    if coupled is not None:
        while True:
            token = coupled.pick(p_target[row], len(path))
            match = [c for c in children[row] if int(tokens[c]) == token]
            if not match:
                return TreeVerdict(path, [int(tokens[i]) for i in path] + [token])
            path.append(match[0])
            row = match[0] + 1
    vocab = p_target.shape[-1]
    q_rows = _pad_vocab(q_nodes.float(), vocab) if q_nodes is not None else None
    while True:
        p = p_target[row].float().clone()
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
                p[x] = 0.0
            else:
                q = q_rows[child]
                _check_sampled([x], q[x : x + 1])
                if float(torch.rand(1, generator=generator)) * float(q[x]) * total < float(p[x]):
                    accepted = child
                    break
                p = (p / total - q).clamp_min(0.0)
        if accepted is None:
            if float(p.sum()) <= 0:  # rounding when p == q: p itself is the answer
                p = p_target[row].float()
            fix = sample((p / p.sum())[None], generator)
            return TreeVerdict(path, [int(tokens[i]) for i in path] + [int(fix[0])])
        path.append(accepted)
        row = accepted + 1
        if not children[row]:
            bonus = sample(p_target[row : row + 1].float(), generator)
            return TreeVerdict(path, [int(tokens[i]) for i in path] + [int(bonus[0])])
