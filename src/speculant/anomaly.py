"""Acceptance-rate anomaly signal: a request whose drafts are accepted far less often
than usual for this deployment is flagged.

Why: the draft approximates the target on the traffic it was chosen (or trained) for.
Jailbreaks, prompt injections and other out-of-distribution inputs push the target
somewhere the draft does not follow, so their acceptance rate drops. It is a signal to
log and look at, not a verdict.

The statistic. For request r with n_r drafted tokens of which a fraction x_r was
accepted, against exponentially weighted estimates over earlier requests of the mean
acceptance m and of the between-request variance s^2 (the variance of per-request
rates minus the part binomial noise explains):

    z_r = (x_r - m) / sqrt(s^2 + m (1 - m) / n_r + 1e-4)

so a short request, whose rate is noisy, needs a larger gap to stand out. A request is
flagged when z_r < threshold (default -3) once the baseline has seen `min_requests`
requests; flagged requests do not update the baseline (an attack cannot drag it down).
Requests with fewer than `min_drafted` drafted tokens are not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AnomalyVerdict:
    acceptance_rate: float | None  # this request's, None when it drafted too little
    zscore: float | None  # None until the baseline is warm, or when not judged
    flagged: bool
    baseline_acceptance: float | None
    baseline_requests: int

    def to_dict(self) -> dict[str, object]:
        return {
            "acceptance_zscore": self.zscore,
            "anomaly": self.flagged,
            "baseline_acceptance": self.baseline_acceptance,
            "baseline_requests": self.baseline_requests,
        }


class AcceptanceBaseline:
    def __init__(
        self,
        threshold: float = -3.0,
        min_requests: int = 20,
        min_drafted: int = 16,
        half_life: float = 200.0,
    ) -> None:
        if not threshold < 0:
            raise ValueError(f"anomaly threshold {threshold} is out of range: use a negative z")
        if min_requests < 2 or min_drafted < 1 or half_life <= 0:
            raise ValueError(
                f"min_requests={min_requests} (>= 2), min_drafted={min_drafted} (>= 1), "
                f"half_life={half_life} (> 0): out of range"
            )
        self.threshold = threshold
        self.min_requests = min_requests
        self.min_drafted = min_drafted
        self.decay = 0.5 ** (1.0 / half_life)
        self.weight = 0.0  # sum of weights
        self.mean = 0.0  # weighted mean of rates
        self.var = 0.0  # weighted variance of rates
        self.noise = 0.0  # weighted mean of m(1-m)/n: the binomial part of var
        self.requests = 0
        self.flagged = 0

    def zscore(self, drafted: int, accepted: int) -> float | None:
        if self.requests < self.min_requests or drafted < self.min_drafted:
            return None
        m = self.mean
        between = max(0.0, self.var - self.noise)
        se = math.sqrt(between + m * (1 - m) / drafted + 1e-4)
        return (accepted / drafted - m) / se

    def judge(self, drafted: int, accepted: int) -> AnomalyVerdict:
        """Score one finished request, then learn from it unless it is flagged."""
        if drafted < self.min_drafted:
            base = self.mean if self.requests else None
            return AnomalyVerdict(None, None, False, base, self.requests)
        rate = accepted / drafted
        z = self.zscore(drafted, accepted)
        flagged = z is not None and z < self.threshold
        verdict = AnomalyVerdict(
            rate, z, flagged, self.mean if self.requests else None, self.requests
        )
        if flagged:
            self.flagged += 1
        else:
            self._update(rate, drafted)
        return verdict

    def _update(self, rate: float, drafted: int) -> None:
        w = self.weight * self.decay
        total = w + 1.0
        delta = rate - self.mean
        mean = self.mean + delta / total
        self.var = (w * self.var + delta * (rate - mean)) / total
        self.mean = mean
        noise = mean * (1 - mean) / drafted
        self.noise = (w * self.noise + noise) / total
        self.weight = total
        self.requests += 1
