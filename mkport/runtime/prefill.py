"""The prompt prefill on CUDA with mkport's fused kernels: cuBLAS matmuls (bf16 tensor cores, fp32 accumulation,
on inputs split into bf16 hi + lo rows as torch_model.linear splits them) and, between them, the kernels of
kernel/cuda/prefill.cuh (built into the decode step's library): 10 kernels a layer (attention one of them, its
scores in shared memory) where torch_model.forward launches 67, each of those a few microseconds however few rows
a prompt has.

Same arithmetic as torch_model.forward: attention takes the prompt's own K/V in fp32, and cached rows before
`start` from the decoder's exact prompt rows or the bf16 cache (torch_model.attended_kv). Capture-safe for a
CUDA graph: no host sync, no host-to-device copy, and control flow from shapes and `start` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import torch_model
from ..kernel.build import device_ptr
from ..kernel.spec import LENGTH_DEPENDENT_ROPE, ModelSpec
from .weights import DecoderWeights


def runs(spec: ModelSpec) -> bool:
    """The fused kernels hold a head as pairs of rotate-half partners in each lane (head_dim a multiple of 64), and
    rotate a partial RoPE's first rotary_dim dimensions as the decode step does (rope.cuh's apply_rope).
    They run the Llama lineage's layers and Gemma's and OLMo's features as the decode step has them: GeGLU, (1 + w)
    norms, post-norms (gemma2/3's sandwich, olmo2/3's without input norms), soft-capped scores, q/k norms over a head
    or over the whole projection, the sliding layers' own RoPE. Not a mixture of experts, nor a hybrid (qwen3_5: its
    prefill is torch_model's with its Gated DeltaNet layers in gated_delta_net's kernels), nor RoPE whose frequencies
    follow the prompt's length (longrope, dynamic): those prompts take torch_model's prefill."""
    return (spec.moe is None and not spec.linear_layers and spec.rope.variant not in LENGTH_DEPENDENT_ROPE
            and spec.head_dim % 64 == 0)


def supported(spec: ModelSpec, weights: DecoderWeights) -> bool:
    """runs(spec), on bf16 weights (what the kernels read)."""
    return runs(spec) and weights.layers[0].wqkv.dtype == torch.bfloat16


def linear_layers_run(spec: ModelSpec, weights: DecoderWeights, kernels_smem: int, smem_per_block: int) -> bool:
    """Whether a hybrid's Gated DeltaNet layers prefill in gated_delta_net's kernels: bf16 weights (what they read),
    and a GPU that gives a block the kernels' shared memory (KernelLibrary.prefill_delta_smem: the H200's 227 KB
    does, a 99 KB consumer card does not)."""
    return (bool(spec.linear_layers) and weights.layers[spec.linear_layers[0]].lin_conv.dtype == torch.bfloat16
            and kernels_smem <= smem_per_block)


def _stream(t: torch.Tensor) -> int:
    """Torch's current stream on t's device: the kernels launch there, so a CUDA graph captures them."""
    return torch.cuda.current_stream(t.device).cuda_stream


def _mm(parts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[2n, k] hi and lo rows (bf16) @ w.T -> [2n, m] fp32: the product of each half, summed by the reader."""
    return torch.mm(parts, w.t(), out_dtype=torch.float32)


@dataclass(frozen=True)
class PromptRows:
    """Several prompts prefilled together, their rows one after another: `table` [3, N] (int64, on the device) gives
    each row its prompt's first row and its sequence's K and V cache (the address of layer 0's rows), `layer_at`
    where each layer's rows are from there (elements; kv_cache.KvLayout.offsets, the same for every sequence of one
    layout), `rows` each layer's cache rows a kv head."""

    table: torch.Tensor
    layer_at: tuple[int, ...]
    rows: tuple[int, ...]


def prompt_rows(sizes: list[int], caches: list[tuple[int, int]], bucket: int) -> torch.Tensor:
    """PromptRows.table on the host for prompts of `sizes` rows, one after another, into the sequences whose layer-0 K
    and V rows are at `caches` (addresses), padded to `bucket` rows: padding continues the last prompt (as a lone
    prompt's padding continues it), so it writes only that sequence's cache rows past its prompt, which no row
    reads before a step writes them (torch_model.prefill_bucket)."""
    if not sizes or len(sizes) != len(caches) or min(sizes) < 1 or sum(sizes) > bucket:
        raise ValueError(f"prompts of {sizes} rows into {len(caches)} sequences do not fit a bucket of {bucket} rows")
    table = torch.empty(3, bucket, dtype=torch.int64)
    first = 0
    for p, (size, (k, v)) in enumerate(zip(sizes, caches)):
        end = first + size if p < len(sizes) - 1 else bucket
        table[0, first:end], table[1, first:end], table[2, first:end] = first, k, v
        first = end
    return table


@torch.no_grad()
def prefill_forward(lib, spec: ModelSpec, w: DecoderWeights, inputs: torch.Tensor, positions: torch.Tensor,
                    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, start: int, table: int = 0,
                    prompt_kv: torch.Tensor | None = None, exact: int = 0,
                    prompts: PromptRows | None = None) -> torch.Tensor:
    """As torch_model.prefill_forward: token ids [N] or input embeddings [N, input_dim] after `start` cached rows;
    writes their K/V into k_cache[i], v_cache[i] (layer i's [kv_heads, rows, head_dim], a ring's rows p % rows);
    returns the final-normed hidden states [N, hidden] (fp32). `lib`: the decode step's KernelLibrary; `w`: the
    decoder's bf16 weights on the GPU; prompt_kv and exact as in torch_model.forward.
    `prompts`: the rows are several prompts, each from position 0 into a sequence of its own (PromptRows; no
    k_cache, v_cache, start or prompt_kv): each row attends to its own prompt's rows and writes its own sequence's
    cache, the weights read once for them all."""
    tokens, embeds = (inputs, None) if not inputs.is_floating_point() else (None, inputs)
    x = torch_model.embed_inputs(spec, w, tokens, embeds, table).contiguous().clone()  # the residual stream
    n, dev = x.shape[0], x.device
    nh, hd, inter = spec.num_heads, spec.head_dim, spec.intermediate_size
    positions = positions.contiguous()
    stream = _stream(x)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    parts_h = torch.empty(2 * n, spec.hidden_size, **bf16)
    parts_q = torch.empty(2 * n, nh * hd, **bf16)
    parts_i = torch.empty(2 * n, inter, **bf16)
    q = torch.empty(nh, n, hd, device=dev, dtype=torch.float32)
    kv = torch.empty(2, spec.num_kv_heads, n, hd, device=dev, dtype=torch.float32)
    # attention in one kernel (its scores in shared memory), or torch's for a context longer than a block holds
    fused_attention = lib.prefill_attn_smem(start + n) <= torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
    if prompts is not None and (start or prompt_kv is not None or not fused_attention):
        raise ValueError("prompts prefilled together start at 0, keep no exact rows and fit the fused attention")
    prompt_table = 0 if prompts is None else prompts.table.data_ptr()
    masks = {} if fused_attention else {window: torch_model.attention_mask(n, start, window, dev)
                                        for window in {spec.window(i) for i in range(spec.num_layers)}}
    exact_cap = 0 if prompt_kv is None else prompt_kv.shape[3]
    # the last matmul's output (halves), added to the residual stream by the next norm, normed first with `post`
    # (post-norm layers; None elsewhere); a layer without input norms (olmo2/3) splits x itself
    add = post = None
    for i, lw in enumerate(w.layers):
        lib.prefill("mk_prefill_norm", x.data_ptr(), device_ptr(add), device_ptr(post), device_ptr(lw.attn_norm), 0,
                    parts_h.data_ptr(), n, stream)
        qkv = _mm(parts_h, lw.wqkv)
        caches = (None, None) if prompts is not None else (k_cache[i], v_cache[i])
        rows = prompts.rows[i] if prompts is not None else k_cache[i].shape[1]
        lib.prefill("mk_prefill_qkv", qkv.data_ptr(), device_ptr(lw.bqkv), device_ptr(lw.q_norm), device_ptr(lw.k_norm),
                    positions.data_ptr(), positions.stride(0), q.data_ptr(), kv.data_ptr(), device_ptr(caches[0]),
                    device_ptr(caches[1]), n, start, rows, int(spec.uses_rope(i)), int(spec.uses_local_rope(i)),
                    prompt_table, 0 if prompts is None else prompts.layer_at[i], stream)
        if fused_attention:
            if start == 0:
                torch_model.keep_exact_rows(prompt_kv, i, kv)
            kept = (None, None) if prompt_kv is None else (prompt_kv[0, i], prompt_kv[1, i])
            lib.prefill("mk_prefill_attn", q.data_ptr(), kv.data_ptr(), device_ptr(caches[0]), device_ptr(caches[1]),
                        device_ptr(kept[0]), device_ptr(kept[1]), exact_cap, exact if start else 0, start, n,
                        rows, spec.window(i), spec.attention_scale, parts_q.data_ptr(),
                        prompt_table, stream)
        else:
            first = torch_model.window_start(spec.window(i), start)
            k, v = torch_model.attended_kv(k_cache[i], v_cache[i], prompt_kv, i, start, exact, kv, first)
            k, v = k.repeat_interleave(spec.gqa_ratio, dim=0), v.repeat_interleave(spec.gqa_ratio, dim=0)
            attn = torch_model.attention(spec, q, k, v, masks[spec.window(i)][:, first:]).contiguous()
            lib.prefill("mk_prefill_attn_split", attn.data_ptr(), parts_q.data_ptr(), n, stream)
        o = _mm(parts_q, lw.wo)
        lib.prefill("mk_prefill_norm", x.data_ptr(), o.data_ptr(), device_ptr(lw.post_attn_norm),
                    device_ptr(lw.mlp_norm), 0, parts_h.data_ptr(), n, stream)
        gate, up = _mm(parts_h, lw.w_gate), _mm(parts_h, lw.w_up)
        lib.prefill("mk_prefill_act", gate.data_ptr(), up.data_ptr(), parts_i.data_ptr(), n, stream)
        add, post = _mm(parts_i, lw.w_down), lw.post_mlp_norm
    out = torch.empty_like(x)
    lib.prefill("mk_prefill_norm", x.data_ptr(), device_ptr(add), device_ptr(post), w.final_norm.data_ptr(),
                out.data_ptr(), 0, n, stream)
    return out


def delta_rule(lib):
    """torch_model.delta_rule_chunked on the GPU in two kernels (kernel/cuda/delta_rule_prefill.cuh) where torch's
    scan launches ~80: scan(s, q, k, v, g, beta) advances the state s in place and returns the read-outs."""

    def scan(s: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
        if not s.is_contiguous():
            raise ValueError("the delta rule's state must be contiguous: the kernel advances it in place")
        n, heads = g.shape
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        work = torch.empty(lib.prefill_delta_floats(n), device=s.device, dtype=torch.float32)
        out = torch.empty(n, heads, v.shape[-1], device=s.device, dtype=torch.float32)
        lib.prefill("mk_prefill_delta_rule", q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), n,
                    work.data_ptr(), s.data_ptr(), out.data_ptr(), _stream(s))
        return out

    return scan


def gated_delta_net(lib):
    """torch_model.gated_delta_net for a decoder's prefill (its arguments; `tap` is not called: a decoder's prefill
    traces nothing) in mkport's kernels around the two projections' matmuls: the conv, norms and gates in one
    (kernel/cuda/gated_delta_net_prefill.cuh), the delta rule in two (delta_rule), the gated norm in one, where torch
    launches ~110 a layer. Capture-safe like prefill_forward."""
    scan = delta_rule(lib)

    def layer(spec: ModelSpec, lw, h: torch.Tensor, state: torch_model.LinearState, slot: int, tap, *,
              real_rows: torch.Tensor | None = None) -> torch.Tensor:
        la, n = spec.linear_attention, h.shape[0]
        f32 = dict(device=h.device, dtype=torch.float32)
        proj = torch_model.linear(h, lw.lin_in).contiguous()  # [n, q/k/v + z + b + a]
        q, k = (torch.empty(n, la.num_value_heads, la.key_head_dim, **f32) for _ in range(2))
        v = torch.empty(n, la.num_value_heads, la.value_head_dim, **f32)
        g, beta = (torch.empty(n, la.num_value_heads, **f32) for _ in range(2))
        lib.prefill("mk_prefill_linear_inputs", proj.data_ptr(), state.conv[slot].data_ptr(), lw.lin_conv.data_ptr(),
                    lw.lin_a_log.data_ptr(), lw.lin_dt_bias.data_ptr(), device_ptr(real_rows), n, q.data_ptr(),
                    k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), _stream(h))
        out = scan(state.recurrent[slot], q, k, v, g, beta)
        parts = torch.empty(2 * n, la.value_dim, device=h.device, dtype=torch.bfloat16)
        lib.prefill("mk_prefill_gated_norm", out.data_ptr(), proj.data_ptr(), lw.lin_norm.data_ptr(), parts.data_ptr(),
                    n, _stream(h))
        halves = _mm(parts, lw.lin_out)
        return torch.add(halves[:n], halves[n:])

    return layer
