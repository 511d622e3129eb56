"""Hub models are fetched with huggingface_hub's real download path, against a Hub served on 127.0.0.1.

``LocalHub`` implements the routes ``snapshot_download`` calls (read from huggingface_hub 2.4's
source): ``GET /api/models/{repo}/revision/{rev}`` (the commit), ``GET /api/models/{repo}/tree/{commit}``
(the file list, one page), and ``HEAD``/``GET /{repo}/resolve/{commit}/{file}`` with ``X-Repo-Commit``,
``ETag``, ``Content-Length`` and ``Range`` (206) answers. It can require a token (401 ``GatedRepo``
without ``Authorization: Bearer ...``, as the Hub answers for Llama) and drop a connection halfway
through a file once. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from fakes import small_tokenizer

from specdec.export.cli import default_out
from specdec.export.cli import main as export_main
from specdec.models.errors import ModelResolutionError
from specdec.models.loading import load_model

REPO = "specdec-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_local_test_token"
#: in the repository but never read by the loader: none of these may be fetched
UNNEEDED = {
    "pytorch_model.bin": b"pickle bytes the loader must not fetch",
    "README.md": b"# tiny\n",
    "consolidated.safetensors": b"the same weights again",
    "original/params.json": b"{}",
}


@dataclass
class LocalHub:
    """A Hub endpoint over a dict of files: records every request, optionally gated or dropping a file once."""

    files: dict[str, bytes]
    gated: bool = False
    drop_once: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)  # method, path, Range, auth
    connections: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
        self.server.hub = self  # type: ignore[attr-defined]
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        """Stop listening and hang up the clients' kept-alive connections: the Hub is gone."""
        self.server.shutdown()
        self.server.server_close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def fetched(self) -> set[str]:
        """Repository files whose bytes were requested (GET on resolve)."""
        prefix = f"/{REPO}/resolve/"
        return {
            p[len(prefix) :].split("/", 1)[1] for m, p, _, _ in self.requests if m == "GET" and p.startswith(prefix)
        }


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer  # with .hub, the LocalHub it serves

    @property
    def hub(self) -> LocalHub:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:  # quiet test output
        pass

    def setup(self) -> None:
        super().setup()
        self.hub.connections.append(self.connection)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _send(
        self, status: int, payload: bytes = b"", headers: dict[str, str] | None = None, body: bool = True
    ) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(payload)), "X-Repo-Commit": COMMIT, **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def _serve(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        auth = self.headers.get("Authorization")
        self.hub.requests.append((self.command, path, self.headers.get("Range"), auth))
        if self.hub.gated and auth != f"Bearer {TOKEN}":
            self._send(
                401,
                b'{"error": "restricted"}',
                {
                    "X-Error-Code": "GatedRepo",
                    "X-Error-Message": f"Access to model {REPO} is restricted. You must be authenticated to access it.",
                },
                body,
            )
        elif path.startswith(f"/api/models/{REPO}/revision/"):
            info = {
                "id": REPO,
                "sha": COMMIT,
                "private": False,
                "gated": "manual" if self.hub.gated else False,
                "siblings": [{"rfilename": name} for name in self.hub.files],
            }
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        elif path.startswith(f"/api/models/{REPO}/tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.hub.files.items()
            ]
            self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        elif path.startswith(f"/{REPO}/resolve/"):
            self._serve_file(path[len(f"/{REPO}/resolve/") :].split("/", 1)[1], body)
        else:
            self._send(404, b"not found", {"X-Error-Code": "RepoNotFound"}, body)

    def _serve_file(self, name: str, body: bool) -> None:
        data = self.hub.files.get(name)
        if data is None:
            self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
            return
        meta = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers["Range"] else 0
        if body and name in self.hub.drop_once and start == 0:
            self.hub.drop_once.discard(name)  # announce the whole file, send half, hang up
            self.send_response(200)
            for key, value in {"Content-Length": str(len(data)), "X-Repo-Commit": COMMIT, **meta}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        elif start:
            self._send(206, data[start:], {**meta, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}, body)
        else:
            self._send(200, data, meta, body)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA as ``save_pretrained`` writes it: sharded safetensors + index, a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = small_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hub") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="200KB")
    tokenizer.save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    return out


@pytest.fixture
def repo_files(local_model: Path) -> dict[str, bytes]:
    return {**{p.name: p.read_bytes() for p in local_model.iterdir() if p.is_file()}, **UNNEEDED}


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty Hugging Face home for this test, no token, online; yields the home."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # no token stored on this machine leaks in
    yield home


def _serve(monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes], **kwargs: object) -> LocalHub:
    hub = LocalHub(files, **kwargs)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return hub


def _assert_same_model(got_spec: str, local: Path) -> None:
    got, want = load_model(got_spec), load_model(local)
    assert got.state_dict.keys() == want.state_dict.keys()
    assert all(torch.equal(got.state_dict[k], want.state_dict[k]) for k in want.state_dict)
    assert {**got.config.to_dict(), "_name_or_path": ""} == {**want.config.to_dict(), "_name_or_path": ""}
    text = "the tokenizer came along"
    assert got.tokenizer(text)["input_ids"] == want.tokenizer(text)["input_ids"]


def test_download_then_load_equals_the_local_directory(hub_env, local_model, repo_files, monkeypatch) -> None:
    hub = _serve(monkeypatch, repo_files)
    try:
        _assert_same_model(REPO, local_model)
    finally:
        hub.stop()
    needed = {p.name for p in local_model.iterdir() if p.is_file()}
    assert hub.fetched() == needed  # config, tokenizer, shards and index: nothing in UNNEEDED
    snapshot = hub_env / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert snapshot.is_dir()  # the cache layout transformers reads


def test_a_cached_model_loads_with_the_hub_gone(hub_env, local_model, repo_files, monkeypatch) -> None:
    hub = _serve(monkeypatch, repo_files)
    load_model(REPO)
    hub.stop()
    seen = len(hub.requests)
    _assert_same_model(REPO, local_model)
    assert len(hub.requests) == seen


def test_offline_with_an_empty_cache_says_what_to_run(hub_env, repo_files, monkeypatch, tmp_path, capsys) -> None:
    hub = _serve(monkeypatch, repo_files)
    try:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ModelResolutionError) as err:
            load_model(REPO)
        msg = str(err.value)
        assert "HF_HUB_OFFLINE=1" in msg and f"hf download {REPO}" in msg and "--target /path/to/tiny-llama" in msg
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.chdir(tmp_path)
        assert export_main(["--target", REPO, "--offline"]) == 2  # --out defaults to exports/<name>
        err_text = capsys.readouterr().err
        assert "--offline" in err_text and f"hf download {REPO}" in err_text and "Traceback" not in err_text
        assert "exports/tiny-llama" in err_text and not (tmp_path / "exports" / "tiny-llama").exists()
    finally:
        hub.stop()
    assert hub.requests == []
    assert os.environ.get("HF_HUB_OFFLINE") is None  # --offline did not leak out of the export


def test_unreachable_hub_with_an_empty_cache_fails_fast(hub_env, monkeypatch) -> None:
    hub = LocalHub({})
    hub.stop()  # a closed port: connection refused
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    with pytest.raises(ModelResolutionError, match="could not be reached") as err:
        load_model(REPO)
    assert f"hf download {REPO}" in str(err.value)


def test_gated_model_names_hf_token_and_works_with_it(hub_env, local_model, repo_files, monkeypatch) -> None:
    hub = _serve(monkeypatch, repo_files, gated=True)
    try:
        with pytest.raises(ModelResolutionError) as err:
            load_model(REPO)
        msg = str(err.value)
        assert "HF_TOKEN" in msg and f"{hub.url}/{REPO}" in msg and "gated" in msg
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        with pytest.raises(ModelResolutionError, match="refused the token in HF_TOKEN"):
            load_model(REPO)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        _assert_same_model(REPO, local_model)
    finally:
        hub.stop()
    assert all(auth == f"Bearer {TOKEN}" for _, p, _, auth in hub.requests if p.startswith(f"/{REPO}/resolve/"))


def test_a_dropped_connection_resumes_where_it_stopped(hub_env, local_model, repo_files, monkeypatch) -> None:
    shard = max(
        (n for n in repo_files if n.endswith(".safetensors") and n.startswith("model-")),
        key=lambda n: len(repo_files[n]),
    )
    from huggingface_hub import constants

    # huggingface_hub writes what it received in 10 MiB chunks, so a dropped tiny file restarts from byte 0;
    # 4 KiB chunks make this file resume as a 13 GB shard does (one Range request for the missing bytes)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub = _serve(monkeypatch, repo_files, drop_once={shard})
    try:
        _assert_same_model(REPO, local_model)
    finally:
        hub.stop()
    ranges = [r for m, p, r, _ in hub.requests if m == "GET" and p.endswith(f"/{shard}") and r]
    sent = len(repo_files[shard]) // 2
    assert ranges == [f"bytes={sent // 4096 * 4096}-"]  # asked only for what it had not kept (whole chunks)


def test_default_out_names_the_target() -> None:
    assert default_out("llama-7b") == Path("exports/llama-7b")
    assert default_out("meta-llama/Llama-2-7b-hf") == Path("exports/Llama-2-7b-hf")
    assert default_out("/models/smol.gguf") == Path("exports/smol")
    assert default_out("tiny-random:num_layers=1") == Path("exports/tiny-random-num_layers-1")


def test_specdec_export_as_typed_downloads_then_runs_offline(hub_env, repo_files, tmp_path) -> None:
    """The console script in a fresh process: HF_ENDPOINT/HF_HOME read as a user sets them, nothing patched."""
    hub = LocalHub(repo_files)
    exe = str(Path(sys.executable).parent / "specdec-export")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(hub_env)}
    try:
        run = subprocess.run(
            [exe, "--target", REPO, "--backend", "torch"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        hub.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "exports" / "tiny-llama" / "manifest.json").is_file()
    assert "exports/tiny-llama" in run.stderr and "peak memory (RSS)" in run.stderr
    again = subprocess.run(
        [exe, "--target", REPO, "--backend", "torch", "--out", "second"],
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]  # from the cache, the Hub long gone
