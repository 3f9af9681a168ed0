"""`speculant serve`: the vLLM launch shape (--model, --speculative-model,
--num-speculative-tokens, ...) on an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from speculant.argtypes import (
    add_dtype_args,
    add_proposer_args,
    k_value,
    nonneg_int,
    port,
    positive_float,
    positive_int,
    positive_seconds,
    proposer_options,
    seconds,
    speculative_config,
)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_BATCHED_TOKENS = 32  # prompt rows a pass carries beside decoding (see docs/serving.md)

EPILOG = """\
examples:
  speculant serve --speculative-model qwen2.5-coder-0.5b-instruct     # default target, draft model
  speculant serve --model smollm2-135m-instruct --speculative-method ngram -k auto
  SPECULANT_API_KEY=secret speculant serve --host 0.0.0.0 --max-num-seqs 4
  speculant serve --max-waiting 16 --request-timeout 120 --drain-timeout 60

then, with any OpenAI client:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "qwen2.5-coder-1.5b-instruct", "messages": [{"role": "user", "content": "hi"}]}'
  curl http://127.0.0.1:8000/metrics       # Prometheus, acceptance rate included
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from speculant.proposers import available_methods

    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server with speculative decoding and Prometheus metrics",
        description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
        "/health and /metrics. Concurrent requests are decoded together: one target pass "
        "verifies the drafts of every running request.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_TARGET, help="target model: name, .gguf or folder")
    p.add_argument(
        "--speculative-model", default=None, help="draft model (same tokenizer as the target)"
    )
    p.add_argument(
        "--speculative-method",
        choices=available_methods(),
        default=None,
        help="how to draft (default: draft when --speculative-model is given, else none)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        "-k",
        type=k_value,
        default=5,
        help="tokens drafted per step, 0..64 or auto (default 5)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help="vLLM's form of the three flags above, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 5}\' '
        "(methods: draft_model, ngram, eagle, eagle3, suffix, layer-skip, none; for eagle, "
        '"model" is the head folder)',
    )
    add_proposer_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECULANT_API_KEY)",
    )
    p.add_argument(
        "--max-model-len", type=positive_int, default=None, help="context length (default: model's)"
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=8,
        help="requests decoded at once; more wait in order (default 8)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=nonneg_int,
        default=DEFAULT_BATCHED_TOKENS,
        help="rows per target pass that decoding and prompt chunks share: a long prompt is "
        "prefilled in chunks alongside the running requests instead of stalling them "
        f"(default {DEFAULT_BATCHED_TOKENS}; 0: prefill each prompt whole when it joins)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the computed keys and values of earlier requests' prompts and outputs "
        "for prompts that start the same way: shared system prompts, a chat's earlier turns "
        "(default: on)",
    )
    p.add_argument(
        "--prefix-cache-gib",
        type=positive_float,
        default=1.0,
        help="memory the prefix cache may hold, in GiB (default 1; least recently used "
        "prefixes are dropped beyond it)",
    )
    p.add_argument(
        "--max-waiting",
        type=nonneg_int,
        default=64,
        help="requests that may wait for a slot; one more gets a 429 with Retry-After "
        "(default 64; 0: no waiting room)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="end a request this long after its arrival (waiting included) with "
        'finish_reason "abort" and the text so far (default: no limit)',
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM / SIGINT, let running and waiting requests finish this long, "
        'then end them with finish_reason "abort" and exit (default 30)',
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id in the API (default --model)"
    )
    add_dtype_args(p)
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads for the kernels (default: one per CPU this process may "
        "use, within its CPU quota, or $SPECULANT_THREADS); beside the native kernels "
        "PyTorch keeps one",
    )
    p.add_argument(
        "--stream-cadence-ms",
        type=float,
        default=None,
        help="stream one token per event every N ms, whatever was accepted together: "
        "hides the acceptance timing side channel (see docs/security.md)",
    )
    p.add_argument(
        "--anomaly-z",
        type=float,
        default=-3.0,
        help="flag requests whose acceptance rate is this many standard deviations below "
        "the running baseline (default -3; see docs/security.md)",
    )
    p.add_argument("--trust-unverified", action="store_true", help="load unverified GGUF files")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
    return p


def apply_speculative_config(args: argparse.Namespace) -> None:
    """Fill the separate flags from --speculative-config (refusing a mix of both)."""
    config = args.speculative_config
    mixed = [
        flag
        for flag, value in (
            ("--speculative-model", args.speculative_model),
            ("--speculative-method", args.speculative_method),
            ("--eagle-head", args.eagle_head),
        )
        if value is not None
    ]
    if mixed:
        raise ValueError(
            f"--speculative-config and {', '.join(mixed)} both say how to draft: use one form"
        )
    args.speculative_method = config["method"]
    if config["method"] == "eagle":
        args.eagle_head = config["model"]
    elif "model" in config:
        args.speculative_model = config["model"]
    for key in ("num_speculative_tokens", "ngram_max", "ngram_min"):
        if key in config:
            setattr(args, key, config[key])


def build_server(args: argparse.Namespace) -> tuple[Any, Any]:
    """(app, AsyncEngine) from parsed flags: the models are loaded here."""
    from speculant import native
    from speculant.engine import Engine
    from speculant.models.model import load_model
    from speculant.server.app import create_app
    from speculant.server.async_engine import AsyncEngine

    native.use_threads(args.threads)
    if args.speculative_config is not None:
        apply_speculative_config(args)
    method = args.speculative_method or ("draft" if args.speculative_model else "none")
    if method == "draft" and not args.speculative_model:
        raise ValueError("--speculative-method draft needs --speculative-model NAME")
    trust = args.trust_unverified
    kv = args.kv_dtype
    target = load_model(args.model, dtype=args.dtype, trust_unverified=trust, kv_dtype=kv)
    draft = None
    if method == "draft":
        draft = load_model(
            args.speculative_model,
            dtype=args.draft_dtype,
            trust_unverified=trust,
            auto_fallback="int8",
            kv_dtype=kv,
        )
    native.share_cores_if_native(target, draft)
    engine = Engine(
        target,
        draft=draft,
        method=method,
        num_speculative_tokens=args.num_speculative_tokens,
        max_seq_len=args.max_model_len,
        proposer_options=proposer_options(method, args),
    )
    name = args.served_model_name or str(args.model)
    async_engine = AsyncEngine(
        engine,
        model_name=name,
        max_num_seqs=args.max_num_seqs,
        draft_name=draft.name if draft is not None else None,
        anomaly_z=args.anomaly_z,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
        max_num_batched_tokens=args.max_num_batched_tokens or None,
        prefix_cache_bytes=int(args.prefix_cache_gib * 2**30) if args.enable_prefix_caching else 0,
    )
    api_key = args.api_key or os.environ.get("SPECULANT_API_KEY") or None
    cadence = args.stream_cadence_ms
    if cadence is not None and not cadence > 0:
        raise ValueError(f"--stream-cadence-ms={cadence} is out of range: use > 0")
    cadence_s = cadence / 1000 if cadence else None
    return create_app(async_engine, api_key=api_key, stream_cadence_s=cadence_s), async_engine


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app, engine = build_server(args)
    key = "on" if (args.api_key or os.environ.get("SPECULANT_API_KEY")) else "off"
    print(
        f"serving {engine.model_name} ({engine.method}, k={engine.num_speculative_tokens}, "
        f"context {engine.max_model_len}, up to {engine.max_num_seqs} at once, API key {key}) "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_WRITE_S,
    )
    draining_server(config, engine, args.drain_timeout).run()
    return 0


GRACEFUL_WRITE_S = 10  # after the drain: time for the last responses to be written


def draining_server(config: Any, engine: Any, drain_timeout: float) -> Any:
    """A uvicorn.Server whose SIGTERM / SIGINT drains instead of stopping at once.

    First signal: the engine stops admitting (new /v1 requests get 503, /health says
    draining) while the server keeps answering; running and waiting requests get up to
    drain_timeout seconds, then the rest end with finish_reason "abort". Only then does
    uvicorn's own shutdown start (should_exit), which waits for the last responses to be
    written and runs the app's lifespan shutdown. A second signal aborts what is left at
    once; a third is uvicorn's (force exit). The signal is not raised again after the
    shutdown, so the process exits with status 0."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.signals = 0
            self.drain_task: asyncio.Task[bool] | None = None
            self._loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # A signal handler: only flags and a wake-up of the loop, no locks.
            self.signals += 1
            loop = self._loop
            if loop is None or not self.started or self.signals > 2:
                super().handle_exit(sig, frame)
                return
            engine.begin_drain()
            name = signal.Signals(sig).name
            loop.call_soon_threadsafe(self._on_signal, name, self.signals)

        def _on_signal(self, name: str, count: int) -> None:
            if count == 1:
                print(
                    f"{name}: draining: no new requests; running and waiting ones get "
                    f"{drain_timeout:g} s to finish (a second signal aborts them now)",
                    file=sys.stderr,
                )
                assert self._loop is not None
                self.drain_task = self._loop.create_task(self._drain())
            else:
                print(f"{name} again: aborting the requests left", file=sys.stderr)
                engine.abort_all()

        async def _drain(self) -> bool:
            try:
                return bool(await engine.drain(drain_timeout))
            finally:
                self.should_exit = True  # uvicorn's shutdown: stop listening, finish writes

    return DrainingServer(config)
