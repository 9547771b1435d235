"""The plain-torch families' shared checks, once for all of them: mkport's torch path (torch_model, TorchDecoder,
`run --backend reference`) against transformers' own classes on each family's tiny random model. Prefill taps to
fp32 rounding, decode taps within the diff's tolerance, greedy tokens equal to transformers' generate, `mkport run
--backend reference` printing transformers' text, weight faults found at their layer and op. What is one family's
own (its spec, refusals, ablations, the tiny configs and why they bite) stays in its file: test_gemma.py,
test_olmo2.py, test_exaone4.py, test_llama_variants.py, test_qwen35.py, test_moe.py, test_rope_scaling.py."""

from __future__ import annotations

import shutil

import pytest

from conftest import MOE_CASES, NEEDS_PHI3_GENERATE, torch_path_against_transformers, validation_inputs
from mkport.check.diff import inject
from mkport.kernel.interface import Tap
from mkport.runtime import torch_model
from test_exaone4 import CONFIGS as EXAONES
from test_llama_variants import CONFIGS as VARIANTS
from test_gemma import CONFIGS as GEMMAS
from test_olmo2 import CONFIGS as OLMOS
from test_rope_scaling import SCALINGS

# family -> taps compared per layer (a full-attention layer, a linear-attention one), and taps one pass must have or
# must not have: OLMo 2's post-norm layers have no attn_norm, Qwen3.5 has both layer kinds
TAPS_PER_LAYER = {"gemma": (6, None), "olmo": (5, None), "qwen3_5": (6, 7), "ernie4_5": (6, None), "helium": (6, None),
                  "seed_oss": (6, None), "exaone4": (5, None), "glm": (6, None)}
MUST_HAVE = {"qwen3_5": {Tap.layer(0, Tap.STATE_OUT), Tap.layer(3, Tap.Q)}}
MUST_NOT_HAVE = {"olmo": {Tap.layer(0, Tap.ATTN_NORM)}, "exaone4": {Tap.layer(0, Tap.ATTN_NORM)}}
PROMPT = [5, 100, 300, 7, 42, 256, 11, 300]


def family_of(case: str) -> str:
    return next(f for f in TAPS_PER_LAYER if case.startswith(f))


# -- one pass and token by token -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,chunk", [(c, None) for c in (*GEMMAS, *OLMOS, *VARIANTS, *EXAONES)] + [("qwen3_5", 64), ("qwen3_5", 4)],
                         ids=[*GEMMAS, *OLMOS, *VARIANTS, *EXAONES, "qwen3_5-one-chunk", "qwen3_5-chunks-of-4"])
def test_prefill_matches_transformers(family_model, monkeypatch, case, chunk):
    """One pass of 20 rows (past the sliding windows of 6) against transformers' float32 classes: the same taps on
    both sides, every one to fp32 rounding; Qwen3.5's chunked scan in one chunk and in chunks of 4."""
    spec, w, ref, _ = family_model(case)
    family = family_of(case)
    if chunk is not None:
        assert torch_model.delta_rule_chunked.__defaults__ == (torch_model.DELTA_CHUNK,)  # its one default: the chunk
        monkeypatch.setattr(torch_model.delta_rule_chunked, "__defaults__", (chunk,))
    ours, reference, report = torch_path_against_transformers(spec, w, ref, validation_inputs(spec, case, n=20, seed=1))
    assert set(ours) == set(reference)
    assert MUST_HAVE.get(family, set()) <= set(ours) and not MUST_NOT_HAVE.get(family, set()) & set(ours)
    assert report.passed, report.to_text()
    full, linear = TAPS_PER_LAYER[family]
    linears = len(spec.linear_layers)
    assert len(report.rows) == 3 + full * (spec.num_layers - linears) + (linear or 0) * linears
    worst = max(report.rows, key=lambda r: r.rel_l2)
    assert worst.rel_l2 < 2e-4, f"{worst.name}: rel_l2 {worst.rel_l2:.3g} is more than fp32 rounding"


@pytest.mark.parametrize("case", [*GEMMAS, *OLMOS, *VARIANTS, *EXAONES, "qwen3_5"])
def test_decode_matches_transformers(family_model, case):
    """Token by token with a bf16 KV cache (the kernel's numerics on the CPU), 16 rows: within the diff's
    tolerance."""
    spec, w, ref, _ = family_model(case)
    _, _, report = torch_path_against_transformers(spec, w, ref, validation_inputs(spec, case, n=16, seed=2),
                                                   decode=True)
    assert report.passed, report.to_text()


# -- the reference backend's tokens and text --------------------------------------------------------------------------

# case -> (prompt, greedy steps): 24 steps past the sliding windows and the scaled RoPEs' original length 16 (the tiny
# phi3's through its generate's recompute of the cache there: runtime.rope_switch); the MoE models' prompt of 5 and 8
# steps
GREEDY = {**{case: (PROMPT, 24) for case in (*GEMMAS, *OLMOS, *VARIANTS, *EXAONES)},
          **{f"llama-{variant}": (PROMPT, 24) for variant in SCALINGS}, "phi3-longrope": (PROMPT, 24),
          "phi4-longrope": (PROMPT, 24),
          **{case: ([3, 17, 99, 250, 4], 8) for case in MOE_CASES}}


def _generate_cases(cases) -> list:
    """The cases, Phi-3's marked: their transformers generate crosses the longrope switch."""
    return [pytest.param(case, marks=NEEDS_PHI3_GENERATE) if case.startswith("phi")
            else case for case in cases]


@pytest.mark.parametrize("case", _generate_cases(GREEDY))
def test_reference_greedy_tokens_are_transformers_generate(family_model_path, case):
    """TorchDecoder's greedy tokens (the reference backend) against transformers' from_pretrained and generate: for
    the MoE models this also checks that the per-expert checkpoint names are those transformers loads."""
    from test_run import reference_tokens, transformers_greedy

    prompt, steps = GREEDY[case]
    path = family_model_path(case)
    assert reference_tokens(path, prompt, steps) == transformers_greedy(path, prompt, steps)


# case -> greedy steps for a prompt of n tokens (the megakernel runs each family: test_gpu_kernel_families.py)
RUNS = {"gemma2": lambda n: 12,
        "olmo2": lambda n: 12,
        "phi3-longrope": lambda n: 24,  # past the original length 16
        "phi4-longrope": lambda n: 24}  # Phi-4-mini's 3/4 of a head


@pytest.mark.parametrize("case", _generate_cases(RUNS))
def test_run_reference_prints_transformers_tokens(family_model_path, tmp_path, case):
    """`mkport run --backend reference` prints transformers' greedy text."""
    from test_run import add_tokenizer, invoke, text_of, tokenizer_of, transformers_greedy

    folder = tmp_path / f"{case}-run"
    shutil.copytree(family_model_path(case), folder)
    add_tokenizer(folder)
    ids = tokenizer_of(folder)("Hello there")["input_ids"]
    steps = RUNS[case](len(ids))
    expected = transformers_greedy(str(folder), ids, steps)
    result = invoke(str(folder), "--prompt", "Hello there", "--backend", "reference", "--max-tokens", str(steps))
    assert result.stdout == text_of(folder, expected)


# -- faults found at their layer and op ------------------------------------------------------------------------------

@pytest.mark.parametrize("case,layer,op", [
    ("gemma", 1, Tap.MLP_RESIDUAL), ("gemma2", 2, Tap.ATTN_RESIDUAL), ("gemma2", 1, Tap.Q), ("gemma3", 3, Tap.K),
    ("gemma3", 2, Tap.ATTN),
    ("olmo2", 0, Tap.Q), ("olmo2", 1, Tap.K), ("olmo2", 2, Tap.ATTN), ("olmo2", 1, Tap.ATTN_RESIDUAL),
    ("olmo2", 2, Tap.MLP_RESIDUAL), ("olmo3", 3, Tap.Q), ("olmo3", 1, Tap.ATTN),
    ("ernie4_5", 1, Tap.Q), ("ernie4_5", 2, Tap.K), ("helium", 1, Tap.K), ("helium", 2, Tap.ATTN_NORM),
    ("seed_oss", 1, Tap.K), ("seed_oss", 2, Tap.MLP_RESIDUAL), ("exaone4", 1, Tap.Q), ("exaone4", 3, Tap.K),
    ("exaone4", 2, Tap.ATTN_RESIDUAL), ("glm", 1, Tap.Q), ("glm", 2, Tap.MLP_RESIDUAL), ("glm4", 1, Tap.K),
    ("glm4", 2, Tap.ATTN_RESIDUAL), ("glm4", 0, Tap.MLP_RESIDUAL)])
def test_injected_weight_fault_is_found_there(family_model, case, layer, op):
    """A perturbed weight of one layer's op: the diff's first failure is that layer and op, not before."""
    spec, w, ref, _ = family_model(case)
    inp = validation_inputs(spec, case, n=12, seed=7)
    _, _, report = torch_path_against_transformers(spec, inject(w, spec, layer, op, seed=1), ref, inp)
    assert not report.passed and report.first_failure.name == Tap.layer(layer, op), report.to_text()
