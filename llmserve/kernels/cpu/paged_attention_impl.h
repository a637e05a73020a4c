// The paged attention bodies, included by paged_attention.cpp once per ISA inside a
// namespace that defines ``Vec`` (vec.h); T is the element type of q and out (float, or
// uint16_t holding bf16), K the caches' (T, bf16 under fp32, or fp8: fp8.h). Arithmetic is
// fp32 throughout; a quantized cache's scales are in Shape (scale, v_scale). This file holds
// the work items (a sequence, a chunk of one for split-K, a few prompt rows) and how the
// threads share them; one item's attention is attend_chunk (attention_chunk_impl.h), its
// scores attention_scores_impl.h. (No include guards: included several times.)

#include "attention_scores_impl.h"  // prefetch, Ahead, load_query, block_scores
#include "attention_chunk_impl.h"   // the online softmax over blocks: attend_chunk

// one sequence's query [num_heads, D] into the scratch (load_query, in cache type K's order)
template <typename K, typename T>
inline void scaled_query(const Shape& sh, const T* q, Scratch& w) {
  for (int64_t h = 0; h < sh.num_heads; ++h) load_query<K>(sh, q + h * sh.head_dim, h, w);
}

// out[d] = acc[slot<K>(d)] * inv, stored as T: acc is in the order cache type K's V rows load
// in (slot), which store2 undoes when T pairs its elements the same way (T == K, or both in
// order); otherwise element by element (an fp8 or bf16 cache under other q and out).
template <typename K, typename T>
inline void store_scaled(T* out, const float* acc, float inv, int64_t D) {
  constexpr int64_t W = Vec::W;
  int64_t d = 0;
  if constexpr (std::is_same<T, uint16_t>::value == std::is_same<K, uint16_t>::value) {
    const Vec iv = Vec::set1(inv);
    for (; d + C <= D; d += C) {
      Vec::store2(out + d, Vec::mul(Vec::load(acc + d), iv), Vec::mul(Vec::load(acc + d + W), iv));
    }
  }
  for (; d < D; ++d) put_f32(out + d, acc[slot<K>(d, D)] * inv);
}

// Every head's first visible token = first (a sliding window's) in w.lower; null when that
// is the chunk's first token t0 (nothing to mask).
inline const int64_t* same_lower(Scratch& w, int64_t first, int64_t t0) {
  if (first <= t0) return nullptr;
  std::fill(w.lower.begin(), w.lower.end(), first);
  return w.lower.data();
}

// One work item per sequence, taken by the threads as they come free: out_h = acc_h / l_h.
// A sliding window starts the walk at the block of its first token.
template <typename T, typename K>
void attend_per_sequence(const Batch& b) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, bs = b.sh.block_size;
  const T* q = static_cast<const T*>(b.q);
  T* out = static_cast<T*>(b.out);
  auto scratch = [&] { return Scratch(b.sh); };
  ::llmserve::parallel_take(b.num_seqs, 1, scratch, [&](Scratch& w, int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t first = window_start(b, b.lens[s] - 1), t0 = first / bs * bs;
      scaled_query<K>(b.sh, q + s * b.q_stride, w);
      attend_chunk(b.sh, static_cast<const K*>(b.k_cache),
                   static_cast<const K*>(b.v_cache), b.tables + s * b.max_blocks, t0, b.lens[s], w,
                   w.acc.data(), w.m.data(), w.l.data(), nullptr, same_lower(w, first, t0));
      for (int64_t h = 0; h < H; ++h) {
        store_scaled<K>(out + (s * H + h) * D, w.acc.data() + h * D, b.sh.v_scale / w.l[h], D);
      }
    }
  });
}

// Split-K (flash-decoding): chunk c of sequence s covers whole blocks [c * per, (c + 1) * per)
// of its table (counted from the block of a sliding window's first token); each chunk leaves
// (m, l, acc), then one reduction per (sequence, head) rescales them to the common maximum M:
//   out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
template <typename T, typename K>
void attend_split(const Batch& b, int64_t chunks) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, bs = b.sh.block_size;
  const int64_t items = b.num_seqs * chunks;
  const T* q = static_cast<const T*>(b.q);
  std::vector<float> part_acc(items * H * D), part_m(items * H), part_l(items * H);
  auto scratch = [&] { return Scratch(b.sh); };
  ::llmserve::parallel_take(items, 1, scratch, [&](Scratch& w, int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, c = item % chunks, len = b.lens[s];
      const int64_t first = window_start(b, len - 1), fb = first / bs;
      const int64_t per = ((len + bs - 1) / bs - fb + chunks - 1) / chunks;  // blocks per chunk
      const int64_t t0 = std::min((fb + c * per) * bs, len);
      const int64_t t1 = std::min((fb + (c + 1) * per) * bs, len);
      float* m = part_m.data() + item * H;
      float* l = part_l.data() + item * H;
      if (t0 >= t1) {  // a short sequence has fewer chunks than the longest
        std::fill(m, m + H, -std::numeric_limits<float>::infinity());
        std::fill(l, l + H, 0.f);
        continue;
      }
      scaled_query<K>(b.sh, q + s * b.q_stride, w);
      attend_chunk(b.sh, static_cast<const K*>(b.k_cache),
                   static_cast<const K*>(b.v_cache), b.tables + s * b.max_blocks, t0, t1, w,
                   part_acc.data() + item * H * D, m, l, nullptr, same_lower(w, first, t0));
    }
  });
  T* out = static_cast<T*>(b.out);
  at::parallel_for(0, b.num_seqs * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / H, h = pair % H;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[(s * chunks + c) * H + h]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t item = s * chunks + c;
        if (part_l[item * H + h] == 0.f) continue;
        const float wt = std::exp(part_m[item * H + h] - mx);
        total += wt * part_l[item * H + h];
        const float* a = part_acc.data() + (item * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wt * a[d];
      }
      store_scaled<K>(out + pair * D, o.data(), b.sh.v_scale / total, D);
    }
  });
}

// Prompt rows and decodes in one pass (query_start: [num_seqs + 1] row offsets of q/out). A
// work item is up to item_rows(H) consecutive query rows of one sequence; its rows' heads that
// share a KV head are attended together as if they were one sequence's heads (virtual head
// g * rows * G + r * G + i is head g * G + i of row r), so each K/V chunk is loaded once for
// all of them, and row r (position p) sees tokens [0, p] only (from a sliding window's first
// token on: the item's walk starts at the block of its first row's). Items run longest first
// and are taken by the threads as they come free (their costs differ by the context lengths).
// 16 rows (144 heads of the default model, one K/V load for 48 query vectors): measured on a
// Zen 5 host against 4 (benchmarks.prompt_attention shapes, alternated call by call in one
// process, nine rounds, medians), fp32 1 x 2048 tokens 300 -> 321 GFLOP/s, 8 x 256 199 -> 224;
// bf16 407 -> 442 and 264 -> 313; the AVX2 path on the same host fp32 1.13x, bf16 1.04-1.06x.
// 32 rows added 3-10% more, but a prompt of 32 rows would then be one item for one thread.
// Models with more query heads take fewer rows, down to the 4 they took before (measured on
// the default model only), so an item's scores stay within kItemHeads heads (72 KB a step).
constexpr int64_t kRows = 16, kMinRows = 4, kItemHeads = 16 * 9;

inline int64_t item_rows(int64_t num_heads) {
  return std::clamp(kItemHeads / num_heads, kMinRows, kRows);
}

template <typename T, typename K>
void attend_varlen(const Batch& b, const int32_t* query_start) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, G = b.sh.group, bs = b.sh.block_size;
  const int64_t per_item = item_rows(H);
  struct Item { int64_t seq, row0, rows, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    if (b.skip != nullptr && b.skip[s]) continue;  // attended elsewhere (prompt_sdpa)
    const int64_t q_len = query_start[s + 1] - query_start[s], first = b.lens[s] - q_len;
    for (int64_t r0 = 0; r0 < q_len; r0 += per_item) {
      const int64_t rows = std::min(per_item, q_len - r0);
      items.push_back({s, r0, rows, rows * (first + r0 + rows - window_start(b, first + r0))});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& c) { return a.cost > c.cost; });
  const T* q = static_cast<const T*>(b.q);
  T* out = static_cast<T*>(b.out);
  struct State {
    Shape vs;  // the virtual sequence of an item's rows
    Scratch w;
    std::vector<int64_t> limits;
  };
  auto state = [&] {
    Shape vs = b.sh;
    vs.num_heads = H * per_item, vs.group = G * per_item;
    return State{vs, Scratch(vs), std::vector<int64_t>(H * per_item)};
  };
  const int64_t n = items.size();
  ::llmserve::parallel_take(n, 1, state, [&](State& st, int64_t begin, int64_t end) {
    Shape& vs = st.vs;
    Scratch& w = st.w;
    std::vector<int64_t>& limits = st.limits;
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t row = query_start[item.seq] + item.row0;  // the item's first row of q
      const int64_t first = b.lens[item.seq] - (query_start[item.seq + 1] - query_start[item.seq]);
      const int64_t p0 = first + item.row0;  // the item's first position
      const int64_t t0 = window_start(b, p0) / bs * bs;
      vs.num_heads = H * item.rows, vs.group = G * item.rows;
      for (int64_t g = 0; g < b.sh.kv_heads; ++g) {
        for (int64_t r = 0; r < item.rows; ++r) {
          for (int64_t i = 0; i < G; ++i) {
            const int64_t vh = (g * item.rows + r) * G + i;
            limits[vh] = p0 + r + 1;
            w.lower[vh] = window_start(b, p0 + r);
            load_query<K>(vs, q + (row + r) * b.q_stride + (g * G + i) * D, vh, w);
          }
        }
      }
      const bool windowed = window_start(b, p0 + item.rows - 1) > t0;
      attend_chunk(vs, static_cast<const K*>(b.k_cache),
                   static_cast<const K*>(b.v_cache), b.tables + item.seq * b.max_blocks, t0,
                   p0 + item.rows, w, w.acc.data(), w.m.data(), w.l.data(),
                   item.rows > 1 ? limits.data() : nullptr, windowed ? w.lower.data() : nullptr);
      for (int64_t g = 0; g < b.sh.kv_heads; ++g) {
        for (int64_t r = 0; r < item.rows; ++r) {
          for (int64_t i = 0; i < G; ++i) {
            const int64_t vh = (g * item.rows + r) * G + i;
            store_scaled<K>(out + ((row + r) * H + g * G + i) * D, w.acc.data() + vh * D,
                            b.sh.v_scale / w.l[vh], D);
          }
        }
      }
    }
  });
}

// out[j] = src[j] * inv as fp8 codes of type F8 (fp8.h's rounding), for n elements of fp32 or
// bf16 (T): the K/V write into an fp8 pool, one token's row at a time; this ISA's copy of the
// loop is vectorized by the compiler (encode_fp8 has no branches).
template <typename F8, typename T>
void encode_rows(const T* src, float inv, int64_t n, uint8_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = fp8_code(static_cast<F8*>(nullptr), to_f32(src[j]) * inv);
  }
}

// f(T{}, K{}) for the batch's q / out type T and cache type K (Batch::kv)
template <typename F>
void with_types(const Batch& b, F&& f) {
  auto caches = [&](auto t) {
    switch (b.kv) {
      case KvType::kE4m3: return f(t, fp8_e4m3{});
      case KvType::kE5m2: return f(t, fp8_e5m2{});
      case KvType::kBf16: return f(t, uint16_t{});
      default: return f(t, t);
    }
  };
  b.is_bf16 ? caches(uint16_t{}) : caches(float{});
}

void run_varlen(const Batch& b, const int32_t* query_start) {
  with_types(b, [&](auto t, auto k) {
    attend_varlen<decltype(t), decltype(k)>(b, query_start);
  });
}

void run(const Batch& b, int64_t chunks) {
  with_types(b, [&](auto t, auto k) {
    using T = decltype(t);
    using K = decltype(k);
    chunks == 1 ? attend_per_sequence<T, K>(b) : attend_split<T, K>(b, chunks);
  });
}
