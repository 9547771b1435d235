"""The prefill's fused kernels (mkport.runtime.prefill) against torch_model's plain torch on the GPU, for every bundled
spec: as accurate against fp32 matmuls, the same KV cache rows (float rounding only), prompts of tokens and of
embeddings, at the start of the cache and continuing it; then the kernel count, and the times (`pytest -s`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import bundled_kernel_params, held_kv, make_validation_model
from test_gemma import CONFIGS as GEMMAS
from test_olmo2 import CONFIGS as OLMOS

from tolerances import rel
from mkport.runtime import prefill, torch_model
from mkport.bench.decode import host_ms
from mkport.runtime.decoder import Decoder, current_device_target
from mkport.kernel.build import build_library
from mkport.kernel.cache import BUILDS, cache_root
from mkport.kernel.launch_plan import plan_launch
from mkport.kernel.render import render
from mkport.kernel.spec import load_spec
from mkport.runtime.weights import Checkpoint, load_weights, random_weights_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pair(name: str, max_seq: int = 160) -> tuple[Decoder, Decoder]:
    spec = load_spec(name)
    if spec.linear_layers:
        pytest.skip(f"{name}: a hybrid's prefill fuses only its Gated DeltaNet layers, which tests/test_gpu_qwen35.py "
                    "compares with torch's")
    w = load_weights(spec, Checkpoint.open(random_weights_folder(spec, seed=0)))
    fused = Decoder(spec, w, max_seq=max_seq, prefill_graphs=False)
    plain = Decoder(spec, w, max_seq=max_seq, prefill_graphs=False, fused_prefill=False)
    assert fused.fused_prefill and not plain.fused_prefill
    return fused, plain


def fused_prefill_params() -> list:
    """bundled_kernel_params(whole_checkpoint=True), each spec the fused prefill does not run (prefill.runs: head_dim
    96, longrope, mixture of experts) skipped with the reason: its prompts take torch_model's prefill."""
    skip = pytest.mark.skip(reason="the fused prefill does not run its layers (prefill.runs)")
    return [p if not isinstance(p, str) or prefill.runs(load_spec(p)) else pytest.param(p, marks=skip)
            for p in bundled_kernel_params(whole_checkpoint=True)]


@pytest.mark.parametrize("name", fused_prefill_params())
def test_fused_prefill_is_as_accurate_as_torch(name):
    """Against an fp32 forward of the same bf16 weights (one pass over the whole prompt, K/V unrounded): the
    fused path is as close as torch's (both sum in other orders, and a continuation attends to the bf16 cache),
    prompts of embeddings and of tokens, at the start of the cache and continuing it; the KV cache rows agree
    but for bf16 rounding steps; the next decode step gives the same greedy token."""
    fused, plain = _pair(name)
    spec = fused.spec
    w32 = fused.weights.map(lambda t: t.float())  # fp32 matmuls (no TF32): torch_model's CPU arithmetic
    gen = torch.Generator().manual_seed(7)
    embeds = (torch.randn(37, spec.input_dim, generator=gen) * 0.1).cuda()
    tokens = torch.randint(0, spec.vocab_size, (23,), generator=gen).cuda()
    for inputs, cut in ((embeds, 30), (tokens, 20)):
        tok, emb = (inputs, None) if not inputs.is_floating_point() else (None, inputs)
        x = torch_model.embed_inputs(spec, w32, tok, emb)
        pos = torch.arange(inputs.shape[0], device="cuda").expand(3, -1)
        exact = torch_model.forward(spec, w32, x, pos)
        out = {}
        for dec in (fused, plain):
            dec.reset()
            first, more = inputs[:cut], inputs[cut:]
            kw = (lambda t: dict(tokens=t)) if tok is not None else (lambda t: dict(embeds=t))
            out[dec] = torch.cat([dec.prefill(**kw(first)), dec.prefill(**kw(more))])  # start 0, then continued
        for rows in (slice(0, cut), slice(cut, None)):
            err_fused, err_torch = rel(out[fused][rows], exact[rows]), rel(out[plain][rows], exact[rows])
            print(f"\n{name} rows {rows.start}..: fused {err_fused:.1e}, torch {err_torch:.1e} from fp32")
            assert err_fused <= 2 * err_torch + 1e-6, (name, rows, err_fused, err_torch)
        n = fused.length
        for a, b in zip(held_kv(fused, n), held_kv(plain, n)):
            a, b = a.float(), b.float()
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3 * float(b.abs().max()))
            assert float((a != b).float().mean()) < 3e-2, name
    assert int(fused.step(1)) == int(plain.step(1))


@pytest.mark.parametrize("case", ["mistral", "ministral", "granite", "smollm3", *GEMMAS, *OLMOS])
def test_fused_prefill_of_the_family_features(case, tmp_path, family_model_path):
    """The same on the tiny family configs: windows of 5 over prompts of 20 and 37 rows (the continuation's rows
    reach back into the cache), a NoPE layer, granite's multipliers; Gemma's GeGLU and (1 + w) norms, gemma2's
    soft-cap of 2, gemma2/3's sandwich norms and window of 6, gemma3's sliding layers' own RoPE, OLMo 2/3's post-norms
    without input norms and q/k norms over the whole projection (test_gemma.py's and test_olmo2.py's configs)."""
    family = case in GEMMAS or case in OLMOS
    test_fused_prefill_is_as_accurate_as_torch(family_model_path(case) if family else make_validation_model(tmp_path, case))


def _no_post_norms(lw) -> dict:
    return dict(post_attn_norm=None, post_mlp_norm=None)


def _input_norms(lw) -> dict:  # olmo2 normed before its sublayers too, with its post-norms' weights
    return dict(attn_norm=lw.post_attn_norm, mlp_norm=lw.post_mlp_norm)


# feature -> (case, the spec change whose kernels lack it, the layer weights' change that drops it from the host side)
ABLATIONS = {
    "sandwich post-norms": ("gemma3", {}, _no_post_norms),
    "GeGLU": ("gemma3", dict(mlp_activation="silu"), None),
    "(1 + w) norms": ("gemma3", dict(norm_weight_offset=0.0), None),
    "sliding layers' RoPE": ("gemma3", dict(local_rope=None), None),
    "soft-capped scores": ("gemma2", dict(attn_logit_softcap=0.0), None),
    "olmo2 post-norms": ("olmo2", {}, _no_post_norms),
    "no input norms": ("olmo2", {}, _input_norms),
    "q/k norm over the projection": ("olmo2", dict(qk_norm_span="head"), None),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
def test_fused_prefill_without_a_feature_is_far_from_fp32(feature, family_model_path):
    """Each Gemma/OLMo feature bites on the tiny configs: the fused prefill of a 37-row prompt is close to an fp32
    forward, but with kernels built without the feature (the spec changed at render) or a layer's norms dropped or
    added on the host side, it is orders of magnitude further."""
    case, spec_change, weights_change = ABLATIONS[feature]
    fused, _ = _pair(family_model_path(case))
    spec, w = fused.spec, fused.weights
    lib = fused.kernel
    if spec_change:
        changed, target = dataclasses.replace(spec, **spec_change), current_device_target()
        lib, _ = build_library(render(changed, plan_launch(changed, target)).write(cache_root() / BUILDS), target.arch)
    ablated_w = w if weights_change is None else dataclasses.replace(
        w, layers=[dataclasses.replace(lw, **weights_change(lw)) for lw in w.layers])
    embeds = (torch.randn(37, spec.input_dim, generator=torch.Generator().manual_seed(5)) * 0.1).cuda()
    pos = torch.arange(37, device="cuda").expand(3, -1)
    w32 = w.map(lambda t: t.float())
    exact = torch_model.forward(spec, w32, torch_model.embed_inputs(spec, w32, None, embeds), pos)

    def run(lib, weights) -> torch.Tensor:  # a whole cache row per position on every layer: no ring at start 0
        k, v = (torch.zeros(spec.num_layers, spec.num_kv_heads, 37, spec.head_dim, device="cuda",
                            dtype=torch.bfloat16) for _ in range(2))
        return prefill.prefill_forward(lib, spec, weights, embeds, pos, k, v, 0)

    err, err_ablated = rel(run(fused.kernel, w), exact), rel(run(lib, ablated_w), exact)
    print(f"\n{case} without {feature}: {err_ablated:.1e} from fp32, with it {err:.1e}")
    assert err_ablated > max(1e-2, 100 * err), (feature, err, err_ablated)


def test_fused_prefill_kernels_and_times():
    """Under a third of torch's kernels (10 a layer against 67: attention one kernel): fails if the fused path,
    or its attention kernel, falls back to torch."""
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
    assert counts[fused] < 0.3 * counts[plain], (counts[fused], counts[plain], layers)


def _attention_paths(name: str, rows: int, cut: int, monkeypatch) -> tuple[dict, torch.Tensor]:
    """A prompt of `rows` rows (`cut`, then the rest continuing it) through the fused prefill twice: with its attention
    kernel, and with the path a context too long for its shared memory takes (torch's attention). Returns each
    path's hidden states and held K/V rows, and the embeds."""
    fused, _ = _pair(name, max_seq=rows + 16)
    gen = torch.Generator().manual_seed(3)
    embeds = (torch.randn(rows, fused.spec.input_dim, generator=gen) * 0.1).cuda()
    out = {"decoder": fused}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(fused.kernel, "prefill_attn_smem", lambda context: 1 << 30)
        fused.reset()
        out[path] = torch.cat([fused.prefill(embeds=embeds[:cut]), fused.prefill(embeds=embeds[cut:])])
        out[path + " cache"] = torch.cat(held_kv(fused, rows)).float()
    return out, embeds


@pytest.mark.parametrize("name", ["qwen3-tts-0.6b-talker", "tinyllama-1.1b"])
@pytest.mark.parametrize("rows, cut", [(90, 70), (1300, 1200)])  # a prompt, and one with a long context
def test_prefill_attention_kernel_equals_torch_attention(name, rows, cut, monkeypatch):
    """The fused attention kernel against torch's attention: the same hidden states and K/V within float rounding, at
    the start of the cache and continuing it (exact fp32 rows, then bf16 cache rows, then the prompt's own)."""
    out, _ = _attention_paths(name, rows, cut, monkeypatch)
    err = rel(out["kernel"], out["torch"])
    print(f"\n{name}, {rows} rows: attention kernel against torch's: hidden {err:.1e}")
    # each path is ~1.2e-5 from an fp32 forward (the test above: fp32 sums in other orders over 28 layers), so two
    # correct paths can differ by up to about twice that; a wrong mask or scale is orders of magnitude more
    assert err < 3e-5, err
    torch.testing.assert_close(out["kernel cache"], out["torch cache"], rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("case", ["mistral", "smollm3"])
def test_prefill_attention_kernel_windows_equal_torch_attention(case, tmp_path, monkeypatch):
    """The same on tiny family models with windows of 5 (a ring of rows; 70 rows, then 20 continuing them): each
    path against an fp32 forward of the whole prompt, the kernel's as close as torch's. Not the talker's absolute
    bound: on these models the two paths were 3.6e-5 and 6.4e-5 apart (H200, seventeenth session), each path's
    own distance from fp32 being other than the talker's 1.2e-5."""
    out, embeds = _attention_paths(make_validation_model(tmp_path, case), 90, 70, monkeypatch)
    spec = out["decoder"].spec
    w32 = out["decoder"].weights.map(lambda t: t.float())
    exact = torch_model.forward(spec, w32, torch_model.embed_inputs(spec, w32, None, embeds),
                                torch.arange(90, device="cuda").expand(3, -1))
    err_kernel, err_torch = rel(out["kernel"], exact), rel(out["torch"], exact)
    print(f"\n{case}: from fp32, attention kernel {err_kernel:.1e}, torch's {err_torch:.1e}")
    assert err_kernel <= 2 * err_torch + 1e-6, (err_kernel, err_torch)
    torch.testing.assert_close(out["kernel cache"], out["torch cache"], rtol=2**-7, atol=1e-2)
