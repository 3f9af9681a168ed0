"""How many tokens to draft per step: a fixed k, or chosen live from measured figures.

`AdaptiveK` keeps, per draft position j, the conditional acceptance rate a_j (accepted
at j given j-1 accepted), the measured cost of drafting one token, and the measured
cost of a verify pass by width. Each step it picks the k in 0..k_max that maximises

    expected tokens / expected time = (1 + sum_j<=k prod_i<=j a_i)
                                      / (verify(k + 1) + draft_call(k))

k = 0 is a plain step. When drafts keep failing, k falls to 0, and a one-token probe
every `probe_every` steps keeps the acceptance estimate alive at little cost, so
decoding stays close to plain speed. When drafts are good, k grows as long as the
marginal token is worth its verify and draft time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FixedK:
    k: int

    def choose(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        return None


@dataclass
class AdaptiveK:
    k_max: int = 8
    prior_rate: float = 0.5  # acceptance prior before anything is measured
    prior_weight: float = 4.0  # in pseudo-observations
    decay: float = 0.98  # forget old steps: acceptance drifts within and across requests
    probe_every: int = 16
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    verify_s: dict[int, float] = field(default_factory=dict)  # width -> EMA seconds
    draft_token_s: float | None = None  # EMA seconds per drafted token
    steps_at_zero: int = 0
    history: list[int] = field(default_factory=list)  # k chosen per step, for reports

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max={self.k_max} must be >= 1")
        self.tried = [0.0] * self.k_max
        self.accepted = [0.0] * self.k_max

    def rates(self) -> list[float]:
        """Conditional acceptance per position. Each position is smoothed towards the
        estimate of the position before it, so positions rarely tried (beyond the k
        chosen so far) inherit the measured rate instead of a fixed prior: a pessimistic
        prior there would keep k small for ever, since untried positions never update."""
        w = self.prior_weight
        out: list[float] = []
        previous = self.prior_rate
        for a, t in zip(self.accepted, self.tried, strict=True):
            previous = (a + w * previous) / (t + w)
            out.append(previous)
        return out

    def _verify_cost(self, width: int) -> float:
        known = self.verify_s
        if width in known:
            return known[width]
        if not known:
            return 1.0
        # Interpolate from the nearest measured widths; unmeasured wider passes are
        # assumed a little costlier than the widest measured one (never cheaper).
        lower = [w for w in known if w < width]
        upper = [w for w in known if w > width]
        if lower and upper:
            lo, hi = max(lower), min(upper)
            f = (width - lo) / (hi - lo)
            return known[lo] * (1 - f) + known[hi] * f
        if lower:
            lo = max(lower)
            return known[lo] * (1.0 + 0.03 * (width - lo))
        return known[min(upper)]

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second with k drafts."""
        rates = self.rates()
        tokens, survive = 1.0, 1.0
        for j in range(k):
            survive *= rates[j]
            tokens += survive
        draft = (self.draft_token_s or 0.0) * k
        return tokens / (self._verify_cost(k + 1) + draft)

    def choose(self, limit: int) -> int:
        limit = min(limit, self.k_max)
        if limit <= 0:
            return 0
        best = max(range(limit + 1), key=self.expected_rate)
        if best == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero % self.probe_every == 0:
                best = 1  # probe: keep measuring acceptance
        else:
            self.steps_at_zero = 0
        self.history.append(best)
        return best

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        for j in range(self.k_max):
            self.tried[j] *= self.decay
            self.accepted[j] *= self.decay
        # Verification stops at the first rejection: positions past it were not judged.
        for j in range(min(drafted, accepted + 1, self.k_max)):
            self.tried[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0
        width = drafted + 1
        old = self.verify_s.get(width)
        self.verify_s[width] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        if drafted:
            per_token = draft_s / drafted
            d = self.draft_token_s
            self.draft_token_s = per_token if d is None else 0.8 * d + 0.2 * per_token
