// Post-norm layers (POST_NORMS): a sublayer's output, whole in p.sub after the grid barrier, RMSNormed and added to the
// residual stream, x += norm(sub) (with sandwich norms: the post_attention_layernorm and post_feedforward_layernorm).
// Every block sums the squares of the whole output itself (cheaper than one more barrier to share the sums) and
// updates its own slice of x.
#pragma once

__device__ void post_norm_phase(const Params& p, const bf16* __restrict__ w, int layer, int trace_at, float* scratch) {
  float ss[BATCH];
#pragma unroll
  for (int b = 0; b < BATCH; ++b) ss[b] = 0.f;
  for (int i = threadIdx.x; i < H; i += THREADS)
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const float v = load_shared_state(p.sub + b * H + i);
      ss[b] += v * v;
    }
  block_sums(ss, scratch);
#pragma unroll
  for (int b = 0; b < BATCH; ++b) {
    const float inv = rsqrtf(ss[b] / H + EPS);
    for (int i = blockIdx.x * THREADS + threadIdx.x; i < H; i += GRID * THREADS) {
      const float normed = norm_scale(bf2f(w[i])) * (load_shared_state(p.sub + b * H + i) * inv);
      const float v = load_shared_state(p.x + b * H + i) + sublayer(normed);
      p.x[b * H + i] = v;
#if MK_TRACE
      layer_trace(p, layer, b)[trace_at + i] = v;
#endif
    }
  }
}
