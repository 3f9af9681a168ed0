"""OpenAI-compatible server: `speculant serve`. The HTTP layer (app.py) sees only the
`EngineClient` protocol; `AsyncEngine` batches requests on one engine thread."""

from speculant.server.app import create_app
from speculant.server.async_engine import (
    AsyncEngine,
    EngineClient,
    EngineDraining,
    QueueFull,
    RequestOutput,
)
from speculant.server.metrics import ServerMetrics
from speculant.server.schema import APIError

__all__ = [
    "APIError",
    "AsyncEngine",
    "EngineClient",
    "EngineDraining",
    "QueueFull",
    "RequestOutput",
    "ServerMetrics",
    "create_app",
]
