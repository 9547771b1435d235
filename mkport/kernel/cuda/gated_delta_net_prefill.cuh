// The prompt prefill's Gated DeltaNet layer around its delta rule (delta_rule_prefill.cuh), the arithmetic of
// torch_model.gated_delta_net in three kernels where torch launches ~30 (runtime/prefill.py's gated_delta_net):
// linear_inputs: a block a row of lin_in's output [N][LA_IN_ROWS] (q/k/v, z, b, a): the causal depthwise conv of its
//   q/k/v channels over the layer's conv state and the rows before it, SiLU, the q/k heads' L2 norms (q scaled by
//   LA_Q_SCALE; each q/k head repeated for its value heads), the gates g = -e^A_log softplus(a + dt_bias) and
//   beta = sigmoid(b), zero past the real rows (a CUDA graph's padding: they then write nothing and do not decay).
// conv_state: the conv state becomes the last LA_CONV - 1 real inputs (a thread a channel, after linear_inputs has
//   read it).
// gated_norm: a warp a (row, value head): the delta rule's read-out RMSNormed, times lin_norm and silu(z), split into
//   bf16 hi and lo rows for out_proj's matmul (prefill.cuh's split_store).
#pragma once

#if HAS_LINEAR_ATTENTION
static_assert(LA_CONV_DIM * 4 <= 40 * 1024, "linear_inputs holds a row's conv outputs in static shared memory");

// Input r of a channel's conv window: lin_in's row r, or the conv state's row LA_CONV - 1 + r for r < 0.
__device__ __forceinline__ float conv_input(const float* proj, const float* conv_state, int r, int c) {
  return r >= 0 ? proj[(size_t)r * LA_IN_ROWS + c] : conv_state[(LA_CONV - 1 + r) * LA_CONV_DIM + c];
}

__global__ void __launch_bounds__(PREFILL_THREADS) linear_inputs_kernel(
    const float* proj, const float* conv_state, const bf16* conv_w, const float* a_log, const float* dt_bias,
    const long long* real_rows, int n, float* q, float* k, float* v, float* g, float* beta) {
  __shared__ float conv[LA_CONV_DIM];
  __shared__ float inv_norm[2 * LA_NK];  // q heads, then k heads
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int c = tid; c < LA_CONV_DIM; c += PREFILL_THREADS) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < LA_CONV; ++j)
      acc += bf2f(conv_w[c * LA_CONV + j]) * conv_input(proj, conv_state, t - (LA_CONV - 1) + j, c);
    conv[c] = silu(acc);
  }
  __syncthreads();
  for (int head = warp; head < 2 * LA_NK; head += PREFILL_WARPS) {  // q heads at 0, k heads at LA_KEY_DIM
    float ss = 0.f;
    for (int d = lane; d < LA_DK; d += 32) ss += conv[head * LA_DK + d] * conv[head * LA_DK + d];
    ss = warp_sum(ss);
    if (lane == 0) inv_norm[head] = rsqrtf(ss + 1e-6f);
  }
  __syncthreads();
  constexpr int REPEAT = LA_NV / LA_NK;  // value heads a q/k head serves
  for (int e = tid; e < LA_NV * LA_DK; e += PREFILL_THREADS) {
    const int hv = e / LA_DK, d = e % LA_DK, hk = hv / REPEAT;
    q[(size_t)t * LA_NV * LA_DK + e] = conv[hk * LA_DK + d] * inv_norm[hk] * LA_Q_SCALE;
    k[(size_t)t * LA_NV * LA_DK + e] = conv[LA_KEY_DIM + hk * LA_DK + d] * inv_norm[LA_NK + hk];
  }
  for (int e = tid; e < LA_VALUE_DIM; e += PREFILL_THREADS) v[(size_t)t * LA_VALUE_DIM + e] = conv[2 * LA_KEY_DIM + e];
  if (tid < LA_NV) {
    const bool real = real_rows == nullptr || t < *real_rows;
    const float* gates = proj + (size_t)t * LA_IN_ROWS + LA_CONV_DIM + LA_VALUE_DIM;  // b, then a
    g[(size_t)t * LA_NV + tid] = real ? log_decay(a_log[tid], gates[LA_NV + tid] + dt_bias[tid]) : 0.f;
    beta[(size_t)t * LA_NV + tid] = real ? sigmoid(gates[tid]) : 0.f;
  }
}

// Row j of the new state is window row real + j (the state's rows, then lin_in's): a thread takes a channel's rows in
// increasing j, so the state rows it reads (real + j >= j) are not yet overwritten.
__global__ void __launch_bounds__(PREFILL_THREADS) conv_state_kernel(const float* proj, float* conv_state,
                                                                     const long long* real_rows, int n) {
  const int c = blockIdx.x * PREFILL_THREADS + threadIdx.x;
  if (c >= LA_CONV_DIM) return;
  const int real = real_rows == nullptr ? n : (int)*real_rows;
#pragma unroll
  for (int j = 0; j < LA_CONV - 1; ++j)
    conv_state[j * LA_CONV_DIM + c] = conv_input(proj, conv_state, real + j - (LA_CONV - 1), c);
}

__global__ void __launch_bounds__(PREFILL_THREADS) gated_norm_kernel(const float* out, const float* proj,
                                                                     const float* norm_w, bf16* parts, int n) {
  const int item = blockIdx.x * PREFILL_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (item >= n * LA_NV) return;
  const int t = item / LA_NV, hv = item % LA_NV;
  const float* x = out + (size_t)item * LA_DV;
  float ss = 0.f;
  for (int d = lane; d < LA_DV; d += 32) ss += x[d] * x[d];
  const float inv = rsqrtf(warp_sum(ss) / LA_DV + EPS);
  const float* z = proj + (size_t)t * LA_IN_ROWS + LA_CONV_DIM + hv * LA_DV;
  const size_t total = (size_t)n * LA_VALUE_DIM;
  for (int d = lane; d < LA_DV; d += 32) {
    const size_t at = (size_t)t * LA_VALUE_DIM + hv * LA_DV + d;
    split_store(parts, at, total + at, norm_w[d] * (x[d] * inv) * silu(z[d]));
  }
}
#endif

// A prefill's n rows of lin_in's output `proj` [n][LA_IN_ROWS] -> the delta rule's q, k [n][LA_NV][LA_DK], v
// [n][LA_NV][LA_DV], g and beta [n][LA_NV]; the layer's conv_state [LA_CONV - 1][LA_CONV_DIM] advanced by the first
// *real_rows rows (all n where null).
extern "C" int mk_prefill_linear_inputs(const float* proj, float* conv_state, const bf16* conv_w, const float* a_log,
                                        const float* dt_bias, const long long* real_rows, int n, float* q, float* k,
                                        float* v, float* g, float* beta, cudaStream_t stream) {
#if HAS_LINEAR_ATTENTION
  linear_inputs_kernel<<<n, PREFILL_THREADS, 0, stream>>>(proj, conv_state, conv_w, a_log, dt_bias, real_rows, n, q, k,
                                                          v, g, beta);
  conv_state_kernel<<<(LA_CONV_DIM + PREFILL_THREADS - 1) / PREFILL_THREADS, PREFILL_THREADS, 0, stream>>>(
      proj, conv_state, real_rows, n);
  return (int)cudaGetLastError();
#else
  return (int)cudaErrorNotSupported;
#endif
}

// The delta rule's read-outs `out` [n][LA_NV][LA_DV] -> out_proj's input, split [2n][LA_VALUE_DIM] (bf16 hi, lo).
extern "C" int mk_prefill_gated_norm(const float* out, const float* proj, const float* norm_w, bf16* parts, int n,
                                     cudaStream_t stream) {
#if HAS_LINEAR_ATTENTION
  gated_norm_kernel<<<(n * LA_NV + PREFILL_WARPS - 1) / PREFILL_WARPS, PREFILL_THREADS, 0, stream>>>(out, proj, norm_w,
                                                                                                     parts, n);
  return (int)cudaGetLastError();
#else
  return (int)cudaErrorNotSupported;
#endif
}
