// Picks the step's token on the device (block 0, after the grid barrier that follows the head):
// argmax of the blocks' best (greedy, or Gumbel-max sampling when top-k is off), or top-k / top-p
// sampling over the processed logits. Seeded Philox: the same seed and step give the same token. One call
// samples one sequence of the batch (v5: block b samples sequence b).
#pragma once

__device__ __forceinline__ unsigned order_key(float f) {  // larger float -> larger unsigned key
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// Top-k (exact, by radix select on the float bits), then top-p over the sorted k, then one draw.
__device__ int top_k_sample(const Params& p, float* smem, int seq) {
  const float* logits = p.logits + (size_t)seq * V;
  __shared__ unsigned s_prefix;
  __shared__ int s_need, s_count, s_token;
  unsigned* hist = reinterpret_cast<unsigned*>(smem);  // [256]; the layout is launch_plan.sample_layout's
  float* cand_val = smem + SAMPLE_SM_CAND_VAL;  // [SAMPLE_CAND]
  int* cand_id = reinterpret_cast<int*>(smem + SAMPLE_SM_CAND_ID);  // [SAMPLE_CAND]
  const int k = (int)p.top_k[seq];
  unsigned prefix = 0u, mask = 0u;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) hist[i] = 0u;
    block_sync();
    for (int v = threadIdx.x; v < V; v += THREADS) {
      const unsigned key = order_key(load_shared_state(logits + v));
      if ((key & mask) == prefix) atomicAdd(hist + ((key >> shift) & 255u), 1u);
    }
    block_sync();
    if (threadIdx.x == 0) {
      int cum = 0, b = 255;
      for (; b > 0; --b) {
        if (cum + (int)hist[b] >= need) break;
        cum += hist[b];
      }
      s_prefix = prefix | ((unsigned)b << shift);
      s_need = need - cum;
      s_count = 0;
    }
    block_sync();
    prefix = s_prefix;
    need = s_need;
    mask |= 255u << shift;
    block_sync();
  }
  // Candidates: every logit at or above the k-th largest (ties beyond SAMPLE_CAND slots are dropped).
  for (int v = threadIdx.x; v < V; v += THREADS) {
    const float l = load_shared_state(logits + v);
    if (order_key(l) >= prefix) {
      const int slot = atomicAdd(&s_count, 1);
      if (slot < SAMPLE_CAND) {
        cand_val[slot] = l;
        cand_id[slot] = v;
      }
    }
  }
  block_sync();
  for (int i = s_count + threadIdx.x; i < SAMPLE_CAND; i += THREADS) {
    cand_val[i] = -INFINITY;
    cand_id[i] = 0x7fffffff;
  }
  block_sync();
  // Bitonic sort: highest logit first, lowest id first among equals.
  for (int size = 2; size <= SAMPLE_CAND; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < SAMPLE_CAND / 2; i += THREADS) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool forward = (lo & size) == 0;
        const bool swap = forward ? ranks_before(cand_val[hi], cand_id[hi], cand_val[lo], cand_id[lo])
                                  : ranks_before(cand_val[lo], cand_id[lo], cand_val[hi], cand_id[hi]);
        if (swap) {
          const float tv = cand_val[lo];
          cand_val[lo] = cand_val[hi];
          cand_val[hi] = tv;
          const int ti = cand_id[lo];
          cand_id[lo] = cand_id[hi];
          cand_id[hi] = ti;
        }
      }
      block_sync();
    }
  }
  if (threadIdx.x == 0) {
    // Softmax over the k best; top-p keeps token j while the mass of j and all below it exceeds 1 - top_p.
    float total = 0.f;
    for (int j = 0; j < k; ++j) total += expf(cand_val[j] - cand_val[0]);
    const float drop = 1.f - (float)p.top_p[seq];
    float suffix = 0.f;
    int keep = k;
    for (int j = k - 1; j > 0; --j) {
      suffix += expf(cand_val[j] - cand_val[0]) / total;
      if (suffix > drop) break;
      keep = j;
    }
    float kept = 0.f;
    for (int j = 0; j < keep; ++j) kept += expf(cand_val[j] - cand_val[0]);
    const float target = philox_uniform((unsigned long long)p.seed[seq], (unsigned long long)p.rng_step[seq], (unsigned)V) * kept;
    float cum = 0.f;
    int pick = keep - 1;
    for (int j = 0; j < keep; ++j) {
      cum += expf(cand_val[j] - cand_val[0]);
      if (cum >= target) {
        pick = j;
        break;
      }
    }
    s_token = cand_id[pick];
  }
  block_sync();
  return s_token;
}

__device__ void sample_phase(const Params& p, float* smem, int seq = 0) {
  int token;
  if (p.temperature[seq] <= 0.0 || p.top_k[seq] == 0) {
    __shared__ int s_best;
    if (threadIdx.x == 0) {
      float best = -INFINITY;
      int best_id = 0x7fffffff;
      for (int b = 0; b < GRID; ++b) {
        const float v = load_shared_state(p.best_val + seq * GRID + b);
        const int id = __ldcg(p.best_id + seq * GRID + b);
        if (ranks_before(v, id, best, best_id)) {
          best = v;
          best_id = id;
        }
      }
      s_best = best_id;
    }
    block_sync();
    token = s_best;
  } else {
    token = top_k_sample(p, smem, seq);
  }
  if (threadIdx.x == 0) {
    p.token_out[seq] = token;
    if (p.seen && p.rep_penalty[seq] != 1.0) p.seen[(size_t)seq * V + token] = 1;  // the history a penalty reads
  }
}
