"""The prefill's fused kernels (mkport.prefill) against torch_model's plain torch on the GPU, for every bundled
spec: the same hidden states and KV cache rows (float rounding only), prompts of tokens and of embeddings, at
the start of the cache and continuing it; then the kernel count it was built for, and the times (`pytest -s`)."""

from __future__ import annotations

import pytest
import torch

from mkport.bench import host_ms
from mkport.runtime import Decoder
from mkport.spec import bundled_names, load_spec
from mkport.weights import Checkpoint, load_weights, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REL_TOL = 1e-5  # the same matmuls on the same inputs; only the norms' sums run in another order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _pair(name: str) -> tuple[Decoder, Decoder]:
    spec = load_spec(name)
    w = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    fused = Decoder(spec, w, max_seq=160, prefill_graphs=False)
    plain = Decoder(spec, w, max_seq=160, prefill_graphs=False, fused_prefill=False)
    assert fused.fused_prefill and not plain.fused_prefill
    return fused, plain


@pytest.mark.parametrize("name", bundled_names())
def test_fused_prefill_equals_torch(name):
    fused, plain = _pair(name)
    spec = fused.spec
    gen = torch.Generator().manual_seed(7)
    embeds = (torch.randn(37, spec.input_dim, generator=gen) * 0.1).cuda()
    tokens = torch.randint(0, spec.vocab_size, (23,), generator=gen)
    for first, more in (((None, embeds[:30]), (None, embeds[30:])), ((tokens[:20], None), (tokens[20:], None))):
        out = {}
        for dec in (fused, plain):
            dec.reset()
            out[dec] = [dec.prefill(tokens=t, embeds=e) for t, e in (first, more)]  # start 0, then continued
        for got, want in zip(out[fused], out[plain]):
            assert got.shape == want.shape and _rel(got, want) < REL_TOL, (name, _rel(got, want))
        n = fused.length
        for cache in ("k_cache", "v_cache"):
            a, b = getattr(fused, cache)[:, :, :n].float(), getattr(plain, cache)[:, :, :n].float()
            assert float((a != b).float().mean()) < 1e-2 and _rel(a, b) < 1e-3, (name, cache)
    # the next decode step sees the same cache: the same greedy token
    assert int(fused.step(1)) == int(plain.step(1))


def test_fused_prefill_kernels_and_times():
    """~16 kernels a layer (the torch path launches ~65): fails if the fused path falls back to torch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fused, plain = _pair("qwen3-tts-0.6b-talker")
    embeds = (torch.randn(100, fused.spec.input_dim, generator=torch.Generator().manual_seed(1)) * 0.1).cuda()
    counts, times = {}, {}
    for dec in (fused, plain):
        def run(dec=dec):
            dec.reset()
            dec.prefill(embeds=embeds)
        run()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        counts[dec] = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
        times[dec] = host_ms(run, 20)
    layers = fused.spec.num_layers
    print(f"\nprefill of 100 rows, eager: fused {counts[fused]} kernels {times[fused]:.2f} ms, "
          f"torch {counts[plain]} kernels {times[plain]:.2f} ms")
    assert counts[fused] <= 18 * layers + 10 < counts[plain]
