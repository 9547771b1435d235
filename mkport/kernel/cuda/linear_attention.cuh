// Gated DeltaNet (qwen3_5's linear-attention layers): the attention half of a linear layer in three phases between grid
// barriers, the arithmetic of torch_model.gated_delta_net. The state is fp32 in global memory, the decoder's
// (LayerWeights::conv_state, delta_state): a layer's pointer is sequence 0's state, and sequence b's lies b states after
// it (LA_CONV_STATE, LA_DELTA_STATE floats; runtime/decoder.py lays the states out [linear layer][sequence]), so the
// offset is the same at every batch and a decoder stepping another's first sequences (share) uses that one's table.
// A batch's sequences have their own rows of the qkv buffer (LA_IN_ROWS floats apart) and read-outs (LA_VALUE_DIM
// apart); a sequence that a batch step leaves out (Params::advances) keeps its state, as it keeps its KV cache rows.
// linear_in: the input norm, then lin_in's rows (q/k/v, z, b, a). At batch 1 the warp of a q/k/v row also runs its
//   channel's causal depthwise conv over the channel's last LA_CONV - 1 inputs and this one, SiLU, and shifts the
//   channel's conv state; a batch's rows run on tensor cores (grid_matvec), and the thread that stores a (row,
//   sequence) runs its conv. A channel of a sequence has one owner, so no other thread reads or writes its state.
// delta_rule: a block a (sequence, value head, LA_COLS columns of its [LA_DK][LA_DV] state; the columns are
//   independent): the q/k L2 norms, the gates (decay from A_log and dt_bias, beta), the columns decayed, corrected
//   toward v at k, read at q. Sums over the rows are added in a fixed order (lanes, then warps): the same inputs give
//   the same bits.
// linear_out: every block normalises every sequence's read-outs itself, a head at a time, gated by silu(z) (the gated
//   RMSNorm), then out_proj adds to the residual stream.
#pragma once

#if HAS_LINEAR_ATTENTION
static_assert(PRE_NORMS && !POST_NORMS, "out_proj adds to the residual stream");
static_assert(LA_CONV <= 32 && LA_DV % LA_COLS == 0 && 32 % LA_COLS == 0, "a lane a conv tap; a warp's lanes share columns");
static_assert(LA_VALUE_DIM % 8 == 0, "out_proj's rows are read in 16-byte pieces");

__device__ __forceinline__ bool linear_layer(int layer) { return LINEAR_LAYER[layer]; }

// A row's log decay of the state, -e^A_log softplus(a + dt_bias) from x = a + dt_bias: softplus as torch's (threshold 20).
__device__ __forceinline__ float log_decay(float a_log, float x) { return -expf(a_log) * (x > 20.f ? x : log1pf(expf(x))); }

// The sequence of element i of BATCH blocks of n (vectors, items): batch 1's a constant, so its offsets fold away.
__device__ __forceinline__ int seq_of(int i, int n) { return BATCH == 1 ? 0 : i / n; }

// Whether sequence b's step writes its state: one that a batch step leaves out keeps it (batch 1 always advances).
__device__ __forceinline__ bool advances(const Params& p, int b) { return BATCH == 1 || p.advances[b]; }

// A batch's causal conv of channel r of sequence b (this step's input d after the channel's LA_CONV - 1 last inputs,
// oldest first, tap by tap in batch 1's order), SiLU; the window is shifted by d when the sequence advances.
__device__ __forceinline__ float conv_step(const Params& p, const LayerWeights& lw, int r, int b, float d) {
  float* state = lw.conv_state + (size_t)b * LA_CONV_STATE + r;
  float in[LA_CONV];
#pragma unroll
  for (int t = 0; t < LA_CONV - 1; ++t) in[t] = state[t * LA_CONV_DIM];
  in[LA_CONV - 1] = d;
  float c = 0.f;
#pragma unroll
  for (int t = 0; t < LA_CONV; ++t) c += bf2f(lw.lin_conv[r * LA_CONV + t]) * in[t];
  if (advances(p, b))
#pragma unroll
    for (int t = 0; t < LA_CONV - 1; ++t) state[t * LA_CONV_DIM] = in[t + 1];
  return silu(c);
}

__device__ void linear_in_phase(const Params& p, int layer, float* smem, float* scratch) {
  const LayerWeights& lw = p.layers[layer];
  rmsnorm_to_smem<H>(p.x, lw.attn_norm, smem, scratch);
  STAMP(p, layer, QKV_INPUT);
#if MK_TRACE
  float* trace = layer_trace(p, layer);
  if (blockIdx.x == 0)
    for (int i = thread_index(); i < BATCH * H; i += THREADS) {
      const int b = seq_of(i, H);
      layer_trace(p, layer, b)[TRACE_ATTN_NORM + i - b * H] = smem[i];
    }
#endif
  if constexpr (BATCH > 1) {
    grid_matvec<H, LA_IN_ROWS>([&](int r) { return lw.lin_in + (size_t)r * H; }, smem, [&](int r, int b, float d) {
      float* qkv = p.qkv + b * LA_IN_ROWS;
      if (r >= LA_CONV_DIM) {
        qkv[r] = d;
        return;
      }
      const float out = conv_step(p, lw, r, b, d);
      qkv[r] = out;
#if MK_TRACE
      layer_trace(p, layer, b)[TRACE_CONV + r] = out;
#endif
    });
    return;
  }
  const int lane = threadIdx.x & 31;
  for (int r = grid_warp(); r < LA_IN_ROWS; r += GRID_WARPS) {
    const bool conv = r < LA_CONV_DIM;
    // lane t < LA_CONV - 1 holds input t of the conv's window (oldest first), lane LA_CONV - 1 this step's; each lane
    // its tap. Loaded before the row's dot product: after it they would be one more round trip.
    float in = 0.f, tap = 0.f;
    if (conv && lane < LA_CONV - 1) in = load_state_now(lw.conv_state + lane * LA_CONV_DIM + r);
    if (conv && lane < LA_CONV) tap = load_weight_now(lw.lin_conv + r * LA_CONV + lane);
    const float d = row_dot<H>(lw.lin_in + (size_t)r * H, smem, lane);
    if (!conv) {
      if (lane == 0) p.qkv[r] = d;
      continue;
    }
    if (lane == LA_CONV - 1) in = d;
    float c = 0.f;
#pragma unroll
    for (int t = 0; t < LA_CONV; ++t) c += __shfl_sync(0xffffffffu, tap * in, t);
    const float next = __shfl_down_sync(0xffffffffu, in, 1);  // the window without its oldest input
    if (lane < LA_CONV - 1) lw.conv_state[lane * LA_CONV_DIM + r] = next;
    if (lane == 0) {
      const float out = silu(c);
      p.qkv[r] = out;
#if MK_TRACE
      trace[TRACE_CONV + r] = out;
#endif
    }
  }
}

// Per column of the block, the sum of one value a thread over the block's row groups: the lanes of a warp that share a
// column (xor butterfly), then the warps in order; `part` holds WARPS * LA_COLS floats. Every thread gets its column's.
__device__ __forceinline__ float column_sum(float v, float* part) {
  const int lane = thread_index() & 31, warp = thread_index() >> 5;
#pragma unroll
  for (int o = 16; o >= LA_COLS; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane < LA_COLS) part[warp * LA_COLS + lane] = v;
  block_sync();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) t += part[w * LA_COLS + (lane % LA_COLS)];
  return t;
}

// Shared memory (launch_plan.linear_floats): q and k of a q/k head, the block's v columns, two column partials, the
// norms' block sums.
constexpr int LA_SM_K = LA_DK, LA_SM_V = 2 * LA_DK, LA_SM_PART = LA_SM_V + 32, LA_SM_SUMS = LA_SM_PART + 2 * WARPS * 32;
constexpr int LA_SLICES = LA_DV / LA_COLS;  // column slices of a head
constexpr int LA_ROW_GROUPS = THREADS / LA_COLS;  // thread t: column t % LA_COLS, rows t / LA_COLS + LA_ROW_GROUPS * i
constexpr int LA_ROWS = (LA_DK + LA_ROW_GROUPS - 1) / LA_ROW_GROUPS;

__device__ void delta_rule_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  float* q_s = smem;
  float* k_s = smem + LA_SM_K;
  float* v_s = smem + LA_SM_V;
  float* part = smem + LA_SM_PART;
  const int col = thread_index() % LA_COLS, group = thread_index() / LA_COLS;
  for (int item = blockIdx.x; item < BATCH * LA_NV * LA_SLICES; item += GRID) {
    const int seq = seq_of(item, LA_NV * LA_SLICES), head_item = item - seq * LA_NV * LA_SLICES;
    const int h = head_item / LA_SLICES, c0 = (head_item % LA_SLICES) * LA_COLS, kh = h / (LA_NV / LA_NK);
    const float* qkv = p.qkv + seq * LA_IN_ROWS;
    const float* gates = qkv + LA_CONV_DIM + LA_VALUE_DIM;  // b of each value head, then a
    float* state = lw.delta_state + (size_t)seq * LA_DELTA_STATE + (size_t)h * LA_DK * LA_DV + c0 + col;
    // the state's columns and the gates' inputs first: they wait on nothing this phase makes
    float s[LA_ROWS];
#pragma unroll
    for (int i = 0; i < LA_ROWS; ++i)
      if (group + LA_ROW_GROUPS * i < LA_DK) s[i] = load_state_now(state + (size_t)(group + LA_ROW_GROUPS * i) * LA_DV);
    const float b = load_state_now(gates + h), a = load_state_now(gates + LA_NV + h);
    const float a_log = load_weight_now(lw.lin_a_log + h), dt_bias = load_weight_now(lw.lin_dt_bias + h);
    float sums[2] = {0.f, 0.f};  // |q|^2, |k|^2
    for (int i = thread_index(); i < LA_DK; i += THREADS) {
      const float q = load_shared_state(qkv + kh * LA_DK + i), k = load_shared_state(qkv + LA_KEY_DIM + kh * LA_DK + i);
      q_s[i] = q;
      k_s[i] = k;
      sums[0] += q * q;
      sums[1] += k * k;
    }
    if (thread_index() < LA_COLS) v_s[thread_index()] = load_shared_state(qkv + 2 * LA_KEY_DIM + h * LA_DV + c0 + thread_index());
    block_sums(sums, smem + LA_SM_SUMS);
    // L2 norms with transformers' 1e-6 inside the root; q also scaled by LA_DK^-0.5
    const float inv_q = rsqrtf(sums[0] + 1e-6f), inv_k = rsqrtf(sums[1] + 1e-6f);
    const float g = log_decay(a_log, a + dt_bias), beta = sigmoid(b);
    const float decay = expf(g);
    float kp = 0.f;  // what the decayed state predicts at k
#pragma unroll
    for (int i = 0; i < LA_ROWS; ++i) {
      const int r = group + LA_ROW_GROUPS * i;
      if (r < LA_DK) {
        s[i] *= decay;
        kp = fmaf(k_s[r] * inv_k, s[i], kp);
      }
    }
    const float delta = beta * (v_s[col] - column_sum(kp, part));
    float qp = 0.f;
#pragma unroll
    for (int i = 0; i < LA_ROWS; ++i) {
      const int r = group + LA_ROW_GROUPS * i;
      if (r < LA_DK) {
        s[i] += (k_s[r] * inv_k) * delta;
        qp = fmaf(q_s[r] * inv_q * LA_Q_SCALE, s[i], qp);
        if (advances(p, seq)) state[(size_t)r * LA_DV] = s[i];
      }
    }
    const float out = column_sum(qp, part + WARPS * 32);
    if (group == 0) {
      p.attn_out[seq * LA_VALUE_DIM + h * LA_DV + c0 + col] = out;
#if MK_TRACE
      layer_trace(p, layer, seq)[TRACE_STATE_OUT + h * LA_DV + c0 + col] = out;
#endif
    }
#if MK_TRACE
    if (thread_index() == 0 && c0 == 0) {
      layer_trace(p, layer, seq)[TRACE_GATES + h] = g;
      layer_trace(p, layer, seq)[TRACE_GATES + LA_NV + h] = beta;
    }
#endif
  }
}

__device__ void linear_out_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  float* trace = layer_trace(p, layer);
  vector_to_smem<LA_VALUE_DIM>(p.attn_out, smem);
  STAMP(p, layer, O_PROJ_INPUT);
  // the gated RMSNorm a warp a head: w * (o * rsqrt(mean(o^2) + eps)) * silu(z), w itself (not 1 + w)
  const int lane = thread_index() & 31, warp = thread_index() >> 5;
  const float* z = p.qkv + LA_CONV_DIM;
  for (int i = warp; i < BATCH * LA_NV; i += WARPS) {  // head h of sequence seq
    const int seq = seq_of(i, LA_NV), h = i - seq * LA_NV;
    float* o = smem + i * LA_DV;
    float ss = 0.f;
    for (int j = lane; j < LA_DV; j += 32) ss += o[j] * o[j];
    const float inv = rsqrtf(warp_sum(ss) / LA_DV + EPS);
    for (int j = lane; j < LA_DV; j += 32) {
      const float zj = load_shared_state(z + seq * LA_IN_ROWS + h * LA_DV + j);
      o[j] = bf2f(lw.lin_norm[j]) * (o[j] * inv) * silu(zj);
    }
  }
  block_sync();
#if MK_TRACE
  if (blockIdx.x == 0)
    for (int i = thread_index(); i < BATCH * LA_VALUE_DIM; i += THREADS) {
      const int b = seq_of(i, LA_VALUE_DIM);
      layer_trace(p, layer, b)[TRACE_GATED_NORM + i - b * LA_VALUE_DIM] = smem[i];
    }
#endif
  // a batch's normed read-outs are this block's own, in shared memory (GLOBAL_X false); batch 1 reads them there
  // whatever GLOBAL_X says, and keeps the instance it had (another would declare its own split-K partials)
  residual_matvec<LA_VALUE_DIM, H, SPLIT_K_LINEAR_OUT, LA_VALUE_DIM, BATCH == 1>(lw.lin_out, smem, sublayer_dst(p),
                                                                                 trace + TRACE_ATTN_RESIDUAL);
}
#else
__device__ __forceinline__ constexpr bool linear_layer(int) { return false; }
__device__ __forceinline__ void linear_in_phase(const Params&, int, float*, float*) {}
__device__ __forceinline__ void delta_rule_phase(const Params&, int, float*) {}
__device__ __forceinline__ void linear_out_phase(const Params&, int, float*) {}
#endif
