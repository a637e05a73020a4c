// Paged decode attention for the CPU: one query token per sequence, K/V read in place from
// the paged pool through the block table (no gathered copy), fp32.
//
//   q        [num_seqs, num_heads, head_dim]
//   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache alike)
//   tables   [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32
//   out      [num_seqs, num_heads, head_dim]
//
// A work item is one sequence, or one chunk of its blocks when there are too few sequences to
// keep every thread busy (split-K, as flash-decoding does on a GPU). An item walks its blocks
// in order (FlashAttention's online softmax, one block at a time); query head h uses KV head
// h / (num_heads / num_kv_heads), so each K/V block is read from memory once for all heads:
//   s[h][i] = scale * q_h . k_i          the block's scores (i < block_size)
//   m_h' = max(m_h, max_i s[h][i]),  l_h = l_h e^(m_h - m_h') + sum_i e^(s[h][i] - m_h')
//   acc_h = acc_h e^(m_h - m_h') + sum_i e^(s[h][i] - m_h') v_i
// One chunk: out_h = acc_h / l_h. Several: each writes (m, l, acc) and a reduction rescales
// them to the common maximum M:  out_h = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
// Items are spread over torch's intra-op threads with at::parallel_for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

// sum over d of a[d] * b[d]
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef LLMSERVE_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  for (; d + 8 <= n; d += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  }
  sum = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// acc[d] += w * x[d]
inline void axpy(float* acc, float w, const float* x, int64_t n) {
  int64_t d = 0;
#ifdef LLMSERVE_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= n; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < n; ++d) acc[d] += w * x[d];
}

struct Shape {
  int64_t num_heads, head_dim, block_size, kv_heads, group, row;  // row = kv_heads * head_dim
};

// out[i] = scale * q . k_i for n key rows k_i = k + i * stride. Four rows at a time: their
// dot products accumulate in four vectors, summed across lanes together at the end.
inline void dots(const float* q, const float* k, int64_t stride, int64_t n, int64_t D, float scale,
                 float* out) {
  int64_t i = 0;
#ifdef LLMSERVE_AVX2
  if (D % 8 == 0) {
    const __m128 sv = _mm_set1_ps(scale);
    for (; i + 4 <= n; i += 4) {
      const float* k0 = k + i * stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + stride + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * stride + d), a3);
      }
      // hadd twice: lane j of the low half holds row j's sum of lanes 0-3, high half lanes 4-7
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      _mm_storeu_ps(out + i, _mm_mul_ps(r, sv));
    }
  }
#endif
  for (; i < n; ++i) out[i] = scale * dot(q, k + i * stride, D);
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum
inline float exp_and_sum(float* s, int64_t n, float mx) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef LLMSERVE_AVX2
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

// Attend query rows q [num_heads, head_dim] over tokens [t0, t1) of one sequence (t0 on a
// block boundary), one block at a time with an online softmax: the block's scores, then
// running maxima m and sums l updated (acc rescaled when the maximum grows), then the block's
// V rows added in. K and V of a block are read right after each other, and the scores never
// leave L1. Leaves acc [num_heads, head_dim] (unnormalised), m and l [num_heads].
void attend_chunk(const Shape& sh, const float* q, const float* k_cache, const float* v_cache,
                  const int32_t* table, int64_t t0, int64_t t1, float scale,
                  std::vector<float>& scores, float* acc, float* m, float* l) {
  const int64_t H = sh.num_heads, D = sh.head_dim, bs = sh.block_size;
  scores.resize(H * bs);
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  for (int64_t b0 = t0; b0 < t1; b0 += bs) {
    const int64_t n = std::min(bs, t1 - b0);
    const int64_t block = table[b0 / bs];
    const float* kb = k_cache + block * bs * sh.row;  // token i of the block: kb + i * row
    const float* vb = v_cache + block * bs * sh.row;
    for (int64_t h = 0; h < H; ++h) {
      dots(q + h * D, kb + (h / sh.group) * D, sh.row, n, D, scale, scores.data() + h * bs);
    }
    for (int64_t h = 0; h < H; ++h) {
      float* s = scores.data() + h * bs;
      float mx = m[h];
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
      const float correction = std::exp(m[h] - mx);  // 0 on the first block (m = -inf)
      l[h] = l[h] * correction + exp_and_sum(s, n, mx);
      if (correction != 1.f) {
        float* a = acc + h * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
      m[h] = mx;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* row = vb + i * sh.row;
      for (int64_t h = 0; h < H; ++h) {
        axpy(acc + h * D, scores[h * bs + i], row + (h / sh.group) * D, D);
      }
    }
  }
}

// The batch as raw pointers, after its tensors were checked.
struct Batch {
  Shape sh;
  int64_t num_seqs, max_blocks;
  const float *q, *k_cache, *v_cache;
  const int32_t *tables, *lens;  // tables: [num_seqs, max_blocks], lens: [num_seqs]
  float* out;
  float scale;
};

Batch check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention (CPU) takes float32 tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention (CPU) takes contiguous tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2 && out.sizes() == q.sizes(),
              "expected q and out [seqs, heads, dim], cache [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache shapes differ");
  Batch b;
  b.sh.num_heads = q.size(1);
  b.sh.head_dim = q.size(2);
  b.sh.block_size = k_cache.size(1);
  b.sh.kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == b.sh.head_dim && b.sh.num_heads % b.sh.kv_heads == 0,
              "head_dim or head counts of q and the cache disagree");
  b.sh.group = b.sh.num_heads / b.sh.kv_heads;
  b.sh.row = b.sh.kv_heads * b.sh.head_dim;
  b.num_seqs = q.size(0);
  b.max_blocks = block_tables.size(1);
  TORCH_CHECK(seq_lens.numel() == b.num_seqs && block_tables.size(0) == b.num_seqs,
              "q, block_tables and seq_lens disagree on the number of sequences");
  b.q = q.data_ptr<float>();
  b.k_cache = k_cache.data_ptr<float>();
  b.v_cache = v_cache.data_ptr<float>();
  b.tables = block_tables.data_ptr<int32_t>();
  b.lens = seq_lens.data_ptr<int32_t>();
  b.out = out.data_ptr<float>();
  b.scale = static_cast<float>(scale);
  const int64_t capacity = b.max_blocks * b.sh.block_size;
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    TORCH_CHECK(b.lens[s] > 0 && b.lens[s] <= capacity, "seq_lens[", s, "] = ", b.lens[s],
                " is outside 1..", capacity, " (the block table's capacity)");
  }
  return b;
}

// One work item per sequence: out_h = acc_h / l_h directly.
void attend_per_sequence(const Batch& b) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim;
  at::parallel_for(0, b.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, m(H), l(H);
    for (int64_t s = begin; s < end; ++s) {
      float* o = b.out + s * H * D;  // [H, D]
      attend_chunk(b.sh, b.q + s * H * D, b.k_cache, b.v_cache, b.tables + s * b.max_blocks, 0,
                   b.lens[s], b.scale, scores, o, m.data(), l.data());
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inv;
      }
    }
  });
}

// Split-K: chunk c of sequence s covers whole blocks [c * per, (c + 1) * per) of its table;
// each chunk leaves (m, l, acc), then one reduction per (sequence, head) rescales them.
void attend_split(const Batch& b, int64_t chunks) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, bs = b.sh.block_size;
  const int64_t items = b.num_seqs * chunks;
  std::vector<float> part_acc(items * H * D), part_m(items * H), part_l(items * H);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, c = item % chunks, len = b.lens[s];
      const int64_t per = ((len + bs - 1) / bs + chunks - 1) / chunks;  // blocks per chunk
      const int64_t t0 = std::min(c * per * bs, len), t1 = std::min((c + 1) * per * bs, len);
      float* m = part_m.data() + item * H;
      float* l = part_l.data() + item * H;
      if (t0 >= t1) {  // a short sequence has fewer chunks than the longest
        std::fill(m, m + H, -std::numeric_limits<float>::infinity());
        std::fill(l, l + H, 0.f);
        continue;
      }
      attend_chunk(b.sh, b.q + s * H * D, b.k_cache, b.v_cache, b.tables + s * b.max_blocks, t0,
                   t1, b.scale, scores, part_acc.data() + item * H * D, m, l);
    }
  });
  at::parallel_for(0, b.num_seqs * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / H, h = pair % H;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[(s * chunks + c) * H + h]);
      float* o = b.out + (s * H + h) * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t item = s * chunks + c;
        if (part_l[item * H + h] == 0.f) continue;
        const float w = std::exp(part_m[item * H + h] - mx);
        total += w * part_l[item * H + h];
        axpy(o, w, part_acc.data() + (item * H + h) * D, D);
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const Batch b = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  if (b.num_seqs == 0) return;
  // Split-K only when the sequences alone cannot give every thread a few items.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (b.num_seqs < 4 * threads) {
    const int64_t longest = *std::max_element(b.lens, b.lens + b.num_seqs);
    const int64_t longest_blocks = (longest + b.sh.block_size - 1) / b.sh.block_size;
    const int64_t want = (4 * threads + b.num_seqs - 1) / b.num_seqs;
    chunks = std::max<int64_t>(1, std::min(want, longest_blocks / 4));  // >= 4 blocks a chunk
  }
  if (chunks == 1) {
    attend_per_sequence(b);
  } else {
    attend_split(b, chunks);
  }
}

}  // namespace

TORCH_LIBRARY(llmserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
