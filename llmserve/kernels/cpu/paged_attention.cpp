// Paged decode attention for the CPU: one query token per sequence, K/V read in place from
// the paged pool through the block table (no gathered copy); fp32, or bf16 q/caches/out with
// fp32 arithmetic (bf16 -> fp32 is a 16-bit shift on load). The body (paged_attention_impl.h)
// is compiled for AVX-512, AVX2 and plain C++; isa.h picks one at run time.
//
//   q        [num_seqs, num_heads, head_dim]
//   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache alike); or a view of
//            that shape over blocks stored [num_kv_heads, head_dim, block_size] (the cpp
//            backend's pool, kv_cache.allocate): scores as vectors of tokens (dots_t)
//   tables   [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32
//   out      [num_seqs, num_heads, head_dim]
//
// A work item is one sequence, or one chunk of its blocks when there are too few sequences to
// keep every thread busy (split-K, as flash-decoding does on a GPU). An item walks its blocks
// in order (FlashAttention's online softmax, a step of whole blocks, up to kStepTokens
// tokens, at a time); query head h uses KV head h / (num_heads / num_kv_heads), so each K/V
// block is read from memory once for all heads:
//   s[h][i] = scale * q_h . k_i          the step's scores (i < its tokens)
//   m_h' = max(m_h, max_i s[h][i]),  l_h = l_h e^(m_h - m_h') + sum_i e^(s[h][i] - m_h')
//   acc_h = acc_h e^(m_h - m_h') + sum_i e^(s[h][i] - m_h') v_i
// One chunk: out_h = acc_h / l_h. Several: each writes (m, l, acc) and a reduction rescales
// them to the common maximum M:  out_h = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
// Items are taken by torch's intra-op threads as they come free (parallel.h: a preempted
// thread does not hold the others back); at batch sizes that give every thread a few
// sequences, one item is one sequence with all its heads, so a block of K (all KV heads,
// contiguous) is streamed from memory once.
//
// paged_attention takes any step (prompt chunks and decodes): an item is up to 16 query rows
// of one sequence, attended as one sequence whose heads are those rows' heads, each row seeing
// its context up to its own position (attend_varlen in paged_attention_impl.h). Prompts whose
// whole context is the step's chunk may go to torch's SDPA instead (prompt_sdpa: bf16 on
// AMX, where its flash attention's GEMMs run 2-3x this kernel on whole prompts).
//
// A sliding window (``window`` > 0, Mistral's and Gemma's local layers): the query at position
// p sees tokens [p - window + 1, p] only. An item starts its walk at the block of its first
// visible token, and the scores of tokens before a row's window are masked as those past its
// position are: a long context costs a windowed layer window tokens a row, not the context.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kernels_ops.h"
#include "parallel.h"
#include "vec.h"

namespace llmserve {

namespace {
std::atomic<int> g_isa{-1};  // -1: not chosen yet
}  // namespace

Isa current_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    const char* env = std::getenv("LLMSERVE_CPU_ISA");
    isa = static_cast<int>(parse_isa(env != nullptr && *env ? env : "auto"));
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<Isa>(isa);
}

void set_current_isa(Isa isa) { g_isa.store(static_cast<int>(isa), std::memory_order_relaxed); }

}  // namespace llmserve

namespace {

struct Shape {
  int64_t num_heads, head_dim, block_size, kv_heads, group, row;  // row = kv_heads * head_dim
  // K pool stored transposed: a block is [kv_heads, head_dim, block_size] (see dots_t)
  bool k_t = false;
  // bf16 scores by vdpbf16ps (AVX512_BF16 chosen, K transposed, head_dim even)
  bool dp_bf16 = false;
  float scale = 1.f;    // softmax scale of the scores, times a quantized cache's k_scale
  float v_scale = 1.f;  // a quantized cache's v_scale, applied to each output row
};

// The caches' element type against q's (--kv-cache-dtype): the same, bf16 under fp32 q, or fp8
enum class KvType { kSame, kBf16, kE4m3, kE5m2 };

// The batch as raw pointers, after its tensors were checked; q and out share a dtype, the
// caches have theirs (kv).
struct Batch {
  Shape sh;
  int64_t num_seqs, max_blocks;
  bool is_bf16;  // q and out
  KvType kv = KvType::kSame;
  int64_t q_stride;  // elements from one token's query row to the next (>= num_heads * D)
  const void *q, *k_cache, *v_cache;
  const int32_t *tables, *lens;  // tables: [num_seqs, max_blocks], lens: [num_seqs]
  void* out;
  const uint8_t* skip = nullptr;  // paged_attention: [num_seqs], 1 = left to prompt_sdpa
  int64_t window = 0;  // a sliding window (0: none): position p sees [p - window + 1, p]
};

// The first token the query at position p sees: 0, or the sliding window's first.
inline int64_t window_start(const Batch& b, int64_t p) {
  return b.window > 0 ? std::max<int64_t>(0, p - b.window + 1) : 0;
}

// A thread's buffers: the scaled fp32 query (and its bf16 pairs for vdpbf16ps), a block's
// scores, accumulators, m, l, corrections.
// Tokens per online-softmax step (whole blocks, at least one): the running maxima, sums and
// corrections, with their sums across lanes, are paid once per step, not once per block.
// Measured on Zen 5 (fp32, engine, random 256/128): one 16-token block per step -> 64 tokens
// took decode attention from 3.48 to 2.60 s and prompt-chunk attention from 1.19 to 0.86 s;
// 128 gained 12% more on the prompt kernel alone, and was even with 64 in the engine.
constexpr int64_t kStepTokens = 128;

inline int64_t step_blocks(int64_t block_size) {
  return std::max<int64_t>(1, kStepTokens / block_size);
}
constexpr int64_t kMaxStepBlocks = kStepTokens;  // step_blocks at block size 1

struct Scratch {
  std::vector<float> q, scores, acc, m, l, correction, ones;
  std::vector<uint32_t> qw;
  std::vector<int64_t> lower;  // each head's first visible token (a sliding window)
  explicit Scratch(const Shape& sh)
      : q(sh.num_heads * sh.head_dim),
        scores(sh.num_heads * sh.block_size * step_blocks(sh.block_size)),
        acc(sh.num_heads * sh.head_dim), m(sh.num_heads), l(sh.num_heads),
        correction(sh.num_heads), ones(sh.num_heads, 1.f), qw(sh.num_heads * sh.head_dim / 2 + 1),
        lower(sh.num_heads) {}
};

}  // namespace

#define LLMSERVE_ISA_IMPL "paged_attention_impl.h"
#include "per_isa.h"

namespace llmserve::attention {

// Whether k_cache [blocks, block_size, kv_heads, D] is a view of a contiguous
// [blocks, kv_heads, D, block_size] pool: the layout kv_cache.allocate gives the cpp backend.
bool keys_transposed(const at::Tensor& k) {
  if (k.dim() != 4) return false;
  const int64_t bs = k.size(1), kvh = k.size(2), D = k.size(3);
  return k.stride(0) == bs * kvh * D && k.stride(1) == 1 && k.stride(2) == D * bs &&
         k.stride(3) == bs;
}

// Whether query rows of row_len elements, row_stride apart, can be read in place: one row
// (its stride is moot) or rows that do not overlap; the kernels read q's rows at any stride.
inline bool rows_apart(int64_t rows, int64_t row_stride, int64_t row_len) {
  return rows <= 1 || row_stride >= row_len;
}

// The caches' element type for q of dtype q_dtype (fails on a pair the kernels do not take)
KvType kv_type(const char* op, at::ScalarType q_dtype, const at::Tensor& k_cache,
               const at::Tensor& v_cache) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv, op, ": k_cache and v_cache dtypes differ");
  if (kv == q_dtype) return KvType::kSame;
  if (kv == at::kBFloat16) return KvType::kBf16;  // under fp32 q
  if (kv == at::kFloat8_e4m3fn) return KvType::kE4m3;
  if (kv == at::kFloat8_e5m2) return KvType::kE5m2;
  TORCH_CHECK(false, op, ": the K/V pools must be in q's dtype, bfloat16, float8_e4m3fn or "
              "float8_e5m2 (got ", kv, " for ", q_dtype, " q)");
  return KvType::kSame;
}

Batch check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   at::Tensor& out, int64_t window, double k_scale, double v_scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype,
              "paged_decode_attention (CPU) takes q and out both float32 or both bfloat16");
  const KvType kv = kv_type("paged_decode_attention", dtype, k_cache, v_cache);
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be positive, got ", k_scale,
              " and ", v_scale);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2 && out.sizes() == q.sizes(),
              "expected q and out [seqs, heads, dim], cache [blocks, block_size, kv_heads, dim]");
  const int64_t q_row = q.size(1) * q.size(2);  // a row's stride is moot when there is one row
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  rows_apart(q.size(0), q.stride(0), q_row) &&
                  (k_cache.is_contiguous() || keys_transposed(k_cache)) &&
                  v_cache.is_contiguous() && out.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention (CPU) takes contiguous tensors (q's rows may be strided, "
              "k_cache may be the transposed view that kv_cache.allocate makes)");
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
  b.sh.k_t = !k_cache.is_contiguous();
  b.sh.dp_bf16 = b.sh.k_t && dtype == at::kBFloat16 && kv == KvType::kSame &&
                 b.sh.head_dim % 2 == 0 && llmserve::current_isa() == llmserve::Isa::kAvx512Bf16;
  // the scales apply to a pool narrower than q only (layers/kv_quant.py alike)
  if (kv == KvType::kSame) k_scale = v_scale = 1.0;
  const double unit = kv == KvType::kE4m3 ? kE4m3Unit : 1.0;  // e4m3 reads value / 2^8 (fp8.h)
  b.sh.scale = static_cast<float>(scale * k_scale * unit);
  b.sh.v_scale = static_cast<float>(v_scale * unit);
  b.kv = kv;
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a sliding window's length, got ", window);
  b.window = window;
  b.num_seqs = seq_lens.numel();
  b.max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == b.num_seqs,
              "block_tables and seq_lens disagree on the number of sequences");
  b.is_bf16 = dtype == at::kBFloat16;
  b.q = q.data_ptr();
  b.q_stride = q.size(0) <= 1 ? q_row : q.stride(0);
  b.k_cache = k_cache.data_ptr();
  b.v_cache = v_cache.data_ptr();
  b.tables = block_tables.data_ptr<int32_t>();
  b.lens = seq_lens.data_ptr<int32_t>();
  b.out = out.data_ptr();
  const int64_t capacity = b.max_blocks * b.sh.block_size;
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    TORCH_CHECK(b.lens[s] > 0 && b.lens[s] <= capacity, "seq_lens[", s, "] = ", b.lens[s],
                " is outside 1..", capacity, " (the block table's capacity)");
  }
  return b;
}

// Split-K only when the sequences alone cannot give every thread a few items.
int64_t num_chunks(const Batch& b) {
  const int64_t threads = at::get_num_threads();
  if (b.num_seqs >= 4 * threads) return 1;
  int64_t longest_blocks = 0;  // of the blocks a query reads (a window's, if any)
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t bs = b.sh.block_size, first = window_start(b, b.lens[s] - 1) / bs;
    longest_blocks = std::max(longest_blocks, (b.lens[s] + bs - 1) / bs - first);
  }
  const int64_t want = (4 * threads + b.num_seqs - 1) / b.num_seqs;
  return std::max<int64_t>(1, std::min(want, longest_blocks / 4));  // >= 4 blocks a chunk
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor& out,
                            int64_t window, double k_scale, double v_scale) {
  Batch b = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, out, window,
                         k_scale, v_scale);
  TORCH_CHECK(q.size(0) == b.num_seqs, "paged_decode_attention: one query row per sequence");
  if (b.num_seqs == 0) return;
  const int64_t chunks = num_chunks(b);
  LLMSERVE_DISPATCH(run(b, chunks));
}

// k or v rows [T, kvh * D] (rows may be strided, unit column stride) at their slots of a
// [blocks, block_size, kvh, D] pool, or of a transposed K pool (element j = h * D + d of a
// token at block[h][d][offset]). Rows in the pool's dtype are copied as they are; fp32 or bf16
// rows into a narrower pool (bf16, fp8) are divided by ``scale`` and rounded to nearest even
// (fp8 saturating at its largest finite value, fp8.h).
void write_rows(const char* op, const char* name, const at::Tensor& x, at::Tensor& cache,
                const at::Tensor& slot_mapping, double scale) {
  const int64_t bs = cache.size(1), row = cache.size(2) * cache.size(3);
  const auto kv = cache.scalar_type();
  const bool narrower = kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2 ||
                        (kv == at::kBFloat16 && x.scalar_type() == at::kFloat);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == row && x.stride(1) == 1 &&
                  (x.scalar_type() == kv || narrower) &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": ", name, " must be [T, kvh * D] with contiguous rows, in the cache's dtype "
              "(or float32 / bfloat16 rows into a narrower cache)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == x.size(0),
              op, ": slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = cache.size(0) * bs, tokens = x.size(0), stride = x.stride(0);
  const bool transposed = !cache.is_contiguous();  // keys_transposed, checked by the caller
  const float inv = static_cast<float>(1.0 / scale);
  auto scatter = [&](auto* dst_pool, const auto* src_rows, auto put) {
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, op, ": slot_mapping[", t, "] = ",
                  slots[t], " is outside the pool's ", capacity, " slots");
      const auto* src = src_rows + t * stride;
      if (transposed) {
        auto* dst = dst_pool + slots[t] / bs * bs * row + slots[t] % bs;
        for (int64_t j = 0; j < row; ++j) put(dst + j * bs, src[j]);
      } else {
        auto* dst = dst_pool + slots[t] * row;
        for (int64_t j = 0; j < row; ++j) put(dst + j, src[j]);
      }
    }
  };
  auto copy = [](auto* dst, auto x) { *dst = x; };
  auto into = [&](auto* pool) {  // rows of x's dtype, converted (and scaled) into pool's
    auto convert = [&](auto* dst, auto x) { put_f32(dst, to_f32(x) * inv); };
    if (x.scalar_type() == at::kFloat) {
      scatter(pool, x.data_ptr<float>(), convert);
    } else {
      scatter(pool, static_cast<const uint16_t*>(x.data_ptr()), convert);
    }
  };
  // fp8: each row encoded by this ISA's vectorized loop (encode_rows), then its bytes placed
  auto into_fp8 = [&](auto* pool) {
    using F8 = std::remove_pointer_t<decltype(pool)>;
    std::vector<uint8_t> codes(row);
    auto each_row = [&](const auto* src_rows) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(src_rows)>>;
      uint8_t* dst_pool = reinterpret_cast<uint8_t*>(pool);
      for (int64_t t = 0; t < tokens; ++t) {
        TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, op, ": slot_mapping[", t, "] = ",
                    slots[t], " is outside the pool's ", capacity, " slots");
        LLMSERVE_DISPATCH(encode_rows<F8, T>(src_rows + t * stride, inv, row, codes.data()));
        if (transposed) {
          uint8_t* dst = dst_pool + slots[t] / bs * bs * row + slots[t] % bs;
          for (int64_t j = 0; j < row; ++j) dst[j * bs] = codes[j];
        } else {
          std::copy(codes.begin(), codes.end(), dst_pool + slots[t] * row);
        }
      }
    };
    if (x.scalar_type() == at::kFloat) {
      each_row(x.data_ptr<float>());
    } else {
      each_row(static_cast<const uint16_t*>(x.data_ptr()));
    }
  };
  if (kv == x.scalar_type()) {  // bit copies
    if (cache.element_size() == 4) {
      scatter(static_cast<uint32_t*>(cache.data_ptr()),
              static_cast<const uint32_t*>(x.data_ptr()), copy);
    } else {
      scatter(static_cast<uint16_t*>(cache.data_ptr()),
              static_cast<const uint16_t*>(x.data_ptr()), copy);
    }
  } else if (kv == at::kFloat8_e4m3fn) {
    into_fp8(static_cast<fp8_e4m3*>(cache.data_ptr()));
  } else if (kv == at::kFloat8_e5m2) {
    into_fp8(static_cast<fp8_e5m2*>(cache.data_ptr()));
  } else {
    into(static_cast<uint16_t*>(cache.data_ptr()));  // fp32 rows into a bf16 pool
  }
}

// this step's k/v rows ([T, kvh * D], rows may be strided) written at their pool slots;
// returns q [T, H * D] as [T, H, D] (a view when its rows only are strided)
at::Tensor write_kv_and_split_heads(const char* op, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                                    const at::Tensor& slot_mapping, double k_scale,
                                    double v_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && v_cache.is_contiguous() &&
                  (k_cache.is_contiguous() || keys_transposed(k_cache)),
              op, ": k_cache and v_cache must be [blocks, block_size, kvh, D] pools (K may be "
              "the transposed view that kv_cache.allocate makes)");
  const int64_t tokens = q.size(0), head_dim = k_cache.size(3);
  TORCH_CHECK(q.dim() == 2 && q.size(1) % head_dim == 0, op, ": q must be [T, H * D]");
  write_rows(op, "k", k, k_cache, slot_mapping, k_scale);
  write_rows(op, "v", v, v_cache, slot_mapping, v_scale);
  const bool in_place = q.stride(1) == 1 && rows_apart(tokens, q.stride(0), q.size(1));
  return (in_place ? q : q.contiguous()).view({tokens, q.size(1) / head_dim, head_dim});
}

// A step of decodes only, in one call: this step's k/v rows written at their pool slots, then
// q ([T, H * D]) attending -> [T, H * D]. The same work as index_copy_ twice and
// paged_decode_attention, without a dozen Python-level view/copy calls per layer around them.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window, double k_scale, double v_scale) {
  const at::Tensor q3 = write_kv_and_split_heads("decode_attention", q, k, v, k_cache, v_cache,
                                                 slot_mapping, k_scale, v_scale);
  at::Tensor out = at::empty({q3.size(0), q3.size(1), q3.size(2)}, q3.options());
  paged_decode_attention(q3, k_cache, v_cache, block_tables, seq_lens, scale, out, window,
                         k_scale, v_scale);
  return out.view({q.size(0), q.size(1)});
}

// Prompts' first chunks of one length len (their whole contexts), rows [start, start + len)
// of q3 [T, H, D] and of k/v [T, kvh * D] for each start, by torch's
// scaled_dot_product_attention in one call (causal, GQA): its flash attention for CPU runs
// the products as bf16 GEMMs, on AMX tiles where the CPU has them, 2-3x this file's kernel on
// whole prompts there (see paged_attention). Heads-first copies [n, heads, len, D]: the flash
// kernel is slower on strided views (411 against 300 us, one prompt of 256 tokens).
void prompt_sdpa(const at::Tensor& q3, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                 const std::vector<int64_t>& starts, int64_t len, double scale) {
  const int64_t D = q3.size(2), n = starts.size();
  auto heads_first = [&](const at::Tensor& rows) {  // [T, heads * D] -> [n, heads, len, D]
    const int64_t heads = rows.size(1) / D;
    at::Tensor batch = at::empty({n, heads, len, D}, rows.options());
    for (int64_t i = 0; i < n; ++i) {
      batch[i].copy_(rows.narrow(0, starts[i], len).view({len, heads, D}).transpose(0, 1));
    }
    return batch;
  };
  const at::Tensor o =
      at::scaled_dot_product_attention(heads_first(q3.view({q3.size(0), -1})), heads_first(k),
                                       heads_first(v), {}, 0.0, /*is_causal=*/true, scale,
                                       /*enable_gqa=*/true);
  for (int64_t i = 0; i < n; ++i) out.narrow(0, starts[i], len).copy_(o[i].transpose(0, 1));
}

// Any step (prompt chunks and decodes, in the batch layout of attention_metadata.py): this
// step's k/v rows written at their pool slots, then the query rows [T, H * D] of sequence s,
// q[query_start[s] : query_start[s + 1]], attending causally over its context of seq_lens[s]
// tokens (the chunk's own K/V are its last rows) -> [T, H * D]. A sequence whose whole
// context is this chunk (a prompt's first chunk, no cached prefix) of at least sdpa_min_rows
// rows (0: none) goes to prompt_sdpa instead; its K/V are written all the same.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start,
                           double scale, int64_t sdpa_min_rows, int64_t window, double k_scale,
                           double v_scale) {
  const at::Tensor q3 = write_kv_and_split_heads("paged_attention", q, k, v, k_cache, v_cache,
                                                 slot_mapping, k_scale, v_scale);
  const int64_t tokens = q.size(0);
  at::Tensor out = at::empty({q3.size(0), q3.size(1), q3.size(2)}, q3.options());
  Batch b = check_inputs(q3, k_cache, v_cache, block_tables, seq_lens, scale, out, window,
                         k_scale, v_scale);
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  query_start.numel() == b.num_seqs + 1,
              "paged_attention: query_start must be int32 [num_seqs + 1]");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[b.num_seqs] == tokens, "paged_attention: query_start must run 0..",
              tokens);
  std::vector<uint8_t> by_sdpa(b.num_seqs, 0);
  std::map<int64_t, std::vector<int64_t>> sdpa_starts;  // length -> first rows of those prompts
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(qs[s] <= qs[s + 1] && q_len <= b.lens[s], "paged_attention: sequence ", s,
                " has ", q_len, " query rows for a context of ", b.lens[s]);
    by_sdpa[s] = sdpa_min_rows > 0 && q_len >= sdpa_min_rows && q_len == b.lens[s] &&
                 (window == 0 || q_len <= window);  // SDPA here is causal, without a window
    if (by_sdpa[s]) sdpa_starts[q_len].push_back(qs[s]);
  }
  b.skip = by_sdpa.data();
  LLMSERVE_DISPATCH(run_varlen(b, qs));
  for (const auto& [len, starts] : sdpa_starts) prompt_sdpa(q3, k, v, out, starts, len, scale);
  return out.view({tokens, q.size(1)});
}

// "auto", "avx512", "avx2" or "scalar": the path every kernel of this library takes from now
// on (tests force each one); returns the one chosen. "" only reports the current one.
std::string set_isa(const std::string& name) {
  if (!name.empty()) llmserve::set_current_isa(llmserve::parse_isa(name));
  return llmserve::isa_name(llmserve::current_isa());
}

}  // namespace llmserve::attention
