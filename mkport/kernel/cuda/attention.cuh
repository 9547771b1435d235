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
// A thread's outputs come in units of PV_WIDTH adjacent dims of one head, read from V in one load: unit
// thread_index() + k * THREADS; when there are fewer units than threads, PV_GROUPS threads share a unit, each over its
// own positions. Pairs only where every thread has two outputs anyway: a batch's build spilled with a second one.
constexpr int PV_WIDTH = G * HD > THREADS ? 2 : 1;
constexpr int OUT_UNITS = G * HD / PV_WIDTH;
constexpr int PV_GROUPS = THREADS >= OUT_UNITS ? THREADS / OUT_UNITS : 1;
static_assert(ATTN_OUT_PER_THREAD == PV_WIDTH * ((OUT_UNITS + THREADS - 1) / THREADS), "the plan's outputs a thread");
// Query heads the scores' warps hold in registers at once (HEAD_E floats a head a lane): up to 16 floats
constexpr int Q_HEADS = G < 16 / HEAD_E ? G : (HEAD_E > 16 ? 1 : 16 / HEAD_E);
static_assert(ATTN_SM_KV * 4 + 2 * ATTN_TILE * HD * 2 <= SMEM_BYTES, "attention tiles fit the plan's smem");
static_assert(ATTN_MAX_SPLITS * G <= ATTN_TILE && G * ATTN_MAX_SPLITS * 2 <= THREADS,
              "the combine's partials fit the tiles' shared memory, their maxima and sums the PV sums'");

// Output (head * HD + dim) of a thread's output slot e, or -1 where the thread has none.
__device__ __forceinline__ int pv_output(int e) {
  const int unit = (PV_GROUPS > 1 ? thread_index() % OUT_UNITS : thread_index()) + (e / PV_WIDTH) * THREADS;
  return unit < OUT_UNITS ? PV_WIDTH * unit + e % PV_WIDTH : -1;
}

// A lane's HEAD_E contiguous elements of a K row in shared memory, in the widest loads their alignment allows.
__device__ __forceinline__ void load_k_slice(const bf16* src, float (&k)[HEAD_E]) {
  if constexpr (HEAD_E % 4 == 0) {  // 16 bytes (head_dim 256) or 8 (128) a load
    constexpr int E = HEAD_E % 8 == 0 ? 8 : 4;
#pragma unroll
    for (int e0 = 0; e0 < HEAD_E; e0 += E) {
      __nv_bfloat162 h[E / 2];
      if constexpr (E == 8) *reinterpret_cast<uint4*>(h) = *reinterpret_cast<const uint4*>(src + e0);
      else *reinterpret_cast<uint2*>(h) = *reinterpret_cast<const uint2*>(src + e0);
#pragma unroll
      for (int i = 0; i < E / 2; ++i) {
        const float2 kk = __bfloat1622float2(h[i]);
        k[e0 + 2 * i] = kk.x;
        k[e0 + 2 * i + 1] = kk.y;
      }
    }
  } else if constexpr (HEAD_E % 2 == 0) {
#pragma unroll
    for (int e = 0; e < HEAD_E; e += 2) {
      const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + e));
      k[e] = kk.x;
      k[e + 1] = kk.y;
    }
  } else {  // head_dim 96: three elements a lane, not 4-byte aligned in every lane
#pragma unroll
    for (int e = 0; e < HEAD_E; ++e) k[e] = bf2f(src[e]);
  }
}

// Start copying positions [base, base + n) of one KV head's cache (`head`, `rows` rows) into a shared-memory tile, all
// but `skip` (this step's, which the block writes itself), as one cp.async group (an empty one when n <= 0).
__device__ __forceinline__ void copy_kv_tile(bf16* tile, const bf16* head, int base, int n, int skip, int rows) {
#pragma unroll 1
  for (int u = thread_index(); u < n * (HD / 8); u += THREADS) {
    const int row = u / (HD / 8), col = (u % (HD / 8)) * 8;
    if (base + row != skip) cp_async16(tile + row * HD + col, head + (size_t)cache_row(base + row, rows) * HD + col);
  }
  cp_async_commit();
}

// One work item of attention: sequence seq of the batch, kv head kvh, positions of split `split` of `splits`, with
// `smem` as its scratch. The K and V tiles are copied with cp.async, each as its own group: a tile's scores wait for
// its K only, and the next tile's K is copied in during this tile's softmax and PV, its V during the next scores.
// Returns true in the block that finished the head: the only split, or the last split to arrive, which combines them.
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
  const int group = PV_GROUPS > 1 ? thread_index() / OUT_UNITS : 0;
  const bool pv_active = group < PV_GROUPS;  // when OUT_UNITS does not divide THREADS, the rest sit out

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

    const int n0 = min(ATTN_TILE, t1 - t0);
    copy_kv_tile(k_s, kh, t0, n0, cache_pos, rows);
    copy_kv_tile(v_s, vh, t0, n0, cache_pos, rows);
    // While the first tile's cached K and V come in, warps 0..G-1 make the group's query heads, warps G and G+1 this
    // step's k and v when the split holds the new position: written to the cache, where a later tile's copy finds
    // them (issued after the first tile's barrier), and into the first tile when it is there.
    const bool has_new = t0 <= cache_pos && cache_pos < t1;
    const int new_row = cache_pos - t0;
    for (int j = warp; j < G + 2; j += WARPS) {
      if (j >= G && !has_new) continue;
      float v[HEAD_SLOTS];
      int idx[HEAD_SLOTS];
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
          if (new_row < n0) k_s[new_row * HD + idx[e]] = kb;
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
          if (new_row < n0) v_s[new_row * HD + idx[e]] = vb;
        }
      }
    }
    for (int base = t0; base < t1; base += ATTN_TILE) {
      const int n = min(ATTN_TILE, t1 - base);
      const int next = base + ATTN_TILE, next_n = min(ATTN_TILE, t1 - next);
      cp_async_wait_group<1>();  // this tile's K (its V may still be coming)
      block_sync();
      if (base == t0) STAMP(p, layer, ATTN_TILE_READY);
      // Scores: one warp per position, a lane holds HEAD_E contiguous elements of k, and of Q_HEADS query heads at a
      // time (from shared memory once a tile, in registers only through their pass: all G at head_dim 256 spilled).
      for (int j0 = 0; j0 < G; j0 += Q_HEADS) {
        float q[Q_HEADS][HEAD_E];
#pragma unroll
        for (int jj = 0; jj < Q_HEADS; ++jj)
#pragma unroll
          for (int e = 0; e < HEAD_E; ++e) q[jj][e] = j0 + jj < G ? q_s[(j0 + jj) * HD + lane * HEAD_E + e] : 0.f;
        for (int tt = warp; tt < n; tt += WARPS) {
          float k[HEAD_E];
          load_k_slice(k_s + tt * HD + lane * HEAD_E, k);
#pragma unroll
          for (int jj = 0; jj < Q_HEADS; ++jj) {
            const int j = j0 + jj;
            if (j >= G) break;
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < HEAD_E; ++e) s = fmaf(q[jj][e], k[e], s);
            s = warp_sum(s);
            // gemma2's soft-cap, c * tanh(s / c), on the scaled score as transformers applies it
            if constexpr (HAS_ATTN_SOFTCAP) {
              if (lane == 0) score[j * ATTN_TILE + tt] = tanhf(s * ATTN_SCALE / ATTN_SOFTCAP) * ATTN_SOFTCAP;
            } else {
              if (lane == 0) score[j * ATTN_TILE + tt] = s * ATTN_SCALE;
            }
          }
        }
      }
      block_sync();  // the scores are written and the K tile read: the next tile's K comes in
      copy_kv_tile(k_s, kh, next, next_n, -1, rows);
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
      cp_async_wait_group<1>();  // this tile's V (the next tile's K may still be coming)
      block_sync();
      // Probabilities times V from shared memory, PV_WIDTH dims at a time; PV_GROUPS threads split the positions.
#pragma unroll
      for (int e = 0; e < ATTN_OUT_PER_THREAD; e += PV_WIDTH) {
        const int idx = pv_output(e);
        if (pv_active && idx >= 0) {
          const int j = idx / HD, d = idx % HD;
          constexpr int CHAINS = 4 / PV_WIDTH;  // four independent chains of sums in all hide shared-memory latency
          float acc[PV_WIDTH][CHAINS] = {};
          auto add = [&](int tt, int c) {
            const float w = score[j * ATTN_TILE + tt];
            if constexpr (PV_WIDTH == 2) {
              const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(v_s + tt * HD + d));
              acc[0][c] = fmaf(w, v.x, acc[0][c]);
              acc[1][c] = fmaf(w, v.y, acc[1][c]);
            } else {
              acc[0][c] = fmaf(w, bf2f(v_s[tt * HD + d]), acc[0][c]);
            }
          };
          int tt = group;
          for (; tt + (CHAINS - 1) * PV_GROUPS < n; tt += CHAINS * PV_GROUPS)
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) add(tt + c * PV_GROUPS, c);
          for (; tt < n; tt += PV_GROUPS) add(tt, 0);
#pragma unroll
          for (int h = 0; h < PV_WIDTH; ++h) {
            float sum;
            if constexpr (CHAINS == 4) sum = (acc[h][0] + acc[h][1]) + (acc[h][2] + acc[h][3]);
            else sum = acc[h][0] + acc[h][1];
            o[e + h] = o[e + h] * rescale[j] + sum;
          }
        }
      }
      block_sync();  // the next tile overwrites the scores, and from here its V comes in
      copy_kv_tile(v_s, vh, next, next_n, -1, rows);
    }

    // Sum the position groups, an output slot at a time: thread (group 0, unit) ends with the whole accumulators.
    if constexpr (PV_GROUPS > 1) {
#pragma unroll
      for (int e = 0; e < PV_WIDTH; ++e) {
        pv[thread_index()] = o[e];
        block_sync();
        if (group == 0)
          for (int g2 = 1; g2 < PV_GROUPS; ++g2) o[e] += pv[thread_index() + g2 * OUT_UNITS];
        if (PV_WIDTH > 1) block_sync();  // before the next slot's partials replace these
      }
    }
    STAMP(p, layer, ATTN_COMPUTED);
    if (splits == 1) {  // the whole sequence in one block: no partials to combine
      if (group == 0) {
#pragma unroll
        for (int e = 0; e < ATTN_OUT_PER_THREAD; ++e) {
          const int idx = pv_output(e);
          if (idx >= 0) {
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
        const int idx = pv_output(e);
        if (idx >= 0) {
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
      // Every split's partials of the group's heads copied into shared memory at once (where the K/V tiles were:
      // launch_plan bounds the splits so that they fit), and their maxima and sums loaded meanwhile; both keep the
      // global layout, [G heads][ATTN_MAX_SPLITS], whose first `splits` of each head are this step's.
      const float* group_part = attn_part + (size_t)kvh * G * ATTN_MAX_SPLITS * HD;
      float* part_s = smem + ATTN_SM_KV;
#pragma unroll 1
      for (int u = thread_index(); u < G * ATTN_MAX_SPLITS * (HD / 4); u += THREADS)
        if (u / (HD / 4) % ATTN_MAX_SPLITS < splits) cp_async16(part_s + 4 * u, group_part + 4 * u);
      if (const int i = thread_index(); i < G * ATTN_MAX_SPLITS * 2 && i % (ATTN_MAX_SPLITS * 2) < 2 * splits)
        pv[i] = load_shared_state(attn_ml + kvh * G * ATTN_MAX_SPLITS * 2 + i);
      cp_async_wait_all();
      block_sync();
      for (int idx = thread_index(); idx < G * HD; idx += THREADS) {
        const int head = kvh * G + idx / HD, d = idx % HD;
        const float* ml = pv + (idx / HD) * ATTN_MAX_SPLITS * 2;  // split s: its max at 2s, its sum at 2s + 1
        const float* part = part_s + (idx / HD) * ATTN_MAX_SPLITS * HD + d;
        float m_max = -INFINITY;
        for (int s = 0; s < splits; ++s) m_max = fmaxf(m_max, ml[s * 2]);
        float num = 0.f, den = 0.f;
        for (int s = 0; s < splits; ++s) {
          const float w = expf(ml[s * 2] - m_max);
          num = fmaf(w, part[s * HD], num);
          den = fmaf(w, ml[s * 2 + 1], den);
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
    for (int item = blockIdx.x; item < NKV * splits; item += GRID)
      attention_item(p, layer, item / splits, item % splits, splits, smem);
    return;
  }
  int seq = 0, first = 0;  // the sequence of the item and the number of its first item
  for (int item = blockIdx.x;; item += GRID) {
    while (seq < BATCH && item >= first + NKV * (int)p.attn_splits[seq]) first += NKV * (int)p.attn_splits[seq++];
    if (seq == BATCH) return;
    const int splits = (int)p.attn_splits[seq], local = item - first;
    attention_item(p, layer, local / splits, local % splits, splits, smem, seq);
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
