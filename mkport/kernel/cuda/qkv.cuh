// Input RMSNorm and the fused q/k/v projection (with its bias where the spec has one; qwen3_5's output gate rows after
// it) into the qkv buffer. Without
// input norms (olmo2/3, !PRE_NORMS) the projection reads the residual stream x itself, and no attn_norm is traced.
#pragma once

__device__ void qkv_phase(const Params& p, int layer, float* smem, float* scratch) {
  const LayerWeights& lw = p.layers[layer];
  residual_input_to_smem<PRE_NORMS>(p, layer, lw.attn_norm, smem, scratch);  // v20: the MLP post-norm before it too
  STAMP(p, layer, QKV_INPUT);
#if MK_TRACE
  if (PRE_NORMS && blockIdx.x == 0)
    for (int i = thread_index(); i < BATCH * H; i += THREADS) layer_trace(p, layer, i / H)[TRACE_ATTN_NORM + i % H] = smem[i];
#endif
#if HAS_Q_GATE
  static_assert(!HAS_QKV_BIAS, "qwen3_5's gate rows follow unbiased q, k and v");
  grid_matvec<H, QKV_ROWS + Q_ROWS>(  // qwen3_5: the output gate's rows after q, k and v
      [&](int r) { return r < QKV_ROWS ? lw.wqkv + (size_t)r * H : lw.q_gate + (size_t)(r - QKV_ROWS) * H; }, smem,
      [&](int r, int b, float d) { p.qkv[b * QKV_STRIDE + r] = d; });
#else
  grid_matvec<H, QKV_ROWS>([&](int r) { return lw.wqkv + (size_t)r * H; }, smem, [&](int r, int b, float d) {
    if constexpr (HAS_QKV_BIAS) p.qkv[b * QKV_STRIDE + r] = d + bf2f(lw.bqkv[r]);
    else p.qkv[b * QKV_STRIDE + r] = d;
  });
#endif
}
