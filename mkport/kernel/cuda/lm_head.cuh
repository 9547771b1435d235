// Output head (the embedding table when TIED_EMBEDDINGS, else one of p.heads) and logit processing:
// bias (suppressed ids), repetition penalty, temperature. Each block leaves its best (value, id) for
// the sampler: the plain argmax when greedy, the Gumbel-perturbed one when sampling without top-k. Each
// sequence of a batch has its own logits, repetition history and sampling parameters; the head is the
// first sequence's for all of them (the host refuses a batch whose sequences ask for different heads).
#pragma once

__device__ __forceinline__ const bf16* output_head(const Params& p) {
  if constexpr (TIED_EMBEDDINGS) return p.embed;
  else return p.heads + (size_t)p.head[0] * V * H;
}

// Bias, repetition penalty and temperature applied to logit l of row r of sequence seq, stored in its logits;
// returns the score the argmax uses: the logit, or the Gumbel-perturbed logit when sampling without top-k.
__device__ __forceinline__ float processed_logit(const Params& p, int r, float l, int seq = 0) {
  const float temperature = (float)p.temperature[seq], penalty = (float)p.rep_penalty[seq];
  if constexpr (HAS_LOGITS_SCALING) l /= LOGITS_SCALING;  // the model's own logits (granite), before any processing
  if constexpr (HAS_FINAL_SOFTCAP) l = tanhf(l / FINAL_SOFTCAP) * FINAL_SOFTCAP;  // the same (gemma2)
  if (p.logit_bias) l += p.logit_bias[(size_t)seq * V + r];  // the sequence's row: a batch has one a sequence
  if (p.seen && penalty != 1.f && p.seen[(size_t)seq * V + r]) l = l > 0.f ? l / penalty : l * penalty;
  if (temperature > 0.f) l /= temperature;
  p.logits[(size_t)seq * V + r] = l;
  if (temperature > 0.f && p.top_k[seq] == 0) {
    const float u = philox_uniform((unsigned long long)p.seed[seq], (unsigned long long)p.rng_step[seq], (unsigned)r);
    return l - logf(-logf(u));
  }
  return l;
}

// The block's best (score, id) for sequence seq over what each thread found, lowest id among equal scores, for
// the sampler. Each sequence has its own slots, so calls for different sequences need no barrier between them.
__device__ void publish_block_best(const Params& p, float best, int best_id, int seq = 0) {
  __shared__ float warp_best_of[BATCH][WARPS];
  __shared__ int warp_best_id_of[BATCH][WARPS];
  float* warp_best = warp_best_of[seq];
  int* warp_best_id = warp_best_id_of[seq];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (ov > best || (ov == best && oi < best_id)) {
      best = ov;
      best_id = oi;
    }
  }
  if (lane == 0) {
    warp_best[warp] = best;
    warp_best_id[warp] = best_id;
  }
  block_sync();
  if (threadIdx.x == 0) {
    for (int w = 1; w < WARPS; ++w)
      if (warp_best[w] > best || (warp_best[w] == best && warp_best_id[w] < best_id)) {
        best = warp_best[w];
        best_id = warp_best_id[w];
      }
    p.best_val[seq * GRID + blockIdx.x] = best;
    p.best_id[seq * GRID + blockIdx.x] = best_id;
  }
}

// The head's rows strided over the grid's warps, for every sequence of the batch (v5). A thread is given the logits
// of one sequence, threadIdx.x modulo BATCH (grid_matvec), so it keeps one best (score, id): that sequence's (a thread
// past MMA_STORERS is given none, and its best stays -inf).
__device__ void lm_head_phase(const Params& p, const float* xs) {
  const bf16* head = output_head(p);
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  grid_matvec<H, V>([&](int r) { return head + (size_t)r * H; }, xs, [&](int r, int b, float l) {
    const float score = processed_logit(p, r, l, b);
    if (score > best) {  // a thread's rows arrive in increasing order, so ties keep the lowest id
      best = score;
      best_id = r;
    }
  });
  const int mine = threadIdx.x % BATCH;
  for (int b = 0; b < BATCH; ++b) publish_block_best(p, mine == b ? best : -INFINITY, mine == b ? best_id : 0x7fffffff, b);
}
