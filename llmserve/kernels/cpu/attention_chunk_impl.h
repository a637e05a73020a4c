// The online softmax of a paged attention step, included by paged_attention_impl.h after
// attention_scores_impl.h (so once per ISA, inside a namespace that defines ``Vec``): the
// running maxima and sums, the V rows weighted into the accumulators (accumulate), and
// attend_chunk, which walks one sequence's blocks [t0, t1) step by step with both.
// (No include guard: this file is meant to be included several times.)


// the largest of m and s[0..n)
inline float running_max(const float* s, int64_t n, float m) {
  constexpr int64_t W = Vec::W;
  int64_t i = 0;
  if (n >= W) {
    Vec mv = Vec::load(s);
    for (i = W; i + W <= n; i += W) mv = Vec::max(mv, Vec::load(s + i));
    m = std::max(m, Vec::reduce_max(mv));
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum
inline float exp_and_sum(float* s, int64_t n, float mx) {
  constexpr int64_t W = Vec::W;
  const Vec mv = Vec::set1(mx);
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec e = Vec::exp(Vec::sub(Vec::load(s + i), mv));
    e.store(s + i);
    acc = Vec::add(acc, e);
  }
  if (i < n) {  // the rest through one vector padded with -inf (e^-inf = 0 adds nothing)
    float tail[W];
    std::fill(tail, tail + W, -std::numeric_limits<float>::infinity());
    std::copy(s + i, s + n, tail);
    const Vec e = Vec::exp(Vec::sub(Vec::load(tail), mv));
    e.store(tail);
    std::copy(tail, tail + (n - i), s + i);
    acc = Vec::add(acc, e);
  }
  return Vec::reduce_add(acc);
}

// x[i] = exp(x[i]) for i < n
inline void exp_inplace(float* x, int64_t n) {
  constexpr int64_t W = Vec::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::exp(Vec::load(x + i)).store(x + i);
  if (i < n) {  // the rest through one padded vector (fewer heads than lanes, usually)
    float tail[W] = {};
    std::copy(x + i, x + n, tail);
    Vec::exp(Vec::load(tail)).store(tail);
    std::copy(tail, tail + (n - i), x + i);
  }
}

// For NH heads h (acc_h = acc + h * D, p_h = p + h * ps): elements [0, NC * C) of acc_h =
// acc_h * correction[h] + sum_i p_h[i] v_i (chunk order) over n rows v_i that lie in blocks
// of bs rows: row i = blocks[i / bs] + off + (i % bs) * stride. The accumulators stay in
// registers over all n rows, each V chunk is widened once. kStep: ah->step() once a row.
template <int NC, int NH, bool kStep, typename T>
inline void accumulate_rows(float* acc, int64_t D, const float* p, int64_t ps,
                            const T* const* blocks, int64_t off, int64_t bs, int64_t stride,
                            int64_t n, const float* correction, Ahead* ah) {
  constexpr int64_t W = Vec::W;
  Vec a[NH][2 * NC], w[NH], x0, x1;
  for (int h = 0; h < NH; ++h) {
    const Vec c = Vec::set1(correction[h]);
    for (int j = 0; j < 2 * NC; ++j) a[h][j] = Vec::mul(Vec::load(acc + h * D + j * W), c);
  }
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const T* v = blocks[b0 / bs] + off;
    const int64_t bn = std::min(bs, n - b0);
    for (int64_t i = 0; i < bn; ++i) {
      if constexpr (kStep) ah->step();
      for (int h = 0; h < NH; ++h) w[h] = Vec::set1(p[h * ps + b0 + i]);
      const T* row = v + i * stride;
      for (int j = 0; j < NC; ++j) {
        Vec::load2(row + j * C, x0, x1);
        for (int h = 0; h < NH; ++h) {
          a[h][2 * j] = Vec::fma(w[h], x0, a[h][2 * j]);
          a[h][2 * j + 1] = Vec::fma(w[h], x1, a[h][2 * j + 1]);
        }
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int j = 0; j < 2 * NC; ++j) a[h][j].store(acc + h * D + j * W);
  }
}

// accumulate_rows over all of D: V rows of KV head g at blocks[b] + off (off = g * D); ah
// null: no asking ahead (the rows are in the caches)
template <int NH, typename T>
inline void accumulate(float* acc, const float* p, int64_t ps, const T* const* blocks,
                       int64_t off, int64_t bs, int64_t stride, int64_t n, int64_t D,
                       const float* correction, Ahead* ah) {
  constexpr int NC = kAccRegs / (2 * NH) >= 4 ? 4 : kAccRegs / (2 * NH) >= 2 ? 2 : 1;
  const int64_t Dc = D / C * C;
  int64_t d = 0;
  auto rows = [&](auto nc) {
    constexpr int kNC = decltype(nc)::value;
    if (ah != nullptr) {
      accumulate_rows<kNC, NH, true>(acc + d, D, p, ps, blocks, off + d, bs, stride, n,
                                     correction, ah);
    } else {
      accumulate_rows<kNC, NH, false>(acc + d, D, p, ps, blocks, off + d, bs, stride, n,
                                      correction, ah);
    }
  };
  for (; d + NC * C <= Dc; d += NC * C) rows(std::integral_constant<int, NC>{});
  for (; d < Dc; d += C) rows(std::integral_constant<int, 1>{});
  for (int h = 0; h < NH; ++h) {
    for (int64_t e = d; e < D; ++e) {
      float a = acc[h * D + e] * correction[h];
      for (int64_t i = 0; i < n; ++i) {
        a += p[h * ps + i] * to_f32(blocks[i / bs][off + (i % bs) * stride + e]);
      }
      acc[h * D + e] = a;
    }
  }
}

// f(std::integral_constant<int, nh>) for a run-time nh in [1, Max]
template <int Max, typename F>
inline void with_heads(int64_t nh, F&& f) {
  if constexpr (Max > 1) {
    if (nh < Max) return with_heads<Max - 1>(nh, f);
  }
  f(std::integral_constant<int, Max>{});
}

// f(std::integral_constant<int, NH>, h, g) for each run of NH <= Max query heads
// h .. h + NH - 1 that share KV head g
template <int Max = kMaxHeads, typename F>
inline void for_head_groups(const Shape& sh, F&& f) {
  for (int64_t g = 0; g < sh.kv_heads; ++g) {
    const int64_t end = (g + 1) * sh.group;
    for (int64_t h = g * sh.group; h < end; h += Max) {
      with_heads<Max>(std::min<int64_t>(Max, end - h), [&](auto nh) { f(nh, h, g); });
    }
  }
}

// scores [h * stride + i] of token b0 + i = -inf where that token is at or past limits[h]
inline void mask_beyond(const int64_t* limits, int64_t heads, int64_t b0, int64_t n,
                        float* scores, int64_t stride) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = std::max<int64_t>(limits[h] - b0, 0); i < n; ++i) {
      scores[h * stride + i] = -std::numeric_limits<float>::infinity();
    }
  }
}

// scores [h * stride + i] of token b0 + i = -inf where that token lies before lower[h] (a
// sliding window's first visible token)
inline void mask_before(const int64_t* lower, int64_t heads, int64_t b0, int64_t n,
                        float* scores, int64_t stride) {
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t end = std::min(lower[h] - b0, n);
    std::fill(scores + h * stride, scores + h * stride + std::max<int64_t>(end, 0),
              -std::numeric_limits<float>::infinity());
  }
}

constexpr int64_t kCachedContextBytes = 1 << 20;  // K + V of one sequence held in L2

// Attend the query rows in w (num_heads of them, put there by load_query) over tokens [t0, t1)
// of one sequence (t0 on a block boundary) with an online softmax, a step of up to
// step_blocks blocks (kStepTokens tokens) at a time: the step's scores block by block, the
// running maxima m and sums l (acc rescaled when a maximum grows, folded into the first V
// pass), then the blocks' V rows. The next blocks' K and V are asked for while this one is
// computed, and the scores never leave L1. Leaves acc [num_heads, head_dim] unnormalised
// (chunk order), m and l [num_heads]. ``limits`` (causal prompt rows, else null): head h sees
// tokens [t0, limits[h]) only. ``lower`` (a sliding window, else null): head h sees tokens
// from lower[h] on; a head whose first step holds none of its tokens skips it (m stays -inf).
// Every head must see at least one token of [t0, t1).
template <typename T>
void attend_chunk(const Shape& sh, const T* k_cache, const T* v_cache, const int32_t* table,
                  int64_t t0, int64_t t1, Scratch& w, float* acc, float* m, float* l,
                  const int64_t* limits = nullptr, const int64_t* lower = nullptr) {
  const int64_t H = sh.num_heads, D = sh.head_dim, bs = sh.block_size;
  const int64_t lower_end = lower == nullptr ? t0 : *std::max_element(lower, lower + H);
  const int64_t stride = bs * step_blocks(bs);  // a head's scores in the scratch
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  const int64_t row_bytes = sh.row * int64_t(sizeof(T));
  // Blocks are scattered, so no hardware prefetcher finds the next one; how they are asked
  // for depends on the vendor (cpu_is_amd, measured):
  // - AMD: the next block in read order (a step's K blocks, then its V blocks, then the next
  //   step's K blocks) into L1, spread over the current block's loops (Ahead). Measured on an
  //   AVX2 Zen 3 host (benchmarks.decode_attention shapes, batch 64, 172 and 384 tokens, one
  //   process, seven alternated rounds) against the scheme measured best on Zen 5 before (the
  //   next block with prefetcht0 and the one after with prefetchnta, each in one burst when
  //   its block starts): 8.4 -> 11.7 GB/s fp32 at 172 tokens, 8.1 -> 10.4 at 384, bf16 8.6 ->
  //   13.1 and 9.2 -> 14.2, batch 4 x 2048 (split) 9.6 -> 14.2. prefetcht2 measured even;
  //   adding the two-ahead burst back lost 2-7%. A burst of ~200 lines is more than a core
  //   keeps in flight, so the loads behind it waited (most likely).
  // - Intel (Sapphire Rapids, benchmarks.decode_attention, batch 64, 172-320 tokens, block
  //   16): the old AMD scheme read 7.1-7.6 GB/s there, half of no prefetch at all (15.2-16.2):
  //   nta and t0 bursts hold the line-fill buffers and the loads behind them wait. The block
  //   two ahead into L2 (prefetcht2) reads 17.6-18.5 GB/s fp32, 14.5-15.7 bf16 (memory 23.9
  //   GB/s); kept so (the spread scheme is not measured on Intel).
  // - AMD Zen 4 (AVX-512, family 19h): both, the next block spread and the one two ahead in
  //   a burst, each into L2. On a Zen 4 VM (bf16, batch 64 x 320, 32 x 1024 and
  //   16 x 1024 tokens, one process, the same pools, the scheme switched per call, nine
  //   alternated rounds): the burst added to the spread (then into L1) read 1.33-1.48x the
  //   spread alone on shuffled blocks, 1.60x on descending runs, 1.00-1.16x on ascending ones
  //   (as a fresh pool hands them out). The spread into L2 instead of L1, measured the same
  //   way (benchmarks.decode_attention shapes, block 16, 8 layers, median of 9): fp32 64 x 320
  //   16.6 -> 19.2 GB/s shuffled, 24.8 -> 28.5 ascending, 16 x 1024 20.2 -> 22.7; bf16 64 x
  //   320 21.5 -> 23.2, 32 x 1024 24.1 -> 25.5. A core keeps few L1 misses in flight (the
  //   line-fill buffers) and more L2 ones, most likely the reason; a third block in a burst
  //   measured even. Zen 3 keeps the spread alone, into L1: a two-ahead burst (prefetchnta)
  //   lost 2-7% there; prefetcht2 for either is not measured on it.
  // - AMD Zen 5 (family 1Ah) as Zen 3: the spread alone, into L1. On a Zen 5 VM, the engine's
  //   attention calls timed with the scheme switched step by step (offline, 64 prompts, one
  //   process each): random 256/128 fp32 33.9 against 35.2 ms a step, bf16 12.3 against 13.1;
  //   text2sql fp32 15.2 against 15.7, bf16 6.9 against 7.7. The spread into L2 measured
  //   between the two; the spread two blocks ahead instead of one, no better.
  // Prompt rows re-read their sequence's blocks item after item: a context that fits the
  // caches is not asked for (the asking cost 5% of the prompt attention at 256 tokens).
  const bool ask = limits == nullptr || (t1 - t0) * row_bytes * 2 > kCachedContextBytes;
  const bool spread = ::llmserve::cpu_is_amd();
  static const bool burst = !spread || (::llmserve::cpu_supports(::llmserve::Isa::kAvx512) &&
                                        ::llmserve::amd_family() != 0x1A);
  const int64_t block_bytes = bs * row_bytes;
  Ahead k_ahead, v_ahead;  // left empty on Intel: step() then asks for nothing
  k_ahead.into_l2 = v_ahead.into_l2 = spread && burst;  // AMD Zen 4
  // before block b0 (of the step [s0, s0 + sn)) of the K pass (is_k) or the V pass
  auto ask_ahead = [&](bool is_k, int64_t b0, int64_t s0, int64_t sn) {
    if (!ask) return;
    const T* pool = is_k ? k_cache : v_cache;
    if (burst && b0 + 2 * bs < t1) {
      prefetch<1>(pool + table[b0 / bs + 2] * bs * sh.row,
                  std::min(bs, t1 - b0 - 2 * bs) * row_bytes);
    }
    if (!spread) return;
    int64_t next = b0 + bs;
    if (next >= s0 + sn) {  // the pass's last block: the other pass's first one
      pool = is_k ? v_cache : k_cache;
      next = is_k ? s0 : s0 + sn;
      if (next >= t1) return;
    }
    (is_k ? k_ahead : v_ahead).begin(pool + table[next / bs] * bs * sh.row, block_bytes);
  };
  // Prompt rows on AVX-512 (blocks of one vector of tokens): the scores of two whole blocks at
  // once (pair_scores), a broadcast query element feeding one FMA per block. Measured on a Zen 5
  // host (benchmarks.prompt_attention shapes, both ways alternated call by call in one process,
  // nine rounds, medians, GFLOP/s): fp32 1 x 2048 tokens 249 -> 293, 8 x 256 180 -> 195; bf16
  // with vdpbf16ps 334 -> 391 and 227 -> 251; bf16 widened (AVX-512 without BF16) 272 -> 300
  // and 207 -> 222. Decode rows (one query row, from memory) keep one block at a time.
  const bool pairs = Vec::W == 16 && limits != nullptr && sh.k_t && bs == Vec::W;
  for (int64_t s0 = t0; s0 < t1; s0 += stride) {
    const int64_t sn = std::min(stride, t1 - s0);  // the step's tokens
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += bs) {
      const T* kb = k_cache + table[b0 / bs] * bs * sh.row;  // token i: kb + i * row
      const int64_t n = std::min(bs, t1 - b0);
      if (pairs && b0 + 2 * bs <= std::min(s0 + sn, t1)) {  // two whole blocks at once
        const T* kb1 = k_cache + table[b0 / bs + 1] * bs * sh.row;
        ask_ahead(true, b0 + bs, s0, sn);
        for_head_groups<kMaxPairHeads>(sh, [&](auto nh, int64_t h, int64_t g) {
          pair_scores<decltype(nh)::value>(sh, w, h, g, kb, kb1,
                                           w.scores.data() + h * stride + (b0 - s0), stride,
                                           k_ahead);
        });
        k_ahead.finish();
        b0 += bs;
        continue;
      }
      ask_ahead(true, b0, s0, sn);
      auto scores = [&](auto nh, int64_t h, int64_t g) {
        block_scores<decltype(nh)::value>(sh, w, h, g, kb, n,
                                          w.scores.data() + h * stride + (b0 - s0), stride, k_ahead);
      };
      sh.k_t ? for_head_groups<kMaxScoreHeads>(sh, scores) : for_head_groups(sh, scores);
      k_ahead.finish();
    }
    if (limits != nullptr) mask_beyond(limits, H, s0, sn, w.scores.data(), stride);
    if (s0 < lower_end) mask_before(lower, H, s0, sn, w.scores.data(), stride);
    for (int64_t h = 0; h < H; ++h) {
      const float mx = running_max(w.scores.data() + h * stride, sn, m[h]);
      w.correction[h] = mx == -std::numeric_limits<float>::infinity() ? mx : m[h] - mx;
      m[h] = mx;
    }
    exp_inplace(w.correction.data(), H);  // ~0 on the first step (m = -inf), where acc = l = 0
    for (int64_t h = 0; h < H; ++h) {
      float* p = w.scores.data() + h * stride;
      if (m[h] == -std::numeric_limits<float>::infinity()) {  // nothing visible yet: weights 0
        std::fill(p, p + sn, 0.f);
        continue;
      }
      l[h] = l[h] * w.correction[h] + exp_and_sum(p, sn, m[h]);
    }
    // The V rows. Decode rows (from memory): block by block, each next block asked for
    // while this one is read. Prompt rows (their context re-read item after item, from the
    // caches): each pass of accumulators runs over the whole step, so it loads and stores
    // them once a step instead of once a block. Measured on an AVX2 Zen 3 host, one process,
    // alternated against block by block: benchmarks.prompt_attention fp32 1.08-1.23x (8 x 256
    // and 2 x 1024 tokens), bf16 1.05-1.08x; the engine's attention calls over 8 prompts of
    // 1024 tokens 4.57 -> 3.96 s, 16 of 256 0.78 -> 0.72 s (medians of 4 and 10 rounds).
    const bool whole_step = limits != nullptr;
    const T* vbs[kMaxStepBlocks];
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += bs) {
      vbs[(b0 - s0) / bs] = v_cache + table[b0 / bs] * bs * sh.row;
    }
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += whole_step ? sn : bs) {
      const int64_t n = whole_step ? sn : std::min(bs, t1 - b0);
      const float* correction = b0 == s0 ? w.correction.data() : w.ones.data();
      if (!whole_step) ask_ahead(false, b0, s0, sn);
      auto values = [&](auto nh, int64_t h, int64_t g) {
        accumulate<decltype(nh)::value>(acc + h * D, w.scores.data() + h * stride + (b0 - s0),
                                        stride, vbs + (b0 - s0) / bs, g * D, bs, sh.row, n, D,
                                        correction + h, whole_step ? nullptr : &v_ahead);
      };
      for_head_groups<kMaxValueHeads>(sh, values);
      v_ahead.finish();
    }
  }
}
