"""How many tokens to draft per step: a fixed k, or chosen live from measured figures.

`AdaptiveK` keeps, per draft position j, the conditional acceptance rate a_j (accepted
at j given j-1 accepted). `PassCosts` keeps the measured seconds of a verify pass by
its rows and of a step's drafting by its depth; one table serves all the lanes of an
engine, since they run the same target and the same kind of proposer.

A step verifies every running sequence s in one batched pass of R = sum_s (k_s + 1)
rows. Each sequence picks the k in 0..k_max that maximises the whole batch's rate

    (T_o + tokens(k)) / (verify(R_o + k + 1) + draft(depth(k)))
    tokens(k) = 1 + sum_j<=k prod_i<=j a_i

where T_o and R_o are the expected tokens and the rows of the other sequences (the k
they chose this step, or their last step's k for those still to choose), and depth(k)
is max(k, d_o) when the proposer drafts the batch with one call per position (a draft
model), d_o + k when it drafts each sequence apart (d_o: the others' depth). Alone,
this is tokens(k) / (verify(k + 1) + draft(k)). A batched draft pass is a cost that no
sequence saves alone, so `choose_batch` then sets the sequences' choices against the
batch drafting less deep, or all alike, and keeps the best for the whole batch.

k = 0 is a plain step. Exploration is kept cheap, so that a first request runs close
to plain speed whatever the drafts are worth:

- an engine's first `plain_first` steps are plain (they measure a plain pass, and
  cost nothing over plain decoding), and k grows at most one past the deepest drafting
  whose cost has been measured;
- a step in which a proposer catches up on tokens it has not seen (a new prompt, the
  tokens of plain steps) is kept out of the draft costs: that catch-up is paid once,
  not per drafted token;
- while the acceptance estimate is still uncertain, a step that the estimate would make
  plain drafts anyway if, within `optimism` standard deviations of it, drafting (at
  most one deeper than measured) could pay: one early rejection does not end drafting
  for a good draft, and a bad one is dropped within a few steps;
- when drafts keep failing, k falls to 0 and stays there but for a one-token probe
  now and then, which keeps the acceptance estimate alive (the proposer would have to
  catch up on the tokens of the plain steps first). Probes are spaced so that
  they take about `probe_share` of the time: a proposer that must catch up on the
  skipped tokens (a draft model) probes rarely, a lookup (ngram) every `probe_every`
  steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

HISTORY = 256  # recent choices kept for reports


@dataclass(frozen=True, eq=False)
class StepCost:
    """What one step's passes cost; every sequence of the step reports the same one.

    rows: verify rows of the batched pass, sum over its sequences of (drafted + 1).
    draft_depth: the drafting's depth, in draft calls: the deepest draft of a proposer
        that drafts all its sequences at once per position, the sum of them otherwise.
    draft_s: None when a proposer caught up on tokens it had not seen this step (a
        one-off, left out of the per-step draft cost).
    """

    rows: int
    verify_s: float
    draft_depth: int
    draft_s: float | None


@dataclass(frozen=True)
class Others:
    """What the other sequences of a step add to its passes (see the module docstring)."""

    rows: int = 0
    tokens: float = 0.0
    draft_depth: int = 0
    batched_drafts: bool = True  # one draft call per position for all of them

    def depth(self, k: int) -> int:
        return max(k, self.draft_depth) if self.batched_drafts else k + self.draft_depth


SOLO = Others()


@dataclass(eq=False)
class PassCosts:
    """Measured seconds of a verify pass by rows and of a step's drafting by depth: the
    mean of the first five samples of each, then an exponential moving average."""

    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds
    draft_s: dict[int, float] = field(default_factory=dict)  # depth -> seconds
    steps: int = 0  # steps observed
    _samples: dict[tuple[str, int], int] = field(default_factory=dict, init=False, repr=False)
    _last: StepCost | None = field(default=None, init=False, repr=False)

    def observe(self, step: StepCost) -> None:
        if step is self._last:  # the other sequences of that step reported it already
            return
        self._last = step
        self.steps += 1
        self._average(self.verify_s, "verify", step.rows, step.verify_s)
        if step.draft_s is not None and step.draft_depth > 0:
            self._average(self.draft_s, "draft", step.draft_depth, step.draft_s)

    def _average(self, table: dict[int, float], kind: str, key: int, value: float) -> None:
        n = self._samples.get((kind, key), 0) + 1
        self._samples[kind, key] = n
        old = table.get(key, value)
        table[key] = old + max(0.2, 1.0 / n) * (value - old)

    @property
    def max_depth(self) -> int:
        """The deepest drafting whose cost was measured (0: none yet)."""
        return max(self.draft_s, default=0)

    def verify(self, rows: int) -> float:
        """Seconds of a pass over `rows`: measured, else interpolated between measured
        row counts, else extrapolated along the slope of the nearest two: past the
        widest, at least 3% more a row; below the narrowest, never less than in
        proportion to the rows (with one measured count, the same as it)."""
        known = self.verify_s
        if rows in known:
            return known[rows]
        if not known:
            return 1.0
        lower = sorted(w for w in known if w < rows)
        upper = sorted(w for w in known if w > rows)
        if lower and upper:
            lo, hi = lower[-1], upper[0]
            f = (rows - lo) / (hi - lo)
            return known[lo] * (1 - f) + known[hi] * f
        if lower:
            lo = lower[-1]
            slope = 0.03 * known[lo]
            if len(lower) > 1:
                slope = max(slope, (known[lo] - known[lower[-2]]) / (lo - lower[-2]))
            return known[lo] + slope * (rows - lo)
        hi = upper[0]
        if len(upper) == 1:
            return known[hi]
        slope = max(0.0, (known[upper[1]] - known[hi]) / (upper[1] - hi))
        return max(known[hi] - slope * (hi - rows), known[hi] * rows / hi)

    def draft(self, depth: int) -> float:
        """Seconds of a step's drafting `depth` calls deep: measured, else interpolated,
        else extrapolated as if one call's worth of it were fixed per step (a draft model
        feeds the last committed token before its first draft). Nothing measured: 0,
        and k grows one past `max_depth` at a time."""
        known = self.draft_s
        if depth <= 0:
            return 0.0
        if depth in known:
            return known[depth]
        if not known:
            return 0.0
        lower = [d for d in known if d < depth]
        upper = [d for d in known if d > depth]
        if lower and upper:
            lo, hi = max(lower), min(upper)
            f = (depth - lo) / (hi - lo)
            return known[lo] * (1 - f) + known[hi] * f
        nearest = max(lower) if lower else min(upper)
        return known[nearest] * (depth + 1) / (nearest + 1)


@dataclass
class FixedK:
    k: int

    def choose(self, limit: int, others: Others = SOLO) -> int:
        return min(self.k, limit)

    def plan(self, limit: int, others: Others = SOLO) -> tuple[int, int, int]:
        """(k, least, most): a fixed k, whatever the batch."""
        k = max(0, min(self.k, limit))
        return k, k, k

    def commit(self, k: int, limit: int) -> int:
        return k

    def expected_tokens(self, k: int) -> float:
        """Nothing is measured: every draft counts as half a token."""
        return 1.0 + k / 2

    def observe(
        self,
        drafted: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        step: StepCost | None = None,
    ) -> None:
        return None


@dataclass
class AdaptiveK:
    k_max: int = 8
    # Acceptance prior before anything is measured, in pseudo-observations. Optimistic:
    # a good draft must earn k >= 2 within a few steps (k = 1 rarely beats a plain step
    # when a draft call costs a third of a verify pass), while failing drafts pull the
    # estimate down within a few steps too.
    prior_rate: float = 0.9
    prior_weight: float = 4.0
    decay: float = 0.98  # forget old drafts: acceptance drifts within and across requests
    # Standard deviations of the acceptance estimates that drafts get the benefit of
    # before the policy settles on plain steps: a few steps' estimate is noisy.
    optimism: float = 1.0
    plain_first: int = 3  # an engine's first steps are plain: they measure a plain pass
    probe_every: int = 16  # the closest probes come, in plain steps
    probe_share: float = 0.02  # of the time, probes take about this much
    costs: PassCosts = field(default_factory=PassCosts)
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    steps_at_zero: int = 0
    probe_s: float = 0.0  # what the last catch-up or probe cost over a plain step
    history: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY))
    _probing: bool = field(default=False, init=False, repr=False)
    _hopeless: bool = field(default=False, init=False, repr=False)  # see plan()

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max={self.k_max} must be >= 1")
        self.tried = [0.0] * self.k_max
        self.accepted = [0.0] * self.k_max

    def rates(self, optimism: float = 0.0) -> list[float]:
        """Conditional acceptance per position. Each position is smoothed towards the
        estimate of the position before it, so positions rarely tried (beyond the k
        chosen so far) inherit the measured rate instead of a fixed prior: a pessimistic
        prior there would keep k small for ever, since untried positions never update.
        With `optimism` z, each rate is raised by z standard deviations of its estimate:
        what drafts could still be worth, given how little was measured."""
        w = self.prior_weight
        out: list[float] = []
        previous = self.prior_rate
        for a, t in zip(self.accepted, self.tried, strict=True):
            previous = (a + w * previous) / (t + w)
            out.append(previous)
        if optimism:
            out = [
                min(1.0, r + optimism * math.sqrt(r * (1.0 - r) / (t + w)))
                for r, t in zip(out, self.tried, strict=True)
            ]
        return out

    @staticmethod
    def _tokens(rates: list[float]) -> list[float]:
        """Expected tokens of a step with k drafts, for k = 0..len(rates)."""
        out, survive = [1.0], 1.0
        for rate in rates:
            survive *= rate
            out.append(out[-1] + survive)
        return out

    def expected_tokens(self, k: int) -> float:
        return self._tokens(self.rates())[min(k, self.k_max)]

    def expected_rate(self, k: int, others: Others = SOLO) -> float:
        """Expected tokens per second of the step (all its sequences) with k drafts."""
        return self._rate(k, others, self.expected_tokens(k))

    def _rate(self, k: int, others: Others, tokens: float) -> float:
        costs = self.costs
        seconds = costs.verify(others.rows + k + 1) + costs.draft(others.depth(k))
        return (others.tokens + tokens) / seconds

    @property
    def probe_interval(self) -> int:
        """Plain steps between probes: a probe costing `probe_s` over a plain step comes
        once per probe_s / probe_share of plain decoding, and never closer than
        `probe_every` steps."""
        plain = self.costs.verify(1)
        if self.probe_s <= 0.0 or plain <= 0.0:
            return self.probe_every
        return max(self.probe_every, math.ceil(self.probe_s / (self.probe_share * plain)))

    def plan(self, limit: int, others: Others = SOLO) -> tuple[int, int, int]:
        """(k, least, most): the best k for this step given the others, and the range
        a batch may move it in: at least 1 while the estimate is too uncertain to settle
        on plain steps, at most one past the deepest drafting measured. Changes nothing:
        `commit` records the k the step takes."""
        if min(limit, self.k_max) <= 0 or self.costs.steps < self.plain_first:
            return 0, 0, 0
        if self.steps_at_zero and any(self.tried):
            # Settled on plain steps: only a probe drafts again, since the proposer
            # must first catch up on every token since it last drafted (probe_s). No
            # probe while the measured costs say that a probe could not pay at this batch
            # size even if its draft were accepted (a draft model beside a busy batch on
            # a few cores): its catch-up would be spent for nothing. (A whole batch
            # drafting together may still pay where one probe does not: choose_batch
            # weighs that for sequences that are not settled.)
            self._hopeless = self.costs.max_depth > 0 and not self._could_pay(limit, others)
            return 0, 0, 0
        most = min(limit, self.k_max, self.costs.max_depth + 1)

        def best_k(tokens: list[float], least: int = 0) -> int:
            return max(range(least, most + 1), key=lambda k: self._rate(k, others, tokens[k]))

        tokens = self._tokens(self.rates())
        best = best_k(tokens)
        self._hopeless = False
        if best == 0 and best_k(self._tokens(self.rates(self.optimism))) > 0:
            # Drafts may still pay, for all that was measured: draft the way the
            # estimate prices best, and learn more.
            return best_k(tokens, least=1), 1, most
        if best == 0:  # a lane new to a busy batch does not probe in vain either
            self._hopeless = self.costs.max_depth > 0 and not self._could_pay(limit, others)
        return best, 0, most

    def _could_pay(self, limit: int, others: Others) -> bool:
        """Whether some k >= 1 beats a plain step when every draft is accepted."""
        most = min(limit, self.k_max, self.costs.max_depth + 1)
        plain = self._rate(0, others, 1.0)
        return any(self._rate(k, others, k + 1.0) > plain for k in range(1, most + 1))

    def commit(self, k: int, limit: int) -> int:
        """Record the k this step drafts; a plain step may become a one-token probe."""
        if min(limit, self.k_max) <= 0:
            return 0
        self._probing = False
        if k == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero >= self.probe_interval and not self._hopeless:
                k, self._probing = 1, True  # keep measuring acceptance
                self.steps_at_zero = 0
        else:
            self.steps_at_zero = 0
        self.history.append(k)
        return k

    def choose(self, limit: int, others: Others = SOLO) -> int:
        return self.commit(self.plan(limit, others)[0], limit)

    def observe(
        self,
        drafted: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        step: StepCost | None = None,
    ) -> None:
        """One step's outcome for this sequence. `step` is what the step's passes cost
        (shared by its sequences); without it, the step is taken as this sequence's
        alone, with `draft_s` and `verify_s` its draft and verify seconds."""
        if drafted:  # plain steps leave the estimate as it is: probes refresh it
            for j in range(self.k_max):
                self.tried[j] *= self.decay
                self.accepted[j] *= self.decay
        # Verification stops at the first rejection: positions past it were not judged.
        for j in range(min(drafted, accepted + 1, self.k_max)):
            self.tried[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0
        if step is None:
            step = StepCost(drafted + 1, verify_s, drafted, draft_s)
        self.costs.observe(step)
        if drafted and (self._probing or step.draft_s is None):
            # What drafting cost over a plain step, catch-up included: the price of the
            # next probe after a plain stretch.
            costs = self.costs
            extra = costs.verify(step.rows) - costs.verify(step.rows - drafted)
            self.probe_s = draft_s + max(0.0, extra)
        self._probing = False


def choose_batch(
    policies: Sequence[FixedK | AdaptiveK],
    limits: Sequence[int],
    previous: Sequence[int],
    batched: bool,
    base: Others = SOLO,
) -> list[int]:
    """k for each sequence of a step whose proposers are of one kind (`batched`: drafted
    together, one call per position); `previous` is each one's last k, `base` what the
    step's other sequences add.

    Each in turn takes its best k given the others (the k they chose this step, or
    their previous k). When the drafting is shared, no sequence saves its cost alone:
    once the others draft, one more row looks cheap to each of them, though the batch
    would run faster with none drafting. So the result is then set against the batch
    drafting less deep (every k capped at m) or all alike (every k = m), and the batch's
    best rate wins."""
    n = len(policies)
    ks = [max(0, min(k, limit)) for k, limit in zip(previous, limits, strict=True)]
    bounds = [(0, 0)] * n
    tokens: list[dict[int, float]] = [{} for _ in policies]

    def tok(i: int, k: int) -> float:
        if k not in tokens[i]:
            tokens[i][k] = policies[i].expected_tokens(k)
        return tokens[i][k]

    def depth(ks: Sequence[int]) -> int:
        return max(ks, default=0) if batched else sum(ks)

    for i, policy in enumerate(policies):
        rest = ks[:i] + ks[i + 1 :]
        others = Others(
            base.rows + sum(k + 1 for k in rest),
            base.tokens + sum(tok(j, k) for j, k in enumerate(ks) if j != i),
            depth(rest),
            batched,
        )
        ks[i], least, most = policy.plan(limits[i], others)
        bounds[i] = (least, most)
    costs = next((p.costs for p in policies if isinstance(p, AdaptiveK)), None)
    if n > 1 and costs is not None and costs.steps:

        def rate(ks: list[int]) -> float:
            total = base.tokens + sum(tok(i, k) for i, k in enumerate(ks))
            rows = base.rows + sum(k + 1 for k in ks)
            return total / (costs.verify(rows) + costs.draft(depth(ks)))

        def fit(i: int, k: int) -> int:
            least, most = bounds[i]
            return max(least, min(k, most))

        candidates = [ks]
        candidates += [[fit(i, min(k, m)) for i, k in enumerate(ks)] for m in range(max(ks))]
        deepest = max(most for _, most in bounds)
        candidates += [[fit(i, m) for i in range(n)] for m in range(deepest + 1)]
        ks = max(candidates, key=rate)
    return [p.commit(k, limit) for p, k, limit in zip(policies, ks, limits, strict=True)]


Policy = FixedK | AdaptiveK


def make_policy(k: int | str, plain: bool, costs: PassCosts | None = None) -> Policy:
    """num_speculative_tokens: an integer 0..64, or "auto" (chosen per step, from the
    pass costs in `costs`: give the lanes of one engine the same table)."""
    if plain:
        return FixedK(0)
    if k == "auto":
        return AdaptiveK(costs=costs if costs is not None else PassCosts())
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
        raise ValueError(f"num_speculative_tokens={k!r} is out of range: use 0..64 or 'auto'")
    return FixedK(k)
