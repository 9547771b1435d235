// The prompt prefill's gated delta rule (qwen3_5's linear-attention layers) in two kernels, the chunked scan of
// torch_model.delta_rule_chunked (its docstring has the algebra), which takes ~80 torch kernels a layer:
// delta_chunk: a block a (value head, chunk of DELTA_ROWS rows), all chunks at once: the chunk's cumulative log decay
//   G, its lower triangular system I + A (A_ij = beta_i e^(G_i - G_j) k_i.k_j, j < i) solved by forward substitution
//   for W_v (right-hand side beta v) and W_k (beta e^G k), a thread a column; the reads e^(G_i - G_j) q_i.k_j (j <= i),
//   e^G q and e^(G_last - G) k, written to the chunk's workspace.
// delta_scan: a block a (value head, DELTA_COLS columns of its state; the columns are independent) passes the state
//   from chunk to chunk: u = W_v - W_k S, out = e^G q S + reads u, S = e^G_last S + (e^(G_last - G) k)^T u.
// Inputs are the torch path's (q, k [N][LA_NV][LA_DK] after their norms and q's scale, v [N][LA_NV][LA_DV], g and beta
// [N][LA_NV], fp32); rows past N are zero, which write nothing and do not decay.
#pragma once

constexpr int DELTA_ROWS = 64;  // a chunk's rows, torch_model.DELTA_CHUNK
constexpr int DELTA_THREADS = 256;
constexpr int DELTA_COLS = 16;  // state columns of a delta_scan block

#if HAS_LINEAR_ATTENTION
static_assert(LA_DK % 4 == 0 && LA_DV % DELTA_COLS == 0, "rows are read in 16-byte pieces; blocks split the columns");
static_assert(2 * DELTA_ROWS * 2 == DELTA_THREADS, "delta_scan: a thread a (W_k or e^G q row, half of the columns)");

// A (chunk, head)'s workspace, in floats: W_v [rows][LA_DV], then W_k and e^G q (rows [2 * rows][LA_DK], one product
// with S), e^(G_last - G) k [rows][LA_DK], the reads [rows][rows] (j, then i) and e^G_last (padded to 16 bytes).
constexpr int DELTA_WV = 0;
constexpr int DELTA_WK = DELTA_WV + DELTA_ROWS * LA_DV;
constexpr int DELTA_QG = DELTA_WK + DELTA_ROWS * LA_DK;
constexpr int DELTA_KD = DELTA_QG + DELTA_ROWS * LA_DK;
constexpr int DELTA_READS = DELTA_KD + DELTA_ROWS * LA_DK;
constexpr int DELTA_DECAY = DELTA_READS + DELTA_ROWS * DELTA_ROWS;
constexpr int DELTA_FLOATS = DELTA_DECAY + 4;
constexpr int DELTA_STRIDE = LA_DK + 4;  // a shared row of k or q: 16-byte reads of 8 consecutive rows hit 8 banks
constexpr int DELTA_CHUNK_SMEM = (2 * DELTA_ROWS * DELTA_STRIDE + DELTA_ROWS * (DELTA_ROWS + 1) + 2 * DELTA_ROWS) * 4;
constexpr int DELTA_STATE_STRIDE = DELTA_COLS + 4;
constexpr int DELTA_SCAN_SMEM = (2 * DELTA_ROWS * DELTA_STRIDE + LA_DK * DELTA_STATE_STRIDE + DELTA_ROWS * DELTA_COLS +
                                 2 * (DELTA_ROWS * LA_DK + DELTA_ROWS * DELTA_ROWS + DELTA_ROWS * DELTA_COLS)) * 4;

__global__ void __launch_bounds__(DELTA_THREADS) delta_chunk_kernel(const float* q, const float* k, const float* v,
                                                                    const float* g, const float* beta, int n,
                                                                    float* work) {
  extern __shared__ __align__(16) float smem[];
  float* ks = smem;                                  // [rows][DELTA_STRIDE]
  float* qs = ks + DELTA_ROWS * DELTA_STRIDE;        // [rows][DELTA_STRIDE]
  float* system = qs + DELTA_ROWS * DELTA_STRIDE;    // [rows][rows + 1]: A, strictly lower
  float* cum = system + DELTA_ROWS * (DELTA_ROWS + 1);
  float* betas = cum + DELTA_ROWS;
  const int h = blockIdx.x, first = blockIdx.y * DELTA_ROWS, t = threadIdx.x;
  float* out = work + ((size_t)blockIdx.y * LA_NV + h) * DELTA_FLOATS;

  for (int e = t; e < DELTA_ROWS * LA_DK / 4; e += DELTA_THREADS) {
    const int i = e / (LA_DK / 4), d = e % (LA_DK / 4) * 4;
    float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), qv = kv;
    if (first + i < n) {
      const size_t at = ((size_t)(first + i) * LA_NV + h) * LA_DK + d;
      kv = *reinterpret_cast<const float4*>(k + at);
      qv = *reinterpret_cast<const float4*>(q + at);
    }
    *reinterpret_cast<float4*>(ks + i * DELTA_STRIDE + d) = kv;
    *reinterpret_cast<float4*>(qs + i * DELTA_STRIDE + d) = qv;
  }
  if (t < 32) {  // G: an inclusive scan of g over the chunk, rows t and 32 + t
    const bool in0 = first + t < n, in1 = first + 32 + t < n;
    float lo = in0 ? g[(size_t)(first + t) * LA_NV + h] : 0.f, hi = in1 ? g[(size_t)(first + 32 + t) * LA_NV + h] : 0.f;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
      const float a = __shfl_up_sync(0xffffffffu, lo, s), b = __shfl_up_sync(0xffffffffu, hi, s);
      if (t >= s) lo += a, hi += b;
    }
    hi += __shfl_sync(0xffffffffu, lo, 31);
    cum[t] = lo;
    cum[32 + t] = hi;
    betas[t] = in0 ? beta[(size_t)(first + t) * LA_NV + h] : 0.f;
    betas[32 + t] = in1 ? beta[(size_t)(first + 32 + t) * LA_NV + h] : 0.f;
  }
  __syncthreads();

  {  // k_i.k_j and q_i.k_j: a thread a row i and 16 columns j (lane & 3) + 4 jj, so that a warp reads 4 banks of k_j
    const int i = t >> 2, j0 = t & 3;
    float kk[DELTA_ROWS / 4] = {}, qk[DELTA_ROWS / 4] = {};
    for (int d = 0; d < LA_DK; d += 4) {
      const float4 ki = *reinterpret_cast<const float4*>(ks + i * DELTA_STRIDE + d);
      const float4 qi = *reinterpret_cast<const float4*>(qs + i * DELTA_STRIDE + d);
#pragma unroll
      for (int jj = 0; jj < DELTA_ROWS / 4; ++jj) {
        const float4 kj = *reinterpret_cast<const float4*>(ks + (j0 + 4 * jj) * DELTA_STRIDE + d);
        kk[jj] += ki.x * kj.x + ki.y * kj.y + ki.z * kj.z + ki.w * kj.w;
        qk[jj] += qi.x * kj.x + qi.y * kj.y + qi.z * kj.z + qi.w * kj.w;
      }
    }
#pragma unroll
    for (int jj = 0; jj < DELTA_ROWS / 4; ++jj) {
      const int j = j0 + 4 * jj;
      const float decay = j <= i ? expf(cum[i] - cum[j]) : 0.f;
      system[i * (DELTA_ROWS + 1) + j] = j < i ? betas[i] * decay * kk[jj] : 0.f;
      out[DELTA_READS + j * DELTA_ROWS + i] = decay * qk[jj];  // transposed: delta_scan's lanes read along i
    }
  }
  __syncthreads();

  // (I + A) W = R by forward substitution, a thread a column of R: beta v's (W_v), then beta e^G k's (W_k)
  for (int col = t; col < LA_DV + LA_DK; col += DELTA_THREADS) {
    const bool value = col < LA_DV;
    float w[DELTA_ROWS];
#pragma unroll
    for (int i = 0; i < DELTA_ROWS; ++i) {
      float r;
      if (value)
        r = first + i < n ? betas[i] * v[((size_t)(first + i) * LA_NV + h) * LA_DV + col] : 0.f;
      else
        r = betas[i] * expf(cum[i]) * ks[i * DELTA_STRIDE + col - LA_DV];
      float part[4] = {};  // four chains of the row's sum, not one 63 long
#pragma unroll
      for (int j = 0; j < i; ++j) part[j & 3] += system[i * (DELTA_ROWS + 1) + j] * w[j];
      w[i] = r - ((part[0] + part[1]) + (part[2] + part[3]));
    }
    float* to = value ? out + DELTA_WV + col : out + DELTA_WK + col - LA_DV;
    const int stride = value ? LA_DV : LA_DK;
#pragma unroll
    for (int i = 0; i < DELTA_ROWS; ++i) to[i * stride] = w[i];
  }
  const float last = cum[DELTA_ROWS - 1];
  for (int e = t; e < DELTA_ROWS * LA_DK; e += DELTA_THREADS) {
    const int i = e / LA_DK, d = e % LA_DK;
    out[DELTA_QG + e] = qs[i * DELTA_STRIDE + d] * expf(cum[i]);
    out[DELTA_KD + e] = ks[i * DELTA_STRIDE + d] * expf(last - cum[i]);
  }
  if (t == 0) out[DELTA_DECAY] = expf(last);
}

// Eight floats from shared memory at a 16-byte aligned address, as two 16-byte reads.
__device__ __forceinline__ void load8(const float* from, float* to) {
  const float4 a = reinterpret_cast<const float4*>(from)[0], b = reinterpret_cast<const float4*>(from)[1];
  to[0] = a.x, to[1] = a.y, to[2] = a.z, to[3] = a.w, to[4] = b.x, to[5] = b.y, to[6] = b.z, to[7] = b.w;
}

// delta_scan's copies of a chunk's workspace (cp.async, waited for at the next chunk's start): W_k and e^G q into the
// tile (rows DELTA_STRIDE apart), and into one of two stages the rest that a chunk reads after its product with S.
struct DeltaStage {
  float* kd;     // [rows][LA_DK]: e^(G_last - G) k
  float* reads;  // [rows][rows]: the reads, transposed (j, then i)
  float* wv;     // [rows][DELTA_COLS]: the block's columns of W_v
};
constexpr int DELTA_STAGE_FLOATS = DELTA_ROWS * LA_DK + DELTA_ROWS * DELTA_ROWS + DELTA_ROWS * DELTA_COLS;

__device__ __forceinline__ void copy_tile(float* tile, const float* chunk, int t) {
  for (int e = t; e < 2 * DELTA_ROWS * LA_DK / 4; e += DELTA_THREADS) {
    const int i = e / (LA_DK / 4), d = e % (LA_DK / 4) * 4;
    cp_async16(tile + i * DELTA_STRIDE + d, chunk + DELTA_WK + i * LA_DK + d);
  }
}

__device__ __forceinline__ void copy_stage(const DeltaStage& st, const float* chunk, int col0, int t) {
  for (int e = t; e < DELTA_ROWS * LA_DK / 4; e += DELTA_THREADS) cp_async16(st.kd + 4 * e, chunk + DELTA_KD + 4 * e);
  for (int e = t; e < DELTA_ROWS * DELTA_ROWS / 4; e += DELTA_THREADS)
    cp_async16(st.reads + 4 * e, chunk + DELTA_READS + 4 * e);
  for (int e = t; e < DELTA_ROWS * DELTA_COLS / 4; e += DELTA_THREADS) {
    const int i = e / (DELTA_COLS / 4), j = e % (DELTA_COLS / 4) * 4;
    cp_async16(st.wv + i * DELTA_COLS + j, chunk + DELTA_WV + i * LA_DV + col0 + j);
  }
}

__global__ void __launch_bounds__(DELTA_THREADS) delta_scan_kernel(const float* work, int chunks, int n, float* state,
                                                                   float* out) {
  extern __shared__ __align__(16) float smem[];
  float* tile = smem;                                        // [2 rows][DELTA_STRIDE]: W_k, then e^G q
  float* s = tile + 2 * DELTA_ROWS * DELTA_STRIDE;           // [LA_DK][DELTA_STATE_STRIDE]: the state's columns
  float* u = s + LA_DK * DELTA_STATE_STRIDE;                 // [rows][DELTA_COLS]
  float* staged = u + DELTA_ROWS * DELTA_COLS;               // two stages
  const int h = blockIdx.x, col0 = blockIdx.y * DELTA_COLS, t = threadIdx.x;
  const int r = t % (2 * DELTA_ROWS), half = t / (2 * DELTA_ROWS) * (DELTA_COLS / 2);  // a row of tile, 8 columns
  float* head_state = state + (size_t)h * LA_DK * LA_DV + col0;
  const auto stage = [&](int c) {
    float* at = staged + (c & 1) * DELTA_STAGE_FLOATS;
    return DeltaStage{at, at + DELTA_ROWS * LA_DK, at + DELTA_ROWS * LA_DK + DELTA_ROWS * DELTA_ROWS};
  };
  const auto chunk_at = [&](int c) { return work + ((size_t)c * LA_NV + h) * DELTA_FLOATS; };
  copy_tile(tile, chunk_at(0), t);
  copy_stage(stage(0), chunk_at(0), col0, t);

  // the state's columns stay in registers, a thread a (row d, half) at a time, and in shared memory for the product
  constexpr int OWNED = (LA_DK * 2 + DELTA_THREADS - 1) / DELTA_THREADS;
  float held[OWNED][DELTA_COLS / 2];
#pragma unroll
  for (int o = 0; o < OWNED; ++o) {
    const int e = t + o * DELTA_THREADS, d = e % LA_DK, hf = e / LA_DK * (DELTA_COLS / 2);
    if (e < 2 * LA_DK)
#pragma unroll
      for (int j = 0; j < DELTA_COLS / 2; ++j) {
        held[o][j] = head_state[(size_t)d * LA_DV + hf + j];
        s[d * DELTA_STATE_STRIDE + hf + j] = held[o][j];
      }
  }

  for (int c = 0; c < chunks; ++c) {
    const DeltaStage st = stage(c);
    const float decay = chunk_at(c)[DELTA_DECAY];
    cp_async_wait_all();
    __syncthreads();  // the chunk's copies, and the state's columns after the last chunk
    if (c + 1 < chunks) copy_stage(stage(c + 1), chunk_at(c + 1), col0, t);  // into the stage chunk c - 1 used

    // [W_k; e^G q] S: rows below DELTA_ROWS give u = W_v - W_k S, the rest the read-outs' e^G q S
    float acc[DELTA_COLS / 2] = {};
#pragma unroll 4
    for (int d = 0; d < LA_DK; d += 4) {
      const float4 a = *reinterpret_cast<const float4*>(tile + r * DELTA_STRIDE + d);
      const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float sv[DELTA_COLS / 2];
        load8(s + (d + e) * DELTA_STATE_STRIDE + half, sv);
#pragma unroll
        for (int j = 0; j < DELTA_COLS / 2; ++j) acc[j] += av[e] * sv[j];
      }
    }
    if (r < DELTA_ROWS) {
      float wv[DELTA_COLS / 2];
      load8(st.wv + r * DELTA_COLS + half, wv);
#pragma unroll
      for (int j = 0; j < DELTA_COLS / 2; ++j) u[r * DELTA_COLS + half + j] = wv[j] - acc[j];
    }
    __syncthreads();  // u; the tile is read
    if (c + 1 < chunks) copy_tile(tile, chunk_at(c + 1), t);

    if (r >= DELTA_ROWS) {
      const int i = r - DELTA_ROWS, row = c * DELTA_ROWS + i;
      for (int j2 = 0; j2 <= i; ++j2) {
        const float rd = st.reads[j2 * DELTA_ROWS + i];
        float uv[DELTA_COLS / 2];
        load8(u + j2 * DELTA_COLS + half, uv);
#pragma unroll
        for (int j = 0; j < DELTA_COLS / 2; ++j) acc[j] += rd * uv[j];
      }
      if (row < n)
#pragma unroll
        for (int j = 0; j < DELTA_COLS / 2; ++j) out[((size_t)row * LA_NV + h) * LA_DV + col0 + half + j] = acc[j];
    }
#pragma unroll
    for (int o = 0; o < OWNED; ++o) {
      const int e = t + o * DELTA_THREADS, d = e % LA_DK, hf = e / LA_DK * (DELTA_COLS / 2);
      if (e < 2 * LA_DK) {
#pragma unroll
        for (int j = 0; j < DELTA_COLS / 2; ++j) held[o][j] *= decay;
#pragma unroll 8
        for (int i = 0; i < DELTA_ROWS; ++i) {
          const float kd = st.kd[i * LA_DK + d];
          float uv[DELTA_COLS / 2];
          load8(u + i * DELTA_COLS + hf, uv);
#pragma unroll
          for (int j = 0; j < DELTA_COLS / 2; ++j) held[o][j] += kd * uv[j];
        }
      }
    }
    __syncthreads();  // every read of u and the state's columns is done
#pragma unroll
    for (int o = 0; o < OWNED; ++o) {
      const int e = t + o * DELTA_THREADS, d = e % LA_DK, hf = e / LA_DK * (DELTA_COLS / 2);
      if (e < 2 * LA_DK)
#pragma unroll
        for (int j = 0; j < DELTA_COLS / 2; ++j) s[d * DELTA_STATE_STRIDE + hf + j] = held[o][j];
    }
  }
#pragma unroll
  for (int o = 0; o < OWNED; ++o) {
    const int e = t + o * DELTA_THREADS, d = e % LA_DK, hf = e / LA_DK * (DELTA_COLS / 2);
    if (e < 2 * LA_DK)
#pragma unroll
      for (int j = 0; j < DELTA_COLS / 2; ++j) head_state[(size_t)d * LA_DV + hf + j] = held[o][j];
  }
}

// Once a device, on its first (eager) call: a graph's capture then only launches.
static int delta_smem_opt_in() {
  constexpr int DEVICES = 64;
  static bool done[DEVICES] = {};
  int device = 0;
  int error = (int)cudaGetDevice(&device);
  if (error || (device < DEVICES && done[device])) return error;
  error = (int)cudaFuncSetAttribute((const void*)delta_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    DELTA_CHUNK_SMEM);
  if (!error)
    error = (int)cudaFuncSetAttribute((const void*)delta_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      DELTA_SCAN_SMEM);
  if (!error && device < DEVICES) done[device] = true;
  return error;
}
#endif

// Workspace floats of an n-row prefill's delta rule (a (chunk, head)'s DELTA_FLOATS each); 0 without linear attention.
extern "C" long long mk_prefill_delta_floats(int n) {
#if HAS_LINEAR_ATTENTION
  return (long long)((n + DELTA_ROWS - 1) / DELTA_ROWS) * LA_NV * DELTA_FLOATS;
#else
  return 0;
#endif
}

// Dynamic shared memory bytes the larger of the two kernels takes (0 without linear attention): past what a block
// of the GPU may opt into, a hybrid's prefill keeps torch's layer (runtime/decoder.py).
extern "C" int mk_prefill_delta_smem() {
#if HAS_LINEAR_ATTENTION
  return DELTA_CHUNK_SMEM > DELTA_SCAN_SMEM ? DELTA_CHUNK_SMEM : DELTA_SCAN_SMEM;
#else
  return 0;
#endif
}

// The n rows' read-outs to out [n][LA_NV][LA_DV], advancing state [LA_NV][LA_DK][LA_DV] in place.
extern "C" int mk_prefill_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                     int n, float* work, float* state, float* out, cudaStream_t stream) {
#if HAS_LINEAR_ATTENTION
  const int error = delta_smem_opt_in();
  if (error) return error;
  const int chunks = (n + DELTA_ROWS - 1) / DELTA_ROWS;
  delta_chunk_kernel<<<dim3(LA_NV, chunks), DELTA_THREADS, DELTA_CHUNK_SMEM, stream>>>(q, k, v, g, beta, n, work);
  delta_scan_kernel<<<dim3(LA_NV, LA_DV / DELTA_COLS), DELTA_THREADS, DELTA_SCAN_SMEM, stream>>>(work, chunks, n, state,
                                                                                                  out);
  return (int)cudaGetLastError();
#else
  return (int)cudaErrorNotSupported;
#endif
}
