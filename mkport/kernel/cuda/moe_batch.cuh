// A batch's sparse layer (BATCH > 1; moe.cuh has the design and batch 1): the routing of every sequence, the union of
// their experts, and the union's gate/up and down tiles on tensor cores. Shared memory after MOE_SM, in 4-byte words:
// launch_plan.moe_routing_layout (MOE_*_AT).
#pragma once

static_assert(MOE_WARP_COUNTS_AT + WARPS == MOE_WORDS_AT && WARPS <= 32, "the prefix sum's counts: a word a warp");

__device__ __forceinline__ float* moe_logits(float* smem) { return smem + MOE_SM + MOE_LOGITS_AT; }  // [BATCH][EXPERTS]
__device__ __forceinline__ int* moe_slots(float* smem) {  // [BATCH][EXPERTS]: rank, then slot among the chosen or -1
  return reinterpret_cast<int*>(smem + MOE_SM + MOE_SLOT_AT);
}
__device__ __forceinline__ int* moe_chosen(float* smem) {  // [BATCH][TOP_K]: the chosen experts, ascending
  return reinterpret_cast<int*>(smem + MOE_SM + MOE_EXPERTS_AT);
}
__device__ __forceinline__ float* moe_weights(float* smem) { return smem + MOE_SM + MOE_WEIGHTS_AT; }  // [BATCH][TOP_K]
__device__ __forceinline__ int* moe_union(float* smem) { return reinterpret_cast<int*>(smem + MOE_SM + MOE_UNION_AT); }
__device__ __forceinline__ unsigned* moe_masks(float* smem) {  // [EXPERTS]: bit b set where sequence b chose union[u]
  return reinterpret_cast<unsigned*>(smem + MOE_SM + MOE_MASK_AT);
}
__device__ __forceinline__ int* moe_warp_counts(float* smem) {  // [WARPS], an array of its own
  return reinterpret_cast<int*>(smem + MOE_SM + MOE_WARP_COUNTS_AT);
}

// Experts in the union: the sum of the warps' counts (the same in every thread, the same order).
__device__ __forceinline__ int union_size(float* smem) {
  const int* counts = moe_warp_counts(smem);
  int total = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += counts[w];
  return total;
}

// Every sequence's routing, as route() does batch 1's (softmax in fp32, top-k by rank with ties to the lower index,
// ascending index, NORM_TOPK), then the union. Every block computes it from the same logits in the same order.
__device__ void route_batch(const Params& p, int layer, float* smem) {
  constexpr int ITEMS = BATCH * EXPERTS, PER = (ITEMS + THREADS - 1) / THREADS;
  float* logit = moe_logits(smem);
  int* slot = moe_slots(smem);
  int* chosen = moe_chosen(smem);
  for (int i = thread_index(); i < ITEMS; i += THREADS) logit[i] = load_state_now(p.router_logits + i);
  block_sync();
  for (int i = thread_index(); i < ITEMS; i += THREADS) {  // rank: the sequence's experts above this one
    const float* row = logit + i / EXPERTS * EXPERTS;
    const float l = logit[i];
    const int e = i % EXPERTS;
    int above = 0;
    for (int f = 0; f < EXPERTS; ++f) above += row[f] > l || (row[f] == l && f < e);
    slot[i] = above;
  }
  block_sync();
  int mine[PER];  // the slot among the sequence's chosen experts (those below it chosen), or -1; all read, then written
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = thread_index() + k * THREADS;
    mine[k] = -1;
    if (i < ITEMS && slot[i] < TOP_K) {
      const int* row = slot + i / EXPERTS * EXPERTS;
      int below = 0;
      for (int f = 0; f < i % EXPERTS; ++f) below += row[f] < TOP_K;
      mine[k] = below;
    }
  }
  block_sync();
#if MK_TRACE
  float* trace_b0 = layer_trace(p, layer);  // sequence b's: trace_b0 + b * TRACE_TOTAL
#endif
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = thread_index() + k * THREADS;
    if (i < ITEMS) {
      slot[i] = mine[k];
      if (mine[k] >= 0) chosen[i / EXPERTS * TOP_K + mine[k]] = i % EXPERTS;
#if MK_TRACE
      if (blockIdx.x == 0) {
        float* trace = trace_b0 + (size_t)(i / EXPERTS) * TRACE_TOTAL;
        trace[TRACE_ROUTER_LOGITS + i % EXPERTS] = logit[i];
        if (mine[k] >= 0) trace[TRACE_EXPERTS + mine[k]] = (float)(i % EXPERTS);
      }
#endif
    }
  }
  block_sync();
  const int warp = thread_index() >> 5, lane = thread_index() & 31;
  for (int b = warp; b < BATCH; b += WARPS) {  // a warp a sequence: the softmax's max and sum, then its weights
    const float* row = logit + b * EXPERTS;
    float m = -INFINITY, sum = 0.f;
    for (int f = lane; f < EXPERTS; f += 32) m = fmaxf(m, row[f]);
    m = warp_max(m);
    for (int f = lane; f < EXPERTS; f += 32) sum += expf(row[f] - m);
    sum = warp_sum(sum);
    float w = lane < TOP_K ? expf(row[chosen[b * TOP_K + lane]] - m) / sum : 0.f;
    if constexpr (NORM_TOPK) w /= warp_sum(w);
    if (lane < TOP_K) {
      moe_weights(smem)[b * TOP_K + lane] = w;
#if MK_TRACE
      if (blockIdx.x == 0) trace_b0[(size_t)b * TRACE_TOTAL + TRACE_EXPERT_WEIGHTS + lane] = w;
#endif
    }
  }
  // the union: thread e's mask of the sequences that chose expert e; its place is the experts below it in the union,
  // the counts of the warps before it (a prefix sum) and of the lanes before it in its own warp
  const int e = thread_index();
  unsigned mask = 0u;
  if (e < EXPERTS)
#pragma unroll
    for (int b = 0; b < BATCH; ++b) mask |= (unsigned)(slot[b * EXPERTS + e] >= 0) << b;
  const unsigned in_union = __ballot_sync(0xffffffffu, mask != 0u);
  int* counts = moe_warp_counts(smem);
  if (lane == 0) counts[warp] = __popc(in_union);
  block_sync();
  if (mask != 0u) {
    int at = __popc(in_union & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) at += counts[w];
    moe_union(smem)[at] = e;
    moe_masks(smem)[at] = mask;
  }
  block_sync();
}

// Slices of k a batched expert matvec takes in one block, chosen for `tiles` tiles of 16 rows: doubled while they still
// fit the grid's warps (mma_slices' rule), k in steps of MMA_K.
__host__ __device__ constexpr int expert_slices(int tiles, int k_steps) {
  int s = 1;
  while (s * 2 <= WARPS && tiles * s * 2 <= GRID_WARPS && k_steps % (s * 2) == 0) s *= 2;
  return s;
}

// A step of 32 k of a tile: the weights of rows g and g + 8 (w_top, w_bottom, this lane's 16 bytes), each n8 tile's
// sequence's inputs at x[j] (this lane's 8 floats; null: zeros, a sequence that did not choose the expert).
__device__ __forceinline__ void expert_mma_step(float (&acc)[MMA_NTILES][4], const uint4& wt, const uint4& wb,
                                                const float* const (&x)[MMA_NTILES]) {
#pragma unroll
  for (int j = 0; j < MMA_NTILES; ++j) {
    float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
    if (x[j] != nullptr) {
      x0 = __ldcg(reinterpret_cast<const float4*>(x[j]));
      x1 = __ldcg(reinterpret_cast<const float4*>(x[j] + 4));
    }
    mma_k32(acc[j], wt, wb, x0, x1);
  }
}


// The gate/up phase of a batch: the routing and union, the shared expert's act, then the union's gate and up rows on
// tensor cores: tile t of union expert u pairs its gate rows 8t .. 8t + 7 with the same up rows, for every sequence's
// normed input (in shared memory since the router phase); a sequence that chose the expert keeps
// weight * act(gate) * up in its slot of act (MOE_ACT floats a sequence), as batch 1's down input.
__device__ void batch_gate_up(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  route_batch(p, layer, smem);
  if (p.experts_read != nullptr && blockIdx.x == 0 && thread_index() == 0) p.experts_read[layer] += union_size(smem);
  if constexpr (SHARED_I > 0) {  // sigmoid(its gate) * act(gate) * up, after the routed experts' inputs
    for (int i = blockIdx.x * THREADS + thread_index(); i < BATCH * SHARED_I; i += GRID * THREADS) {
      const float* raw = p.act + (size_t)(i / SHARED_I) * MOE_ACT + SHARED_AT;
      const int j = i % SHARED_I;
      const float gate = sigmoid(load_shared_state(raw + 2 * SHARED_I));
      p.act[(size_t)(i / SHARED_I) * MOE_ACT + TOP_K * EXPERT_I + j] =
          gate * act_times(load_shared_state(raw + j), load_shared_state(raw + SHARED_I + j));
    }
  }
  constexpr int EXPERT_TILES = EXPERT_I / 8;  // an expert's tiles of 8 gate and 8 up rows
  // slices for the smallest union (TOP_K experts): larger unions only take more rounds
  constexpr int S = expert_slices(TOP_K * EXPERT_TILES, H / MMA_K), TILES_A_BLOCK = WARPS / S, KS = H / S;
  constexpr int MAX_ROWS = EXPERTS * 2 * EXPERT_I;
  const int* uni = moe_union(smem);
  const unsigned* masks = moe_masks(smem);
  const int* slot = moe_slots(smem);
  const float* weight = moe_weights(smem);
  const int tiles = union_size(smem) * EXPERT_TILES;
  const auto row = [&](int r) {  // row r of the union's tiles: expert r / (2 * EXPERT_I), tile q / 16, gate or up
    const int u = r / (2 * EXPERT_I), q = r % (2 * EXPERT_I);
    return (q % 16 < 8 ? lw.expert_gate : lw.expert_up) + ((size_t)uni[u] * EXPERT_I + q / 16 * 8 + q % 8) * H;
  };
  float* part = smem + MMA_PART_AT;
  const int warp = thread_index() >> 5, lane = thread_index() & 31, g = lane >> 2, t = lane & 3;
  for (int first = blockIdx.x * TILES_A_BLOCK; first < tiles; first += GRID * TILES_A_BLOCK) {
    const int tile = first + warp / S, slice = warp % S;
    if (tile < tiles) {
      float acc[MMA_NTILES][4];
      mma_tile<H, MAX_ROWS, H, false>(row, tile * MMA_ROWS, slice * KS, (slice + 1) * KS, smem, acc);
      store_part(part + warp * MMA_PART_FLOATS, acc, g, t);
    }
    block_sync();
    for (int o = thread_index(); o < TILES_A_BLOCK * 8 * BATCH; o += THREADS) {
      const int seq = o % BATCH, pair = (o / BATCH) % 8, tile_in = o / (BATCH * 8), at = first + tile_in;
      if (at >= tiles) continue;
      const int u = at / EXPERT_TILES;
      if (!((masks[u] >> seq) & 1u)) continue;  // a sequence that did not choose this expert
      const float* tile_part = part + tile_in * S * MMA_PART_FLOATS;
      float gate = 0.f, up = 0.f;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        gate += tile_part[s * MMA_PART_FLOATS + pair * MMA_PART_COLS + seq];
        up += tile_part[s * MMA_PART_FLOATS + (pair + 8) * MMA_PART_COLS + seq];
      }
      const int k = slot[seq * EXPERTS + uni[u]];
      p.act[(size_t)seq * MOE_ACT + k * EXPERT_I + at % EXPERT_TILES * 8 + pair] =
          weight[seq * TOP_K + k] * act_times(gate, up);
    }
    block_sync();
  }
}

// The down phase of a batch: tiles of 16 output rows, each split over DS warps of a block by k. Step j (32 k) of
// expert e goes to slice (e * E_STEPS + j) % DS, a rule of e and j alone, so a sequence's partial sums hold its own
// experts' steps whatever the union; the warp walks the union in ascending index, the inputs of the sequences that did
// not choose an expert zero, then the shared expert's steps (slice j % DS) for every sequence; the slices' partial
// tiles are added in slice order. That a product with zero inputs leaves the accumulator's bits as they were (an
// mma of zeros adds exact zeros to C) is the one assumption behind "a sequence's bits do not depend on the others'
// experts"; a -0 sum could become +0.
__device__ void batch_down(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  static_assert(H % MMA_ROWS == 0, "whole tiles of output rows");
  constexpr int TILES = H / MMA_ROWS, E_STEPS = EXPERT_I / MMA_K, SH_STEPS = SHARED_I / MMA_K;
  constexpr int DS = expert_slices(TILES, 1 << 30), TILES_A_BLOCK = WARPS / DS;
  const int* uni = moe_union(smem);
  const unsigned* masks = moe_masks(smem);
  const int* slot = moe_slots(smem);
  const int count = union_size(smem);
  float* part = smem + MMA_PART_AT;
  const int warp = thread_index() >> 5, lane = thread_index() & 31, g = lane >> 2, t = lane & 3;
#if MK_TRACE
  float* trace_b0 = layer_trace(p, layer);
#endif
  for (int first = blockIdx.x * TILES_A_BLOCK; first < TILES; first += GRID * TILES_A_BLOCK) {
    const int tile = first + warp / DS, slice = warp % DS;
    if (tile < TILES) {
      const int r0 = tile * MMA_ROWS;
      float acc[MMA_NTILES][4];
#pragma unroll
      for (int j = 0; j < MMA_NTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      for (int u = 0; u < count; ++u) {
        const int e = uni[u];
        const unsigned mask = masks[u];
        const float* x[MMA_NTILES];
#pragma unroll
        for (int j = 0; j < MMA_NTILES; ++j) {
          const int seq = 8 * j + g;
          x[j] = seq < BATCH && ((mask >> seq) & 1u)
                     ? p.act + (size_t)seq * MOE_ACT + slot[seq * EXPERTS + e] * EXPERT_I + 8 * t
                     : nullptr;
        }
        const bf16* w_top = lw.expert_down + ((size_t)e * H + r0 + g) * EXPERT_I + 8 * t;
        const bf16* w_bottom = w_top + (size_t)8 * EXPERT_I;
#pragma unroll 2
        for (int step = ((slice - e * E_STEPS) % DS + DS) % DS; step < E_STEPS; step += DS) {
          const uint4 wt = load_weights16(w_top + step * MMA_K), wb = load_weights16(w_bottom + step * MMA_K);
          const float* xs[MMA_NTILES];
#pragma unroll
          for (int j = 0; j < MMA_NTILES; ++j) xs[j] = x[j] == nullptr ? nullptr : x[j] + step * MMA_K;
          expert_mma_step(acc, wt, wb, xs);
        }
      }
      if constexpr (SHARED_I > 0) {
        const float* x[MMA_NTILES];
#pragma unroll
        for (int j = 0; j < MMA_NTILES; ++j) {
          const int seq = 8 * j + g;
          x[j] = seq < BATCH ? p.act + (size_t)seq * MOE_ACT + TOP_K * EXPERT_I + 8 * t : nullptr;
        }
        const bf16* w_top = lw.w_down + (size_t)(r0 + g) * SHARED_I + 8 * t;
        const bf16* w_bottom = w_top + (size_t)8 * SHARED_I;
#pragma unroll 2
        for (int step = slice; step < SH_STEPS; step += DS) {
          const uint4 wt = load_weights16(w_top + step * MMA_K), wb = load_weights16(w_bottom + step * MMA_K);
          const float* xs[MMA_NTILES];
#pragma unroll
          for (int j = 0; j < MMA_NTILES; ++j) xs[j] = x[j] == nullptr ? nullptr : x[j] + step * MMA_K;
          expert_mma_step(acc, wt, wb, xs);
        }
      }
      store_part(part + warp * MMA_PART_FLOATS, acc, g, t);
    }
    block_sync();
    for (int o = thread_index(); o < TILES_A_BLOCK * MMA_ROWS * BATCH; o += THREADS) {
      const int seq = o % BATCH, r_in = (o / BATCH) % MMA_ROWS, tile_in = o / (BATCH * MMA_ROWS);
      if (first + tile_in >= TILES) continue;
      const int r = (first + tile_in) * MMA_ROWS + r_in;
      const float before = load_shared_state(p.x + seq * H + r);
      const float* tile_part = part + tile_in * DS * MMA_PART_FLOATS;
      float d = 0.f;
#pragma unroll
      for (int s = 0; s < DS; ++s) d += tile_part[s * MMA_PART_FLOATS + r_in * MMA_PART_COLS + seq];
      const float v = before + sublayer(d);
      p.x[seq * H + r] = v;
#if MK_TRACE
      float* trace = trace_b0 + (size_t)seq * TRACE_TOTAL;
      trace[TRACE_MOE + r] = d;
      trace[TRACE_MLP_RESIDUAL + r] = v;
#endif
    }
    block_sync();
  }
}
