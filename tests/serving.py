"""Test helpers: run the real app on a loopback port in a thread; read its metrics."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from speculant.server import AsyncEngine, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(
    engine: AsyncEngine, api_key: str | None = None, cadence_s: float | None = None
) -> Iterator[str]:
    """The app on 127.0.0.1:<free port>, started and stopped (with its engine thread)."""
    port = free_port()
    app = create_app(engine, api_key=api_key, stream_cadence_s=cadence_s)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed 'name{label=value,...}'."""
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
