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

// Frequency i of a layer's rotation: `local`, the sliding layers' own table (uses_local_rope).
__device__ __forceinline__ float rope_inv_freq(int i, bool local) {
#if HAS_LOCAL_ROPE
  return local ? ROPE_LOCAL_INV_FREQ[i] : ROPE_INV_FREQ[i];
#else
  return ROPE_INV_FREQ[i];
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

// Rotate-half RoPE on one head held by a warp: element idx[p] pairs with idx[p + E/2] = idx[p] + HD/2. `local`: the
// sliding layers' table (uses_local_rope).
template <int E>
__device__ __forceinline__ void apply_rope(float (&v)[E], const int (&idx)[E], const int (&pos)[3], bool local = false) {
#pragma unroll
  for (int p = 0; p < E / 2; ++p) {
    const int i = idx[p];
    const float inv_freq = rope_inv_freq(i, local);  // loaded before the position, as ptxas has always scheduled it
    const float angle = __fmul_rn((float)pos[rope_stream(i)], inv_freq);
    float c, s;
    if constexpr (HAS_ROPE_ATTENTION_FACTOR) {  // yarn: cos and sin times the attention factor, as transformers has it
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
