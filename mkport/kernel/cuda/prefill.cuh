// The prompt prefill's elementwise work, fused around its cuBLAS matmuls (mkport/prefill.py). Every matmul
// input is split into bf16 rows hi and lo (hi + lo = y to ~2^-16 relative), stacked as [2n, cols], so that one
// bf16 tensor-core matmul with fp32 accumulation gives the fp32 product; its output halves are summed where
// the next kernel reads them. Each kernel does what a few dozen torch kernels did, with the same arithmetic.
#pragma once

constexpr int PREFILL_THREADS = 256;
constexpr int PREFILL_WARPS = PREFILL_THREADS / 32;

__device__ __forceinline__ void split_store(bf16* parts, size_t hi_at, size_t lo_at, float y) {
  const bf16 hi = __float2bfloat16_rn(y);
  parts[hi_at] = hi;
  parts[lo_at] = __float2bfloat16_rn(y - bf2f(hi));
}

__device__ __forceinline__ float prefill_block_sum(float v) {
  __shared__ float partial[PREFILL_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float t = lane < PREFILL_WARPS ? partial[lane] : 0.f;
  return warp_sum(t);
}

// One row of the residual stream: x += sublayer(a) with a = add[row] + add[n + row] (the halves of the last matmul)
// when add is given, RMSNormed with `post` first in post-norm layers (gemma2/3's sandwich norms, olmo2/3), as
// post_norm.cuh does; then RMSNorm(x) * w to `out` (fp32, the final norm) or split to `parts` (the next matmul's
// input), or x itself split where w is null (olmo2/3: no input norms).
__global__ void __launch_bounds__(PREFILL_THREADS) prefill_norm_kernel(float* x, const float* add, const bf16* post,
                                                                       const bf16* w, float* out, bf16* parts, int n) {
  const int row = blockIdx.x;
  float* xr = x + (size_t)row * H;
  const float* add_hi = add + (size_t)row * H;
  const float* add_lo = add + (size_t)(n + row) * H;
  float post_inv = 0.f;
  if (add && post) {  // the whole sublayer output's RMS before any of it reaches x
    float ss = 0.f;
    for (int c = threadIdx.x; c < H; c += PREFILL_THREADS) {
      const float a = add_hi[c] + add_lo[c];
      ss += a * a;
    }
    post_inv = rsqrtf(prefill_block_sum(ss) / H + EPS);
    __syncthreads();  // every warp has read prefill_block_sum's partials before the sum below rewrites them
  }
  float ss = 0.f;
  for (int c = threadIdx.x; c < H; c += PREFILL_THREADS) {
    float v = xr[c];
    if (add) {
      float a = add_hi[c] + add_lo[c];
      if (post) a = norm_scale(bf2f(post[c])) * (a * post_inv);
      v = v + sublayer(a);
    }
    xr[c] = v;
    ss += v * v;
  }
  if (!w) {
    for (int c = threadIdx.x; c < H; c += PREFILL_THREADS) split_store(parts, (size_t)row * H + c, (size_t)(n + row) * H + c, xr[c]);
    return;
  }
  const float inv = rsqrtf(prefill_block_sum(ss) / H + EPS);
  for (int c = threadIdx.x; c < H; c += PREFILL_THREADS) {
    const float y = norm_scale(bf2f(w[c])) * (xr[c] * inv);
    if (out) out[(size_t)row * H + c] = y;
    else split_store(parts, (size_t)row * H + c, (size_t)(n + row) * H + c, y);
  }
}

// The q/k/v matmul's output, one warp a head: + bias, q/k RMSNorm (HAS_QK_NORM: over each head, or over the whole q or
// k projection with QK_NORM_PROJECTION), RoPE (unless `rope` is 0: a NoPE layer; `local`: the sliding layers' own
// table, gemma3's) at the row's positions ([3][pos_stride] t, h, w); q to q_out [NH][n][HD] and k, v to kv_out [2][NKV][n][HD] (fp32, for
// attention, as torch_model.forward attends to the prompt's own rows), k and v also to this layer's KV cache
// ([NKV][rows][HD], bf16) at the row of position start + i (cache_row: a sliding layer's ring).
// Prompts prefilled together (`prompts`, [3][n]: each row's prompt's first row and its sequence's K and V cache, this
// layer's `layer_at` elements in; start 0): row i goes to its own sequence's cache, at its row within its prompt.
__global__ void __launch_bounds__(PREFILL_THREADS) prefill_qkv_kernel(
    const float* both, const bf16* bias, const bf16* q_norm, const bf16* k_norm, const long long* positions,
    int pos_stride, float* q_out, float* kv_out, bf16* k_cache, bf16* v_cache, int n, int start, int rows, int rope,
    int local, const long long* prompts, long long layer_at) {
  const int row = blockIdx.x, lane = threadIdx.x & 31;
  const int head = blockIdx.y * PREFILL_WARPS + (threadIdx.x >> 5);
  if (head >= NH + 2 * NKV) return;
  int idx[HEAD_SLOTS];
  float v[HEAD_SLOTS];
  head_lane_index(lane, idx);
  float wv[HEAD_SLOTS];
  if constexpr (HAS_QK_NORM)  // a projection's norm weights: this head's HD of its NH * HD (or NKV * HD)
    if (head < NH + NKV)
      head_norm_weights(head < NH ? q_norm + (QK_NORM_PROJECTION ? head * HD : 0)
                                  : k_norm + (QK_NORM_PROJECTION ? (head - NH) * HD : 0), idx, wv);
  const float* hi = both + (size_t)row * QKV_ROWS;
  const float* lo = both + (size_t)(n + row) * QKV_ROWS;
#pragma unroll
  for (int e = 0; e < HEAD_SLOTS; ++e) {  // a padding slot (head_dim 96) holds 0, as in attention.cuh
    const int at = head * HD + idx[e];
    v[e] = head_slot_valid(lane, e) ? hi[at] + lo[at] : 0.f;
    if (bias && head_slot_valid(lane, e)) v[e] = v[e] + bf2f(bias[at]);
  }
  if (head < NH + NKV) {
    if constexpr (QK_NORM_PROJECTION) {
      // the row's whole q or k projection: its matmul's halves plus the bias (attention.cuh's projection_inv_rms)
      const auto value_at = [&](int at) {
        return [=](int i) { return hi[at + i] + lo[at + i] + (bias ? bf2f(bias[at + i]) : 0.f); };
      };
      const float inv = head < NH ? projection_inv_rms<Q_ROWS>(value_at(0), lane)
                                  : projection_inv_rms<KV_ROWS>(value_at(Q_ROWS), lane);
#pragma unroll
      for (int e = 0; e < HEAD_SLOTS; ++e) v[e] = wv[e] * (v[e] * inv);
    } else if constexpr (HAS_QK_NORM) {
      head_rmsnorm(v, wv);
    }
    const int pos[3] = {(int)positions[row], (int)positions[pos_stride + row], (int)positions[2 * pos_stride + row]};
    if (rope) apply_rope(v, idx, pos, local, RopeLength{0, nullptr});  // prefill.supported: no longrope or dynamic
  }
  if (head < NH) {
#pragma unroll
    for (int e = 0; e < HEAD_SLOTS; ++e)
      if (head_slot_valid(lane, e)) q_out[((size_t)head * n + row) * HD + idx[e]] = v[e];
    return;
  }
  const bool is_k = head < NH + NKV;
  const int kv_head = is_k ? head - NH : head - NH - NKV;
  float* att = kv_out + (((size_t)(is_k ? 0 : NKV) + kv_head) * n + row) * HD;
  // the row's sequence's cache and its position there: a prompt's own (prompts), else this one's from start
  bf16* cache = prompts ? reinterpret_cast<bf16*>(prompts[(is_k ? 1 : 2) * n + row]) + layer_at : is_k ? k_cache : v_cache;
  const int at = prompts ? row - (int)prompts[row] : start + row;
#if HAS_SLIDING_WINDOW
  cache += ((size_t)kv_head * rows + cache_row(at, rows)) * HD;
#else
  cache += ((size_t)kv_head * rows + at) * HD;
#endif
#pragma unroll
  for (int e = 0; e < HEAD_SLOTS; ++e) {
    if (!head_slot_valid(lane, e)) continue;
    att[idx[e]] = v[e];
    cache[idx[e]] = __float2bfloat16_rn(v[e]);
  }
}

// Attention's output [NH][n][HD] -> the o projection's input, split, rows [2n][NH * HD] (after torch's attention, for
// a context longer than prefill_attn_kernel's shared memory holds).
__global__ void __launch_bounds__(PREFILL_THREADS) prefill_attn_split_kernel(const float* attn, bf16* parts, int n) {
  const size_t total = (size_t)n * Q_ROWS;
  for (size_t i = blockIdx.x * (size_t)PREFILL_THREADS + threadIdx.x; i < total; i += (size_t)gridDim.x * PREFILL_THREADS) {
    const size_t row = i / Q_ROWS;
    const int c = (int)(i % Q_ROWS), head = c / HD, d = c % HD;
    split_store(parts, i, total + i, attn[((size_t)head * n + row) * HD + d]);
  }
}

__device__ __forceinline__ float prefill_block_max(float v) {
  __shared__ float partial[PREFILL_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_max(lane < PREFILL_WARPS ? partial[lane] : -INFINITY);
}

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(bf16 v) { return bf2f(v); }

// A score as attention.cuh scales it: gemma2's soft-cap, c * tanh(s / c), on the scaled score.
__device__ __forceinline__ float prefill_score(float dot, float scale) {
  if constexpr (HAS_ATTN_SOFTCAP) return tanhf(dot * scale / ATTN_SOFTCAP) * ATTN_SOFTCAP;
  else return dot * scale;
}

// Scores of q against `rows` keys ([rows][HD], fp32 or bf16) at positions first.., a warp a key, with
// PREFILL_KEYS keys a warp in flight at once (each key's sum in the order of a key alone).
constexpr int PREFILL_KEYS = 4;

template <typename T>
__device__ __forceinline__ void prefill_scores(const float* qs, const T* keys, int rows, int first, float scale,
                                               float* score) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int r = warp;
  for (; r + (PREFILL_KEYS - 1) * PREFILL_WARPS < rows; r += PREFILL_KEYS * PREFILL_WARPS) {
    float dot[PREFILL_KEYS];
#pragma unroll
    for (int u = 0; u < PREFILL_KEYS; ++u) dot[u] = 0.f;
#pragma unroll
    for (int d = lane; d < HD; d += 32) {
#pragma unroll
      for (int u = 0; u < PREFILL_KEYS; ++u)
        dot[u] = fmaf(qs[d], as_float(keys[(size_t)(r + u * PREFILL_WARPS) * HD + d]), dot[u]);
    }
#pragma unroll
    for (int u = 0; u < PREFILL_KEYS; ++u) {
      const float s = warp_sum(dot[u]);
      if (lane == 0) score[first + r + u * PREFILL_WARPS] = prefill_score(s, scale);
    }
  }
  for (; r < rows; r += PREFILL_WARPS) {
    float dot = 0.f;
#pragma unroll
    for (int d = lane; d < HD; d += 32) dot = fmaf(qs[d], as_float(keys[(size_t)r * HD + d]), dot);
    dot = warp_sum(dot);
    if (lane == 0) score[first + r] = prefill_score(dot, scale);
  }
}

// Element d of sum_r p[first + r] * values[r], over the rows r = part, part + parts, ...: four sums, row k into sum
// k % 4 in row order, eight loads in flight, then four, then one at a time into the first sum.
template <typename T>
__device__ __forceinline__ float prefill_weighted(const float* p, const T* values, int rows, int first, int d, int part,
                                                  int parts) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int r = part;
  for (; r + 7 * parts < rows; r += 8 * parts) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = as_float(values[(size_t)(r + u * parts) * HD + d]);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc[u % 4] = fmaf(p[first + r + u * parts], v[u], acc[u % 4]);
  }
  for (; r + 3 * parts < rows; r += 4 * parts) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] = fmaf(p[first + r + u * parts], as_float(values[(size_t)(r + u * parts) * HD + d]), acc[u]);
  }
  for (; r < rows; r += parts) acc[0] = fmaf(p[first + r], as_float(values[(size_t)r * HD + d]), acc[0]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Causal attention of one query row (blockIdx.y) of one head (blockIdx.x), in fp32, written split as the o
// projection's input (rows [2n][NH * HD]). Row i attends to positions 0..start + i (with a sliding `window` W > 0,
// only start + i - W + 1..start + i: the scores before are set to -inf, which the exp turns into exact zeros): those
// before `start` from this layer's cache, the first `exact` of them as the exact fp32 rows kept beside it
// ([NKV][exact_cap][HD]), the prompt's own from kv ([2][NKV][n][HD], as the qkv kernel left them); a sliding layer
// reads no cached row before its first row's window (a ring holds no older one; their scores are -inf), in at most
// two runs of its ring. Shared memory: q, the scores (start + n floats), then the partial sums of the thread groups.
// One kernel where torch's attention took about fifteen (the K/V concatenated and repeated for grouped heads, the
// mask, scaled_dot_product_attention, the split). Prompts prefilled together (`prompts`, as prefill_qkv_kernel's;
// start 0, nothing cached): a row attends to its own prompt's rows only, from the prompt's first.
constexpr int PV_PARTS = PREFILL_THREADS >= HD ? PREFILL_THREADS / HD : 1;  // thread groups sharing the PV sum

__global__ void __launch_bounds__(PREFILL_THREADS) prefill_attn_kernel(
    const float* q, const float* kv, const bf16* k_cache, const bf16* v_cache, const float* exact_k,
    const float* exact_v, int exact_cap, int exact, int start, int n, int rows, int window, float scale, bf16* parts,
    const long long* prompts) {
  if (HD % 64 != 0) return;  // head_dim 96 prefills with torch_model (prefill.supported): nothing to build
  extern __shared__ float prefill_smem[];
  const int head = blockIdx.x, row = blockIdx.y, kvh = head / G;
  const int first = prompts ? (int)prompts[row] : 0, ctx = start + row - first + 1;
  float* qs = prefill_smem;             // [HD]
  float* score = qs + HD;               // [start + n]
  float* partial = score + start + n;   // [PV_PARTS][HD]
  // the cached positions [from, start): from cache row cached_at, but the last `wrapped` of a ring from its row 0
#if HAS_SLIDING_WINDOW
  const int from = window ? max(exact, start + 1 - window) : exact, from_row = cache_row(from, rows);
  const int wrapped = max(0, start - from - (rows - from_row));
  const size_t kept_at = (size_t)kvh * exact_cap * HD, cached_at = ((size_t)kvh * rows + from_row) * HD;
  const size_t wrapped_at = (size_t)kvh * rows * HD;
#else
  const int from = exact;
  constexpr int wrapped = 0;
  const size_t kept_at = (size_t)kvh * exact_cap * HD, cached_at = ((size_t)kvh * rows + exact) * HD;
#endif
  const float* k_new = kv + ((size_t)kvh * n + first) * HD;
  const float* v_new = kv + (((size_t)NKV + kvh) * n + first) * HD;
  for (int d = threadIdx.x; d < HD; d += PREFILL_THREADS) qs[d] = q[((size_t)head * n + row) * HD + d];
  __syncthreads();
  if (exact) prefill_scores(qs, exact_k + kept_at, exact, 0, scale, score);
  prefill_scores(qs, k_cache + cached_at, start - from - wrapped, from, scale, score);
#if HAS_SLIDING_WINDOW
  prefill_scores(qs, k_cache + wrapped_at, wrapped, start - wrapped, scale, score);
#endif
  prefill_scores(qs, k_new, row - first + 1, start, scale, score);
  __syncthreads();
  for (int j = threadIdx.x; window && j < ctx - window; j += PREFILL_THREADS) score[j] = -INFINITY;
  __syncthreads();
  float m = -INFINITY;
  for (int j = threadIdx.x; j < ctx; j += PREFILL_THREADS) m = fmaxf(m, score[j]);
  m = prefill_block_max(m);
  float sum = 0.f;
  for (int j = threadIdx.x; j < ctx; j += PREFILL_THREADS) {
    const float e = expf(score[j] - m);
    score[j] = e;
    sum += e;
  }
  sum = prefill_block_sum(sum);  // its barrier also puts every exp in `score` before the sums below read them
  const int d = threadIdx.x % HD, part = threadIdx.x / HD;
  if (part < PV_PARTS) {
    float acc = exact ? prefill_weighted(score, exact_v + kept_at, exact, 0, d, part, PV_PARTS) : 0.f;
    acc += prefill_weighted(score, v_cache + cached_at, start - from - wrapped, from, d, part, PV_PARTS);
#if HAS_SLIDING_WINDOW
    acc += prefill_weighted(score, v_cache + wrapped_at, wrapped, start - wrapped, d, part, PV_PARTS);
#endif
    acc += prefill_weighted(score, v_new, row - first + 1, start, d, part, PV_PARTS);
    partial[part * HD + d] = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < HD; e += PREFILL_THREADS) {
    float o = 0.f;
    for (int g = 0; g < PV_PARTS; ++g) o += partial[g * HD + e];
    const size_t at_row = (size_t)row * Q_ROWS + head * HD + e;
    split_store(parts, at_row, (size_t)n * Q_ROWS + at_row, o / sum);
  }
}

// act(gate) * up (mlp.cuh's act_times: SwiGLU, or Gemma's GeGLU) from the halves of both matmuls' outputs ([2n][I]
// each) -> the down projection's input, split.
__global__ void __launch_bounds__(PREFILL_THREADS) prefill_act_kernel(const float* gate, const float* up, bf16* parts,
                                                                      int n) {
  const size_t total = (size_t)n * I;
  for (size_t i = blockIdx.x * (size_t)PREFILL_THREADS + threadIdx.x; i < total; i += (size_t)gridDim.x * PREFILL_THREADS)
    split_store(parts, i, total + i, act_times(gate[i] + gate[total + i], up[i] + up[total + i]));
}

static int prefill_grid(size_t total) {
  const size_t blocks = (total + PREFILL_THREADS - 1) / PREFILL_THREADS;
  return (int)(blocks < 4096 ? blocks : 4096);  // the grid-stride loops cover the rest
}

extern "C" int mk_prefill_norm(float* x, const float* add, const bf16* post, const bf16* w, float* out, bf16* parts,
                               int n, cudaStream_t stream) {
  prefill_norm_kernel<<<n, PREFILL_THREADS, 0, stream>>>(x, add, post, w, out, parts, n);
  return (int)cudaGetLastError();
}

extern "C" int mk_prefill_qkv(const float* both, const bf16* bias, const bf16* q_norm, const bf16* k_norm,
                              const long long* positions, int pos_stride, float* q_out, float* kv_out,
                              bf16* k_cache, bf16* v_cache, int n, int start, int rows, int rope, int local,
                              const long long* prompts, long long layer_at, cudaStream_t stream) {
  const dim3 grid(n, (NH + 2 * NKV + PREFILL_WARPS - 1) / PREFILL_WARPS);
  prefill_qkv_kernel<<<grid, PREFILL_THREADS, 0, stream>>>(both, bias, q_norm, k_norm, positions, pos_stride, q_out,
                                                           kv_out, k_cache, v_cache, n, start, rows, rope, local,
                                                           prompts, layer_at);
  return (int)cudaGetLastError();
}

extern "C" int mk_prefill_attn_split(const float* attn, bf16* parts, int n, cudaStream_t stream) {
  prefill_attn_split_kernel<<<prefill_grid((size_t)n * Q_ROWS), PREFILL_THREADS, 0, stream>>>(attn, parts, n);
  return (int)cudaGetLastError();
}

// Shared memory of prefill_attn_kernel for a prompt ending at row `context`; the host runs torch's attention
// past what a block can have.
extern "C" int mk_prefill_attn_smem(int context) { return (int)((HD + context + PV_PARTS * HD) * sizeof(float)); }

extern "C" int mk_prefill_attn(const float* q, const float* kv, const bf16* k_cache, const bf16* v_cache,
                               const float* exact_k, const float* exact_v, int exact_cap, int exact, int start, int n,
                               int rows, int window, float scale, bf16* parts, const long long* prompts,
                               cudaStream_t stream) {
  if (HD % 64 != 0) return (int)cudaErrorNotSupported;
  const int smem = mk_prefill_attn_smem(start + n);
  if (smem > 48 * 1024) {  // past the default only for long contexts, not at the prompt lengths graphs capture
    const cudaError_t e = cudaFuncSetAttribute((const void*)prefill_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
  }
  prefill_attn_kernel<<<dim3(NH, n), PREFILL_THREADS, smem, stream>>>(q, kv, k_cache, v_cache, exact_k, exact_v,
                                                                     exact_cap, exact, start, n, rows, window, scale, parts,
                                                                     prompts);
  return (int)cudaGetLastError();
}

extern "C" int mk_prefill_act(const float* gate, const float* up, bf16* parts, int n, cudaStream_t stream) {
  prefill_act_kernel<<<prefill_grid((size_t)n * I), PREFILL_THREADS, 0, stream>>>(gate, up, parts, n);
  return (int)cudaGetLastError();
}
