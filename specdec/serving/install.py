"""Where ``specdec serve`` finds a ``tritonserver`` and its Python-backend stub.

Two installs are supported, in this order:

1. a ``tritonserver`` on ``PATH`` (the NGC Triton container: it has the onnxruntime and
   tensorrt backends a GPU deployment wants);
2. the binary bundled in the ``nvidia-pytriton`` wheel (CPU-friendly, no Docker; it has only the
   Python backend, which is all the specdec engine model needs).

Standard library only, like the launcher that uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

INSTALL_HINT = (
    "install the bundled server with `pip install 'specdec-toolkit[serve]'` "
    "(or `pip install nvidia-pytriton==0.7.0`), or put a `tritonserver` binary on PATH "
    "(e.g. run inside the NGC container nvcr.io/nvidia/tritonserver:<yy.mm>-py3)"
)
STUB_NAME = "triton_python_backend_stub"


class TritonError(RuntimeError):
    """Base class of every launcher error, so the CLI can report all of them the same way."""


class TritonNotFoundError(TritonError):
    """No usable ``tritonserver`` binary (neither on PATH nor in the nvidia-pytriton wheel)."""


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver lives and what it needs to run."""

    binary: Path
    backend_directory: Path
    ld_library_path: tuple[Path, ...] = ()
    source: Literal["PATH", "nvidia-pytriton"] = "PATH"


# --------------------------------------------------------------------------- locating the server


def find_tritonserver() -> TritonInstall:
    """Locate tritonserver: PATH first (production images have more backends), else the pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        binary = Path(on_path).resolve()
        override = os.environ.get("SPECDEC_TRITON_BACKENDS")
        if override:
            backends = Path(override)
        elif Path("/opt/tritonserver/backends").is_dir():
            backends = Path("/opt/tritonserver/backends")
        else:
            backends = binary.parent.parent / "backends"
        return TritonInstall(binary=binary, backend_directory=backends, source="PATH")
    bundled = _find_bundled()
    if bundled is None:
        raise TritonNotFoundError(f"tritonserver not found: {INSTALL_HINT}")
    return bundled


def _find_bundled() -> TritonInstall | None:
    """The wheel's tritonserver, found without importing pytriton (its import pulls heavy deps)."""
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return None
    libs = pkg.parent / "nvidia_pytriton.libs"
    backends = _ensure_python_stub(root)
    return TritonInstall(
        binary=binary,
        backend_directory=backends,
        ld_library_path=(libs,) if libs.is_dir() else (),
        source="nvidia-pytriton",
    )


def _ensure_python_stub(root: Path) -> Path:
    """Give the bundled Python backend a stub for *this* interpreter and return the backend directory.

    The wheel ships one stub per Python version beside the backend; the backend only looks in
    ``backends/python/``. Copy it there (atomically, so concurrent starts never see half a file), or,
    when site-packages is read-only, mirror the backend directory under the user cache with symlinks.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    backends = root / "backends"
    python_dir = backends / "python"
    if not stub.is_file():
        raise TritonNotFoundError(
            f"the bundled tritonserver has no Python-backend stub for Python {version} (looked for {stub})"
        )
    target = python_dir / STUB_NAME
    if _same_file_content(target, stub):
        return backends
    if os.access(python_dir, os.W_OK):
        try:
            _atomic_copy(stub, target)
            return backends
        except OSError:
            pass
    return _private_backends(backends, stub, version)


def _same_file_content(a: Path, b: Path) -> bool:
    try:
        return a.is_file() and a.stat().st_size == b.stat().st_size and os.access(a, os.X_OK)
    except OSError:
        return False


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _private_backends(backends: Path, stub: Path, version: str) -> Path:
    """A backend directory of symlinks under the cache whose ``python/`` also links this Python's stub."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(backends).encode()).hexdigest()[:12]
    private = cache / "specdec" / "triton-backends" / f"py{version}-{digest}"
    (private / "python").mkdir(parents=True, exist_ok=True)
    for entry in backends.iterdir():
        if entry.name != "python":
            _symlink(entry, private / entry.name)
    for entry in (backends / "python").iterdir():
        if entry.name != STUB_NAME and not entry.name.startswith("."):
            _symlink(entry, private / "python" / entry.name)
    _symlink(stub, private / "python" / STUB_NAME)
    return private


def _symlink(src: Path, dst: Path) -> None:
    if dst.is_symlink() and os.readlink(dst) == str(src):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(src)
    os.replace(tmp, dst)


# --------------------------------------------------------------------------- checks before starting


def libpython_dir() -> Path | None:
    """The directory of this interpreter's shared libpython, if it has one.

    The bundled stub links ``libpython3.X.so.1.0`` by soname and the loader finds the system's copy
    first. When this interpreter is a different patch release (pyenv, conda), its extension modules
    need symbols the system library lacks: ``import ssl`` (and so transformers) fails in the stub
    with ``undefined symbol: _PyModule_Add``. Putting this interpreter's library first fixes that.
    """
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not name or not (Path(libdir) / name).is_file():
        return None
    return Path(libdir)
