// Decode attention for one new token: q/k RMSNorm (HAS_QK_NORM) and RoPE, this step's K/V written to the cache,
// flash-decoding over splits of the sequence (soft-capped scores with HAS_ATTN_SOFTCAP, a window on the sliding
// layers), qwen3_5's output gate (HAS_ATTN_OUTPUT_GATE), and the output projection.
#pragma once

constexpr int HEAD_E = HD / 32;  // elements of one head a lane holds in the scores' contiguous layout

// A lane holds elements lane + 32p of the first half of a head and their rotate-half partners, HEAD_PAIRS pairs in
// HEAD_SLOTS slots. With head_dim 96 (Phi-3/3.5-mini) the 48 pairs do not fill two a lane: the second pair of lanes
// 16..31 is padding (HEAD_PADDED), held as zeros at index 0 and HD / 2, and never stored (head_slot_valid).
constexpr int HEAD_PAIRS = (HD / 2 + 31) / 32;
constexpr int HEAD_SLOTS = 2 * HEAD_PAIRS;
constexpr bool HEAD_PADDED = (HD / 2) % 32 != 0;

__device__ __forceinline__ bool head_slot_valid(int lane, int slot) {
  return !HEAD_PADDED || lane + 32 * (slot % HEAD_PAIRS) < HD / 2;
}

__device__ __forceinline__ void head_lane_index(int lane, int (&idx)[HEAD_SLOTS]) {
#pragma unroll
  for (int p = 0; p < HEAD_PAIRS; ++p) {
    idx[p] = head_slot_valid(lane, p) ? lane + 32 * p : 0;
    idx[p + HEAD_PAIRS] = idx[p] + HD / 2;
  }
}

// Element e of a head a lane loads: the value at idx[e], or 0 in a padding slot.
__device__ __forceinline__ float load_head_slot(const float* head, const int (&idx)[HEAD_SLOTS], int lane, int e) {
  return head_slot_valid(lane, e) ? load_shared_state(head + idx[e]) : 0.f;
}

// QK_NORM_PROJECTION (olmo2/3): 1 / RMS of a whole projection of N floats (all of q, or all of k), value(i) its i-th
// (the decode step's from the qkv buffer, the prefill's from its matmul's halves and bias). Every warp that needs it
// sums it itself, in one fixed order (lane-strided, then warp_sum's xor butterfly, which leaves the same bits in every
// lane), so every head of every block and every step normalises with the same value.
template <int N, typename ValueAt>
__device__ __forceinline__ float projection_inv_rms(ValueAt value, int lane) {
  float ss = 0.f;
  for (int i = lane; i < N; i += 32) {
    const float x = value(i);
    ss += x * x;
  }
  return rsqrtf(warp_sum(ss) / N + EPS);
}

// One projected head of layer `layer` from the qkv buffer, normalised and rotated, held by one warp.
__device__ __forceinline__ void prepare_head(const float* src, const bf16* norm_w, const int (&pos)[3],
                                             const RopeLength& length, int layer, int lane, float (&v)[HEAD_SLOTS],
                                             int (&idx)[HEAD_SLOTS]) {
  head_lane_index(lane, idx);
  float wv[HEAD_SLOTS];  // at batch 1 read before the head (not a round trip after its sum); a batch's kernel has no
  if constexpr (HAS_QK_NORM && BATCH == 1) head_norm_weights(norm_w, idx, wv);  // registers to hold them that long
#pragma unroll
  for (int e = 0; e < HEAD_SLOTS; ++e) v[e] = load_head_slot(src, idx, lane, e);
  if constexpr (HAS_QK_NORM) {
    if constexpr (BATCH > 1) head_norm_weights(norm_w, idx, wv);
    head_rmsnorm(v, wv);
  }
  if (uses_rope(layer)) apply_rope(v, idx, pos, uses_local_rope(layer), length);
}

// prepare_head with QK_NORM_PROJECTION (olmo2/3): the norm sums over the whole q or k projection, SPAN rows from
// `proj`; norm_w points at the head's own HD weights of the projection's.
template <int SPAN>
__device__ __forceinline__ void prepare_projection_head(const float* src, const float* proj, const bf16* norm_w,
                                                        const int (&pos)[3], const RopeLength& length, int layer,
                                                        int lane, float (&v)[HEAD_SLOTS], int (&idx)[HEAD_SLOTS]) {
  head_lane_index(lane, idx);
  float wv[HEAD_SLOTS];
  if constexpr (BATCH == 1) head_norm_weights(norm_w, idx, wv);
#pragma unroll
  for (int e = 0; e < HEAD_SLOTS; ++e) v[e] = load_head_slot(src, idx, lane, e);
  if constexpr (BATCH > 1) head_norm_weights(norm_w, idx, wv);
  const float inv = projection_inv_rms<SPAN>([&](int i) { return load_shared_state(proj + i); }, lane);
#pragma unroll
  for (int e = 0; e < HEAD_SLOTS; ++e) v[e] = wv[e] * (v[e] * inv);
  if (uses_rope(layer)) apply_rope(v, idx, pos, uses_local_rope(layer), length);
}

// The cache row of position `pos` in a cache of `rows` rows: a ring's; in a full layer every position is below rows.
__device__ __forceinline__ int cache_row(int pos, int rows) { return HAS_SLIDING_WINDOW ? pos % rows : pos; }

// qwen3_5: sigmoid of attention output i's gate row, which the qkv phase left after q, k and v.
__device__ __forceinline__ float output_gate(const float* qkv, int i) {
  return sigmoid(load_shared_state(qkv + QKV_ROWS + i));
}

// Shared memory of the attention phase, in floats (ATTN_SM_*, launch_plan.attention_layout): q, scores, softmax
// state, PV partial sums, then the K and V tiles (bf16).
constexpr int PV_GROUPS = THREADS >= G * HD ? THREADS / (G * HD) : 1;  // threads sharing one output
// partials of the combine one wave of a thread's loads brings: 16 spilled in qwen3-0.6b's and the code predictor's
// decode steps (4 bytes), 8 in qwen3.5-4b's at head_dim 256 (116 bytes)
constexpr int COMBINE_WAVE = HD > 128 ? 4 : 8;
static_assert(ATTN_SM_KV * 4 + 2 * ATTN_TILE * HD * 2 <= SMEM_BYTES, "attention tiles fit the plan's smem");

// One work item of attention: sequence seq of the batch, kv head kvh, positions of split `split` of `splits`, with
// `smem` as its scratch.
// ASYNC_TILES: K/V tiles copied with cp.async, waited for with wait_all (v5); otherwise plain 16-byte loads, for
// a kernel whose other cp.async copies must stay in flight (v2). Returns true in the block that finished the
// head: the only split, or the last split to arrive, which combines them.
template <bool ASYNC_TILES>
__device__ bool attention_item(const Params& p, int layer, int kvh, int split, int splits, float* smem, int seq = 0) {
  const LayerWeights& lw = p.layers[layer];
  float* trace = layer_trace(p, layer, seq);
  // the thread's index through thread_index: a hybrid's batch build reads it in place (common.cuh says why)
  const int lane = thread_index() & 31, warp = thread_index() >> 5;
  const int cache_pos = (int)p.cache_pos[seq];
  const int ctx = cache_pos + 1;
#if HAS_SLIDING_WINDOW
  const int first = ATTN_WINDOW[layer] ? max(0, ctx - ATTN_WINDOW[layer]) : 0;  // the oldest row this layer reads
#else
  constexpr int first = 0;
#endif
  const int chunk = (ctx - first + splits - 1) / splits;
  const int pos[3] = {(int)p.pos_t[seq], (int)p.pos_h[seq], (int)p.pos_w[seq]};
  const RopeLength rope_length = decode_rope_length(p, pos[0]);
#if HAS_SLIDING_WINDOW
  // a full layer's rows a kv head (the decoder's positions, a batch's spare row included), a sliding layer's ring; the
  // layout is constants.cuh's (KV_FULL_BEFORE), found by arithmetic: a pointer loaded from a table costs registers
  const int full = (int)p.max_seq, ring = min(KV_RING_ROWS, full);
  const int rows = ATTN_WINDOW[layer] ? ring : full;
  const size_t head_stride = (size_t)rows * HD;
  const size_t before = (size_t)KV_FULL_BEFORE[layer] * full + (size_t)(layer - KV_FULL_BEFORE[layer]) * ring;
  const size_t sequence_rows = (size_t)KV_FULL_LAYERS * full + (size_t)(L - KV_FULL_LAYERS) * ring;
  bf16* k_layer = p.k_cache + ((size_t)seq * sequence_rows + before) * NKV * HD;  // [sequence][layer][kv head][row]
  bf16* v_layer = p.v_cache + ((size_t)seq * sequence_rows + before) * NKV * HD;
#else
  const int rows = (int)p.max_seq;
  const size_t head_stride = (size_t)p.max_seq * HD;
  bf16* k_layer = p.k_cache + ((size_t)seq * L + layer) * NKV * head_stride;  // [sequence][layer][kv head][position]
  bf16* v_layer = p.v_cache + ((size_t)seq * L + layer) * NKV * head_stride;
#endif
  const float* qkv = p.qkv + seq * QKV_STRIDE;
  float* attn_out = p.attn_out + seq * Q_ROWS;
  float* attn_part = p.attn_part + (size_t)seq * NH * ATTN_MAX_SPLITS * HD;
  float* attn_ml = p.attn_ml + seq * NH * ATTN_MAX_SPLITS * 2;
  unsigned* attn_counters = p.attn_counters + seq * NKV;
  float* q_s = smem + ATTN_SM_Q;          // [G][HD]
  float* score = smem + ATTN_SM_SCORE;    // [G][ATTN_TILE]
  float* m_s = smem + ATTN_SM_STATE;      // [G] running max
  float* l_s = m_s + G;                   // [G] running sum of exp
  float* rescale = l_s + G;               // [G] factor for the accumulators when the max moves
  float* pv = smem + ATTN_SM_PV;          // [THREADS] partial sums of PV_GROUPS
  bf16* k_s = reinterpret_cast<bf16*>(smem + ATTN_SM_KV);  // [ATTN_TILE][HD]
  bf16* v_s = k_s + ATTN_TILE * HD;                        // [ATTN_TILE][HD]
  __shared__ int is_last;
  // A thread owns output (head j, dim d) of ATTN_OUT_PER_THREAD outputs, over positions group, group+PV_GROUPS, ...
  const int group = thread_index() / (G * HD < THREADS ? G * HD : THREADS);
  const bool pv_active = group < PV_GROUPS;  // when G * HD does not divide THREADS, the rest sit out

  {
    const int t0 = first + split * chunk, t1 = min(ctx, t0 + chunk);
    bf16* kh = k_layer + kvh * head_stride;
    bf16* vh = v_layer + kvh * head_stride;
    float o[ATTN_OUT_PER_THREAD];
#pragma unroll
    for (int e = 0; e < ATTN_OUT_PER_THREAD; ++e) o[e] = 0.f;
    if (thread_index() < G) {
      m_s[thread_index()] = -INFINITY;
      l_s[thread_index()] = 0.f;
    }

    for (int base = t0; base < t1; base += ATTN_TILE) {
      const int n = min(ATTN_TILE, t1 - base);
      const bool has_new = base <= cache_pos && cache_pos < base + n;
      // Start copying the tile's cached K and V into shared memory; this step's k/v are made below.
      for (int u = thread_index(); u < n * (HD / 8); u += THREADS) {
        const int row = u / (HD / 8), col = (u % (HD / 8)) * 8;
        if (base + row == cache_pos) continue;
        const int at = cache_row(base + row, rows);  // a ring can wrap inside the tile
        if constexpr (ASYNC_TILES) {
          cp_async16(k_s + row * HD + col, kh + (size_t)at * HD + col);
          cp_async16(v_s + row * HD + col, vh + (size_t)at * HD + col);
        } else {
          *reinterpret_cast<uint4*>(k_s + row * HD + col) = __ldcg(reinterpret_cast<const uint4*>(kh + (size_t)at * HD + col));
          *reinterpret_cast<uint4*>(v_s + row * HD + col) = __ldcg(reinterpret_cast<const uint4*>(vh + (size_t)at * HD + col));
        }
      }
      // Meanwhile, warps 0..G-1 make the group's query heads (first tile only); warps G and G+1 this
      // step's k and v when the tile holds the new position (written to the cache and to the tile).
      for (int j = warp; j < G + 2; j += WARPS) {
        if (j < G ? base != t0 : !has_new) continue;
        float v[HEAD_SLOTS];
        int idx[HEAD_SLOTS];
        const int row = cache_pos - base;
        if (j < G) {
          const int head = kvh * G + j;
          if constexpr (QK_NORM_PROJECTION)
            prepare_projection_head<Q_ROWS>(qkv + head * HD, qkv, lw.q_norm + head * HD, pos, rope_length, layer, lane,
                                            v, idx);
          else prepare_head(qkv + head * HD, lw.q_norm, pos, rope_length, layer, lane, v, idx);
#pragma unroll
          for (int e = 0; e < HEAD_SLOTS; ++e)
            if (head_slot_valid(lane, e)) q_s[j * HD + idx[e]] = v[e];
#if MK_TRACE
          if (split == 0)
            for (int e = 0; e < HEAD_SLOTS; ++e)
              if (head_slot_valid(lane, e)) trace[TRACE_Q + head * HD + idx[e]] = v[e];
#endif
        } else if (j == G) {
          const int at = cache_row(cache_pos, rows);
          if constexpr (QK_NORM_PROJECTION)
            prepare_projection_head<KV_ROWS>(qkv + Q_ROWS + kvh * HD, qkv + Q_ROWS, lw.k_norm + kvh * HD, pos,
                                             rope_length, layer, lane, v, idx);
          else prepare_head(qkv + Q_ROWS + kvh * HD, lw.k_norm, pos, rope_length, layer, lane, v, idx);
#pragma unroll
          for (int e = 0; e < HEAD_SLOTS; ++e) {
            if (!head_slot_valid(lane, e)) continue;
            const bf16 kb = __float2bfloat16(v[e]);
            kh[(size_t)at * HD + idx[e]] = kb;
            k_s[row * HD + idx[e]] = kb;
          }
#if MK_TRACE
          for (int e = 0; e < HEAD_SLOTS; ++e)
            if (head_slot_valid(lane, e)) trace[TRACE_K + kvh * HD + idx[e]] = v[e];
#endif
        } else {
          const int at = cache_row(cache_pos, rows);
          head_lane_index(lane, idx);
#pragma unroll
          for (int e = 0; e < HEAD_SLOTS; ++e) {
            if (!head_slot_valid(lane, e)) continue;
            const bf16 vb = __float2bfloat16(load_shared_state(qkv + Q_ROWS + KV_ROWS + kvh * HD + idx[e]));
            vh[(size_t)at * HD + idx[e]] = vb;
            v_s[row * HD + idx[e]] = vb;
          }
        }
      }
      if constexpr (ASYNC_TILES) cp_async_wait_all();
      block_sync();
      if (base == t0) STAMP(p, layer, ATTN_TILE_READY);
      // Scores: one warp per position, a lane holds HEAD_E contiguous elements of k.
      for (int tt = warp; tt < n; tt += WARPS) {
        float k[HEAD_E];
        if constexpr (HEAD_E % 2 == 0) {
#pragma unroll
          for (int e = 0; e < HEAD_E; e += 2) {
            const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(k_s + tt * HD + lane * HEAD_E + e));
            k[e] = kk.x;
            k[e + 1] = kk.y;
          }
        } else {  // head_dim 96: three elements a lane, not 4-byte aligned in every lane
#pragma unroll
          for (int e = 0; e < HEAD_E; ++e) k[e] = bf2f(k_s[tt * HD + lane * HEAD_E + e]);
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < HEAD_E; ++e) s = fmaf(q_s[j * HD + lane * HEAD_E + e], k[e], s);
          s = warp_sum(s);
          // gemma2's soft-cap, c * tanh(s / c), on the scaled score as transformers applies it
          if constexpr (HAS_ATTN_SOFTCAP) {
            if (lane == 0) score[j * ATTN_TILE + tt] = tanhf(s * ATTN_SCALE / ATTN_SOFTCAP) * ATTN_SOFTCAP;
          } else {
            if (lane == 0) score[j * ATTN_TILE + tt] = s * ATTN_SCALE;
          }
        }
      }
      block_sync();
      // Online softmax bookkeeping, one warp per query head.
      for (int j = warp; j < G; j += WARPS) {
        float mx = -INFINITY;
        for (int tt = lane; tt < n; tt += 32) mx = fmaxf(mx, score[j * ATTN_TILE + tt]);
        mx = warp_max(mx);
        const float m_old = m_s[j], m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        for (int tt = lane; tt < n; tt += 32) {
          const float e = expf(score[j * ATTN_TILE + tt] - m_new);
          score[j * ATTN_TILE + tt] = e;
          sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();  // every lane has read m_s[j] before lane 0 replaces it (racecheck flagged the pair)
        if (lane == 0) {
          rescale[j] = expf(m_old - m_new);
          m_s[j] = m_new;
          l_s[j] = l_s[j] * rescale[j] + sum;
        }
      }
      block_sync();
      // Probabilities times V from shared memory; PV_GROUPS threads split the positions of one output.
#pragma unroll
      for (int e = 0; e < ATTN_OUT_PER_THREAD; ++e) {
        const int idx = (thread_index() % (G * HD < THREADS ? G * HD : THREADS)) + e * THREADS;
        if (pv_active && idx < G * HD) {
          const int j = idx / HD, d = idx % HD;
          float acc = o[e] * rescale[j];
          float acc4[4] = {0.f, 0.f, 0.f, 0.f};  // independent chains hide shared-memory latency
          int tt = group;
          for (; tt + 3 * PV_GROUPS < n; tt += 4 * PV_GROUPS)
#pragma unroll
            for (int q = 0; q < 4; ++q)
              acc4[q] = fmaf(score[j * ATTN_TILE + tt + q * PV_GROUPS], bf2f(v_s[(tt + q * PV_GROUPS) * HD + d]), acc4[q]);
          for (; tt < n; tt += PV_GROUPS) acc4[0] = fmaf(score[j * ATTN_TILE + tt], bf2f(v_s[tt * HD + d]), acc4[0]);
          o[e] = acc + ((acc4[0] + acc4[1]) + (acc4[2] + acc4[3]));
        }
      }
      block_sync();  // the next tile overwrites k_s, v_s and the scores
    }

    // Sum the position groups: thread (group 0, output) ends with the whole accumulator.
    if constexpr (PV_GROUPS > 1) {
      pv[thread_index()] = o[0];
      block_sync();
      if (group == 0)
        for (int g2 = 1; g2 < PV_GROUPS; ++g2) o[0] += pv[thread_index() + g2 * G * HD];
    }
    STAMP(p, layer, ATTN_COMPUTED);
    if (splits == 1) {  // the whole sequence in one block: no partials to combine
      if (group == 0) {
#pragma unroll
        for (int e = 0; e < ATTN_OUT_PER_THREAD; ++e) {
          const int idx = thread_index() + e * THREADS;
          if (idx < G * HD) {
            float out = o[e] / l_s[idx / HD];
            if constexpr (HAS_ATTN_OUTPUT_GATE) out *= output_gate(qkv, kvh * G * HD + idx);
            attn_out[kvh * G * HD + idx] = out;
#if MK_TRACE
            trace[TRACE_ATTN + kvh * G * HD + idx] = out;
#endif
          }
        }
      }
      block_sync();
      return true;
    }

    // This split's partial result; the last split of the head to finish combines all of them.
    if (group == 0) {
#pragma unroll
      for (int e = 0; e < ATTN_OUT_PER_THREAD; ++e) {
        const int idx = thread_index() + e * THREADS;
        if (idx < G * HD) {
          const int head = kvh * G + idx / HD;
          attn_part[((size_t)head * ATTN_MAX_SPLITS + split) * HD + idx % HD] = o[e];
        }
      }
    }
    if (thread_index() < G) {
      const int head = kvh * G + thread_index();
      attn_ml[(head * ATTN_MAX_SPLITS + split) * 2] = m_s[thread_index()];
      attn_ml[(head * ATTN_MAX_SPLITS + split) * 2 + 1] = l_s[thread_index()];
    }
    // One thread publishes the block's partials (cumulative over the barrier) and, when last, makes the other
    // splits' visible before the block reads them: one atomic with release and acquire, as cooperative groups' grid
    // barrier arrives (v7's sequentially consistent fence on each side of a relaxed atomic was slower).
    block_sync();
    if (thread_index() == 0) {
      unsigned arrived;
      asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(attn_counters + kvh) : "memory");
      is_last = arrived == (unsigned)(splits - 1);
    }
    block_sync();
    STAMP(p, layer, ATTN_COUNTED);
    if (is_last) {
      // every split's max and sum of the group's heads into shared memory in one wave of loads, where the block's
      // threads cover them (ATTN_MAX_SPLITS keeps it so up to 16 query heads a KV head); batch 1 only: a batch's
      // build spilled with the wave's registers (and its splits are fewer)
      const bool waves = BATCH == 1 && G * splits * 2 <= THREADS;
      if (waves) {
        for (int i = thread_index(); i < G * splits * 2; i += THREADS)
          pv[i] = load_shared_state(attn_ml + (kvh * G + i / (2 * splits)) * ATTN_MAX_SPLITS * 2 + i % (2 * splits));
        block_sync();
      }
      for (int idx = thread_index(); idx < G * HD; idx += THREADS) {
        const int head = kvh * G + idx / HD, d = idx % HD;
        float num = 0.f, den = 0.f;
        if (waves) {  // then each output's partials, COMBINE_WAVE in flight at once, summed in v7's order
          const float* ml = pv + (idx / HD) * splits * 2;
          float m_max = -INFINITY;
          for (int s = 0; s < splits; ++s) m_max = fmaxf(m_max, ml[s * 2]);
          for (int s0 = 0; s0 < splits; s0 += COMBINE_WAVE) {
            float part[COMBINE_WAVE];
#pragma unroll
            for (int s = 0; s < COMBINE_WAVE; ++s)
              if (s0 + s < splits) part[s] = load_shared_state(attn_part + ((size_t)head * ATTN_MAX_SPLITS + s0 + s) * HD + d);
#pragma unroll
            for (int s = 0; s < COMBINE_WAVE; ++s) {
              if (s0 + s < splits) {
                const float w = expf(ml[(s0 + s) * 2] - m_max);
                num = fmaf(w, part[s], num);
                den = fmaf(w, ml[(s0 + s) * 2 + 1], den);
              }
            }
          }
        } else {  // the maxima, then each split's weight, partial and sum, loop by loop
          float m_max = -INFINITY;
          for (int s = 0; s < splits; ++s) m_max = fmaxf(m_max, load_shared_state(attn_ml + (head * ATTN_MAX_SPLITS + s) * 2));
          for (int s = 0; s < splits; ++s) {
            const float w = expf(load_shared_state(attn_ml + (head * ATTN_MAX_SPLITS + s) * 2) - m_max);
            num = fmaf(w, load_shared_state(attn_part + ((size_t)head * ATTN_MAX_SPLITS + s) * HD + d), num);
            den = fmaf(w, load_shared_state(attn_ml + (head * ATTN_MAX_SPLITS + s) * 2 + 1), den);
          }
        }
        if constexpr (HAS_ATTN_OUTPUT_GATE) {
          const float out = num / den * output_gate(qkv, head * HD + d);
          attn_out[head * HD + d] = out;
#if MK_TRACE
          trace[TRACE_ATTN + head * HD + d] = out;
#endif
        } else {
          attn_out[head * HD + d] = num / den;
#if MK_TRACE
          trace[TRACE_ATTN + head * HD + d] = num / den;
#endif
        }
      }
      if (thread_index() == 0) attn_counters[kvh] = 0u;  // ready for the next layer
    }
    block_sync();
    return is_last;
  }
}

// v5: the items (sequence, kv head, split), numbered sequence after sequence, strided over the grid between two
// grid barriers.
__device__ void attention_phase(const Params& p, int layer, float* smem) {
  if constexpr (BATCH == 1) {  // sequence 0 as a constant: its buffers' offsets fold away (registers for head_dim 256)
    const int splits = (int)p.attn_splits[0];
    for (int item = blockIdx.x; item < NKV * splits; item += GRID) attention_item<true>(p, layer, item / splits, item % splits, splits, smem);
    return;
  }
  int seq = 0, first = 0;  // the sequence of the item and the number of its first item
  for (int item = blockIdx.x;; item += GRID) {
    while (seq < BATCH && item >= first + NKV * (int)p.attn_splits[seq]) first += NKV * (int)p.attn_splits[seq++];
    if (seq == BATCH) return;
    const int splits = (int)p.attn_splits[seq], local = item - first;
    attention_item<true>(p, layer, local / splits, local % splits, splits, smem, seq);
  }
}

// Output projection and residual: x += Wo . attn (post-norm layers: Wo . attn to p.sub).
__device__ void o_proj_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  float* trace = layer_trace(p, layer);
  if constexpr (BATCH > 1) {  // the attention outputs straight from global memory
    residual_matvec<Q_ROWS, H, 1, Q_ROWS>(lw.wo, p.attn_out, sublayer_dst(p), trace + TRACE_ATTN_RESIDUAL);
  } else {
    vector_to_smem<Q_ROWS>(p.attn_out, smem);
    STAMP(p, layer, O_PROJ_INPUT);
    residual_matvec<Q_ROWS, H, SPLIT_K_O_PROJ, Q_ROWS>(lw.wo, smem, sublayer_dst(p), trace + TRACE_ATTN_RESIDUAL);
  }
}
