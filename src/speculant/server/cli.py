"""`speculant serve`: the vLLM launch shape (--model, --speculative-model,
--num-speculative-tokens, ...) on an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from speculant.argtypes import add_dtype_args, k_value, port, positive_int

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"

EPILOG = """\
examples:
  speculant serve --speculative-model qwen2.5-coder-0.5b-instruct     # default target, draft model
  speculant serve --model smollm2-135m-instruct --speculative-method ngram -k auto
  SPECULANT_API_KEY=secret speculant serve --host 0.0.0.0 --max-num-seqs 4

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
        "--eagle-head",
        default=None,
        metavar="DIR",
        help="EAGLE head folder (speculant train eagle) for --speculative-method eagle",
    )
    p.add_argument(
        "--tree-topk", type=int, default=1, help="eagle: candidates per tree node (1 = chain)"
    )
    p.add_argument("--tree-tokens", type=int, default=16, help="eagle: draft tokens per tree")
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
        "--served-model-name", default=None, help="model id in the API (default --model)"
    )
    add_dtype_args(p)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
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


def build_server(args: argparse.Namespace) -> tuple[Any, Any]:
    """(app, AsyncEngine) from parsed flags: the models are loaded here."""
    import torch

    from speculant.engine import Engine
    from speculant.models.model import load_model
    from speculant.server.app import create_app
    from speculant.server.async_engine import AsyncEngine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    method = args.speculative_method or ("draft" if args.speculative_model else "none")
    if method == "draft" and not args.speculative_model:
        raise ValueError("--speculative-method draft needs --speculative-model NAME")
    trust = args.trust_unverified
    target = load_model(args.model, dtype=args.dtype, trust_unverified=trust)
    draft = None
    if method == "draft":
        draft = load_model(
            args.speculative_model,
            dtype=args.draft_dtype,
            trust_unverified=trust,
            auto_fallback="int8",
        )
    if args.threads is None:
        from speculant import native

        native.share_cores_if_native(target, draft)
    engine = Engine(
        target,
        draft=draft,
        method=method,
        num_speculative_tokens=args.num_speculative_tokens,
        max_seq_len=args.max_model_len,
        proposer_options=(
            {
                "eagle_head": args.eagle_head,
                "tree_topk": args.tree_topk,
                "tree_tokens": args.tree_tokens,
                "trust_unverified": trust,
            }
            if method == "eagle"
            else None
        ),
    )
    name = args.served_model_name or str(args.model)
    async_engine = AsyncEngine(
        engine,
        model_name=name,
        max_num_seqs=args.max_num_seqs,
        draft_name=draft.name if draft is not None else None,
        anomaly_z=args.anomaly_z,
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
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
