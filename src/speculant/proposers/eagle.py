"""EAGLE-2 drafting: a trained feature-level head, chain or dynamic tree.

The head (eagle/head.py) drafts from the target's own features, so it needs them:
this proposer sets `needs_features`, and the scheduler hands it, through `observe`, the
target's final-normed hidden state of every committed position (the prompt's from the
prefill, then the accepted rows of each verify pass). Between steps it holds features
for every committed position but the last, exactly as the target's cache holds keys.

Each `propose` first feeds the head the (feature f_i, next token x_{i+1}) pairs it has
not seen, then drafts:

* chain (tree_topk = 1): k tokens, each sampled from the processed q of the head's
  logits (greedy: its argmax), feeding the head its own predicted feature. The q rows
  go to the chain verifier, so sampling stays lossless (Leviathan et al.).
* dynamic tree (EAGLE-2, Li et al. 2024): the root's top-`tree_topk` tokens form
  depth 0; at every further depth the `tree_topk` nodes with the highest cumulative
  draft log-probability are expanded by their own top-`tree_topk` tokens, in one head
  call per depth. After k depths the `tree_tokens` nodes of highest cumulative
  log-probability (a set closed under parents, since a child never scores above its
  parent) form the tree, siblings ordered best first. Candidates are deterministic
  (top-k), so the tree verifier treats them as point masses: recursive rejection over
  siblings (SpecInfer, Miao et al. 2024; rejection.verify) keeps the target's
  distribution exactly at any temperature, and greedy follows the target's argmax.

A reduced draft vocabulary only narrows which tokens can be drafted; q is zero
elsewhere, and verification always uses the full vocabulary.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from speculant.eagle.head import EagleHead, HeadCache, HeadLoadError, HeadRuntime, load_head
from speculant.models.decoder import GGUFWeight, Int4Weight, Int8Weight, Linear
from speculant.proposers.base import Draft, register
from speculant.sampling import SamplingParams, draw, process_logits

if TYPE_CHECKING:
    from speculant.models.model import Model

CATCH_UP_CHUNK = 512  # pairs fed to the head per call when catching up on a prompt
# Defaults measured on this project's CPUs: a verify pass costs more per extra row here
# than on a GPU, and chains were faster than trees at every shape tried (docs/eagle.md).
# On a GPU, where a wider verify pass is nearly free, trees (e.g. top-4, 16 tokens) pay.
DEFAULT_TREE_TOPK = 1
DEFAULT_TREE_TOKENS = 16


def dense_rows(w: Linear, ids: Tensor) -> Tensor:
    """Rows `ids` of a (possibly quantized) weight as float32 [len(ids), in]."""
    if isinstance(w, Int8Weight):
        return w.q[ids].float() * w.scales[ids].float()[:, None]
    if isinstance(w, Int4Weight):
        return w.dequantize()[ids]
    if isinstance(w, GGUFWeight):
        return w.rows(ids)
    return w[ids].float()


def check_head_pairing(head: EagleHead, target: Model) -> None:
    """Refuse a head trained for another target (other tokenizer or shapes)."""
    cfg, tc = head.cfg, target.config
    problems = []
    if (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) != (
        tc.dim,
        tc.n_heads,
        tc.n_kv_heads,
        tc.head_dim,
    ):
        problems.append(f"its width is {cfg.dim}, the target's {tc.dim}")
    if cfg.vocab_size != tc.vocab_size:
        problems.append(f"its vocabulary has {cfg.vocab_size} ids, the target's {tc.vocab_size}")
    tok = target.tokenizer
    if tok is not None and cfg.target_fingerprint and tok.fingerprint() != cfg.target_fingerprint:
        problems.append("its tokenizer fingerprint differs from the target's")
    if problems:
        raise HeadLoadError(
            f"EAGLE head for {cfg.target!r} cannot draft for {target.name!r}: "
            + "; ".join(problems)
            + ". Train one for this target: speculant eagle train --target NAME --out DIR"
        )


def build_runtime(head: EagleHead, target: Model, dtype: str = "int8") -> HeadRuntime:
    """The drafting form of `head`, sharing the target's embedding and LM-head rows."""
    check_head_pairing(head, target)
    w = target.net.weights
    ids = head.draft_vocab.long()  # type: ignore[operator]
    lm_rows = dense_rows(w.output, ids)
    return HeadRuntime(
        head, w.tok_embeddings, lm_rows, dtype, max_positions=target.config.max_seq_len
    )


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list, -1 for the root's children
    depth: int
    score: float  # cumulative draft log-probability
    row: int = -1  # head cache row once fed
    feature: Tensor | None = None  # the head's predicted feature after this node


@register("eagle")
class EagleProposer:
    name = "eagle"
    needs_features = True

    def __init__(
        self,
        target: Model,
        draft: Model | None = None,
        *,
        eagle_head: str | Path | EagleHead | None = None,
        tree_topk: int = DEFAULT_TREE_TOPK,
        tree_tokens: int = DEFAULT_TREE_TOKENS,
        eagle_dtype: str = "int8",
        trust_unverified: bool = False,
        runtime: HeadRuntime | None = None,
        **_: Any,
    ) -> None:
        if runtime is None:
            if eagle_head is None:
                raise ValueError("method 'eagle' needs a trained head (--eagle-head DIR)")
            head = (
                eagle_head
                if isinstance(eagle_head, EagleHead)
                else load_head(eagle_head, trust_unverified=trust_unverified)
            )
            runtime = build_runtime(head, target, eagle_dtype)
        if not 1 <= tree_topk <= 16:
            raise ValueError(f"tree_topk={tree_topk} is out of range: use 1..16")
        if not 1 <= tree_tokens <= 256:
            raise ValueError(f"tree_tokens={tree_tokens} is out of range: use 1..256")
        self.runtime = runtime
        self.tree_topk = tree_topk
        self.tree_tokens = tree_tokens
        self.target_vocab = target.vocab_size
        self._features: Tensor | None = None  # [rows, dim]: f_i of committed positions
        self._n_features = 0
        self._cache: HeadCache | None = None
        self._fed = 0  # head cache rows holding committed pairs

    # -- request lifecycle -------------------------------------------------------------
    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        self._features = None
        self._n_features = 0
        self._cache = self.runtime.new_cache(capacity + self.tree_tokens + 16)
        self._fed = 0

    def end(self, tokens: Sequence[int] = ()) -> None:
        self._features = None
        self._cache = None

    def spawn(self) -> EagleProposer:
        fresh = EagleProposer.__new__(EagleProposer)
        fresh.__dict__.update(self.__dict__)
        fresh._features, fresh._cache, fresh._n_features, fresh._fed = None, None, 0, 0
        return fresh

    def observe(self, features: Tensor) -> None:
        """The target's features [n, dim] of the next n committed positions."""
        if self._features is None or self._n_features + features.shape[0] > len(self._features):
            rows = max(2 * (self._n_features + features.shape[0]), 256)
            grown = features.new_zeros(rows, features.shape[1])
            if self._features is not None:
                grown[: self._n_features] = self._features[: self._n_features]
            self._features = grown
        self._features[self._n_features : self._n_features + features.shape[0]] = features
        self._n_features += features.shape[0]

    # -- drafting ----------------------------------------------------------------------
    def _catch_up(self, context: Sequence[int]) -> Tensor | None:
        """Feed the head every committed pair it has not seen; return its predicted
        feature for the last committed position (None when there is no pair yet)."""
        assert self._cache is not None and self._features is not None, "begin() first"
        n_pairs = min(self._n_features, len(context) - 1)
        if n_pairs < 1:
            return None
        self._cache.length = self._fed
        last: Tensor | None = None
        if self._fed == n_pairs:  # nothing new (a repeated call): recompute the last pair
            self._fed -= 1
        while self._fed < n_pairs:
            lo, hi = self._fed, min(n_pairs, self._fed + CATCH_UP_CHUNK)
            tokens = torch.as_tensor(list(context[lo + 1 : hi + 1]), dtype=torch.long)
            positions = torch.arange(lo, hi)
            visible = torch.arange(hi)[None, :] <= positions[:, None]
            out = self.runtime.step(
                tokens, self._features[lo:hi], positions, self._cache, lo, visible
            )
            last = out[-1]
            self._fed = hi
        self._cache.length = self._fed
        return last

    def propose(
        self,
        context: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        if k <= 0:
            return Draft([])
        feature = self._catch_up(context)
        if feature is None:
            return Draft([])
        if self.tree_topk == 1:
            return self._chain(feature, len(context), k, params, generator)
        return self._tree(feature, len(context), k)

    def _full_q(self, q_draft: Tensor) -> Tensor:
        """q over the draft vocabulary [draft_vocab] -> over the target's [vocab]."""
        full = q_draft.new_zeros(self.target_vocab)
        return full.index_copy_(0, self.runtime.draft_vocab, q_draft)

    def _chain(
        self, feature: Tensor, n_ctx: int, k: int, params: SamplingParams, gen: torch.Generator
    ) -> Draft:
        assert self._cache is not None
        rt = self.runtime
        ids: list[int] = []
        qs: list[Tensor] = []
        for j in range(k):
            q = process_logits(rt.logits(feature[None]), params)  # [1, draft_vocab]
            token = draw(q, params, gen, n_ctx + j, rt.draft_vocab)
            ids.append(token)
            if not params.greedy:  # greedy q is one-hot: a point mass, no rows needed
                qs.append(self._full_q(q[0]))
            if j + 1 == k:
                break
            row = self._fed + j  # the pair (feature, token) at position n_ctx - 1 + j
            visible = torch.ones(1, row + 1, dtype=torch.bool)
            feature = rt.step(
                torch.tensor([token]),
                feature[None],
                torch.tensor([n_ctx - 1 + j]),
                self._cache,
                row,
                visible,
            )[0]
        return Draft(ids, torch.stack(qs) if qs else None)

    def _tree(self, feature: Tensor, n_ctx: int, depth: int) -> Draft:
        """EAGLE-2's dynamic tree: expand by cumulative confidence, keep the best."""
        assert self._cache is not None
        rt = self.runtime
        topk = self.tree_topk
        nodes: list[_Node] = []
        logp = torch.log_softmax(rt.logits(feature[None])[0], dim=-1)
        values, idx = logp.topk(topk)
        frontier = []
        for v, i in zip(values.tolist(), idx.tolist(), strict=True):
            nodes.append(_Node(int(rt.draft_vocab[i]), -1, 0, v))
            frontier.append(len(nodes) - 1)
        next_row = self._fed
        for d in range(1, depth):
            # feed the frontier: each node's (parent's predicted feature, its token)
            feats = torch.stack(
                [feature if nodes[i].parent < 0 else _feat(nodes, i) for i in frontier]
            )
            tokens = torch.tensor([nodes[i].token for i in frontier])
            positions = torch.full((len(frontier),), n_ctx - 1 + d - 1)
            rows = list(range(next_row, next_row + len(frontier)))
            end = rows[-1] + 1
            visible = torch.zeros(len(frontier), end, dtype=torch.bool)
            visible[:, : self._fed] = True
            for r, i in enumerate(frontier):
                nodes[i].row = rows[r]
                a = i
                while a >= 0:
                    visible[r, nodes[a].row] = True
                    a = nodes[a].parent
            out = rt.step(tokens, feats, positions, self._cache, next_row, visible)
            next_row = end
            logp = torch.log_softmax(rt.logits(out), dim=-1)  # [frontier, draft_vocab]
            values, idx = logp.topk(topk, dim=-1)
            candidates = []
            for r, i in enumerate(frontier):
                nodes[i].feature = out[r]
                base = nodes[i].score
                for v, j in zip(values[r].tolist(), idx[r].tolist(), strict=True):
                    nodes.append(_Node(int(rt.draft_vocab[j]), i, d, base + v))
                    candidates.append(len(nodes) - 1)
            frontier = heapq.nlargest(topk, candidates, key=lambda c: nodes[c].score)
        # keep the best tree_tokens nodes, closed under parents
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
        keep: set[int] = set()
        for i in order:
            if len(keep) == self.tree_tokens:
                break
            if nodes[i].parent < 0 or nodes[i].parent in keep:
                keep.add(i)
        # parents first (by depth), siblings best first
        chosen = sorted(keep, key=lambda i: (nodes[i].depth, -nodes[i].score, i))
        index = {node: pos for pos, node in enumerate(chosen)}
        tokens_out = [nodes[i].token for i in chosen]
        parents = [index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in chosen]
        return Draft(tokens_out, None, parents)


def _feat(nodes: list[_Node], i: int) -> Tensor:
    parent = nodes[nodes[i].parent]
    assert parent.feature is not None
    return parent.feature
