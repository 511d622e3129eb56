"""``python -m specdec.serving.openai``: the OpenAI-compatible frontend of a running ``specdec serve`` (uvicorn).

``specdec serve`` starts it by itself (``--openai-port``); run it by hand to put a frontend in front of a Triton
endpoint elsewhere, or several of them behind a balancer (it keeps no state between requests).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from specdec.serving.openai.process import API_KEY_ENV, DEFAULT_PORT, model_name
from specdec.serving.server import loopback


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from specdec.serving.openai.app import DEFAULT_MAX_BODY_BYTES

    parser = argparse.ArgumentParser(prog="python -m specdec.serving.openai", description=__doc__)
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC address of the Triton endpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    name = parser.add_mutually_exclusive_group(required=True)
    name.add_argument("--model-name", help="the model name clients send (`model`) and /v1/models lists")
    name.add_argument("--export", type=Path, help="take the model name from this export's manifest")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM/SIGINT, seconds the open responses may take to finish (default 60)",
    )
    parser.add_argument("--control-dir", type=Path, help="the launcher's drain flag directory (specdec serve)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn

    from specdec.serving.openai.app import Frontend, Settings, create_app

    api_key = os.environ.get(API_KEY_ENV) or None
    if not loopback(args.host) and not api_key:
        print(
            f"warning: --host {args.host} serves every network this machine is on without an API key: set "
            f"${API_KEY_ENV}",
            file=sys.stderr,
            flush=True,
        )
    settings = Settings(
        triton_url=args.triton_url,
        model=args.model_name or model_name(args.export),
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        timeout_s=args.timeout,
        control_dir=args.control_dir,
    )
    app = create_app(settings)
    frontend: Frontend = app.state.frontend
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    class Server(uvicorn.Server):
        """uvicorn, draining on its shutdown signal: readiness and new requests refused while streams finish."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            frontend.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(args.graceful_timeout),
        lifespan="on",
    )
    server = Server(config)
    # uvicorn re-raises the shutdown signal once it has shut down, into the handler that was there before it: this
    # one lets the process end with 0 after a graceful shutdown, instead of being killed by its own signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _sig, _frame: None)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
