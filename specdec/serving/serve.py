"""``specdec serve``: run the server in the foreground, drain it on a signal, bring it back when it fails.

The policy of the command; ``specdec.serving.server.TritonServer`` holds the mechanisms (start, drain, restart,
cleanup). Standard library only, so ``specdec serve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from specdec.serving.control import ADMIN_HEADER, GRPC_ADMIN_HEADER
from specdec.serving.install import TritonError
from specdec.serving.openai.process import API_KEY_ENV, DEFAULT_PORT, OpenAIFrontend, model_name
from specdec.serving.repository import validate_repository
from specdec.serving.server import (
    PortInUseError,
    TritonServer,
    TritonStartError,
    error_summary,
    loopback,
    port_free,
)
from specdec.serving.supervisor import POLL_S, RestartPolicy, Supervisor

SUPERVISE_POLL_S = POLL_S


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec serve`` (kept here so cli.py only wires the subcommand)."""
    parser.add_argument("model_repository", help="Triton model repository (e.g. the one `specdec export` wrote)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for all, warned)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("SPECDEC_ADMIN_KEY"),
        help="the value of the specdec-admin-key header that Triton's management APIs (model "
        "repository, shared memory, logging, trace) require (default $SPECDEC_ADMIN_KEY, else "
        "a random key written to a private file named at start)",
    )
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)")
    parser.add_argument(
        "--openai-port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port of the OpenAI-compatible HTTP API (/v1/chat/completions, ...; default {DEFAULT_PORT})",
    )
    parser.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible API")
    parser.add_argument(
        "--openai-model-name",
        help="the model name OpenAI clients send (default: the export's target name, from its manifest)",
    )
    parser.add_argument(
        "--openai-api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on the OpenAI API (default ${API_KEY_ENV}; none: open)",
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        help="server log (default: a temporary file, printed at start, "
        "removed after a clean exit unless something went wrong)",
    )
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for all models to load (default 300)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGINT/SIGTERM, seconds the requests in flight may take to finish before they are "
        "aborted (default 60; pair it with the pod's terminationGracePeriodSeconds)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="repairs (a dead or frozen stub reloaded, tritonserver or the frontend restarted) allowed within "
        f"--restart-window before `specdec serve` calls it a crash loop and exits 1 (default "
        f"{RestartPolicy.max_restarts}; 0: never repair)",
    )
    parser.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window_s,
        help=f"seconds over which --max-restarts counts (default {RestartPolicy.window_s:.0f}); repairs wait an "
        f"exponential backoff from {RestartPolicy.backoff_s:g} s",
    )
    parser.add_argument(
        "--exit-timeout",
        type=int,
        default=30,
        help="tritonserver --exit-timeout-secs: seconds it may take to unload after the drain (default 30)",
    )
    return parser


def serve_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the server in the foreground until SIGINT/SIGTERM; return its exit code (1 on launcher errors).

    The first signal drains (``TritonServer.drain``: nothing new is admitted, every request in flight is
    answered in full), then Triton unloads the models and exits; a second signal, or ``--drain-timeout``,
    ends what is left with UNAVAILABLE first. Exit 0 when the server stopped cleanly.
    """
    if not isinstance(args, argparse.Namespace):
        parser = add_serve_args(argparse.ArgumentParser(prog="specdec serve", description=__doc__))
        args = parser.parse_args(None if args is None else list(args))
    server = TritonServer(log_file=args.log_file)
    frontend = None if args.no_openai else _frontend(args)
    signals: list[int] = []

    def close_gate() -> None:
        with contextlib.suppress(TritonError, OSError, RuntimeError):
            server.set_ready(False)

    def remember(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)
        if len(signals) == 1 and server.running():  # readiness false from the first instant of the drain, from
            # a thread: the handler returns at once, and a second signal is heard while the gate closes
            threading.Thread(target=close_gate, name="specdec-close-gate", daemon=True).start()

    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args, server, frontend, signals)
    finally:
        if frontend is not None and frontend.running():  # every way out stops it (a clean one already has)
            frontend.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _frontend(args: argparse.Namespace) -> OpenAIFrontend:
    """The OpenAI frontend ``specdec serve`` runs beside tritonserver (started once the models are ready)."""
    return OpenAIFrontend(
        triton_url="",  # the server's gRPC address, set once it has started (``_start``)
        model=args.openai_model_name or model_name(Path(args.model_repository)),
        host=args.host,
        port=args.openai_port,
        api_key=args.openai_api_key or None,
        graceful_s=args.drain_timeout,
    )


def _check_frontend_port(args: argparse.Namespace) -> None:
    """The OpenAI port must be free and differ from the others, checked before anything starts."""
    others = {"--grpc-port": args.grpc_port, "--http-port": args.http_port, "--metrics-port": args.metrics_port}
    clash = [flag for flag, port in others.items() if port == args.openai_port]
    if clash:
        raise PortInUseError(f"--openai-port {args.openai_port} is also {clash[0]}: the ports must differ")
    if not port_free(args.host, args.openai_port):
        raise PortInUseError(
            f"port {args.openai_port} on {args.host} (--openai-port) is already in use; pick another with "
            "--openai-port (or --no-openai)"
        )


def _start(
    args: argparse.Namespace,
    server: TritonServer,
    frontend: OpenAIFrontend | None,
    signals: list[int],
    supervisor: Supervisor,
) -> None:
    """Start tritonserver, wait until its models are ready, then the frontend (``TritonError`` if one fails)."""
    if frontend is not None:
        validate_repository(args.model_repository)  # a bad repository is named first, as ``server.start`` would
        _check_frontend_port(args)
    if not loopback(args.host):
        print(
            f"warning: --host {args.host} serves every network this machine is on; inference has no "
            "authentication (put it behind a gateway that has), management APIs need the admin key"
            + ("" if frontend is None or frontend.api_key else f", the OpenAI API none unless ${API_KEY_ENV}"),
            file=sys.stderr,
            flush=True,
        )
    server.start(
        args.model_repository,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        exit_timeout_s=args.exit_timeout,
        admin_key=args.admin_key,
    )
    if not args.admin_key:
        print(
            f"specdec serve: management APIs need header {ADMIN_HEADER} (HTTP) / {GRPC_ADMIN_HEADER} "
            f"(gRPC): its value is in {server.write_admin_key()}",
            file=sys.stderr,
            flush=True,
        )
    assert server.install is not None  # start() found tritonserver, or raised
    print(
        f"specdec serve: starting {server.install.binary} ({server.install.source}); log: {server.log_file}",
        file=sys.stderr,
        flush=True,
    )
    _until_ready(server, supervisor, args.ready_timeout, signals)
    if frontend is not None and not signals:
        frontend.triton_url = server.grpc_url
        frontend.start()
        frontend.wait_ready()


def _serve(args: argparse.Namespace, server: TritonServer, frontend: OpenAIFrontend | None, signals: list[int]) -> int:
    supervisor = Supervisor(server, frontend, RestartPolicy(args.max_restarts, args.restart_window))
    try:
        _start(args, server, frontend, signals, supervisor)
    except TritonError as exc:
        if frontend is not None:
            frontend.stop()
        server.stop()
        if signals:
            return 128 + signals[0]
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if signals:  # stopped while loading: nothing was admitted yet, so there is nothing to drain
        if frontend is not None:
            frontend.stop()
        server.stop()
        return 0
    openai = "" if frontend is None else f"  OpenAI  {frontend.url}/v1 (model {frontend.model!r})\n"
    print(
        f"specdec serve: ready\n  gRPC    {server.grpc_url}\n  HTTP    {server.http_url}\n"
        f"  metrics {server.metrics_url}\n{openai}(Ctrl-C to stop: in-flight requests finish first)",
        flush=True,
    )
    if not _supervise(supervisor, signals, lambda: _until_ready(server, supervisor, args.ready_timeout, signals)):
        server.stop()
        return 1
    if signals:
        print(
            f"specdec serve: {signal.Signals(signals[0]).name}: draining, admitting no new requests "
            f"({server.inflight() or 0} in flight; signal again to abort them)",
            file=sys.stderr,
            flush=True,
        )
        if frontend is not None:
            frontend.drain()
        aborted = server.drain(args.drain_timeout, abort=lambda: len(signals) > 1)
        if aborted:
            print(f"specdec serve: aborted {aborted} request(s) still in flight", file=sys.stderr, flush=True)
    return _stop(server, frontend, signals)


def _stop(server: TritonServer, frontend: OpenAIFrontend | None, signals: list[int]) -> int:
    """Stop the frontend, then tritonserver; the exit code of ``specdec serve`` (0: both stopped cleanly).

    The frontend first: its open streams have had their last responses from Triton and finish writing them.
    """
    frontend_code = None if frontend is None else frontend.stop()
    code = server.stop()
    assert code is not None
    if code < 0:  # killed by a signal: report it the way a shell would
        code = 128 - code
    if code != 0:
        print(f"error: tritonserver exited with code {code}\n{error_summary(server.read_log())}", file=sys.stderr)
    elif frontend_code not in (None, 0):
        assert frontend is not None
        print(
            f"error: the OpenAI frontend exited with code {frontend_code}\n{frontend.read_log()[-3000:]}",
            file=sys.stderr,
        )
        code = 1
    elif signals:
        print("specdec serve: stopped", file=sys.stderr, flush=True)
    return code


def _supervise(supervisor: Supervisor, signals: list[int], wait_ready: Callable[[], None]) -> bool:
    """Serve until a signal, repairing whatever fails (``Supervisor``); False: it could not be repaired."""
    while not signals:
        fault = supervisor.fault()
        if fault is None:
            time.sleep(SUPERVISE_POLL_S)
            continue
        if not supervisor.repair(fault, wait_ready):
            return False
    return True


def _until_ready(server: TritonServer, supervisor: Supervisor, timeout: float, signals: list[int]) -> None:
    """Wait until every model is ready, watching the stubs from their first heartbeat: one that dies or freezes
    while the others load (or as Triton turns ready) is repaired like any other. A signal ends the wait (the
    caller then stops the server); a tritonserver that exits while starting is an error with its log."""
    deadline = time.monotonic() + timeout
    while not signals:
        fault = supervisor.fault()
        if fault is not None and not fault.frontend and server.running():
            if not supervisor.repair(fault, wait_ready=lambda: None):
                raise TritonStartError(f"{fault.what} while the server started, and it could not be repaired")
            continue
        try:
            server.wait_ready(min(1.0, max(0.0, deadline - time.monotonic())))
            return
        except TritonStartError:
            if not server.running() or time.monotonic() >= deadline:
                raise
