"""The Triton kernel of RaggedTreeAttention against the torch reference.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported or any kernel is built); shapes stay small because the interpreter executes every
program in Python. ``test_cuda_*`` runs the compiled kernels when a GPU is present.
"""

from __future__ import annotations

import os

# Triton's interpreter, set before triton is imported; restored once the imports are done (see _interpreter)
_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="OpenAI Triton is not installed (pip install triton) — kernel tests skipped")

from forests import ROOT, Seq, mixed_batch, visible_new  # noqa: E402

from specdec.plugins.reference import ragged_tree_attention  # noqa: E402
from specdec.plugins.triton_kernel import (  # noqa: E402
    KernelConfig,
    ragged_tree_attention_triton,
    torch_cuda_attention,
    triton_available,
)

# Only this module's tests use the interpreter (the autouse fixture below); give other modules back their value.
if _PREVIOUS_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

KINDS = ("prefill", "decode", "chain", "forest", "forest_past0")


def _parents(kind: str, n: int, gen: torch.Generator) -> list[int]:
    if kind in ("prefill", "chain"):
        return [ROOT, *range(n - 1)]
    if kind == "decode":
        return [ROOT]
    roots = int(torch.randint(2, max(3, n // 2 + 1), (1,), generator=gen))  # a forest: several trees
    return [ROOT if j < roots else int(torch.randint(-1, j, (1,), generator=gen)) for j in range(n)]


def _random_seqs(seed: int, num_slots: int = 6, max_n: int = 9, max_past: int = 24) -> list[Seq]:
    """A ragged forest batch mixing prefill, decode, chains and forests; at least one slot idle."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, num_slots, (1,), generator=gen))
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs].tolist()
    seqs = []
    for i, slot in enumerate(slots):
        kind = KINDS[(i + seed) % len(KINDS)]
        n = int(torch.randint(1, max_n, (1,), generator=gen))
        n = max(n, 3) if kind.startswith("forest") else n
        past = 0 if kind in ("prefill", "forest_past0") else int(torch.randint(1, max_past, (1,), generator=gen))
        seqs.append(Seq(slot, past, _parents(kind, n, gen)))
    return seqs


def _inputs(
    seqs: list[Seq],
    hq: int,
    hkv: int,
    d: int,
    num_slots: int,
    max_len: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    gen = torch.Generator().manual_seed(1000 + seed)
    total = sum(len(s.parents) for s in seqs)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rnd(total, hq, d), rnd(total, hkv, d), rnd(total, hkv, d)
    k_cache, v_cache = rnd(num_slots, hkv, max_len, d), rnd(num_slots, hkv, max_len, d)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s.parents))
    tree = torch.zeros(total, max(len(s.parents) for s in seqs), dtype=torch.bool)
    for b, s in enumerate(seqs):
        tree[cu[b] : cu[b + 1], : len(s.parents)] = visible_new(s.parents)
    return q, k, v, k_cache, v_cache, cu, tree.to(device)


def _check(
    seqs: list[Seq],
    hq: int,
    hkv: int,
    d: int,
    seed: int,
    *,
    num_slots: int = 6,
    max_len: int = 40,
    cache_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tol: float = 1e-4,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run kernel and reference on the same inputs; outputs within tol, caches identical, idle slots untouched."""
    assert all(s.past + len(s.parents) <= max_len for s in seqs)
    q, k, v, k_cache, v_cache, cu, tree = _inputs(seqs, hq, hkv, d, num_slots, max_len, seed, dtype, device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    past, slots = [s.past for s in seqs], [s.slot for s in seqs]
    scale = 1 / math.sqrt(d)
    idx = {"device": device, "dtype": torch.int32}
    out = ragged_tree_attention_triton(
        q,
        k,
        v,
        k_cache,
        v_cache,
        torch.tensor(cu, **idx),
        torch.tensor(past, **idx),
        torch.tensor(slots, **idx),
        tree,
        scale,
        None if cache_mask is None else cache_mask.to(device),
        config=config,
    )
    # the reference in fp32 on CPU on the same (rounded) inputs: the yardstick for every dtype and device
    # (the reference builds its prefix mask on the CPU, so it cannot take CUDA tensors)
    want = ragged_tree_attention(
        q.float().cpu(),
        k.float().cpu(),
        v.float().cpu(),
        k_ref.float().cpu(),
        v_ref.float().cpu(),
        cu,
        past,
        slots,
        tree.cpu(),
        scale,
        cache_mask,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float().cpu() - want).abs().max().item()
    assert err < tol, f"max |Δ| = {err:.3g} (tol {tol})"
    k_expect, v_expect = k_before.clone(), v_before.clone()
    for b, s in enumerate(seqs):
        n = len(s.parents)
        k_expect[s.slot, :, s.past : s.past + n] = k[cu[b] : cu[b + 1]].transpose(0, 1)
        v_expect[s.slot, :, s.past : s.past + n] = v[cu[b] : cu[b + 1]].transpose(0, 1)
    assert torch.equal(k_cache, k_expect), "K cache differs from the expected scatter"
    assert torch.equal(v_cache, v_expect), "V cache differs from the expected scatter"
    idle = set(range(num_slots)) - set(slots)
    for slot in idle:
        assert torch.equal(k_cache[slot], k_before[slot]) and torch.equal(v_cache[slot], v_before[slot])
    return out


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 for each test here: the kernel module reads it at every call (CUDA tests override it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_triton_is_available() -> None:
    assert triton_available()


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (6, 2)], ids=["mha", "gqa2", "gqa3"])
@pytest.mark.parametrize("seed", range(5))
def test_random_ragged_forests(seed: int, heads: tuple[int, int], d: int) -> None:
    seqs = _random_seqs(seed)
    assert len({s.slot for s in seqs}) < 6, "at least one idle slot"
    _check(seqs, *heads, d=d, seed=seed)


def test_mixed_batch_all_kinds_at_once() -> None:
    seqs = mixed_batch()  # slot 2 idle
    _check(seqs, hq=4, hkv=2, d=64, seed=99)


def test_sequences_spanning_several_blocks() -> None:
    """Rows over several query blocks, a prefix over several key blocks, a tree crossing block edges."""
    gen = torch.Generator().manual_seed(7)
    seqs = [
        Seq(slot=0, past=0, parents=[ROOT, *range(36)]),  # 37-token prefill: 3 query blocks of 16
        Seq(slot=2, past=70, parents=[ROOT, *range(19)]),  # chain after a 70-token prefix
        Seq(slot=3, past=45, parents=_parents("forest", 21, gen)),
        Seq(slot=4, past=33, parents=[ROOT]),
    ]  # slot 1 idle
    _check(seqs, hq=3, hkv=1, d=32, seed=7, num_slots=5, max_len=96, config=KernelConfig(block_m=16, block_n=16))


def test_empty_sequence_inside_the_pack() -> None:
    """A sequence with no new tokens (cu_seqlens repeats) writes nothing and shifts nobody."""
    seqs = [
        Seq(slot=1, past=5, parents=[ROOT, 0]),
        Seq(slot=3, past=4, parents=[]),
        Seq(slot=0, past=2, parents=[ROOT, ROOT, 1]),
    ]
    _check(seqs, hq=4, hkv=2, d=32, seed=8, num_slots=5, max_len=12)


@pytest.mark.parametrize("seed", range(4))
def test_cache_mask_with_holes(seed: int) -> None:
    seqs = _random_seqs(seed + 10, max_past=40)
    width = max(s.past for s in seqs) + 3  # the mask may be wider than the longest past
    gen = torch.Generator().manual_seed(seed)
    cache_mask = torch.rand(len(seqs), width, generator=gen) > 0.4
    cache_mask[0, :] = True  # one row without holes
    if len(seqs) > 1:
        cache_mask[1, :] = False  # one row whose whole past is hidden
    _check(seqs, hq=4, hkv=2, d=32, seed=seed, max_len=56, cache_mask=cache_mask, config=KernelConfig(block_n=16))


def test_row_that_sees_nothing_is_zero_like_the_reference() -> None:
    seqs = [Seq(slot=0, past=5, parents=[ROOT, 0]), Seq(slot=1, past=0, parents=[ROOT])]
    q, k, v, k_cache, v_cache, cu, tree = _inputs(seqs, 2, 1, 32, 2, 8, seed=4)
    tree[1, :] = False  # token 1 of sequence 0 ...
    cache_mask = torch.tensor([[False] * 5, [False] * 5])  # ... and its whole past hidden
    k2, v2 = k_cache.clone(), v_cache.clone()
    out = ragged_tree_attention_triton(
        q,
        k,
        v,
        k_cache,
        v_cache,
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor([5, 0], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        tree,
        0.2,
        cache_mask,
    )
    want = ragged_tree_attention(q, k, v, k2, v2, cu, [5, 0], [0, 1], tree, 0.2, cache_mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert (out - want).abs().max().item() < 1e-5


def test_strided_views_and_index_forms() -> None:
    """q/k/v as views of a fused QKV output; index args as int64 tensors and lists."""
    seqs = [Seq(slot=2, past=6, parents=[ROOT, 0, ROOT]), Seq(slot=0, past=0, parents=[ROOT, 0])]
    hq, hkv, d = 4, 2, 32
    q0, k0, v0, k_cache, v_cache, cu, tree = _inputs(seqs, hq, hkv, d, 3, 16, seed=11)
    qkv = torch.cat([q0.flatten(1), k0.flatten(1), v0.flatten(1)], dim=1)
    q = qkv[:, : hq * d].view(-1, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
    assert not q.is_contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = ragged_tree_attention_triton(
        q, k, v, k_cache, v_cache, torch.tensor(cu), [6, 0], torch.tensor([2, 0]), tree, 0.3
    )
    want = ragged_tree_attention(q0, k0, v0, k_ref, v_ref, cu, [6, 0], [2, 0], tree, 0.3)
    assert (out - want).abs().max().item() < 1e-4
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_empty_batch_returns_empty() -> None:
    q = torch.empty(0, 2, 32)
    kv = torch.empty(0, 1, 32)
    cache = torch.randn(2, 1, 4, 32)
    before = cache.clone()
    out = ragged_tree_attention_triton(
        q,
        kv,
        kv,
        cache,
        cache.clone(),
        torch.zeros(1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.zeros(0, 1, dtype=torch.bool),
        1.0,
    )
    assert out.shape == (0, 2, 32) and torch.equal(cache, before)


def test_fp16_in_the_interpreter() -> None:
    seqs = [Seq(slot=1, past=9, parents=[ROOT, ROOT, 0, 1]), Seq(slot=0, past=0, parents=[ROOT, 0, 1])]
    _check(seqs, hq=4, hkv=2, d=32, seed=3, num_slots=3, max_len=16, dtype=torch.float16, tol=1e-2)


def test_bad_arguments_are_named() -> None:
    q, k, v = torch.randn(3, 3, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    cache = torch.randn(2, 2, 8, 32)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ragged_tree_attention_triton(
            q, k, v, cache, cache, torch.tensor([0, 3]), idx, idx, torch.ones(3, 3, dtype=torch.bool), 1.0
        )
    with pytest.raises(TypeError, match="share a dtype"):
        ragged_tree_attention_triton(
            q[:, :2],
            k,
            v,
            cache.half(),
            cache.half(),
            torch.tensor([0, 3]),
            idx,
            idx,
            torch.ones(3, 3, dtype=torch.bool),
            1.0,
        )


def test_torch_cuda_attention_uses_the_reference_on_cpu() -> None:
    seqs = [Seq(slot=1, past=4, parents=[ROOT, 0]), Seq(slot=0, past=2, parents=[ROOT])]
    q, k, v, k_cache, v_cache, cu, tree = _inputs(seqs, 2, 1, 32, 2, 8, seed=5)
    k2, v2 = k_cache.clone(), v_cache.clone()
    out = torch_cuda_attention(
        q, k, v, k_cache, v_cache, torch.tensor(cu, dtype=torch.int32), [4, 2], [1, 0], tree, 0.25
    )
    want = ragged_tree_attention(q, k, v, k2, v2, cu, [4, 2], [1, 0], tree, 0.25)
    assert torch.equal(out, want) and torch.equal(k_cache, k2)


def test_module_imports_without_triton() -> None:
    """With triton unimportable the module still imports, reports it, and the dispatch uses the reference."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from specdec.plugins import triton_kernel as tk\n"
        "assert not tk.triton_available()\n"
        "q = torch.randn(1, 1, 8); kv = torch.randn(1, 1, 8); c = torch.zeros(1, 1, 2, 8)\n"
        "m = torch.ones(1, 1, dtype=torch.bool)\n"
        "o = tk.torch_cuda_attention(q, kv, kv, c, c.clone(), [0, 1], [0], [0], m, 1.0)\n"
        "assert torch.allclose(o, kv)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the compiled GPU kernel is only "
    "checked on a GPU (benchmarks/gpu_check.sh); the interpreter tests above cover the logic",
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.gpu
def test_cuda_matches_reference(seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernels, not the interpreter
    seqs = _random_seqs(seed, max_n=40, max_past=90)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _check(seqs, hq=8, hkv=2, d=128, seed=seed, max_len=136, dtype=dtype, device="cuda", tol=tol)
