"""The OpenAI endpoint of a REAL ``specdec serve`` (tritonserver, the SmolLM2 export, the frontend it starts), driven
by the clients people use: the official ``openai`` SDK (sync and async, unary and streamed) and ``curl``.

One server for the module (starting one costs tens of seconds on a 2-core machine); every greedy answer is compared
with ``SpecdecClient`` (gRPC) on the same server, so the frontend must translate without changing a token. The
last test drains that server with SIGTERM while SSE streams are open and checks that nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from servers import SPECDEC_SERVE, eventually, free_ports, needs_tritonserver, processes_mentioning, samples

from specdec.serving.client import SpecdecClient
from specdec.serving.control import shm_regions
from specdec.serving.server import port_free

needs_tritonserver()
openai = pytest.importorskip("openai", reason="the official openai SDK (the `test` extra) is not installed")

pytestmark = [pytest.mark.server, pytest.mark.real_model]

WAIT_S = 240.0  # what a loaded CI machine may need; a passing run waits for events, never for this
PROMPT = "The three primary colors are"
STORY = "Once upon a time, a lighthouse keeper lived alone by the sea. Every night he"
#: the conversation surface of the entry models (messages, n, logprobs): its tests run once the protocol declares it


@dataclass
class Served:
    proc: subprocess.Popen[str]
    grpc: str
    openai: str  # http://host:port (the API under /v1)
    metrics: str
    model: str
    ports: list[int]
    repo: Path

    def sdk(self, **options: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.openai}/v1", api_key="unused", max_retries=0, **options)


@pytest.fixture(scope="module")
def served(smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``specdec serve`` with its OpenAI frontend, ready; afterwards none of its processes and ports may remain."""
    ports = free_ports(4)
    grpc, http, metrics, api = ports
    log = tmp_path_factory.mktemp("openai") / "server.log"
    args = [str(smollm2_export), "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]
    args += ["--openai-port", str(api), "--log-file", str(log), "--ready-timeout", str(WAIT_S)]
    args += ["--drain-timeout", str(WAIT_S), "--exit-timeout", "60"]
    proc = subprocess.Popen([*SPECDEC_SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        lines.append(line)
        if not line or line.startswith("(Ctrl-C"):
            break
    if not lines[-1].startswith("(Ctrl-C"):
        proc.kill()
        raise AssertionError(f"specdec serve did not get ready: {''.join(lines)}{proc.stderr.read()}")  # type: ignore[union-attr]
    model = json.loads((smollm2_export / "manifest.json").read_text())["target"]["name"]
    assert f"OpenAI  http://127.0.0.1:{api}/v1" in "".join(lines)
    repo = smollm2_export / "triton_repo"
    yield Served(
        proc, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{api}", f"http://127.0.0.1:{metrics}/metrics", model, ports, repo
    )
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0, proc.stderr.read()  # type: ignore[union-attr]
    assert eventually(lambda: processes_mentioning(str(repo)) == [] and not _frontends(grpc))
    assert eventually(lambda: all(port_free("127.0.0.1", p) for p in ports)), "a port is still held"
    assert eventually(lambda: not shm_regions(f"specdec_{proc.pid}_")), "a /dev/shm region of the server remains"


def _frontends(grpc_port: int) -> list[int]:
    """The frontend processes of the server whose gRPC port is ``grpc_port``."""
    return processes_mentioning(f"--triton-url 127.0.0.1:{grpc_port} ")


def grpc_answer(served: Served, prompt: str, **params: Any) -> Any:
    return SpecdecClient(served.grpc).generate(prompt, **params)


def _idle(served: Served) -> bool:
    values = samples(served.metrics)
    gauges = (
        "specdec_kv_slots_used",
        "specdec_active_sequences",
        "specdec_queued_requests",
        "specdec_inflight_requests",
    )
    ours = [v for k, v in values.items() if k.split("{")[0] in gauges]
    return bool(ours) and not any(ours)


def test_sdk_completions_sync_async_unary_and_streamed_equal_the_grpc_client(served: Served) -> None:
    reference = grpc_answer(served, PROMPT, max_tokens=24, temperature=0.0)
    client = served.sdk()
    unary = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert unary.choices[0].text == reference.text and unary.choices[0].finish_reason == reference.finish_reason
    assert unary.usage.completion_tokens == len(reference.output_ids)
    extension = unary.choices[0].model_extra["specdec"]
    assert extension["method"] == "ems" and extension["target_calls"] >= 1
    assert 0 <= extension["acceptance_rate"] <= 1 and extension["draft_tokens"] >= extension["accepted_draft_tokens"]
    chunks = list(
        client.completions.create(
            model=served.model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert chunks[-1].usage.completion_tokens == len(reference.output_ids) and not chunks[-1].choices

    async def both() -> tuple[Any, str]:
        async_client = openai.AsyncOpenAI(base_url=f"{served.openai}/v1", api_key="unused", max_retries=0)
        one = await async_client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0)
        stream = await async_client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream])
        await async_client.close()
        return one, text

    one, streamed = asyncio.run(both())
    assert one.choices[0].text == reference.text and streamed == reference.text


def test_stop_seed_and_methods(served: Served) -> None:
    client = served.sdk()
    stop = client.completions.create(model=served.model, prompt=STORY, max_tokens=64, temperature=0, stop=["\n", "."])
    reference = grpc_answer(served, STORY, max_tokens=64, temperature=0.0, stop=["\n", "."])
    assert stop.choices[0].text == reference.text and stop.choices[0].finish_reason == "stop"
    assert "." not in stop.choices[0].text
    sampled = {"model": served.model, "prompt": STORY, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    first = client.completions.create(**sampled, seed=11).choices[0].text
    assert client.completions.create(**sampled, seed=11).choices[0].text == first
    assert grpc_answer(served, STORY, max_tokens=24, temperature=1.0, top_p=0.95, seed=11).text == first
    assert client.completions.create(**sampled, seed=12).choices[0].text != first
    greedy = {"model": served.model, "prompt": STORY, "max_tokens": 24, "temperature": 0}
    ems = client.completions.create(**greedy).choices[0].text
    assert client.completions.create(**greedy, extra_body={"method": "ar"}).choices[0].text == ems
    beam = client.completions.create(**greedy, extra_body={"method": "beam", "beam_width": 2})
    assert beam.choices[0].model_extra["specdec"]["method"] == "beam" and beam.choices[0].text


def test_curl_sees_sse_framing_and_done(served: Served) -> None:
    body = json.dumps({"model": served.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True})
    out = subprocess.run(
        ["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body, f"{served.openai}/v1/completions"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=True,
    ).stdout
    frames = out.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", out[-300:]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: {") for f in frames[:-2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == grpc_answer(served, PROMPT, max_tokens=12).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    headers = subprocess.run(
        ["curl", "-sS", "-D", "-", "-o", "/dev/null", "-H", "Content-Type: application/json", "-d", body,
         f"{served.openai}/v1/completions"],
        capture_output=True, text=True, timeout=WAIT_S, check=True,
    ).stdout.lower()  # fmt: skip
    assert "content-type: text/event-stream" in headers


def _post(served: Served, path: str, data: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"{served.openai}{path}", data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_refused_requests_get_openai_errors_while_a_good_stream_finishes_identical(served: Served) -> None:
    reference = grpc_answer(served, STORY, max_tokens=96, temperature=0.0)
    good: dict[str, Any] = {}

    def stream() -> None:
        chunks = served.sdk().completions.create(
            model=served.model, prompt=STORY, max_tokens=96, temperature=0, stream=True
        )
        good["text"] = "".join(c.choices[0].text for c in chunks)

    runner = threading.Thread(target=stream)
    runner.start()
    request = {"model": served.model, "prompt": PROMPT, "max_tokens": 4}
    cases = [
        (b'{"model": "x", "prompt": ', 400, None),
        (json.dumps({**request, "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({**request, "model": "gpt-4o"}).encode(), 404, "model"),
        (json.dumps({**request, "prompt": "x" * (2 << 20)}).encode(), 413, None),
        (json.dumps({**request, "frequency_penalty": 0.5}).encode(), 400, "frequency_penalty"),
        (json.dumps({**request, "logit_bias": {"1": 5}}).encode(), 400, "logit_bias"),
        (json.dumps({**request, "max_tokens": 5000}).encode(), 400, "max_tokens"),  # refused by the server
        (json.dumps({**request, "method": "nope"}).encode(), 400, "method"),  # refused by the server
        (json.dumps({**request, "prompt": " "}).encode(), 400, "prompt"),  # refused by the server
        (json.dumps({**request, "prompt": "x " * 3000}).encode(), 400, "prompt"),  # past the context
    ]
    for body, status, param in cases:
        code, error = _post(served, "/v1/completions", body)
        assert code == status, (body[:80], error)
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == param, error
        assert "Traceback" not in json.dumps(error) and 'File "' not in json.dumps(error)
    with pytest.raises(openai.BadRequestError, match="tools"):
        served.sdk().chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]
        )
    with pytest.raises(openai.NotFoundError):
        served.sdk().completions.create(model="nope", prompt="x")
    runner.join(WAIT_S)
    assert good["text"] == reference.text


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_spares_its_batch_mate(served: Served) -> None:
    reference = grpc_answer(served, PROMPT, max_tokens=64, temperature=0.0)
    before = samples(served.metrics, "specdec_requests_total")
    with ThreadPoolExecutor(1) as pool:
        mate = pool.submit(
            lambda: served.sdk().completions.create(model=served.model, prompt=PROMPT, max_tokens=64, temperature=0)
        )
        stream = served.sdk().completions.create(
            model=served.model, prompt=STORY, max_tokens=900, temperature=0, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the connection goes: the frontend cancels the gRPC stream, the engine the sequence
        assert mate.result(WAIT_S).choices[0].text == reference.text
    cancelled = 'specdec_requests_total{outcome="cancelled"}'
    assert eventually(
        lambda: samples(served.metrics, "specdec_requests_total").get(cancelled, 0) > before.get(cancelled, 0),
        timeout=WAIT_S,
    )
    assert eventually(lambda: _idle(served), timeout=WAIT_S), samples(served.metrics, "specdec_")


def test_chat_multi_turn_with_a_system_prompt(served: Served) -> None:
    client = served.sdk()
    one_turn = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0
    )
    reference = grpc_answer(served, PROMPT, max_tokens=24, temperature=0.0, apply_chat_template=True)
    assert one_turn.choices[0].message.content == reference.text
    conversation = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    answer = client.chat.completions.create(model=served.model, messages=conversation, max_tokens=16, temperature=0)
    streamed = client.chat.completions.create(
        model=served.model, messages=conversation, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert answer.choices[0].message.content and text == answer.choices[0].message.content
    assert answer.usage.prompt_tokens > one_turn.usage.prompt_tokens > 0


def test_the_main_jobs_openai_request_script_prints_the_apis_greedy_answer(served: Served) -> None:
    """``scripts/openai_request.py`` as ``scripts/main.sh`` runs it (the SDK, a system and a user turn, ems): its
    printed answer is the API's greedy answer, which ``ar`` gives too."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "openai_request.py"
    system = "You are a terse assistant."
    args = [f"{served.openai}/v1", "--system", system, "--prompt", PROMPT, "--max-tokens", "24"]
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=WAIT_S, check=True
    ).stdout
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
    ar = served.sdk().chat.completions.create(
        model=served.model, messages=messages, max_tokens=24, temperature=0, extra_body={"method": "ar"}
    )
    lines = out.splitlines()
    assert lines[0].startswith(f"POST {served.openai}/v1/chat/completions  model={served.model!r}")
    assert "\n".join(lines[1:-2]) == ar.choices[0].message.content
    assert lines[-2].startswith("finish_reason=length, ") and lines[-2].endswith(" + 24 completion tokens")
    assert lines[-1].startswith("specdec: method ems, ")


def test_a_prompt_of_token_ids_is_the_prompt_of_its_text(served: Served, smollm2_export: Path) -> None:
    from specdec.models.export_meta import load_export_metadata

    tokenizer = load_export_metadata(smollm2_export, "target").tokenizer
    ids = list(tokenizer(PROMPT)["input_ids"])
    client = served.sdk()
    by_text = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0)
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens


def test_n_seeded_samples(served: Served) -> None:
    client = served.sdk()
    answer = client.completions.create(model=served.model, prompt=STORY, max_tokens=16, temperature=1.0, seed=3, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.text for c in answer.choices}) > 1  # three samples, not one three times
    again = client.completions.create(model=served.model, prompt=STORY, max_tokens=16, temperature=1.0, seed=3, n=3)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]
    streamed = client.completions.create(
        model=served.model, prompt=STORY, max_tokens=16, temperature=1.0, seed=3, n=3, stream=True
    )
    texts = ["", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in answer.choices]


def test_logprobs_of_the_target_equal_between_ems_and_ar(served: Served) -> None:
    client = served.sdk()
    asked = {"model": served.model, "prompt": STORY, "max_tokens": 16, "temperature": 0, "logprobs": 3}
    ems = client.completions.create(**asked).choices[0]
    ar = client.completions.create(**asked, extra_body={"method": "ar"}).choices[0]
    assert ems.text == ar.text and ems.logprobs.tokens == ar.logprobs.tokens
    assert ems.logprobs.token_logprobs == pytest.approx(ar.logprobs.token_logprobs, abs=1e-4)
    assert all(lp <= 0 for lp in ems.logprobs.token_logprobs) and all(len(t) == 3 for t in ems.logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most probable one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in content)


def test_sigterm_with_sse_streams_in_flight_drains_and_leaves_nothing(served: Served) -> None:
    """Last in the module: it stops the module's server. The streams open at the signal complete identical to
    the answers the server gave before it, a new request gets 503 at once, ``specdec serve`` exits 0."""
    prompts = [STORY, PROMPT, "List five animals that live in the sea."]
    references = [grpc_answer(served, p, max_tokens=120, temperature=0.0).text for p in prompts]
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: str) -> str:
        chunks = served.sdk().completions.create(
            model=served.model, prompt=prompt, max_tokens=120, temperature=0, stream=True
        )
        parts = []
        for i, chunk in enumerate(chunks):
            if i == 0:
                started.wait(WAIT_S)
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        started.wait(WAIT_S)  # every stream has its first chunk
        served.proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:
            try:
                served.sdk().completions.create(model=served.model, prompt="hi", max_tokens=2)
            except openai.APIStatusError as exc:
                refused = exc
        assert refused is not None and refused.status_code == 503, refused
        assert refused.body["code"] == "server_draining"
        assert [f.result(WAIT_S) for f in futures] == references
    assert served.proc.wait(WAIT_S) == 0, served.proc.stderr.read()  # type: ignore[union-attr]
    assert eventually(lambda: processes_mentioning(str(served.repo)) == [] and not _frontends(served.ports[0]))
    assert eventually(lambda: all(port_free("127.0.0.1", p) for p in served.ports)), "a port is still held"
