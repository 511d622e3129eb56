"""A small gRPC client of the served endpoint (``tritonclient.grpc``) and the ``specdec client`` command.

``SpecdecClient.generate`` calls the unary ``specdec`` model; ``SpecdecClient.stream`` calls
``specdec_stream`` over a gRPC stream and yields the partial responses as tokens are
accepted. Every input is typed from ``specdec.serving.protocol``, so what this client sends
is what the server's configs declare.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specdec.runtime.methods import BASELINE_METHOD, DEFAULT_METHOD, SERVED_METHODS, get_method
from specdec.serving import protocol
from specdec.serving.protocol import STREAM_MODEL, UNARY_MODEL

_SPEC = {s.name: s for s in protocol.CLIENT_INPUTS}


class ClientError(RuntimeError):
    """The server refused or failed a request; the message is the server's, ``status`` its gRPC status name
    (``"StatusCode.UNAVAILABLE"``, ``"StatusCode.INVALID_ARGUMENT"``, ...) where the transport reported one."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


def _client_error(exc: Any) -> ClientError:
    """A tritonclient error (``InferenceServerException``) as a ``ClientError`` with its status: the transport's,
    or for a stream's error the one its message leads with (``protocol.coded``)."""
    message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    status = exc.status() if callable(getattr(exc, "status", None)) else None
    in_band, text = protocol.split_coded(message or str(exc))
    if status is None and in_band is not None:
        return ClientError(text, f"StatusCode.{in_band}")
    return ClientError(message or str(exc), None if status is None else str(status))


@dataclass
class Answer:
    """One request's result as the client assembled it (from ``text_output``, ``output_ids`` and the fields of
    ``protocol.METRICS``, each named as its tensor)."""

    text: str
    output_ids: list[int]
    finish_reason: str
    acceptance_rate: float
    accepted_draft_tokens: int
    draft_tokens: int
    target_calls: int
    mean_batch_size: float
    beam_widths: list[int] = field(default_factory=list)  # dsbd / beam: output beams of each round
    prompt_tokens: int = 0
    completion_tokens: int = 0
    responses: int = 1  # partial responses received (streaming)
    seconds: float = 0.0
    first_response_seconds: float = 0.0
    chunks: list[str] = field(default_factory=list)


def make_inputs(prompt: str, **params: Any) -> list[Any]:
    """``InferInput``s for ``prompt`` and the given parameters (None values are not sent)."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in {protocol.TEXT_INPUT.name: prompt, **params}.items():
        if value is None:
            continue
        if name not in _SPEC:
            raise ValueError(f"unknown parameter {name!r}: choose from {', '.join(_SPEC)}")
        array = protocol.array(_SPEC[name], value)
        tensor = grpcclient.InferInput(name, list(array.shape), _SPEC[name].wire_dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _value(result: Any, spec: protocol.TensorSpec) -> Any:
    """An output of a result as Python values: one for a ``[1]`` tensor, else a list (BYTES decoded)."""
    values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in result.as_numpy(spec.name).reshape(-1)]
    return values[0] if spec.dims == (1,) else values


def text_of(result: Any) -> str:
    """The ``text_output`` of one response (a delta when streaming)."""
    return _value(result, protocol.TEXT_OUTPUT)


def _answer(results: Sequence[Any], seconds: float, first: float) -> Answer:
    chunks = [text_of(r) for r in results]
    ids = [t for r in results for t in _value(r, protocol.OUTPUT_IDS)]
    metrics = {spec.name: _value(results[-1], spec) for spec in protocol.METRICS}
    return Answer(
        "".join(chunks),
        ids,
        **metrics,
        responses=len(results),
        seconds=seconds,
        first_response_seconds=first,
        chunks=chunks,
    )


class SpecdecClient:
    """One gRPC connection to a ``specdec serve`` endpoint; use one client per thread."""

    def __init__(self, url: str = "127.0.0.1:8001", timeout_s: float = 600.0) -> None:
        import tritonclient.grpc as grpcclient

        self.url, self.timeout_s = url, timeout_s
        self._client = grpcclient.InferenceServerClient(url)

    def ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready() and self._client.is_model_ready(UNARY_MODEL))
        except Exception:
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise ClientError(f"server at {self.url} not ready after {timeout_s:.0f} s")
            time.sleep(0.5)

    def generate(self, prompt: str, **params: Any) -> Answer:
        """One complete answer from the unary model."""
        from tritonclient.utils import InferenceServerException

        start = time.perf_counter()
        try:
            result = self._client.infer(UNARY_MODEL, make_inputs(prompt, **params), client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            raise _client_error(exc) from exc
        seconds = time.perf_counter() - start
        return _answer([result], seconds, seconds)

    def stream(self, prompt: str, **params: Any) -> Iterator[Any]:
        """Partial results of ``specdec_stream`` as they arrive (tritonclient ``InferResult``s)."""
        events: queue.Queue[tuple[Any, Any]] = queue.Queue()
        # errors arrive in band, without a gRPC status (Triton's default): the `triton_grpc_error` header would give
        # them one, but tritonserver 2.51 then crashed (SIGSEGV in its stream handler) on an error response here
        self._client.start_stream(
            callback=lambda result, error: events.put((result, error)), stream_timeout=self.timeout_s
        )
        complete = False
        try:
            self._client.async_stream_infer(
                STREAM_MODEL,
                make_inputs(prompt, **params),
                request_id=uuid.uuid4().hex,
                enable_empty_final_response=True,
            )
            while True:
                result, error = events.get(timeout=self.timeout_s)
                if error is not None:
                    # specdec's errors are final responses: the request is over on the server, and cancelling it
                    # too would race its completion (tritonserver 2.51 then never unloads specdec_stream)
                    complete = True
                    raise _client_error(error)
                final = result.get_response().parameters.get("triton_final_response")
                if result.get_response().outputs:
                    yield result
                if final is not None and final.bool_param:
                    complete = True
                    return
        finally:
            # cancel only a request that is still running (the caller stopped reading, or an error)
            self._client.stop_stream(cancel_requests=not complete)

    def generate_stream(self, prompt: str, **params: Any) -> Answer:
        """Stream one answer and assemble it (the concatenation of the partial texts)."""
        start = time.perf_counter()
        results: list[Any] = []
        first = 0.0
        for result in self.stream(prompt, **params):
            if not results:
                first = time.perf_counter() - start
            results.append(result)
        if not results:
            raise ClientError("the stream ended without a response")
        return _answer(results, time.perf_counter() - start, first)

    def close(self) -> None:
        self._client.close()


def run_concurrent(
    url: str, prompts: Sequence[str], concurrency: int, stream: bool = False, **params: Any
) -> tuple[list[Answer | ClientError], float]:
    """Send ``prompts`` from ``concurrency`` threads (one client each); answers in prompt order + wall time."""

    def worker(indices: list[int]) -> list[tuple[int, Answer | ClientError]]:
        client = SpecdecClient(url)
        done: list[tuple[int, Answer | ClientError]] = []
        try:
            for i in indices:
                try:
                    call = client.generate_stream if stream else client.generate
                    done.append((i, call(prompts[i], **params)))
                except ClientError as exc:
                    done.append((i, exc))
                except Exception as exc:
                    done.append((i, ClientError(f"{type(exc).__name__}: {exc}")))
        finally:
            client.close()
        return done

    shards = [list(range(t, len(prompts), concurrency)) for t in range(concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [item for part in pool.map(worker, [s for s in shards if s]) for item in part]
    wall = time.perf_counter() - start
    ordered = dict(results)
    return [ordered[i] for i in range(len(prompts))], wall


# --------------------------------------------------------------------------- `specdec client`


def _at_least_one(text: str) -> int:
    """A count flag's value: an integer >= 1 (refused at parsing, before any request is sent)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_client_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of `specdec serve`")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the demo prompts)")
    parser.add_argument("--prompts-file", help="JSON list of strings, or one prompt per line")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=SERVED_METHODS, help=f"default {DEFAULT_METHOD}")
    parser.add_argument("--beam-width", type=int, help="dsbd / beam: beams per step (draft width W_S for dsbd)")
    parser.add_argument("--dsbd-threshold", type=float, help="dsbd dynamic-width threshold (0 = fixed width)")
    parser.add_argument("--dsbd-min-width", type=int, help="dsbd smallest width")
    parser.add_argument("--memory-mode", choices=("full", "single"), help="dsbd / beam: keep one beam per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append")
    parser.add_argument("--chat", action="store_true", help="apply the chat template on the server")
    parser.add_argument("--stream", action="store_true", help="stream through specdec_stream (prints as it comes)")
    parser.add_argument("--concurrency", type=int, default=0, help="client threads (default: one per prompt)")
    parser.add_argument(
        "--compare-ar", action="store_true", help="send the same prompts again with method=ar and print the speed-up"
    )
    parser.add_argument(
        "--repeats",
        type=_at_least_one,
        default=1,
        help="with --compare-ar: warm up once, then send both methods this many times, "
        "interleaved, and report the median of each (a single cold run mostly measures the "
        "first one's warm-up)",
    )
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server to become ready")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--summary", action="store_true", help="print the totals only, not every answer")
    return parser


def _params(args: argparse.Namespace, method: str) -> dict[str, Any]:
    spec = get_method(method, served=True)
    return {
        "method": method,
        "max_tokens": args.max_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "apply_chat_template": True if args.chat else None,
        **({"beam_width": args.beam_width, "memory_mode": args.memory_mode} if spec.beams else {}),
        **(
            {"dsbd_threshold": args.dsbd_threshold, "dsbd_min_width": args.dsbd_min_width}
            if spec.beams and spec.uses_drafter
            else {}
        ),
    }


def _summary(answers: Sequence[Answer | ClientError], wall: float) -> dict[str, float]:
    ok = [a for a in answers if isinstance(a, Answer)]
    tokens = sum(len(a.output_ids) for a in ok)
    drafts = sum(a.draft_tokens for a in ok)
    return {
        "requests": len(answers),
        "errors": len(answers) - len(ok),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2) if wall else 0.0,
        "requests_per_second": round(len(ok) / wall, 3) if wall else 0.0,
        "acceptance_rate": round(sum(a.accepted_draft_tokens for a in ok) / drafts, 4) if drafts else 0.0,
        "mean_batch_size": round(sum(a.mean_batch_size for a in ok) / len(ok), 3) if ok else 0.0,
    }


def _median_run(runs: Sequence[tuple[list[Answer | ClientError], float]]) -> tuple[list[Answer | ClientError], float]:
    """The run of median wall time (its answers: every run of a greedy method answers the same)."""
    return sorted(runs, key=lambda run: run[1])[(len(runs) - 1) // 2]


def client_main(args: argparse.Namespace) -> int:
    from specdec.runtime.prompts import read_prompts

    prompts = read_prompts(args)
    if args.wait:
        SpecdecClient(args.url).wait_ready(args.wait)
    concurrency = args.concurrency or len(prompts)
    if args.stream and len(prompts) == 1 and not args.json:
        client = SpecdecClient(args.url)
        try:
            for result in client.stream(prompts[0], **_params(args, args.method)):
                print(text_of(result), end="", flush=True)
        except ClientError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
        print()
        return 0
    compare = args.compare_ar and args.method != BASELINE_METHOD
    if compare and args.repeats > 1:  # warm-up, untimed: the server's first steps of these shapes allocate
        run_concurrent(args.url, prompts, concurrency, args.stream, **_params(args, args.method))
    runs: dict[str, list[tuple[list[Answer | ClientError], float]]] = {args.method: [], BASELINE_METHOD: []}
    for _ in range(args.repeats if compare else 1):
        for method in (args.method, BASELINE_METHOD) if compare else (args.method,):
            runs[method].append(run_concurrent(args.url, prompts, concurrency, args.stream, **_params(args, method)))
    answers, wall = _median_run(runs[args.method])
    summary = _summary(answers, wall)
    baseline = None
    if compare:
        ar_answers, ar_wall = _median_run(runs[BASELINE_METHOD])
        baseline = _summary(ar_answers, ar_wall)
    if args.json:
        doc: dict[str, Any] = {
            "answers": [a.__dict__ if isinstance(a, Answer) else {"error": str(a)} for a in answers],
            "summary": summary,
        }
        if baseline:
            doc[BASELINE_METHOD] = baseline
        print(json.dumps(doc))
    else:
        for i, (prompt, answer) in enumerate([] if args.summary else zip(prompts, answers)):
            print(f"\n[{i}] {prompt}")
            if isinstance(answer, ClientError):
                print(f"    ERROR: {answer}")
                continue
            print(f"--> {answer.text!r}")
            print(
                f"    tokens={len(answer.output_ids)} finish={answer.finish_reason} "
                f"acceptance={answer.acceptance_rate:.2f} accepted/draft={answer.accepted_draft_tokens}/"
                f"{answer.draft_tokens} target_calls={answer.target_calls} "
                f"mean_batch={answer.mean_batch_size:.2f} latency={answer.seconds:.2f}s"
                + (f" beams/round={answer.beam_widths}" if answer.beam_widths else "")
            )
        timing = f" (median of {len(runs[args.method])} interleaved runs)" if len(runs[args.method]) > 1 else ""
        print(
            f"\n{args.method} through Triton{timing}: {summary['requests']} requests from {concurrency} clients, "
            f"{summary['tokens']} tokens in {summary['seconds']:.2f} s = {summary['tokens_per_second']:.1f} tok/s, "
            f"acceptance {summary['acceptance_rate']:.2f}, mean batch {summary['mean_batch_size']:.2f}"
        )
        if baseline:
            print(
                f"ar through Triton: {baseline['tokens']} tokens in {baseline['seconds']:.2f} s = "
                f"{baseline['tokens_per_second']:.1f} tok/s"
            )
            same = all(
                isinstance(a, Answer) and isinstance(b, Answer) and a.output_ids == b.output_ids
                for a, b in zip(answers, ar_answers)
            )
            print(
                f"speed-up of {args.method} over ar: "
                f"{summary['tokens_per_second'] / max(baseline['tokens_per_second'], 1e-9):.2f}x"
                + ("  (outputs identical)" if same else "")
            )
    return 1 if summary["errors"] else 0
