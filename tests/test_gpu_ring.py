"""A sliding layer's KV cache ring on the GPU (runtime/kv_cache.py; the CPU half is tests/test_kv_cache.py): tiny
sliding configs (windows of 5 and 6: rings of 20 and 21 rows, prompts prefilled 16 rows a pass) with prompts several
windows long and decode steps that wrap the ring again, against the float32 reference; the bytes the decoder
allocates; graph and eager, fused and torch prefill over the ring's passes."""

from __future__ import annotations

import pytest
import torch

from tolerances import CONTINUATION_TOL, HIDDEN_TOL, rel
from mkport.check.diff import kernel_diff
from mkport.kernel.spec import load_spec, open_model
from mkport.runtime.decoder import Decoder
from mkport.runtime.kv_cache import KvCache, KvLayout
from mkport.runtime.torch_decoder import TorchDecoder
from mkport.runtime.weights import Checkpoint, load_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT, STEPS = 45, 24  # 9 windows of 5 in 3 passes, then 24 steps: each ring (20, 21 rows) wraps again
VALIDATION = ("mistral", "ministral", "smollm3", "phi3")  # every layer, some layers, with NoPE; head_dim 96
GEMMAS = ("gemma2", "gemma3")


def _model(validation_models, family_model_path, case: str) -> str:
    return validation_models[case] if case in VALIDATION else family_model_path(case)


@pytest.mark.parametrize("case", VALIDATION + GEMMAS)
def test_past_the_ring_against_the_reference(validation_models, family_model_path, case):
    """The trace build against the float32 reference over the whole prompt and every step: each traced state
    within the policy, the greedy tokens agreeing but where random weights leave near ties."""
    model = _model(validation_models, family_model_path, case)
    source = open_model(model)
    layout = KvLayout.of(source.spec, PROMPT + STEPS)
    assert layout.chunk_rows == 16 and min(layout.rows) < PROMPT  # the ring is in use, and wraps in the prompt
    result = kernel_diff(source, Checkpoint.open(model), prompt_len=PROMPT, steps=STEPS, seed=0)
    assert result.report.passed, result.report.verdict()
    assert result.token_agreement >= STEPS * 3 // 4


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
def test_a_batch_past_the_ring(validation_models, family_model_path, case):
    """Four sequences at their own positions (prompts of 45 to 48 rows), each past its ring, one layout of layers
    holding all of them, against their own reference runs."""
    model = _model(validation_models, family_model_path, case)
    result = kernel_diff(open_model(model), Checkpoint.open(model), prompt_len=PROMPT, steps=12, seed=0, batch=4)
    assert result.report.passed, result.report.verdict()


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
def test_the_decoder_allocates_the_rings_bytes(validation_models, family_model_path, case):
    """The bytes the GPU's allocator hands the decoder's cache are the layout's: the rings' rows, not max_seq's."""
    model = _model(validation_models, family_model_path, case)
    spec = load_spec(model)
    for batch in (1, 4):
        layout = KvLayout.of(spec, 512, batch)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        cache = KvCache(layout, "cuda")
        grown = torch.cuda.memory_allocated() - before
        assert cache.nbytes == batch * layout.sequence_bytes()
        assert 0 <= grown - cache.nbytes < 2 * 512  # the allocator's rounding of two buffers
        full = 2 * 2 * spec.num_layers * (512 + (batch > 1)) * spec.num_kv_heads * spec.head_dim * batch
        assert cache.nbytes < 0.6 * full
        del cache
    dec = Decoder(spec, load_weights(spec, Checkpoint.open(model)), max_seq=512)
    assert dec.kv.nbytes == KvLayout.of(spec, 512).sequence_bytes()


@pytest.mark.parametrize("case", ["mistral", "ministral"])
def test_prefill_paths_agree_over_the_ring(validation_models, case):
    """A prompt of 45 rows in passes of 16: graph replays and eager, the fused kernels and torch_model's prefill
    give the same hidden states (to the prefill's rounding), and after 24 steps the same states as TorchDecoder's
    float32, full-length cache."""
    model = validation_models[case]
    spec = load_spec(model)
    weights = load_weights(spec, Checkpoint.open(model))
    tokens = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    decoders = {"graph": Decoder(spec, weights, max_seq=PROMPT + STEPS),
                "eager": Decoder(spec, weights, max_seq=PROMPT + STEPS, prefill_graphs=False),
                "torch": Decoder(spec, weights, max_seq=PROMPT + STEPS, prefill_graphs=False, fused_prefill=False)}
    assert decoders["graph"].fused_prefill and decoders["graph"].kv.layout.passes(PROMPT)[-1] == (32, 45)
    reference = TorchDecoder(spec, weights, max_seq=PROMPT + STEPS, device="cuda")
    prompt = {name: dec.prefill(tokens) for name, dec in decoders.items()}
    want = reference.prefill(tokens)
    assert rel(prompt["graph"], prompt["eager"]) < CONTINUATION_TOL
    assert rel(prompt["torch"], prompt["eager"]) < CONTINUATION_TOL
    assert rel(prompt["eager"], want) < HIDDEN_TOL
    token = int(tokens[-1])
    for _ in range(STEPS):  # every decoder fed the reference's tokens
        for dec in (reference, *decoders.values()):
            dec.step(token)
        token = int(reference.token_out)
    for name, dec in decoders.items():
        assert rel(dec.hidden, reference.hidden) < HIDDEN_TOL, name
