// The fused element-wise bodies, included by fused.cpp once per ISA inside a namespace that
// defines ``Vec`` (vec.h). T is the element type in memory (float, or uint16_t holding bf16);
// arithmetic is fp32, and a bf16 result is rounded once, at the store.
// (No include guard: this file is meant to be included several times.)

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  constexpr int64_t W = Vec::W;
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec v = Vec::load(x + i);
    acc = Vec::fma(v, v, acc);
  }
  float sum = Vec::reduce_add(acc);
  for (; i < n; ++i) sum += to_f32(x[i]) * to_f32(x[i]);
  return sum;
}

// out[i] = x[i] * scale * w[i] (w in T, or fp32)
template <typename T, typename TW>
inline void scale_mul(T* out, const T* x, const TW* w, float scale, int64_t n) {
  constexpr int64_t W = Vec::W;
  const Vec sv = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    Vec::mul(Vec::mul(Vec::load(x + i), sv), Vec::load(w + i)).store(out + i);
  }
  for (; i < n; ++i) put_f32(out + i, to_f32(x[i]) * scale * to_f32(w[i]));
}

// r[i] += x[i] (rounded to T, as a T-typed residual stream is)
template <typename T>
inline void add_into(T* r, const T* x, int64_t n) {
  constexpr int64_t W = Vec::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::add(Vec::load(r + i), Vec::load(x + i)).store(r + i);
  for (; i < n; ++i) put_f32(r + i, to_f32(r[i]) + to_f32(x[i]));
}

template <typename T, typename TW>
void rms_norm_rows(const T* x, const TW* w, T* out, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = 1.f / std::sqrt(sum_squares(x + r * d, d) / d + eps);
      scale_mul(out + r * d, x + r * d, w, scale, d);
    }
  });
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * d;
      T* rr = residual + r * d;
      add_into(rr, xr, d);
      const float scale = 1.f / std::sqrt(sum_squares(rr, d) / d + eps);
      scale_mul(xr, rr, w, scale, d);
    }
  });
}

// The gates of act_and_mul_rows as g * sigmoid(a * u(g)), by minus_arg(g) = -a * u(g) (Act in
// fused.cpp): silu(g) = g * sigmoid(g); GELU's tanh form 0.5 g (1 + tanh(u)) = g * sigmoid(2u),
// u = sqrt(2 / pi) (g + 0.044715 g^3), so -2u = g * (kA + kB g^2).
constexpr float kGeluA = -2.f * 0.7978845608028654f, kGeluB = kGeluA * 0.044715f;

template <Act A>
inline Vec minus_arg(Vec g) {
  if constexpr (A == Act::kSilu) return Vec::sub(Vec::zero(), g);
  return Vec::mul(g, Vec::fma(Vec::mul(g, g), Vec::set1(kGeluB), Vec::set1(kGeluA)));
}

template <Act A>
inline float minus_arg(float g) {
  if constexpr (A == Act::kSilu) return -g;
  return g * (kGeluA + kGeluB * g * g);
}

// out[r] = act(x[r, :d]) * x[r, d:], rows of 2d -> rows of d; act(g) = g / (1 + e^minus_arg(g))
template <Act A, typename T>
void act_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d) {
  constexpr int64_t W = Vec::W;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    const Vec one = Vec::set1(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * d;
      const T* up = gate + d;
      T* o = out + r * d;
      int64_t i = 0;
      for (; i + W <= d; i += W) {
        const Vec g = Vec::load(gate + i);
        const Vec sig = Vec::recip(Vec::add(one, Vec::exp(minus_arg<A>(g))));
        Vec::mul(Vec::mul(g, sig), Vec::load(up + i)).store(o + i);
      }
      for (; i < d; ++i) {
        const float g = to_f32(gate[i]);
        put_f32(o + i, g / (1.f + std::exp(minus_arg<A>(g))) * to_f32(up[i]));
      }
    }
  });
}

// out[t, h * D + 2i, +1] = pair (x[2i], x[2i+1]) of head h rotated by cis[position[t], i]
template <typename T, typename C>
void rotary_rows(const T* x, int64_t row_stride, const int64_t* positions, const C* cis, T* out,
                 int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t width = heads * head_dim;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const C* ct = cis + positions[t] * head_dim;  // (cos, sin) pairs of this position
      for (int64_t i = 0; i < head_dim; ++i) c[i] = to_f32(ct[i]);
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = x + t * row_stride + h * head_dim;
        T* o = out + t * width + h * head_dim;
        for (int64_t i = 0; i < head_dim; i += 2) {
          const float a = to_f32(in[i]), b = to_f32(in[i + 1]), cs = c[i], sn = c[i + 1];
          put_f32(o + i, a * cs - b * sn);
          put_f32(o + i + 1, a * sn + b * cs);
        }
      }
    }
  });
}

// NeoX's rotary (split halves): out[t, h * D + i] and [... + i + half] = the pair (x_i,
// x_{i + half}) of head h, i < half = rotary_dim / 2, rotated by position[t]'s angle i (tables
// cos, sin [positions, half]); channels rotary_dim..D are copied
template <typename T, typename C>
void rotary_neox_rows(const T* x, int64_t row_stride, const int64_t* positions, const C* cos,
                      const C* sin, T* out, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t rotary_dim) {
  constexpr int64_t W = Vec::W;
  const int64_t half = rotary_dim / 2, width = heads * head_dim;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c = cos + positions[t] * half;
      const C* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = x + t * row_stride + h * head_dim;
        T* o = out + t * width + h * head_dim;
        int64_t i = 0;
        for (; i + W <= half; i += W) {
          const Vec a = Vec::load(in + i), b = Vec::load(in + i + half);
          const Vec cv = Vec::load(c + i), sv = Vec::load(s + i);
          Vec::sub(Vec::mul(a, cv), Vec::mul(b, sv)).store(o + i);
          Vec::add(Vec::mul(b, cv), Vec::mul(a, sv)).store(o + i + half);
        }
        for (; i < half; ++i) {
          const float a = to_f32(in[i]), b = to_f32(in[i + half]);
          const float cs = to_f32(c[i]), sn = to_f32(s[i]);
          put_f32(o + i, a * cs - b * sn);
          put_f32(o + i + half, b * cs + a * sn);
        }
        std::copy(in + rotary_dim, in + head_dim, o + rotary_dim);
      }
    }
  });
}

// The first index of the largest of x[0, n) as torch.max(dim=-1).indices gives it, value by
// value: a NaN counts as the largest (the first NaN wins), ties go to the first index
inline bool takes_lead(float v, float best) { return std::isnan(v) || v > best; }

template <typename T>
int64_t argmax_plain(const T* x, int64_t n) {
  int64_t index = 0;
  float best = to_f32(x[0]);
  for (int64_t i = 1; i < n && !std::isnan(best); ++i) {
    const float v = to_f32(x[i]);
    if (takes_lead(v, best)) best = v, index = i;
  }
  return index;
}

// The same, faster for finite values: the max of each block of kArgmaxBlock values in
// vectors, then value by value inside the first block that holds the row's max (x == best
// finds -0 and +0 alike, as torch's tie rule does). A row with an infinity or a NaN anywhere
// (v * 0 is NaN exactly there) is done again by argmax_plain.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int64_t W = Vec::W;
  constexpr int64_t kBlock = kArgmaxBlock;
  static_assert(kBlock % (2 * W) == 0, "a block is whole pairs of vectors");
  const Vec zero = Vec::zero();
  Vec nonfinite = zero;  // sums v * 0: NaN once any v is an infinity or a NaN
  float best = -INFINITY;
  int64_t best_at = -1;  // where the block with the largest max begins, or the tail's index
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Vec m0 = Vec::load(x + i), m1 = Vec::load(x + i + W);
    nonfinite = Vec::fma(m0, zero, Vec::fma(m1, zero, nonfinite));
    for (int64_t j = i + 2 * W; j < i + kBlock; j += 2 * W) {
      const Vec a = Vec::load(x + j), b = Vec::load(x + j + W);
      m0 = Vec::max(m0, a), m1 = Vec::max(m1, b);
      nonfinite = Vec::fma(a, zero, Vec::fma(b, zero, nonfinite));
    }
    const float block_max = Vec::reduce_max(Vec::max(m0, m1));
    if (block_max > best) best = block_max, best_at = i;
  }
  bool in_tail = false;
  for (; i < n; ++i) {
    const float v = to_f32(x[i]);
    if (!std::isfinite(v)) return argmax_plain(x, n);
    if (v > best) best = v, best_at = i, in_tail = true;
  }
  if (std::isnan(Vec::reduce_add(nonfinite))) return argmax_plain(x, n);
  if (in_tail) return best_at;
  while (to_f32(x[best_at]) != best) ++best_at;
  return best_at;
}

// out[r] = argmax_row of row r of x [rows, n]; rows are taken as threads come free
template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t rows, int64_t n) {
  llmserve::parallel_take(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * n, n);
  });
}

// sum of exp(scale * x + shift) over one block of kArgmaxBlock values, in vectors (exp's
// clamp makes a -inf about 1e-38 here)
template <typename T>
inline double block_exp_sum(const T* x, Vec scale, Vec shift) {
  constexpr int64_t W = Vec::W;
  Vec acc0 = Vec::zero(), acc1 = Vec::zero();
  for (int64_t j = 0; j < kArgmaxBlock; j += 2 * W) {
    acc0 = Vec::add(acc0, Vec::exp(Vec::fma(Vec::load(x + j), scale, shift)));
    acc1 = Vec::add(acc1, Vec::exp(Vec::fma(Vec::load(x + j + W), scale, shift)));
  }
  return Vec::reduce_add(Vec::add(acc0, acc1));
}

// One draw from softmax(x * inv_temperature) at a uniform u in [0, 1): the first value whose
// running sum of exp((x - max) * inv_temperature) passes u x the total. The total, and the
// blocks wholly below the target, are summed block by block in vectors; from the block that
// holds the target on, value by value with std::exp, where a -inf weighs exactly 0 (a masked
// value is never drawn; if rounding leaves the target unpassed, the last value of positive
// weight is). A row whose max is not finite (all -inf, an inf, a NaN) gets its argmax.
template <typename T>
int64_t draw_row(const T* x, int64_t n, float inv_temperature, float u) {
  const int64_t first = argmax_row(x, n);
  const float top = to_f32(x[first]);
  if (!std::isfinite(top)) return first;
  const Vec scale = Vec::set1(inv_temperature), shift = Vec::set1(-top * inv_temperature);
  const int64_t whole = n / kArgmaxBlock * kArgmaxBlock;
  auto weight = [&](int64_t i) { return std::exp((to_f32(x[i]) - top) * inv_temperature); };
  double total = 0.0;
  for (int64_t b = 0; b < whole; b += kArgmaxBlock) total += block_exp_sum(x + b, scale, shift);
  for (int64_t i = whole; i < n; ++i) total += weight(i);
  const double target = u * total;
  double sum = 0.0;
  int64_t i = 0;
  for (; i < whole; i += kArgmaxBlock) {
    const double block = block_exp_sum(x + i, scale, shift);
    if (sum + block > target) break;
    sum += block;
  }
  int64_t last = first;
  for (; i < n; ++i) {
    const float w = weight(i);
    if (w > 0.f) {
      last = i;
      sum += w;
      if (sum > target) return i;
    }
  }
  return last;
}

// Top-p and min-p before the draw, without a sort. The weights w = exp((x - max) *
// inv_temperature) are in (0, 1]; their float bit patterns order them, so a histogram of
// their mass over buckets of 2^17 patterns (64 a power of two, 8,128 in all) finds the
// bucket where the mass counted from the top reaches top_p x the total. Every value in the
// buckets above is kept, the values in that bucket are sorted and kept while the mass before
// them is below top_p x the total (the top value always stays), and min_p drops what weighs
// less than min_p x the top one's. Values tied with the last kept one are kept with it.
constexpr int kWeightShift = 17;
constexpr int64_t kWeightBuckets = (0x3F800000 >> kWeightShift) + 1;  // w in (0, 1]

// 0 for w >= 1 (the top value; an fma's rounding may put it a hair above 1), growing as w
// shrinks; w > 0
inline int64_t weight_bucket(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof(bits));
  return bits >= 0x3F800000u ? 0 : static_cast<int64_t>((0x3F800000u - bits) >> kWeightShift);
}

struct NucleusScratch {
  std::vector<float> w;         // the row's weights; 0 for a -inf logit
  std::vector<double> mass;     // per bucket
  std::vector<int64_t> members;  // of the bucket where the nucleus ends
};

template <typename T>
int64_t draw_nucleus_row(const T* x, int64_t n, float inv_temperature, float u, float top_p,
                         float min_p, NucleusScratch& s) {
  constexpr int64_t W = Vec::W;
  const int64_t first = argmax_row(x, n);
  const float top = to_f32(x[first]);
  if (!std::isfinite(top)) return first;
  s.w.resize(n);
  s.mass.assign(kWeightBuckets, 0.0);
  float* w = s.w.data();
  const Vec scale = Vec::set1(inv_temperature), shift = Vec::set1(-top * inv_temperature);
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::exp(Vec::fma(Vec::load(x + i), scale, shift)).store(w + i);
  for (; i < n; ++i) w[i] = std::exp((to_f32(x[i]) - top) * inv_temperature);
  double total = 0.0;
  for (i = 0; i < n; ++i) {
    if (to_f32(x[i]) == -INFINITY || !(w[i] > 0.f)) {  // masked (exp's clamp left ~1e-38)
      w[i] = 0.f;
      continue;
    }
    total += w[i];
    s.mass[weight_bucket(w[i])] += w[i];
  }
  const double wanted = static_cast<double>(top_p) * total;
  double before = 0.0;
  int64_t b = 0;
  while (b < kWeightBuckets - 1 && before + s.mass[b] < wanted) before += s.mass[b++];
  s.members.clear();
  for (i = 0; i < n; ++i) {
    if (w[i] > 0.f && weight_bucket(w[i]) == b) s.members.push_back(i);
  }
  std::sort(s.members.begin(), s.members.end(), [w](int64_t a, int64_t c) { return w[a] > w[c]; });
  float last_kept = 1.f;
  double kept = before;
  for (const int64_t m : s.members) {
    if (kept >= wanted && last_kept != w[m]) break;
    last_kept = w[m];
    kept += w[m];
  }
  const float threshold = std::max(last_kept, min_p);
  if (threshold > last_kept) {  // min_p cut deeper: count what it keeps
    kept = 0.0;
    for (i = 0; i < n; ++i) kept += w[i] >= threshold ? w[i] : 0.f;
  }
  const double target = u * kept;
  double sum = 0.0;
  int64_t last = first;
  for (i = 0; i < n; ++i) {
    if (w[i] > 0.f && w[i] >= threshold) {
      last = i;
      sum += w[i];
      if (sum > target) return i;
    }
  }
  return last;
}

// out[r] = row r's draw from x [rows, n] at its inverse temperature and uniform, after its
// top_p and min_p where either is on (top_p < 1, min_p > 0)
template <typename T>
void draw_rows(const T* x, const float* inv_temperature, const float* u, const float* top_p,
               const float* min_p, int64_t* out, int64_t rows, int64_t n) {
  llmserve::parallel_take(rows, 1, [] { return NucleusScratch(); },
                          [&](NucleusScratch& scratch, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      if (top_p[r] < 1.f || min_p[r] > 0.f) {
        out[r] = draw_nucleus_row(row, n, inv_temperature[r], u[r], top_p[r], min_p[r], scratch);
      } else {
        out[r] = draw_row(row, n, inv_temperature[r], u[r]);
      }
    }
  });
}
