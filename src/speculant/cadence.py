"""Fixed-cadence streaming: a mitigation of the speculative timing side channel.

Speculative decoding commits several tokens at once when drafts are accepted and one
when they are not, so the arrival times of streamed text reveal, token by token, where
the draft agreed with the target: information about the target's distribution and, on
a shared server, about the text itself. In cadence mode every token is emitted as its
own event, one every `cadence_s` seconds from the first token, whatever step committed
it: the observable timing is the same for any pattern of acceptance.

What it hides: which tokens came in the same verify step (acceptance), and so the
draft/target agreement pattern. What it does not hide: the time to the first token
(prefill, prompt length), the total number of tokens, each event's size (one token's
text: pad or batch at the transport if that matters), and any tick the engine misses
because generation ran slower than the cadence (counted in `late`; choose a cadence at
or above the slowest per-token time, e.g. plain decoding's, so none are missed).
The cost is latency: tokens that were ready early wait for their tick.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator

from speculant.detokenize import TokenSplitter
from speculant.requests import StreamChunk


class Ticker:
    """The slots of a fixed cadence: the i-th emission is due at t_first + i * cadence_s.
    `delay(now)` says how long to wait before the next emission and counts late ones."""

    def __init__(self, cadence_s: float) -> None:
        if not cadence_s > 0:
            raise ValueError(f"stream cadence {cadence_s!r} s is out of range: use > 0")
        self.cadence_s = cadence_s
        self.start: float | None = None
        self.ticks = 0
        self.late = 0  # emissions after their slot (generation slower than the cadence)

    def delay(self, now: float) -> float:
        if self.start is None:
            self.start = now
        slot = self.start + self.ticks * self.cadence_s
        self.ticks += 1
        if now < slot:
            return slot - now
        if self.ticks > 1 and now - slot > self.cadence_s / 2:
            self.late += 1
        return 0.0


def paced(
    chunks: Iterable[StreamChunk],
    decode: Callable[[list[int]], str],
    ticker: Ticker,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """Yield one text piece per token, each at its slot of `ticker`."""
    splitter = TokenSplitter(decode)
    for chunk in chunks:
        for piece in splitter.split(chunk):
            wait = ticker.delay(clock())
            if wait > 0:
                sleep(wait)
            yield piece


async def wait_for_slot(ticker: Ticker) -> None:
    wait = ticker.delay(time.perf_counter())
    if wait > 0:
        await asyncio.sleep(wait)
