"""Tolerances that CPU and GPU tests share, and the relative error they are measured in, defined once. A tolerance
only one file uses stays in that file, with its reason."""

from __future__ import annotations

import torch

# Graph replay against the eager path (the prefill, the codec): the same float32 math, summed in other orders.
REL_TOL = 1e-5
CONTINUATION_TOL = 1e-4  # rows that attend to the cache see its one-bf16-step differences (_assert_cache_close)

# The megakernel against the float32 reference (LLM decode and Qwen3-TTS): a token may differ only where the
# reference's top-2 logit margin is under MARGIN_TOL (bf16 KV cache and fp32 accumulation order move logits by
# ~1e-2 at most); hidden states within HIDDEN_TOL (relative L2).
MARGIN_TOL = 0.05
HIDDEN_TOL = 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b, computed in float64 whatever their dtype."""
    return float((a.double() - b.double()).norm() / b.double().norm())
