// Rotary position embedding. The frequency tables and which layers rotate are constants.cuh's, computed on the host
// exactly as the reference computes them.
#pragma once

#if HAS_LOCAL_ROPE
__device__ __forceinline__ bool uses_local_rope(int layer) { return ROPE_LOCAL_LAYER[layer]; }
#else
__device__ __forceinline__ constexpr bool uses_local_rope(int) { return false; }
#endif

#if HAS_NOPE_LAYERS
__device__ __forceinline__ bool uses_rope(int layer) { return ROPE_LAYER[layer]; }
#else
__device__ __forceinline__ constexpr bool uses_rope(int) { return true; }
#endif

// longrope and dynamic NTK: transformers' dynamic_rope_update picks a forward's frequencies by its sequence length,
// the forward's largest position + 1 (render.rope_tables(spec, seq_len), torch_model.rope_cos_sin). A decode step
// forwards one row of a sequence at position p: length p + 1, each sequence of a batch its own. So does transformers'
// generate from position 0, step by step (its dynamic update grows the base to p + 1 at each step); the cached keys
// keep the frequencies of the step that wrote them.
struct RopeLength {
  int len;  // the forward's sequence length; 0: none past the original (the load-time tables)
  const float* dynamic;  // dynamic NTK: Params::rope_table
};

__device__ __forceinline__ RopeLength decode_rope_length(const Params& p, int pos_t) {
  return {pos_t + 1, p.rope_table};
}

// Frequency i of a layer's rotation: `local`, the sliding layers' own table (uses_local_rope); else the spec's, of
// a forward of `length`.
__device__ __forceinline__ float rope_inv_freq(int i, bool local, const RopeLength& length) {
#if HAS_LONGROPE
  const float global = ROPE_LONGROPE_INV_FREQ[length.len > ROPE_ORIGINAL][i];  // one load: two and a select spilled at batch 8
#elif HAS_DYNAMIC_ROPE  // render.dynamic_rope_table's rows: a frequency for each rotated pair
  const float global = __ldg(length.dynamic + max(length.len - ROPE_ORIGINAL, 0) * (ROPE_DIM / 2) + i);
#else
  const float global = ROPE_INV_FREQ[i];
#endif
#if HAS_LOCAL_ROPE
  return local ? ROPE_LOCAL_INV_FREQ[i] : global;
#else
  return global;
#endif
}

// The position stream (0 = t, 1 = h, 2 = w) that rotates frequency i: MRoPE's sections, else t.
__device__ __forceinline__ int rope_stream(int i) {
#if HAS_MROPE
  return ROPE_STREAM[i];
#else
  return 0;
#endif
}

// This thread's lane, read from %laneid where it is used: a volatile asm is neither hoisted nor held.
__device__ __forceinline__ int lane_id() {
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return (int)lane;
}

// Rotate-half RoPE on one head held by a warp: element idx[p] pairs with idx[p + E/2] = idx[p] + HD/2. `local`: the
// sliding layers' table (uses_local_rope); `length`: the forward's, for longrope and dynamic NTK.
// Rotate-half over the first ROPE_DIM dimensions only (partial RoPE, any even ROPE_DIM < HD: qwen3_5's 64 of 256,
// Phi-4-mini's 96 of 128): element i < ROPE_DIM pairs with i +- ROPE_DIM / 2, which another lane and slot may hold,
// so each rotated slot takes its partner by shuffle (every lane of the warp runs this). With head_dim a multiple of
// 64 element i sits in lane i % 32, slot i / 32 (head_lane_index), so the rotated ones fill the first SLOTS slots.
template <int E>
__device__ __forceinline__ void apply_partial_rope(float (&v)[E], const int (&idx)[E], const int (&pos)[3], bool local,
                                                   const RopeLength& length) {
  constexpr int HALF = ROPE_DIM / 2, SLOTS = (ROPE_DIM + 31) / 32;
  static_assert(ROPE_DIM < HD && ROPE_DIM % 2 == 0 && HD % 64 == 0 && SLOTS <= E,
                "element i of a head in lane i % 32, slot i / 32 (launch_plan.check_kernel_support refuses the rest)");
  // Past half a head the lane is read here, not taken from idx: the partners' lanes and slots, derived from it, were
  // hoisted out of the layer loop and held, and Phi-4-mini's trace build spilled (qwen3_5's build is as it was).
  const int lane = ROPE_DIM > HD / 2 ? lane_id() : idx[0];
  float partner[SLOTS];
#pragma unroll
  for (int p = 0; p < SLOTS; ++p) {
    const int i = lane + 32 * p;
    const int j = i < HALF ? i + HALF : i - HALF;
    partner[p] = 0.f;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const float got = __shfl_sync(0xffffffffu, v[s], j & 31);
      if ((j >> 5) == s) partner[p] = got;
    }
  }
#pragma unroll
  for (int p = 0; p < SLOTS; ++p) {
    const int i = lane + 32 * p;
    if (i >= ROPE_DIM) continue;
    const int f = i < HALF ? i : i - HALF;
    const float angle = __fmul_rn((float)pos[rope_stream(f)], rope_inv_freq(f, local, length));
    float c = cosf(angle), s = sinf(angle);
    if constexpr (HAS_ROPE_ATTENTION_FACTOR) {  // as the full rotation's
      c *= ROPE_ATTENTION_FACTOR;
      s *= ROPE_ATTENTION_FACTOR;
    }
    v[p] = i < HALF ? v[p] * c - partner[p] * s : v[p] * c + partner[p] * s;
  }
}

template <int E>
__device__ __forceinline__ void apply_rope(float (&v)[E], const int (&idx)[E], const int (&pos)[3], bool local,
                                           const RopeLength& length) {
  if constexpr (ROPE_DIM < HD) {
    apply_partial_rope(v, idx, pos, local, length);
  } else {
#pragma unroll
    for (int p = 0; p < E / 2; ++p) {
      const int i = idx[p];
      const float inv_freq = rope_inv_freq(i, local, length);  // loaded before the position, as ptxas has always scheduled it
      const float angle = __fmul_rn((float)pos[rope_stream(i)], inv_freq);
      float c, s;
      if constexpr (HAS_ROPE_ATTENTION_FACTOR) {  // yarn, longrope: cos and sin times the attention factor
        c = cosf(angle) * ROPE_ATTENTION_FACTOR;
        s = sinf(angle) * ROPE_ATTENTION_FACTOR;
      } else {
        c = cosf(angle);
        s = sinf(angle);
      }
      const float x1 = v[p], x2 = v[p + E / 2];
      v[p] = x1 * c - x2 * s;
      v[p + E / 2] = x2 * c + x1 * s;
    }
  }
}
