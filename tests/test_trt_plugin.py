"""The plugin (``specdec.plugins.trt_plugin``) without TensorRT: its ``tensorrt.plugin`` definition against a
stand-in module (the ONNX node's inputs and attributes, aliased caches), its index sanitizing, the network edits
that give it an int32 mask and its layer names, and its enqueue body on the CPU in Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import types
import typing

import pytest
import torch
from trt_stand_ins import REPO, Layer, Network, Tensor

from specdec.plugins import onnx_op, trt_plugin


def test_network_edits_give_the_plugin_an_int32_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tensorrt")
    fake.LayerType = types.SimpleNamespace(PLUGIN_V3="PLUGIN_V3", PLUGIN_V2="PLUGIN_V2")
    fake.bool, fake.int32 = "bool", "int32"
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    mask, cu = Tensor("tree_mask", "bool"), Tensor("cu_seqlens", "int32")
    attn = [Layer(f"node_ragged_tree_attention_{i}", "PLUGIN_V3", [Tensor("q", "float"), cu, mask]) for i in range(3)]
    network = Network([Layer("MatMul", "MATRIX_MULTIPLY", [mask]), *attn])
    layers = trt_plugin.plugin_layers(network)
    assert layers == attn
    assert trt_plugin.cast_bool_inputs(network, layers) == 1  # one cast, shared by every layer
    casted = {id(layer.get_input(2)) for layer in attn}
    assert len(casted) == 1 and attn[0].get_input(2).dtype == "int32" and attn[0].get_input(1) is cu
    assert network.layers[0].get_input(0) is mask  # other consumers keep the bool tensor
    trt_plugin.name_plugin_layers(layers)
    trt_plugin.name_plugin_layers(layers)  # idempotent
    assert [layer.name for layer in attn] == [
        f"RaggedTreeAttention.{i}:node_ragged_tree_attention_{i}" for i in range(3)
    ]


class _OldDesc:
    """Stand-in for tensorrt.plugin.TensorDesc of a TensorRT without ``aliased()``."""

    def __init__(self, name: str, aliased_to: _OldDesc | None = None) -> None:
        self.name, self.aliased_to = name, aliased_to

    def like(self) -> _OldDesc:
        return type(self)(self.name)


class _Desc(_OldDesc):
    """Stand-in for tensorrt.plugin.TensorDesc."""

    def aliased(self) -> _Desc:
        return _Desc(self.name, aliased_to=self)


def _fake_trtp(desc_type: type) -> types.SimpleNamespace:
    fake = types.SimpleNamespace(TensorDesc=desc_type, Tensor=type("Tensor", (), {}), registered={}, impls={})
    fake.register = lambda pid: lambda f: fake.registered.setdefault(pid, f)
    fake.impl = lambda pid: lambda f: fake.impls.setdefault(pid, f)
    return fake


def test_plugin_definition_matches_the_onnx_node() -> None:
    fake = _fake_trtp(_Desc)
    trt_plugin._define(fake)
    assert set(fake.registered) == set(fake.impls) == {"specdec::RaggedTreeAttention"}
    describe, enqueue = fake.registered[trt_plugin.PLUGIN_ID], fake.impls[trt_plugin.PLUGIN_ID]

    sig = inspect.signature(describe)
    attrs = [a for a in onnx_op.ATTRIBUTE_NAMES if not a.startswith("plugin_")]
    assert list(sig.parameters) == [*onnx_op.INPUT_NAMES, *attrs]  # the ONNX node's inputs, then its attributes
    assert all(sig.parameters[n].annotation is _Desc for n in onnx_op.INPUT_NAMES)  # classes, not strings
    assert [sig.parameters[a].annotation for a in attrs] == [float, int, int]
    assert typing.get_origin(sig.return_annotation) is tuple
    assert typing.get_args(sig.return_annotation) == (_Desc, _Desc, _Desc)

    descs = [_Desc(n) for n in onnx_op.INPUT_NAMES]
    out, k_out, v_out = describe(*descs, 0.125, 4, 2)
    assert out.name == "q" and out.aliased_to is None
    assert k_out.aliased_to is descs[3] and v_out.aliased_to is descs[4]  # in-place caches

    impl_sig = inspect.signature(enqueue)
    assert list(impl_sig.parameters) == [*onnx_op.INPUT_NAMES, "scale", "outputs", "stream"]
    assert impl_sig.parameters["scale"].annotation is float and impl_sig.parameters["stream"].annotation is int
    assert typing.get_args(impl_sig.parameters["outputs"].annotation) == (fake.Tensor,) * 3


def test_plugin_definition_without_aliasing_support() -> None:
    fake = _fake_trtp(_OldDesc)
    trt_plugin._define(fake)
    _, k_out, v_out = fake.registered[trt_plugin.PLUGIN_ID](*[_OldDesc(n) for n in onnx_op.INPUT_NAMES], 0.1, 4, 2)
    assert k_out.name == "k_cache" and v_out.name == "v_cache" and k_out.aliased_to is None


def test_sanitize_indices_keeps_valid_packs_and_empties_bad_ones() -> None:
    cu, past, slots = (torch.tensor(x, dtype=torch.int32) for x in ([0, 3, 5], [4, 0], [2, 0]))
    c, p, s, ok = trt_plugin.sanitize_indices(cu, past, slots, num_tokens=5, num_slots=3, max_len=8)
    assert bool(ok) and torch.equal(c, cu) and torch.equal(p, past) and torch.equal(s, slots)
    bad = {
        "slot out of range": (cu, past, torch.tensor([3, 0], dtype=torch.int32)),
        "negative slot": (cu, past, torch.tensor([-1, 0], dtype=torch.int32)),
        "past + n > max_len": (cu, torch.tensor([6, 0], dtype=torch.int32), slots),
        "decreasing cu": (torch.tensor([0, 3, 2], dtype=torch.int32), past, slots),
        "cu not from 0": (torch.tensor([1, 3, 5], dtype=torch.int32), past, slots),
        "cu past T": (torch.tensor([0, 3, 6], dtype=torch.int32), past, slots),
    }
    for what, (c_in, p_in, s_in) in bad.items():
        c, p, s, ok = trt_plugin.sanitize_indices(c_in, p_in, s_in, num_tokens=5, num_slots=3, max_len=8)
        assert not bool(ok), what
        assert not c.any() and not p.any() and not s.any(), what


_ENQUEUE_CHECK = """
import torch
from specdec.plugins import trt_plugin
from specdec.plugins.reference import ragged_tree_attention
from tests.forests import attention_case, ints

for aliased in (True, False):
    c = attention_case()
    want_k, want_v = c["k_cache"].clone(), c["v_cache"].clone()
    want = ragged_tree_attention(c["q"], c["k"], c["v"], want_k, want_v, c["cu"], c["past"], c["slots"],
                                 c["tree"], c["scale"])
    k_in, v_in = c["k_cache"].clone(), c["v_cache"].clone()
    k_out, v_out = (k_in, v_in) if aliased else (torch.zeros_like(k_in), torch.zeros_like(v_in))
    out = torch.empty_like(c["q"])
    trt_plugin.run_attention(c["q"], c["k"], c["v"], k_in, v_in, ints(c["cu"]), ints(c["past"]),
                             ints(c["slots"]), c["tree"], c["scale"], out, k_out, v_out)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, want_k)
    torch.testing.assert_close(v_out, want_v)
    if not aliased:  # the inputs stay as TensorRT gave them
        assert torch.equal(k_in, c["k_cache"]) and torch.equal(v_in, c["v_cache"])

# bad indices: slot 7 of 3 would make the kernel write outside the cache
c = attention_case(1)
k, v = c["k_cache"].clone(), c["v_cache"].clone()
out = torch.zeros_like(c["q"])
trt_plugin.run_attention(c["q"], c["k"], c["v"], k, v, ints(c["cu"]), ints(c["past"]), ints([2, 0, 7]),
                         c["tree"], c["scale"], out, k, v)
assert torch.isnan(out).all()
assert torch.equal(k, c["k_cache"]) and torch.equal(v, c["v_cache"])
print("ok")
"""


def test_plugin_enqueue_body_matches_the_reference() -> None:
    """``run_attention`` (the plugin's enqueue minus TensorRT's buffer wrapping) against the torch reference.

    On CPU in Triton's interpreter, in a fresh process: the interpreter must be chosen before
    triton is first imported, which this test process may already have done in compiled mode.
    Covers aliased caches, copied caches, and out-of-range indices (NaN out, caches untouched).
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("OpenAI Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _ENQUEUE_CHECK], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
