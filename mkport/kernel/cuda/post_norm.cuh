// Post-norm layers (POST_NORMS): a sublayer's output, whole in p.sub after the grid barrier, RMSNormed and added to the
// residual stream, x += norm(sub) (with sandwich norms: the post_attention_layernorm and post_feedforward_layernorm).
// Every block sums the squares of the whole output itself (cheaper than one more barrier to share the sums).
#pragma once

// v16: a phase of its own after the sublayer's grid barrier; each block updates its own slice of x.
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

// v20 (FOLD_POST_NORMS): the phase after the sublayer makes x + norm(sub) itself, with no barrier of its own: every
// block needs the whole new residual for its input anyway. It lands in shared memory (`out`), RMSNormed with pre_w
// when NORMED (the next sublayer's input norm). The same sums in the same order as post_norm_phase then
// rmsnorm_to_smem, so the same bits as v16. Each block stores its share of the new residual into x_out, the residual
// stream's other copy: the other blocks still read x_in in this phase.
template <bool NORMED>
__device__ void folded_post_norm_to_smem(const Params& p, const float* x_in, float* x_out, const bf16* __restrict__ post_w,
                                         const bf16* __restrict__ pre_w, int layer, int trace_at, float* out, float* scratch) {
  float ss[BATCH];
#pragma unroll
  for (int b = 0; b < BATCH; ++b) ss[b] = 0.f;
  for (int i = threadIdx.x; i < H; i += THREADS)
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const float v = load_shared_state(p.sub + b * H + i);
      out[b * H + i] = v;
      ss[b] += v * v;
    }
  block_sums(ss, scratch);
  float inv[BATCH];
#pragma unroll
  for (int b = 0; b < BATCH; ++b) {
    inv[b] = rsqrtf(ss[b] / H + EPS);
    ss[b] = 0.f;
  }
  for (int i = threadIdx.x; i < H; i += THREADS) {  // each thread its own elements of out: no sync needed
    const float wv = norm_scale(bf2f(post_w[i]));
    const bool mine = (i / THREADS) % GRID == blockIdx.x;
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const float v = load_shared_state(x_in + b * H + i) + sublayer(wv * (out[b * H + i] * inv[b]));
      out[b * H + i] = v;
      ss[b] += v * v;
      if (mine && x_out) x_out[b * H + i] = v;
#if MK_TRACE
      if (mine) layer_trace(p, layer, b)[trace_at + i] = v;
#endif
    }
  }
  if constexpr (NORMED) {
    if constexpr (STAGED_NORM_WEIGHTS) cp_async_wait_all();  // block_sums' barriers publish everyone's part
    block_sums(ss, scratch);
#pragma unroll
    for (int b = 0; b < BATCH; ++b) inv[b] = rsqrtf(ss[b] / H + EPS);
    for (int i = threadIdx.x; i < H; i += THREADS) {
      const float wv = norm_scale(bf2f(STAGED_NORM_WEIGHTS ? staged_norm_weights()[i] : pre_w[i]));
#pragma unroll
      for (int b = 0; b < BATCH; ++b) out[b * H + i] = wv * (out[b * H + i] * inv[b]);
    }
  }
  block_sync();
}

// A layer's input (qkv_phase) or the final norm's: with folded post-norms, the residual after the layer before's MLP
// post-norm, made here; otherwise x, RMSNormed with w where the layer has input norms.
template <bool NORMED>
__device__ __forceinline__ void residual_input_to_smem(const Params& p, int layer, const bf16* w, float* out, float* scratch) {
  if constexpr (FOLD_POST_NORMS) {
    if (layer > 0) {  // the MLP's fold reads the copy the attention's fold wrote (x_alt) and writes x back
      const int before = layer - 1;
      folded_post_norm_to_smem<NORMED>(p, p.x_alt, layer < L ? p.x : nullptr, p.layers[before].post_mlp_norm, w, before,
                                       TRACE_MLP_RESIDUAL, out, scratch);
      return;
    }
  }
  sublayer_input_to_smem<NORMED>(p.x, w, out, scratch);
}
