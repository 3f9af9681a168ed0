"""Prometheus metrics of the server, in their own registry (several servers, or tests,
can live in one process). Names follow vLLM's spec-decode metrics under `speculant:`."""

from __future__ import annotations

import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("speculant.server")

LOW_ACCEPTANCE = 0.70  # below this the draft is misaligned with the target
WINDOW_TOKENS = 1000  # the recent acceptance rate covers about this many draft tokens
MIN_TOKENS_TO_WARN = 200  # do not judge the draft on fewer draft tokens than this
WARN_EVERY_S = 60.0

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, model: str, draft: str | None, method: str) -> None:
        self.registry = CollectorRegistry()
        self.draft = draft or method
        self.method = method
        r = self.registry
        self.num_drafts = Counter(
            "speculant:spec_decode_num_drafts",
            "Verify steps in which at least one token was drafted.",
            registry=r,
        )
        self.num_draft_tokens = Counter(
            "speculant:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r
        )
        self.num_accepted_tokens = Counter(
            "speculant:spec_decode_num_accepted_tokens",
            "Draft tokens the target accepted.",
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "speculant:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first drafted token).",
            ["position"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "speculant:spec_decode_acceptance_rate",
            f"Accepted / drafted over about the last {WINDOW_TOKENS} draft tokens.",
            registry=r,
        )
        self.anomalies = Counter(
            "speculant:spec_decode_anomalous_requests",
            "Requests whose acceptance rate fell far below the deployment's baseline "
            "(z-score under the threshold; see docs/security.md).",
            registry=r,
        )
        self.requests = Counter(
            "speculant:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "speculant:request_errors",
            "Requests answered with an error, by status.",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "speculant:prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(
            "speculant:generation_tokens", "Tokens generated.", registry=r
        )
        self.running = Gauge(
            "speculant:num_requests_running", "Sequences in the running batch.", registry=r
        )
        self.waiting = Gauge(
            "speculant:num_requests_waiting", "Requests waiting for a batch slot.", registry=r
        )
        self.prefix_queries = Counter(
            "speculant:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "speculant:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (copied, not computed).",
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "speculant:prefix_cache_blocks",
            "Blocks of 16 tokens held in the prefix cache.",
            registry=r,
        )
        self.ttft = Histogram(
            "speculant:time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "speculant:inter_token_latency_seconds",
            "Time per output token between consecutive steps of a request "
            "(a step's interval divided by the tokens it committed).",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "speculant:e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        info = Gauge(
            "speculant:model_info",
            "The served model and how it drafts (value 1).",
            ["model", "draft", "method"],
            registry=r,
        )
        info.labels(model=model, draft=draft or "", method=method).set(1)
        self._window: deque[tuple[int, int]] = deque()
        self._window_drafted = 0
        self._window_accepted = 0
        self._last_warning = float("-inf")
        self.warnings = 0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record_step(self, drafted: int, accepted: int) -> None:
        """One verify step of one sequence."""
        if drafted <= 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            self.accepted_per_pos.labels(position=str(pos)).inc()
        self._window.append((drafted, accepted))
        self._window_drafted += drafted
        self._window_accepted += accepted
        while self._window and self._window_drafted - self._window[0][0] >= WINDOW_TOKENS:
            d, a = self._window.popleft()
            self._window_drafted -= d
            self._window_accepted -= a
        rate = self.recent_acceptance()
        if rate is None:
            return
        self.acceptance_rate.set(rate)
        self._maybe_warn(rate)

    def recent_acceptance(self) -> float | None:
        if not self._window_drafted:
            return None
        return self._window_accepted / self._window_drafted

    def _maybe_warn(self, rate: float) -> None:
        if self._window_drafted < MIN_TOKENS_TO_WARN or rate >= LOW_ACCEPTANCE:
            return
        now = time.monotonic()
        if now - self._last_warning < WARN_EVERY_S:
            return
        self._last_warning = now
        self.warnings += 1
        log.warning(
            "draft acceptance rate %.0f%% over the last %d draft tokens is below %.0f%%: "
            "the draft (%s) is misaligned with the target for this traffic. Try a smaller "
            "--num-speculative-tokens (or 'auto'), or a draft better aligned with the "
            "target (same family, fine-tuned on this domain).",
            100 * rate,
            self._window_drafted,
            100 * LOW_ACCEPTANCE,
            self.draft,
        )
