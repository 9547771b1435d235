"""`mkport run` on the megakernel (GPU only): its greedy tokens against the reference backend's on the same weights,
for every LLM family, and the command's text on the default backend."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_run import LLM_CASES, add_tokenizer, family_models, invoke, tokenizer_of  # noqa: F401 (a fixture)

from mkport.kernel.spec import open_model
from mkport.runtime.decoder import Decoder
from mkport.runtime.sampling import SamplingParams
from mkport.runtime.generate import generate
from mkport.runtime.weights import Checkpoint, load_weights
from mkport.runtime.torch_decoder import TorchDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = [5, 100, 300, 7, 42, 256, 11, 300, 17, 400, 3, 250]
STEPS = 24
MARGIN_TOL = 0.05  # logits: the kernel's bf16 KV cache and accumulation order move them by ~1e-2 (test_gpu_decode)


def kernel_tokens(model: str, sampling: SamplingParams, n: int = STEPS) -> list[int]:
    spec = open_model(model).spec
    weights = load_weights(spec, Checkpoint.open(Path(model)))
    return list(generate(Decoder(spec, weights, max_seq=len(PROMPT) + n, prefill_graphs=False), PROMPT, sampling, n))


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("case", LLM_CASES)
def test_megakernel_greedy_tokens_are_the_reference_backends(family_models, case, penalty):
    """Equal token for token; a divergence is allowed only at a step where the reference's top two logits are
    closer than MARGIN_TOL (a near tie), and the comparison ends there (the sequences differ after it)."""
    model = family_models[case]
    sampling = SamplingParams(repetition_penalty=penalty)
    kernel = kernel_tokens(model, sampling)
    spec = open_model(model).spec
    reference = TorchDecoder(spec, load_weights(spec, Checkpoint.open(Path(model))), len(PROMPT) + STEPS, "cuda")
    ref, margins = [], []
    for token in generate(reference, PROMPT, sampling, STEPS):
        top2 = reference.logits.topk(2).values
        ref.append(token)
        margins.append(float(top2[0] - top2[1]))
    differ = [i for i, (a, b) in enumerate(zip(kernel, ref)) if a != b]
    assert len(kernel) == len(ref) == STEPS
    assert not differ or margins[differ[0]] < MARGIN_TOL, (differ[0], margins[differ[0]], kernel, ref)


def test_run_streams_the_megakernels_text(family_models, tmp_path):
    """The default backend through the command: the text of the kernel's greedy tokens, and its figures."""
    folder = tmp_path / "llama-run"
    shutil.copytree(family_models["llama"], folder)
    add_tokenizer(folder)
    ids = tokenizer_of(folder)("Hello there")["input_ids"]
    spec = open_model(str(folder)).spec
    weights = load_weights(spec, Checkpoint.open(folder))
    expected = list(generate(Decoder(spec, weights, max_seq=len(ids) + 15, prefill_graphs=False), ids,
                             SamplingParams(), 16, eos=[tokenizer_of(folder).eos_token_id]))
    result = invoke(str(folder), "--prompt", "Hello there", "--max-tokens", "16")
    assert result.stdout == tokenizer_of(folder).decode(expected, skip_special_tokens=True) + "\n"
    assert f"mkport run: {len(expected)} tokens" in result.stderr and "backend megakernel" in result.stderr
