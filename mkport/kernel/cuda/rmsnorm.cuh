// RMSNorm of an fp32 vector into shared memory. Every block computes it itself: cheaper than a grid
// barrier to share one copy. Same arithmetic as the reference: w * (x * rsqrt(mean(x^2) + eps)).
#pragma once

// Gemma's zero-centred norm weights (NORM_WEIGHT_OFFSET): the norm scales by (1 + w), added in fp32 as transformers
// adds it.
__device__ __forceinline__ float norm_scale(float w) {
  if constexpr (NORM_WEIGHT_OFFSET) return 1.f + w;
  else return w;
}

// For each sequence of the batch (vectors N floats apart, their sums of squares reduced together); `scratch`
// holds WARPS * BATCH floats.
// Batch 1 (STAGED_NORM_WEIGHTS): the norm's weights are copied into shared memory by the phase before it
// (stage_norm_weights, just before its grid barrier), so the norm waits for no memory round trip of them; x is read
// with all of a thread's loads in flight at once (a loop storing into shared memory kept them one at a time: the store
// might alias x). A batch reads the weights in the norm, after the sums (held across them, they made the 1.7B
// talker's kernel spill at batch 8).
constexpr bool STAGED_NORM_WEIGHTS = NORM_WEIGHTS_AT > 0;

__device__ __forceinline__ bf16* staged_norm_weights() {
  extern __shared__ __align__(16) float smem_base[];
  return reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem_base) + NORM_WEIGHTS_AT);
}

// Issued by the warps other than warp 0 (whose thread 0 fences in the grid barrier, which would wait for them).
__device__ __forceinline__ void stage_norm_weights(const bf16* w) {
  if constexpr (STAGED_NORM_WEIGHTS) {
    static_assert(H % 8 == 0, "16-byte copies");
    for (int i = threadIdx.x - 32; i >= 0 && i < H / 8; i += THREADS - 32) cp_async16(staged_norm_weights() + 8 * i, w + 8 * i);
  }
}

template <int N>
__device__ void rmsnorm_to_smem(const float* x, const bf16* __restrict__ w, float* out, float* scratch) {
  if constexpr (STAGED_NORM_WEIGHTS) {
    static_assert(BATCH == 1 && N == H, "the staged weights are one norm's of H");
    constexpr int PER_THREAD = (N + THREADS - 1) / THREADS;
    float v[PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k)
      if (threadIdx.x + k * THREADS < N) v[k] = load_state_now(x + threadIdx.x + k * THREADS);
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k)
      if (threadIdx.x + k * THREADS < N) ss += v[k] * v[k];
    cp_async_wait_all();  // this thread's part of the staged weights; block_sums' barriers publish everyone's
    float sums[1] = {ss};
    block_sums(sums, scratch);
    const float inv = rsqrtf(sums[0] / N + EPS);
    const bf16* staged = staged_norm_weights();
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k)
      if (threadIdx.x + k * THREADS < N) out[threadIdx.x + k * THREADS] = norm_scale(bf2f(staged[threadIdx.x + k * THREADS])) * (v[k] * inv);
  } else {
    float ss[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) ss[b] = 0.f;
    for (int i = threadIdx.x; i < N; i += THREADS)
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const float v = load_shared_state(x + b * N + i);
        out[b * N + i] = v;
        ss[b] += v * v;
      }
    block_sums(ss, scratch);
    float inv[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) inv[b] = rsqrtf(ss[b] / N + EPS);
    for (int i = threadIdx.x; i < N; i += THREADS) {
      const float wv = norm_scale(bf2f(w[i]));
#pragma unroll
      for (int b = 0; b < BATCH; ++b) out[b * N + i] = wv * (out[b * N + i] * inv[b]);
    }
  }
  block_sync();
}

// The weights of a head's RMSNorm at the elements idx a lane owns, read before the head itself is (read after
// its sum they would be one more memory round trip on attention's chain).
template <int E>
__device__ __forceinline__ void head_norm_weights(const bf16* __restrict__ w, const int (&idx)[E], float (&wv)[E]) {
#pragma unroll
  for (int e = 0; e < E; ++e) wv[e] = norm_scale(load_weight_now(w + idx[e]));
}

// RMSNorm over one attention head held by one warp: lane owns E elements of HD, wv their weights.
template <int E>
__device__ __forceinline__ void head_rmsnorm(float (&v)[E], const float (&wv)[E]) {
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) ss += v[e] * v[e];
  const float inv = rsqrtf(warp_sum(ss) / HD + EPS);
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = wv[e] * (v[e] * inv);
}
