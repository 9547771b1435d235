"""bench's hf_graph engine on length-dependent RoPE (issue 28), the CPU half: transformers' dynamic_rope_update picks
longrope's short or long factors (and dynamic NTK's base) from max(position_ids) + 1 with a Python branch on a tensor,
a host sync that fails a CUDA graph capture. rope_frozen runs that update once, eagerly, and keeps it out of the
captured region: the same cos/sin as transformers' own on either side of the switch, no host read and no update
inside, and a one-line refusal (the engine's row) when the graph's positions would cross the switch. The tiny models'
original length is 16 (test_rope_scaling's configs: Phi-3.5-mini's head_dim 96 with longrope, llama with dynamic)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mkport.bench import decode
from mkport.bench.decode import rope_frozen
from mkport.errors import MkportError
from test_rope_scaling import _config


def _model(shape: str, variant: str):
    from transformers import AutoConfig, AutoModel

    cfg = _config(shape, variant)
    torch.manual_seed(0)
    return AutoModel.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()


@pytest.fixture(scope="module")
def phi3():
    return _model("phi3", "longrope")


class NoHostReads(TorchDispatchMode):
    """Raises on aten._local_scalar_dense, the op under .item() and a tensor's bool(): on CUDA, a device-to-host sync
    (what fails a capture); on CPU the same op, so the test sees it without a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("host read of a tensor")
        return func(*args, **(kwargs or {}))


def _pos(p: int) -> torch.Tensor:
    return torch.tensor([[p]])


@pytest.mark.parametrize("first,last", [(3, 15), (16, 40)])  # every position short / every position long
def test_frozen_rotary_is_transformers_own(phi3, first, last):
    """(a) Each position first..last: cos and sin bit-equal to transformers' decorated forward, and a 4-token forward
    of the whole model too."""
    rotary, x = phi3.rotary_emb, torch.randn(1, 1, 192)
    ref = {p: rotary(x, _pos(p)) for p in range(first, last + 1)}
    rotary(x, _pos(40 if first < 16 else 0))  # transformers' state left on the other side: rope_frozen must re-pick
    xs = torch.randn(1, 4, 192)
    with torch.no_grad():
        whole = phi3(inputs_embeds=xs, position_ids=torch.arange(last - 3, last + 1)[None], use_cache=False)
    with rope_frozen(phi3, x, _pos(first), last):
        assert "forward" in vars(rotary)
        for p, (cos, sin) in ref.items():
            got = rotary(x, _pos(p))
            assert torch.equal(got[0], cos) and torch.equal(got[1], sin), p
        with torch.no_grad():
            frozen = phi3(inputs_embeds=xs, position_ids=torch.arange(last - 3, last + 1)[None], use_cache=False)
    assert torch.equal(frozen.last_hidden_state, whole.last_hidden_state)
    assert "forward" not in vars(rotary)  # the class's decorated forward again


def test_the_comparison_sees_the_other_factors(phi3):
    """The equality above can fail: frozen on the short factors, position 20's cos is not transformers' (long)."""
    rotary, x = phi3.rotary_emb, torch.randn(1, 1, 192)
    cos_long, _ = rotary(x, _pos(20))
    with rope_frozen(phi3, x, _pos(3), 15):
        cos_short, _ = rotary(x, _pos(20))  # past the range rope_frozen was told of: still the short factors
    assert not torch.allclose(cos_short, cos_long, rtol=1e-3)


@pytest.mark.parametrize("shape,variant,first,last", [("phi3", "longrope", 3, 15), ("phi3", "longrope", 16, 40),
                                                      ("llama", "dynamic", 3, 15)])
def test_no_update_and_no_host_read_inside(monkeypatch, shape, variant, first, last):
    """(b) Inside rope_frozen the rotary forward neither runs dynamic_rope_update (its first act, torch.max of the
    positions, made to raise) nor reads a tensor on the host; transformers' own forward does the first, and for
    dynamic NTK (both versions) and longrope in transformers before its torch.where (5.17) the second."""
    model = _model(shape, variant)
    rotary, x = model.rotary_emb, torch.randn(1, 1, model.config.hidden_size)
    with rope_frozen(model, x, _pos(first), last):
        def no_update(*args, **kwargs):
            raise AssertionError("dynamic_rope_update ran")

        with monkeypatch.context() as m:
            m.setattr(torch, "max", no_update)
            with NoHostReads():
                for p in range(first, last + 1):
                    rotary(x, _pos(p))
            with pytest.raises(AssertionError, match="dynamic_rope_update ran"):
                type(rotary).forward(rotary, x, _pos(first))  # the decorated forward: the update
    if variant == "dynamic":
        with pytest.raises(RuntimeError, match="host read"), NoHostReads():
            rotary(x, _pos(first))


@pytest.mark.parametrize("shape,variant,first,last,words", [
    ("phi3", "longrope", 10, 20, "longrope takes its long factors from position 16"),
    ("phi3", "longrope", 15, 16, "longrope takes its long factors from position 16"),
    ("llama", "dynamic", 3, 16, "dynamic RoPE recomputes its frequencies from position 16"),
])
def test_positions_across_the_switch_are_refused_in_one_line(shape, variant, first, last, words):
    """(c) A graph whose replays would cross the switch: MkportError naming the positions and the switch, in one
    line, and no rotary module left patched."""
    model = _model(shape, variant)
    x = torch.randn(1, 1, model.config.hidden_size)
    with pytest.raises(MkportError, match=words) as e:
        with rope_frozen(model, x, _pos(first), last):
            pass
    assert f"positions {first}..{last}" in str(e.value) and "\n" not in str(e.value)
    assert "forward" not in vars(model.rotary_emb)


def test_plain_rope_is_left_alone():
    """A rotary module without a length-dependent type (yarn here) keeps its forward; nothing is refused."""
    model = _model("llama", "yarn")
    with rope_frozen(model, torch.randn(1, 1, 128), _pos(3), 60):
        assert "forward" not in vars(model.rotary_emb)


def test_the_refusal_is_the_engine_row(monkeypatch):
    """run_bench puts hf_graph's refusal in that engine's row and goes on with the other engines."""
    spec = types.SimpleNamespace(name="tiny", max_position=1 << 20, max_context=1 << 20, moe=None, linear_layers=(),
                                 weight_bytes_per_step=lambda **k: 1000)
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr("mkport.runtime.weights.load_weights", lambda spec, checkpoint: None)
    monkeypatch.setattr(decode, "HFStep", lambda *a: object())
    monkeypatch.setattr(decode, "environment", lambda: {})
    message = "hf_graph cannot capture positions 4095..4205: longrope takes its long factors from position 4096"

    def refuse(*args):
        raise MkportError(message)

    monkeypatch.setattr(decode, "bench_hf_graph", refuse)
    monkeypatch.setattr(decode, "bench_hf_eager", lambda hf, ctx, *a: decode.EngineTiming("hf_eager", ctx, [5.0]))
    result = decode.run_bench(types.SimpleNamespace(spec=spec), None, [4096], engines=("hf_graph", "hf_eager"))
    assert result["results"][0] == {"engine": "hf_graph", "context": 4096, "error": message}
    assert result["results"][1]["engine"] == "hf_eager" and result["results"][1]["median_us"] == 5.0
