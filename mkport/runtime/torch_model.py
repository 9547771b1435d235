"""The decoder in plain torch, in the kernel's weight layout and with the kernel's trace points.

Two uses: the prefill of a prompt in one pass (batched matmuls, writing the megakernel's KV cache), and a
CPU model of the same schedule, so that a divergence can be bisected without a GPU.

`prefill_forward` is capture-safe for a CUDA graph when given device `rope_tables`: no host syncs, no
host-to-device copies, and its Python control flow depends only on shapes and `start`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import MkportError
from ..kernel.interface import Tap
from ..kernel.render import rope_tables
from ..kernel.spec import LENGTH_DEPENDENT_ROPE, ModelSpec
from .kv_cache import cache_rows, write_cache_rows
from .weights import DecoderWeights

PREFILL_MIN_BUCKET = 16
DELTA_CHUNK = 64  # rows of a prefill's chunked scan of the delta rule: one triangular solve a chunk


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (fp32) @ w.T + b. With bf16 weights on CUDA (the prefill), x is split into two bf16 parts,
    hi + lo = x within 2^-16 relative, and both go through one tensor-core matmul with fp32 accumulation
    and output: the fp32 product to ~3e-6, reading w as stored instead of converting it to fp32 for every
    call (3x the bytes) and running fp32 FMA (10 -> 7 ms for a 102-row 0.6B-talker prefill, 19 -> 8 ms 1.7B)."""
    if x.is_cuda and w.dtype == torch.bfloat16:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        both = torch.mm(_hi_lo(rows), w.t(), out_dtype=torch.float32)
        y = torch.add(both[:n], both[n:]).reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b.float()
    return F.linear(x, w.float(), None if b is None else b.float())


def _hi_lo(x: torch.Tensor) -> torch.Tensor:
    """x [..., m, k] (fp32) as bf16 [..., 2m, k]: its rows rounded (hi), then what rounding left (lo)."""
    m = x.shape[-2]
    parts = torch.empty(*x.shape[:-2], 2 * m, x.shape[-1], dtype=torch.bfloat16, device=x.device)
    parts[..., :m, :] = x  # hi
    torch.sub(x, parts[..., :m, :], out=parts[..., m:, :])  # lo = x - hi, in fp32, then rounded
    return parts


def mixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [N, m, k] (fp32) @ b [N, k, p] (fp32, or bf16 as a KV cache stores it) in fp32. A bf16 b on CUDA is
    read as stored, a split into hi + lo as in linear."""
    if a.is_cuda and b.dtype == torch.bfloat16:
        m = a.shape[-2]
        both = torch.bmm(_hi_lo(a), b, out_dtype=torch.float32)
        return torch.add(both[:, :m], both[:, m:])
    return torch.bmm(a, b.float())


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """offset 1: the (1 + w) form of zero-centred norm weights (qwen3_5); 0: the weights as they are, no add."""
    scale = w.float() + offset if offset else w.float()
    return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_device_tables(spec: ModelSpec, device) -> tuple[torch.Tensor, ...]:
    """render.rope_tables (inv_freq, each frequency's position stream) as tensors on `device`, then the local_rope's
    (gemma3's and olmo3's sliding layers) when the spec has one: a prefill captured in a CUDA graph copies neither."""
    tables = [rope_tables(spec)]
    if spec.local_rope is not None:
        tables.append(rope_tables(dataclasses.replace(spec, rope=spec.local_rope)))
    return tuple(torch.from_numpy(t).to(device) for pair in tables for t in pair)


def rope_cos_sin(spec: ModelSpec, positions: torch.Tensor, tables=None,
                 length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [N, head_dim] for positions [3, N] (rows t, h, w; equal unless MRoPE).
    `tables` (rope_device_tables on positions' device) avoids the copy from the host (not capturable); dynamic and
    longrope RoPE ignore them: their frequencies follow the largest position + 1, which this reads back (a host sync),
    or `length` where given (Phi-3's recompute at its switch, runtime.rope_switch: the rows before the switch rotated
    as the forward over every row rotates them).
    yarn's and longrope's attention factor scales cos and sin, as transformers' rotary embeddings do."""
    if spec.rope.variant in LENGTH_DEPENDENT_ROPE:
        length = int(positions.max()) + 1 if length is None else length
        inv, stream = (torch.from_numpy(t).to(positions.device) for t in rope_tables(spec, length))
    else:
        inv, stream = (tables if tables is not None else rope_device_tables(spec, positions.device))[:2]
    pos = positions[stream]  # [half, N]: each frequency's stream
    angle = pos.t().float() * inv
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos() * spec.rope.attention_factor, angle.sin() * spec.rope.attention_factor


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim], rotate-half over the first cos.shape[-1] dimensions (all but with partial RoPE);
    the rest pass unrotated."""
    dim = cos.shape[-1]
    part = x[..., :dim]
    half = dim // 2
    rotated = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    part = part * cos[:, None] + rotated * sin[:, None]
    return part if dim == x.shape[-1] else torch.cat([part, x[..., dim:]], dim=-1)


def prefill_weights(w: DecoderWeights) -> DecoderWeights:
    """The weights as the prefill reads them: vectors (norms, biases) in fp32 once, so that no call converts
    them again (a kernel each), matrices as stored."""
    return w.map(lambda t: t.float() if t.dim() == 1 else t)


def embed_inputs(spec: ModelSpec, w: DecoderWeights, tokens=None, embeds=None, table: int = 0) -> torch.Tensor:
    x = w.embed[table][tokens].float() if embeds is None else embeds.float()
    if w.in_proj_w is not None:
        x = linear(x, w.in_proj_w, w.in_proj_b)
    if spec.embedding_multiplier != 1.0:
        x = x * spec.embedding_multiplier
    return x


def attention(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [heads, N, head_dim] over k, v [heads, S, head_dim] (KV heads already repeated) with
    mask [N, S]; gemma2's scores are soft-capped, c * tanh(s / c), before the mask (which SDPA cannot do)."""
    if not spec.attn_logit_softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.attention_scale)
    cap = spec.attn_logit_softcap
    scores = torch.tanh(q @ k.transpose(-1, -2) * (spec.attention_scale / cap)) * cap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def attention_mask(n: int, start: int, window: int, device) -> torch.Tensor:
    """[n, start + n] bool: which cache rows the n rows after `start` attend to. Causal; with a sliding window W
    (0: none) the row at cache index p sees p-W+1..p (transformers: kv_idx > q_idx - W)."""
    mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start)
    return mask.triu(diagonal=start - window + 1) if window else mask


def forward(
    spec: ModelSpec,
    w: DecoderWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    start: int = 0,
    taps: dict | None = None,
    rope_tables=None,
    prompt_kv: torch.Tensor | None = None,
    exact: int = 0,
    routing: dict | None = None,
    state: "LinearState | None" = None,
    rope_length: int | None = None,
    real_rows: torch.Tensor | None = None,
    linear_attention=None,
) -> torch.Tensor:
    """Runs N tokens (x: [N, hidden] fp32, positions [3, N]) after `start` cached ones.
    A hybrid spec's linear-attention layers read and update `state` (zeroed at start 0: a new sequence); without
    one, a fresh state is used, which only a sequence from start 0 may do.
    Writes their K/V into the caches when given: k_cache[i], v_cache[i] is layer i's [kv_heads, rows, head_dim] (a
    [layers, ...] tensor, or one a layer: kv_cache.KvCache.sequence), position p at row p % rows (a sliding layer's
    ring); a sliding layer reads back only the rows its window holds.
    routing {layer: expert ids [N, top_k]} forces sparse layers' experts (the reference's choice, so that a check
    compares every layer on the same experts); the EXPERTS tap still records each layer's own choice.
    prompt_kv [2, layers, kv_heads, R, head_dim] (fp32) keeps the exact K/V of a prompt's first rows: a
    prefill at start 0 writes its first R rows there, and a later one attends to the first `exact` cached
    rows from there instead of their bf16 copies (see attended_kv).
    rope_length: the length dynamic and longrope RoPE take their frequencies from, when not the largest position + 1
    (rope_cos_sin).
    real_rows: a device count of the rows that are real when the rest pad a CUDA graph's bucket (prefill_bucket):
    a linear-attention layer's state then advances by the real rows only (gated_delta_net).
    linear_attention: what runs a linear-attention layer, with gated_delta_net's arguments (that one when None;
    prefill.gated_delta_net on a GPU).
    Returns the final-normed hidden states [N, hidden] fp32; fills `taps` with the traced states."""
    n = x.shape[0]
    cos, sin = rope_cos_sin(spec, positions, rope_tables, rope_length)
    local = None if spec.local_rope is None else rope_cos_sin(dataclasses.replace(spec, rope=spec.local_rope), positions,
                                                              None if rope_tables is None else rope_tables[2:],
                                                              rope_length)

    def tap(name, value):
        if taps is not None:
            taps[name] = value.reshape(n, -1).detach().clone()

    # attention of the N new tokens over start + N positions: one mask for each window size (0: causal, full)
    masks = {window: attention_mask(n, start, window, x.device) for window in {spec.window(i) for i in range(spec.num_layers)}}

    def attend(i, q, k, v):
        k_all, v_all = k.transpose(0, 1), v.transpose(0, 1)
        first = 0  # the position of the first key attended to
        if k_cache is not None:
            write_cache_rows(k_cache[i], start, k_all)  # rounded to the cache's bf16 in the copy
            write_cache_rows(v_cache[i], start, v_all)
            first = window_start(spec.window(i), start)
            k_all, v_all = attended_kv(k_cache[i], v_cache[i], prompt_kv, i, start, exact,
                                       torch.stack([k_all, v_all]), first)
        # GQA by repeating KV heads
        k_all, v_all = k_all.repeat_interleave(spec.gqa_ratio, dim=0), v_all.repeat_interleave(spec.gqa_ratio, dim=0)
        return attention(spec, q.transpose(0, 1), k_all, v_all, masks[spec.window(i)][:, first:]).transpose(0, 1)

    if spec.linear_layers:
        if state is None:
            if start:
                raise MkportError(f"a hybrid model continued at position {start} needs its linear-attention state")
            state = LinearState.zeros(spec, x.device)
        elif start == 0:
            state.reset()
    return decoder_layers(spec, w, x, cos, sin, attend, tap, routing, state, local, real_rows, linear_attention)


def decoder_layers(spec: ModelSpec, w: DecoderWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend, tap=lambda name, value: None, routing: dict | None = None,
                   state: "LinearState | None" = None, local_rope: tuple | None = None,
                   real_rows: torch.Tensor | None = None, linear_attention=None) -> torch.Tensor:
    """The layers and the final norm on rows x [N, hidden] (fp32) with rope cos, sin [N, rope_dim]. Attention
    is the caller's: attend(layer, q [N, heads, head_dim], k, v [N, kv_heads, head_dim]) stores the rows' K/V
    wherever its cache is and returns their attention [N, heads, head_dim]. A hybrid spec's linear-attention layers
    run here on `state` (LinearState), which they advance by the N rows. local_rope: (cos, sin) of gemma3's sliding
    layers (spec.local_rope). real_rows, linear_attention: forward's. Returns the final-normed states."""
    n, hd = x.shape[0], spec.head_dim
    nh, nkv = spec.num_heads, spec.num_kv_heads
    q_rows, kv_rows = nh * hd, nkv * hd
    offset = spec.norm_weight_offset
    if spec.linear_layers and state is None:
        raise MkportError(f"{spec.name}: its linear-attention layers need a LinearState")
    tap(Tap.EMBED, x)
    for i, lw in enumerate(w.layers):
        h = x  # olmo2/3: no input norm, and no attn_norm state to trace
        if lw.attn_norm is not None:
            h = _rmsnorm(x, lw.attn_norm, spec.rms_eps, offset)
            tap(Tap.layer(i, Tap.ATTN_NORM), h)
        if spec.is_linear(i):
            layer = linear_attention or gated_delta_net
            x = x + _residual(spec, layer(spec, lw, h, state, spec.linear_layers.index(i),
                                          lambda op, value, i=i: tap(Tap.layer(i, op), value), real_rows=real_rows))
            tap(Tap.layer(i, Tap.ATTN_RESIDUAL), x)
            x = _mlp_block(spec, lw, x, i, tap, routing)
            tap(Tap.layer(i, Tap.MLP_RESIDUAL), x)
            continue
        qkv = linear(h, lw.wqkv, lw.bqkv)
        qk = qkv[:, : q_rows + kv_rows].view(n, nh + nkv, hd)  # q and k heads: one norm and one rope for both
        v = qkv[:, q_rows + kv_rows :].view(n, nkv, hd)
        if spec.qk_norm and spec.qk_norm_span == "projection":  # olmoe: q and k each normed over all their heads
            qk = torch.cat([_rmsnorm(qkv[:, :q_rows], lw.q_norm, spec.rms_eps),
                            _rmsnorm(qkv[:, q_rows : q_rows + kv_rows], lw.k_norm, spec.rms_eps)], -1).view(n, nh + nkv, hd)
        elif spec.qk_norm:
            qk = _rmsnorm(qk, torch.cat([lw.q_norm.float().expand(nh, hd), lw.k_norm.float().expand(nkv, hd)]),
                          spec.rms_eps, offset)
        if spec.uses_rope(i):
            qk = _rope(qk, *(local_rope if spec.uses_local_rope(i) else (cos, sin)))
        q, k = qk[:, :nh], qk[:, nh:]
        tap(Tap.layer(i, Tap.Q), q)
        tap(Tap.layer(i, Tap.K), k)
        attn = attend(i, q, k, v)
        if lw.q_gate is not None:  # qwen3_5: each attention output element times sigmoid of its gate row
            attn = attn * torch.sigmoid(linear(h, lw.q_gate)).view(n, nh, hd)
        tap(Tap.layer(i, Tap.ATTN), attn)
        o = linear(attn.reshape(n, q_rows), lw.wo)
        if lw.post_attn_norm is not None:  # gemma2/3, olmo2/3: the attention output is normed before the residual add
            o = _rmsnorm(o, lw.post_attn_norm, spec.rms_eps, offset)
        x = x + _residual(spec, o)
        tap(Tap.layer(i, Tap.ATTN_RESIDUAL), x)
        x = _mlp_block(spec, lw, x, i, tap, routing)
        tap(Tap.layer(i, Tap.MLP_RESIDUAL), x)
    out = _rmsnorm(x, w.final_norm, spec.rms_eps, offset)
    tap(Tap.FINAL_NORM, out)
    return out


def _mlp_block(spec: ModelSpec, lw, x: torch.Tensor, layer: int, tap, routing: dict | None) -> torch.Tensor:
    """The residual stream after layer `layer`'s norm and MLP: the SiLU-gated MLP, or a sparse layer's experts."""
    h = x if lw.mlp_norm is None else _rmsnorm(x, lw.mlp_norm, spec.rms_eps, spec.norm_weight_offset)  # olmo2/3: none
    if spec.sparse(layer):
        f = _experts(spec, lw, h, layer, tap, None if routing is None else routing.get(layer))
    else:
        f = _mlp(spec, h, lw.w_gate, lw.w_up, lw.w_down)
    if lw.post_mlp_norm is not None:  # gemma2/3, olmo2/3: the MLP output is normed before the residual add
        f = _rmsnorm(f, lw.post_mlp_norm, spec.rms_eps, spec.norm_weight_offset)
    return x + _residual(spec, f)


def _mlp(spec: ModelSpec, h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The gated MLP: SiLU, or Gemma's GeGLU (GELU's tanh form, transformers' gelu_pytorch_tanh)."""
    gate = linear(h, w_gate)
    act = F.silu(gate) if spec.mlp_activation == "silu" else F.gelu(gate, approximate="tanh")
    return linear(act * linear(h, w_up), w_down)


def route(spec: ModelSpec, router_logits: torch.Tensor, forced: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The family's routing of rows [N, experts] of router logits, as transformers routes them: softmax over every
    expert in fp32, the top_k largest probabilities, renormalised to sum 1 when norm_topk_prob. Returns the experts
    the logits choose [N, top_k] (ascending index), the experts applied (`forced`, the reference's choice, when
    given; else the same) and their weights [N, top_k], in the same order."""
    moe = spec.moe
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.topk(probs, moe.top_k, dim=-1).indices.sort(dim=-1).values
    applied = chosen if forced is None else forced.to(chosen.device).long().sort(dim=-1).values
    weights = probs.gather(-1, applied)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, applied, weights


# bytes of gathered expert weights a prompt's rows copy at once in _experts (Mixtral's expert is 117 MB a projection)
EXPERT_GATHER_BYTES = 1 << 30


def _experts(spec: ModelSpec, lw, h: torch.Tensor, layer: int, tap, forced: torch.Tensor | None) -> torch.Tensor:
    """A sparse layer's MLP on rows h [N, hidden]: each row's top-k experts weighted and summed in ascending expert
    index (transformers' order: the same inputs give the same bits), then qwen2_moe's shared expert gated by
    sigmoid(shared_gate . h). Each row reads its own experts' rows (gathered), so a prefill of N rows copies N x top_k
    experts, EXPERT_GATHER_BYTES at a time: fine for decode steps and short prompts."""
    logits = linear(h, lw.router)
    chosen, applied, weights = route(spec, logits, forced)
    tap(Tap.layer(layer, Tap.ROUTER), logits)
    tap(Tap.layer(layer, Tap.EXPERTS), chosen.float())
    tap(Tap.layer(layer, Tap.EXPERT_WEIGHTS), weights)
    out = torch.zeros_like(h)
    expert_bytes = lw.expert_gate[0].numel() * lw.expert_gate.element_size()
    chunk = max(1, EXPERT_GATHER_BYTES // expert_bytes)  # rows whose gathered experts are copied at once
    for r in range(0, h.shape[0], chunk):
        rows = h[r : r + chunk, None, :]  # [n, 1, hidden]
        for j in range(spec.moe.top_k):
            e = applied[r : r + chunk, j]
            act = F.silu(mixed_bmm(rows, lw.expert_gate[e].transpose(1, 2))) * mixed_bmm(rows, lw.expert_up[e].transpose(1, 2))
            out[r : r + chunk] += mixed_bmm(act, lw.expert_down[e].transpose(1, 2))[:, 0] * weights[r : r + chunk, j : j + 1]
    if lw.shared_gate is not None:
        out = out + torch.sigmoid(linear(h, lw.shared_gate)) * _mlp(spec, h, lw.w_gate, lw.w_up, lw.w_down)
    tap(Tap.layer(layer, Tap.MOE), out)
    return out


@dataclass
class LinearState:
    """The per-sequence state of a hybrid model's linear-attention layers, fp32, owned by its decoder like the KV
    cache (slot s: the s-th of spec.linear_layers). It stands for every row the sequence has run so far."""

    conv: torch.Tensor  # [linear layers, conv_kernel - 1, conv_dim]: the conv's last inputs, oldest first
    recurrent: torch.Tensor  # [linear layers, value_heads, key_head_dim, value_head_dim]: the delta-rule state

    @classmethod
    def zeros(cls, spec: ModelSpec, device, batch: int | None = None) -> "LinearState":
        """A sequence's zero state; with `batch`, a batch's: [linear layers, batch, ...] each (sequence)."""
        la, layers = spec.linear_attention, len(spec.linear_layers)
        seqs = () if batch is None else (batch,)
        return cls(torch.zeros(layers, *seqs, la.conv_kernel - 1, la.conv_dim, device=device),
                   torch.zeros(layers, *seqs, la.num_value_heads, la.key_head_dim, la.value_head_dim, device=device))

    def sequence(self, b: int) -> "LinearState":
        """Sequence b of a batch's state (zeros with `batch`) as one sequence's, views: what advances it advances the
        batch's."""
        return LinearState(self.conv[:, b], self.recurrent[:, b])

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dimension, with transformers' (and FLA's) 1e-6 inside the square root."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def gated_delta_net(spec: ModelSpec, lw, h: torch.Tensor, state: LinearState, slot: int, tap, *,
                    real_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One Gated DeltaNet layer on rows h [N, hidden] (normed), advancing state slot `slot` by N rows; returns
    out_proj's output [N, hidden]. tap(op, value) sees the conv's output, the gates (log decay g, then beta),
    the state's read-out and the gated norm's output. One row takes the recurrent step, more the chunked scan.
    real_rows (a device count, for a CUDA graph's padded bucket): the state advances by the first real_rows rows
    only; the rows after them get g = beta = 0, which write nothing and do not decay (delta_rule_chunked)."""
    la = spec.linear_attention
    n, nk, nv, dk, dv = h.shape[0], la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    mixed, z, b, a = linear(h, lw.lin_in).split([la.conv_dim, la.value_dim, nv, nv], dim=-1)
    # causal depthwise conv: row t sees its kernel-1 predecessors, from the state before the first row
    window = torch.cat([state.conv[slot], mixed])
    if real_rows is None:
        state.conv[slot] = window[n:]
    else:  # the last kernel - 1 real inputs, picked on the device
        state.conv[slot] = window.index_select(0, real_rows + torch.arange(la.conv_kernel - 1, device=h.device))
    conv = F.silu((window.unfold(0, la.conv_kernel, 1) * lw.lin_conv.float()).sum(-1))
    tap(Tap.CONV, conv)
    q, k, v = conv.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
    # each q/k head serves nv / nk consecutive value heads
    q = _l2norm(q.reshape(n, nk, dk)).repeat_interleave(nv // nk, dim=1) * dk**-0.5
    k = _l2norm(k.reshape(n, nk, dk)).repeat_interleave(nv // nk, dim=1)
    v = v.reshape(n, nv, dv)
    g = -lw.lin_a_log.float().exp() * F.softplus(a + lw.lin_dt_bias.float())  # log of the state's decay this row
    beta = torch.sigmoid(b)  # how far the row's value overwrites what the state predicted for its key
    if real_rows is not None:
        real = (torch.arange(n, device=h.device) < real_rows)[:, None]
        g, beta = g * real, beta * real
    tap(Tap.GATES, torch.cat([g, beta], dim=-1))
    if n == 1:
        out = delta_rule_step(state.recurrent[slot], q[0], k[0], v[0], g[0], beta[0])[None]
    else:
        out = delta_rule_chunked(state.recurrent[slot], q, k, v, g, beta)
    tap(Tap.STATE_OUT, out)
    normed = _rmsnorm(out, lw.lin_norm, spec.rms_eps) * F.silu(z.reshape(n, nv, dv))
    tap(Tap.GATED_NORM, normed)
    return linear(normed.reshape(n, la.value_dim), lw.lin_out)


def delta_rule_step(s: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One row of the gated delta rule on s [heads, dk, dv] in place (q, k [heads, dk], v [heads, dv], g, beta
    [heads]): decay s, write beta * (v - what s predicts for k) at k, read at q. Returns the read-out [heads, dv]."""
    s.mul_(g.exp()[:, None, None])
    predicted = torch.einsum("hkv,hk->hv", s, k)
    s.add_(k[:, :, None] * (beta[:, None] * (v - predicted))[:, None, :])
    return torch.einsum("hkv,hk->hv", s, q)


def delta_rule_chunked(s: torch.Tensor, q, k, v, g, beta, chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """The gated delta rule over N rows (q, k [N, heads, dk], v [N, heads, dv], g, beta [N, heads]) from state
    s [heads, dk, dv], updated in place to the state after the last row; returns the read-outs [N, heads, dv].

    Within a chunk, with G_i the cumulative log decay from the chunk's start S0, the values the rows write are
    u = W_v - W_k S0, where (I + A) W_v = beta v and (I + A) W_k = beta e^G k, A_ij = beta_i e^(G_i - G_j) k_i.k_j
    for j < i: the writes' interactions inside a chunk are one triangular solve for all chunks at once, and only
    the chunk-to-chunk state passes in sequence. Row i reads e^G_i q_i S0 + sum_{j<=i} e^(G_i - G_j) (q_i.k_j) u_j;
    the chunk leaves e^G_last S0 + sum_j e^(G_last - G_j) k_j u_j. Padding rows (k = v = g = beta = 0) write
    nothing and do not decay, so the state is exact whatever N."""
    n, heads = g.shape
    pad = -n % chunk

    def chunks(t):  # [N, heads, ...] -> [heads, chunks, chunk, ...], zero padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad)).transpose(0, 1)
        return t.reshape(heads, -1, chunk, *t.shape[2:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [heads, chunks, chunk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^(G_i - G_j), j <= i
    strict = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    system = strict + torch.eye(chunk, device=g.device)
    w_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    reads = decay * (q @ k.transpose(-1, -2))
    # chunk-major, each chunk's operands contiguous: the pass below is five kernels a chunk (a GPU prefill is
    # thousands of small kernels, ~4 us each), W_k S0 and the e^G q S0 term in one product
    read_k = torch.cat([w_k, q * cum.exp()[..., None]], dim=-2).transpose(0, 1).contiguous()  # [chunks, heads, 2c, dk]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2).transpose(0, 1).contiguous()
    w_v, reads = w_v.transpose(0, 1).contiguous(), reads.transpose(0, 1).contiguous()
    chunk_decay = cum[..., -1].exp().t()[..., None, None].contiguous()  # [chunks, heads, 1, 1]
    out = torch.empty_like(w_v)
    for c in range(q.shape[1]):
        both = read_k[c] @ s
        u = w_v[c] - both[:, :chunk]
        torch.baddbmm(both[:, chunk:], reads[c], u, out=out[c])
        s.mul_(chunk_decay[c]).baddbmm_(k_to_end[c], u)
    return out.transpose(0, 1).reshape(heads, -1, v.shape[-1])[:, :n].transpose(0, 1)


def _residual(spec: ModelSpec, f: torch.Tensor) -> torch.Tensor:
    """A sublayer's output as added to the residual stream (granite scales it by residual_multiplier)."""
    return f if spec.residual_multiplier == 1.0 else f * spec.residual_multiplier


def keep_exact_rows(prompt_kv: torch.Tensor | None, layer: int, kv: torch.Tensor) -> None:
    """A prompt prefilled from row 0: the exact K/V of its first rows into prompt_kv, for a continuation (attended_kv)."""
    if prompt_kv is not None:
        keep = min(kv.shape[2], prompt_kv.shape[3])
        prompt_kv[:, layer, :, :keep] = kv[:, :, :keep]


def window_start(window: int, start: int) -> int:
    """The first position that rows after `start` attend to with a sliding window (0: none): the first row's window."""
    return max(0, start + 1 - window) if window else 0


def attended_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, prompt_kv: torch.Tensor | None, layer: int,
                start: int, exact: int, kv: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [kv_heads, start + N - first, head_dim] (fp32) of positions first.. that a prefill's N new rows
    (kv [2, kv_heads, N, head_dim]) attend to, given this layer's caches. At start 0 their exact values also go to
    prompt_kv's first rows; a prefill continuing at `start` takes its first `exact` rows from there, as a one-pass
    prefill saw them, the rest as the bf16 cache holds them. With the prompt's prefix exact, a prompt prefilled as a
    cached prefix and the rest equals one pass."""
    if start == 0:
        keep_exact_rows(prompt_kv, layer, kv)
        return kv[0], kv[1]

    def rows(which: int, cache: torch.Tensor) -> torch.Tensor:
        parts = [prompt_kv[which, layer, :, first:exact]] if first < exact else []
        if start > max(first, exact):
            parts.append(cache_rows(cache, max(first, exact), start).float())
        return torch.cat([*parts, kv[which]], dim=1)

    return rows(0, k_cache), rows(1, v_cache)


def prefill_forward(
    spec: ModelSpec,
    w: DecoderWeights,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    table: int = 0,
    rope_tables=None,
    prompt_kv: torch.Tensor | None = None,
    exact: int = 0,
    routing: dict | None = None,
    state: LinearState | None = None,
    real_rows: torch.Tensor | None = None,
    linear_attention=None,
) -> torch.Tensor:
    """The prefill of runtime.Decoder: `inputs` are token ids [N] (integers, through embedding `table`) or
    input embeddings [N, input_dim]; returns the final-normed hidden states [N, hidden]. `routing`, `state`,
    `real_rows`, `linear_attention`: forward's (a hybrid's linear-attention state, advanced by the real rows with the
    chunked scan)."""
    tokens, embeds = (inputs, None) if not inputs.is_floating_point() else (None, inputs)
    x = embed_inputs(spec, w, tokens, embeds, table)
    return forward(spec, w, x, positions, k_cache, v_cache, start=start, rope_tables=rope_tables,
                   prompt_kv=prompt_kv, exact=exact, routing=routing, state=state, real_rows=real_rows,
                   linear_attention=linear_attention)


def prefill_bucket(n: int, room: int) -> int:
    """Rows an n-row prefill is padded to for its CUDA graph: the next power of two, at least
    PREFILL_MIN_BUCKET, but no more than `room`, the cache rows left from its start (n <= room).

    Padding at the end is exact for the real rows: attention is causal, so row i < n never sees a padded
    row, and nothing else mixes rows. Padded rows write K/V at cache positions start+n.., past the
    decoder's length; a decode step at position p writes its own K/V there before its attention reads
    it (attention.cuh: the new row goes to the cache and to the shared tile; rows past p are never read),
    and a later prefill reads only rows before its start. So a padded row is never read. On a sliding layer's ring
    (kv_cache.py) padded rows overwrite older positions, which no row of the pass reads: the ring holds the window
    and a whole padded pass (interface.ring_rows)."""
    if not 1 <= n <= room:
        raise ValueError(f"a prefill of {n} rows does not fit {room} free cache rows")
    return min(max(PREFILL_MIN_BUCKET, 1 << (n - 1).bit_length()), room)


def logits(spec: ModelSpec, w: DecoderWeights, hidden: torch.Tensor, head: int = 0) -> torch.Tensor:
    out = linear(hidden, w.head(head))
    if spec.logits_scaling != 1.0:
        out = out / spec.logits_scaling
    if spec.final_logit_softcap:  # gemma2
        out = torch.tanh(out / spec.final_logit_softcap) * spec.final_logit_softcap
    return out
