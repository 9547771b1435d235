"""Random weights: today's sequential generator pinned byte for byte (every recorded number rests on it), and the
counter-based one (a tensor's values a function of seed, name and element index only) that large models use."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from conftest import validation_config

import mkport.runtime.weights as weights
from mkport.kernel.spec import bundled_names, load_spec
from mkport.runtime.weights import (COUNTER_CHUNK, COUNTER_WEIGHTS_BYTES, CounterCheckpoint, checkpoint_bytes, _init_rule, checkpoint_shapes, counter_bits,
                                    counter_checkpoint, counter_key, counter_tensor, random_checkpoint, weight_names)

# sha256 over (name, shape, bf16 bits) of random_checkpoint(qwen3-tts-1.7b-code-predictor, seed 0), computed on main
# at 6e27806 before the counter-based generator was added beside it
PINNED_SEQUENTIAL = "67ca0a19c476eb046aeeb669b42e5dfaddd2eb48f9235351f8064f2dacabe56f"


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def test_sequential_random_weights_are_unchanged():
    assert _digest(random_checkpoint(load_spec("qwen3-tts-1.7b-code-predictor"), seed=0)) == PINNED_SEQUENTIAL


def _counter(shape, rule=("normal", 1.0, 0.0), name="model.layers.0.mlp.up_proj.weight", seed=0, chunk=COUNTER_CHUNK):
    return counter_tensor(counter_key(seed, name), shape, rule, "cpu", chunk)


def _tiny_spec(tmp_path, case="qwen3"):
    cfg, _ = validation_config(case)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_spec(str(tmp_path))


def test_counter_weights_are_a_function_of_seed_name_and_index(tmp_path):
    spec = _tiny_spec(tmp_path)
    first, again = counter_checkpoint(spec, seed=3), counter_checkpoint(spec, seed=3)
    assert _digest(first) == _digest(again)
    assert set(first) == set(random_checkpoint(spec, seed=3))
    assert all(first[n].dtype == torch.bfloat16 and first[n].shape == t.shape for n, t in random_checkpoint(spec).items())
    other = counter_checkpoint(spec, seed=4)
    assert all(not torch.equal(first[n], other[n]) for n in first)
    # a tensor read alone (as a layer at a time reads it) is the same tensor
    name = "model.layers.1.self_attn.k_proj.weight"
    alone = CounterCheckpoint(spec, seed=3).read({name: first[name].shape})
    assert torch.equal(alone[name], first[name])


def test_counter_weights_do_not_depend_on_the_chunking():
    whole = _counter((96, 130))
    for chunk in (1, 7, 4096, 96 * 130 - 1):
        assert torch.equal(_counter((96, 130), chunk=chunk), whole)
    # element j is element j whatever the shape: a prefix of a longer tensor
    assert torch.equal(_counter((20, 130)), whole[:20])


def test_counter_weights_differ_between_tensors_and_elements():
    a = _counter((256, 256), name="model.layers.0.self_attn.q_proj.weight")
    b = _counter((256, 256), name="model.layers.1.self_attn.q_proj.weight")
    assert (a == b).float().mean() < 0.01  # only coincidences of equal bf16 values
    corr = torch.corrcoef(torch.stack([a.flatten().float(), b.flatten().float()]))[0, 1]
    assert abs(corr) < 0.02
    # neighbouring elements and rows are uncorrelated too
    flat = a.flatten().float()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]) < 0.02
    assert abs(torch.corrcoef(torch.stack([a[:-1].flatten().float(), a[1:].flatten().float()]))[0, 1]) < 0.02
    assert len(torch.unique(a)) > 1000


def test_counter_weights_have_the_intended_scale():
    spec = load_spec("qwen3-tts-1.7b-code-predictor")
    names, n = weight_names(spec), 1 << 18
    rules = {_init_rule(spec, names, name, shape): name for name, shape in checkpoint_shapes(spec, names).items()}
    assert len(rules) >= 4  # projections of two widths, embeddings and heads, norms, the projection's bias
    for rule, name in rules.items():
        x = _counter((n,), rule, name).double()
        std, mean = rule[1], rule[2]
        assert abs(x.mean().item() - mean) < 5 * std / math.sqrt(n), name
        assert abs(x.std().item() / std - 1) < 0.01, name
        assert (x - mean).abs().max().item() <= 3.47 * std, name  # four uniforms: tails cut at sqrt(12)
    x = _counter((n,), ("normal", 1.0, 0.0)).double()
    assert abs(((x**4).mean() / (x**2).mean() ** 2).item() - 2.7) < 0.05  # four uniforms' sum: 3 - 6 / 20 (a normal: 3)
    u = _counter((n,), ("uniform", math.log(0.05), 0.0)).double()
    low = torch.tensor(math.log(0.05)).bfloat16().item()  # the bound as bf16 rounds it
    assert low <= u.min().item() < low + 0.02 and -0.01 < u.max().item() <= 0.0
    assert abs(u.mean().item() - math.log(0.05) / 2) < 0.01


def test_counter_hash_uses_only_exact_integer_ops():
    """The same bits on any device need ops whose results are defined exactly: no int64 product may wrap (signed
    overflow), every shift must act on a non-negative value, and the float steps take exact integers. Checked by
    tracing the hash on the extreme counters and keys with tensors that record every intermediate."""
    seen = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs or {})
            if isinstance(out, torch.Tensor):
                with torch._C.DisableTorchFunctionSubclass():
                    seen.append((func.__name__, out.min().item(), out.max().item()))
            return out

    counters = torch.tensor([0, 1, 2**32 - 1, 2**32, 2 * (2**40) + 1, 2**41 - 1]).as_subclass(Traced)
    for key in ((0, 0), (2**32 - 1, 2**32 - 1), counter_key(0, "x")):
        bits = counter_bits(key, counters).as_subclass(torch.Tensor)
        assert 0 <= bits.min() and bits.max() < 2**32
    assert seen and all(0 <= low and high < 2**49 for _, low, high in seen), max(seen, key=lambda s: s[2])
    assert {f for f, _, _ in seen} == {"__and__", "__rshift__", "__xor__", "mul", "__lshift__", "add"}
    # the float part takes the exact integer sum of four 16-bit halves: with a scale of 1 the value is that sum, rounded
    # once (to bf16)
    key, j = counter_key(1, "w"), torch.arange(5000)
    halves = [(bits >> shift) & 0xFFFF for bits in (counter_bits(key, 2 * j), counter_bits(key, 2 * j + 1))
              for shift in (0, 16)]
    exact = sum(halves) - 2 * 65535
    assert torch.equal(counter_tensor(key, (5000,), ("normal", weights._SUM4_STD, 0.0)), exact.to(torch.bfloat16))


def test_counter_weights_are_made_in_bounded_memory(monkeypatch):
    """A chunk's temporaries, not the tensor's: arange is only ever asked for `chunk` counters."""
    import mkport.runtime.weights as weights

    sizes, arange = [], torch.arange

    def spy(*args, **kwargs):
        out = arange(*args, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(weights.torch, "arange", spy)
    _counter((1000, 100), chunk=4096)
    assert max(sizes) == 4096 and sum(sizes) == 100_000


def test_only_models_past_the_threshold_get_counter_weights(tmp_path, monkeypatch):
    """Every bundled spec but the MoE ones past it keeps its cached sequential checkpoint; a model past
    COUNTER_WEIGHTS_BYTES gets counter-based weights with nothing written (the writer is replaced by one that fails)."""
    for name in bundled_names():  # a checkpoint holds every expert: 61, 29 and 93 GB
        past = name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")
        assert (checkpoint_bytes(load_spec(name)) > COUNTER_WEIGHTS_BYTES) == past, name

    def refuse(spec, seed=0):
        raise AssertionError("wrote random weights")

    monkeypatch.setattr(weights, "random_weights_folder", refuse)
    cfg = json.loads((Path(weights.__file__).parents[1] / "kernel/model_specs/mistral-7b-v0.3.json").read_text())
    cfg["num_hidden_layers"] = 40  # 17.7 GB
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    big = load_spec(str(tmp_path))
    assert checkpoint_bytes(big) > COUNTER_WEIGHTS_BYTES
    checkpoint = weights.random_weights(big, seed=2)
    assert isinstance(checkpoint, CounterCheckpoint) and checkpoint.seed == 2
    name = "model.layers.39.self_attn.k_proj.weight"
    k = checkpoint.read({name: (1024, 4096)})[name]
    assert torch.equal(k, counter_tensor(counter_key(2, name), (1024, 4096), _init_rule(big, weight_names(big), name, k.shape)))
