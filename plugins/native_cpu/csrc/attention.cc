// Flash attention forward and backward on CPU (FlashAttention-2's schedule):
// an online softmax over blocks of keys in float32, the backward recomputing
// the probabilities from the saved log-sum-exp.
//
// Work items: the forward and dq take (batch, kv head, block of query
// positions) and hold the rows of every query head of that kv head's group,
// so a GQA group reads each K/V block once; dk and dv take (batch, kv head,
// block of keys). Every item writes outputs no other item writes, and its
// arithmetic never depends on the thread it runs on, so the answer is the
// same bit for bit at any thread count.
//
// Vectorisation: every hot loop runs over a contiguous float32 axis with no
// reduction across lanes (K and V blocks are transposed into scratch where a
// product needs it), so the compiler vectorises it without -ffast-math. The
// item functions are compiled twice (target_clones): for x86-64-v3 (AVX2 and
// FMA) and for the baseline, picked once at load time by the CPU's features.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ATTN_NATIVE_CPU_NO_CLONES)
#define ATTN_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ATTN_HOT
#endif

namespace attn_native_cpu {
namespace {

constexpr int64_t kBlockKeys = 128;  // keys per block (scratch rows of K, V, S)
constexpr int64_t kRowsPerItem = 64;  // query rows (heads x positions) per item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// Reads n values of dtype at src into float32 dst.
inline void LoadRow(DType dtype, const void* src, int64_t offset, int64_t n, float* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
  }
}

inline void StoreRow(DType dtype, void* dst, int64_t offset, int64_t n, const float* src,
                     float factor) {
  if (dtype == DType::kF32) {
    float* d = static_cast<float*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = src[i] * factor;
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(src[i] * factor);
  }
}

// exp(x) for x <= ~0 (scores minus a running max or the lse), branch-free so a
// loop over it vectorises: 2^n * e^r with |r| <= ln2/2 and a degree-7 Taylor
// polynomial (relative error below 2e-7); inputs below -87 give 2^-126 or less
// scaled, and callers only pass visible keys' scores.
inline float FastExp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * 1.44269504088896341f;
  const int32_t n = static_cast<int32_t>(t + (t >= 0.0f ? 0.5f : -0.5f));
  const float nf = static_cast<float>(n);
  const float r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The visible keys [lo, hi) of query position i in batch row b (lo >= hi: none).
struct Range {
  int64_t lo, hi;
};

inline Range Visible(const Params& p, int64_t b, int64_t i) {
  const Shape& s = p.shape;
  const Visibility& v = p.vis;
  if (v.q_lengths != nullptr && i >= v.q_lengths[b]) return {0, 0};
  int64_t hi = s.kv_len;
  if (v.kv_lengths != nullptr) hi = std::max<int64_t>(0, std::min<int64_t>(hi, v.kv_lengths[b]));
  int64_t lo = 0;
  const int64_t diag = i + s.kv_len - s.q_len;
  if (v.causal) hi = std::min(hi, diag + 1);
  if (v.window_left >= 0) lo = std::max(lo, diag - v.window_left);
  if (v.window_right >= 0) hi = std::min(hi, diag + v.window_right + 1);
  return {lo, hi};
}

// Query positions per item: rows are (group heads) x (positions).
inline int64_t PositionsPerItem(const Shape& s) {
  const int64_t group = s.q_heads / s.kv_heads;
  return std::max<int64_t>(1, kRowsPerItem / group);
}

// K (or V) block [j0, j0 + nk) of kv head g in batch b, as float32: `rows`
// [nk][width] and/or transposed `cols` [width][kBlockKeys]; either may be null.
void LoadKeys(const Params& p, DType dtype, const void* src, int64_t width, int64_t b,
              int64_t g, int64_t j0, int64_t nk, float* rows, float* cols, float* tmp) {
  const Shape& s = p.shape;
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* row = rows != nullptr ? rows + jj * width : tmp;
    LoadRow(dtype, src, ((b * s.kv_len + j0 + jj) * s.kv_heads + g) * width, width, row);
    if (cols != nullptr) {
      for (int64_t d = 0; d < width; ++d) cols[d * kBlockKeys + jj] = row[d];
    }
  }
}

// Scores of one (scaled) query row against keys [a, e) of a transposed block:
// s[jj] = q . k_jj, softcapped when asked (tanh_out keeps tanh for the backward).
inline void Scores(const Params& p, const float* q, const float* kt, int64_t a, int64_t e,
                   float* s, float* tanh_out) {
  const int64_t dims = p.shape.head_dim;
  for (int64_t jj = a; jj < e; ++jj) s[jj] = 0.0f;
  for (int64_t d = 0; d < dims; ++d) {
    const float qd = q[d];
    const float* kd = kt + d * kBlockKeys;
    for (int64_t jj = a; jj < e; ++jj) s[jj] += qd * kd[jj];
  }
  if (p.softcap > 0.0f) {
    const float cap = p.softcap, inv = 1.0f / p.softcap;
    for (int64_t jj = a; jj < e; ++jj) {
      const float t = std::tanh(s[jj] * inv);
      if (tanh_out != nullptr) tanh_out[jj] = t;
      s[jj] = cap * t;
    }
  }
}

// dp[jj] = do . v_jj over keys [a, e) of a transposed V block.
inline void RowDotKeys(const float* x, const float* cols, int64_t width, int64_t a, int64_t e,
                       float* out) {
  for (int64_t jj = a; jj < e; ++jj) out[jj] = 0.0f;
  for (int64_t d = 0; d < width; ++d) {
    const float xd = x[d];
    const float* c = cols + d * kBlockKeys;
    for (int64_t jj = a; jj < e; ++jj) out[jj] += xd * c[jj];
  }
}

// acc[:] += sum over jj in [a, e) of w[jj] * rows[jj][:].
inline void AccumulateRows(const float* w, const float* rows, int64_t width, int64_t a,
                           int64_t e, float* acc) {
  for (int64_t jj = a; jj < e; ++jj) {
    const float wj = w[jj];
    const float* r = rows + jj * width;
    for (int64_t d = 0; d < width; ++d) acc[d] += wj * r[d];
  }
}

// The rows of an item: query head (g * group + hh) at position i0 + ii.
struct Rows {
  int64_t b, g, i0, positions, group;
  int64_t count() const { return positions * group; }
  int64_t head(int64_t r) const { return g * group + r / positions; }
  int64_t position(int64_t r) const { return i0 + r % positions; }
};

Rows ItemRows(const Params& p, int64_t item) {
  const Shape& s = p.shape;
  const int64_t per = PositionsPerItem(s);
  const int64_t blocks = (s.q_len + per - 1) / per;
  const int64_t qb = item % blocks, bg = item / blocks;
  const int64_t i0 = qb * per;
  return {bg / s.kv_heads, bg % s.kv_heads, i0, std::min(per, s.q_len - i0),
          s.q_heads / s.kv_heads};
}

int64_t QueryItems(const Shape& s) {
  const int64_t per = PositionsPerItem(s);
  return s.batch * s.kv_heads * ((s.q_len + per - 1) / per);
}

inline int64_t QOffset(const Shape& s, int64_t b, int64_t i, int64_t h, int64_t width) {
  return ((b * s.q_len + i) * s.q_heads + h) * width;
}

ATTN_HOT void ForwardItem(const Params& p, DType dtype, const void* q, const void* k,
                          const void* v, void* out, float* lse, int64_t item) {
  const Shape& s = p.shape;
  const Rows rows = ItemRows(p, item);
  const int64_t m = rows.count(), dims = s.head_dim, vdims = s.v_head_dim;
  std::vector<float> qs(m * dims), acc(m * vdims, 0.0f), row_max(m, kNegInf), row_sum(m, 0.0f);
  std::vector<float> kt(dims * kBlockKeys), vb(kBlockKeys * vdims), tmp(std::max(dims, vdims));
  std::vector<float> sc(kBlockKeys);
  std::vector<Range> range(m);
  int64_t first = s.kv_len, last = 0;
  for (int64_t r = 0; r < m; ++r) {
    range[r] = Visible(p, rows.b, rows.position(r));
    if (range[r].lo < range[r].hi) {
      first = std::min(first, range[r].lo);
      last = std::max(last, range[r].hi);
    }
    LoadRow(dtype, q, QOffset(s, rows.b, rows.position(r), rows.head(r), dims), dims,
            qs.data() + r * dims);
    for (int64_t d = 0; d < dims; ++d) qs[r * dims + d] *= p.scale;
  }
  for (int64_t j0 = first; j0 < last; j0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, last - j0);
    LoadKeys(p, dtype, k, dims, rows.b, rows.g, j0, nk, nullptr, kt.data(), tmp.data());
    LoadKeys(p, dtype, v, vdims, rows.b, rows.g, j0, nk, vb.data(), nullptr, nullptr);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t a = std::max<int64_t>(range[r].lo - j0, 0);
      const int64_t e = std::min<int64_t>(range[r].hi - j0, nk);
      if (a >= e) continue;
      Scores(p, qs.data() + r * dims, kt.data(), a, e, sc.data(), nullptr);
      float block_max = kNegInf;
      for (int64_t jj = a; jj < e; ++jj) block_max = std::max(block_max, sc[jj]);
      const float new_max = std::max(row_max[r], block_max);
      const float alpha = std::exp(row_max[r] - new_max);  // 0 on the first block
      // Two loops: the exponentials vectorise, the in-order sum (no -ffast-math) does not.
      for (int64_t jj = a; jj < e; ++jj) sc[jj] = FastExp(sc[jj] - new_max);
      float sum = 0.0f;
      for (int64_t jj = a; jj < e; ++jj) sum += sc[jj];
      row_sum[r] = row_sum[r] * alpha + sum;
      row_max[r] = new_max;
      float* o = acc.data() + r * vdims;
      for (int64_t d = 0; d < vdims; ++d) o[d] *= alpha;
      AccumulateRows(sc.data(), vb.data(), vdims, a, e, o);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = rows.position(r), h = rows.head(r);
    const bool any = row_sum[r] > 0.0f;
    StoreRow(dtype, out, QOffset(s, rows.b, i, h, vdims), vdims, acc.data() + r * vdims,
             any ? 1.0f / row_sum[r] : 0.0f);
    lse[(rows.b * s.q_heads + h) * s.q_len + i] =
        any ? row_max[r] + std::log(row_sum[r]) : kNegInf;
  }
}

// One row's probabilities and dS over keys [a, e): p = exp(s - lse),
// ds = p * (dp - delta), times 1 - tanh^2 under softcap (the raw score's gradient).
inline void RowGradients(const Params& p, const float* q, const float* dov, const float* kt,
                         const float* vt, int64_t a, int64_t e, float lse, float delta,
                         float* prob, float* ds, float* tanh_buf) {
  Scores(p, q, kt, a, e, prob, tanh_buf);
  for (int64_t jj = a; jj < e; ++jj) prob[jj] = FastExp(prob[jj] - lse);
  RowDotKeys(dov, vt, p.shape.v_head_dim, a, e, ds);
  for (int64_t jj = a; jj < e; ++jj) ds[jj] = prob[jj] * (ds[jj] - delta);
  if (p.softcap > 0.0f) {
    for (int64_t jj = a; jj < e; ++jj) ds[jj] *= 1.0f - tanh_buf[jj] * tanh_buf[jj];
  }
}

// delta = rowsum(dout * out) - d_lse, the softmax backward's per-row constant.
inline float RowDelta(const float* dov, const float* o, int64_t vdims, float dlse) {
  float delta = 0.0f;
  for (int64_t d = 0; d < vdims; ++d) delta += dov[d] * o[d];
  return delta - (std::isfinite(dlse) ? dlse : 0.0f);
}

struct BackwardArgs {
  const void *q, *k, *v, *out, *dout;
  const float *lse, *dlse;
  void *dq, *dk, *dv;
};

ATTN_HOT void DqItem(const Params& p, DType dtype, const BackwardArgs& x, int64_t item) {
  const Shape& s = p.shape;
  const Rows rows = ItemRows(p, item);
  const int64_t m = rows.count(), dims = s.head_dim, vdims = s.v_head_dim;
  std::vector<float> qs(m * dims), dov(m * vdims), o(vdims), dq(m * dims, 0.0f);
  std::vector<float> row_lse(m), delta(m);
  std::vector<float> kt(dims * kBlockKeys), kb(kBlockKeys * dims), vt(vdims * kBlockKeys);
  std::vector<float> tmp(vdims), prob(kBlockKeys), ds(kBlockKeys), tanh_buf(kBlockKeys);
  std::vector<Range> range(m);
  int64_t first = s.kv_len, last = 0;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = rows.position(r), h = rows.head(r);
    range[r] = Visible(p, rows.b, i);
    if (range[r].lo < range[r].hi) {
      first = std::min(first, range[r].lo);
      last = std::max(last, range[r].hi);
    }
    LoadRow(dtype, x.q, QOffset(s, rows.b, i, h, dims), dims, qs.data() + r * dims);
    for (int64_t d = 0; d < dims; ++d) qs[r * dims + d] *= p.scale;
    LoadRow(dtype, x.dout, QOffset(s, rows.b, i, h, vdims), vdims, dov.data() + r * vdims);
    LoadRow(dtype, x.out, QOffset(s, rows.b, i, h, vdims), vdims, o.data());
    const int64_t at = (rows.b * s.q_heads + h) * s.q_len + i;
    row_lse[r] = x.lse[at];
    delta[r] = RowDelta(dov.data() + r * vdims, o.data(), vdims, x.dlse[at]);
  }
  for (int64_t j0 = first; j0 < last; j0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, last - j0);
    LoadKeys(p, dtype, x.k, dims, rows.b, rows.g, j0, nk, kb.data(), kt.data(), nullptr);
    LoadKeys(p, dtype, x.v, vdims, rows.b, rows.g, j0, nk, nullptr, vt.data(), tmp.data());
    for (int64_t r = 0; r < m; ++r) {
      const int64_t a = std::max<int64_t>(range[r].lo - j0, 0);
      const int64_t e = std::min<int64_t>(range[r].hi - j0, nk);
      if (a >= e) continue;
      RowGradients(p, qs.data() + r * dims, dov.data() + r * vdims, kt.data(), vt.data(), a, e,
                   row_lse[r], delta[r], prob.data(), ds.data(), tanh_buf.data());
      AccumulateRows(ds.data(), kb.data(), dims, a, e, dq.data() + r * dims);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    StoreRow(dtype, x.dq, QOffset(s, rows.b, rows.position(r), rows.head(r), dims), dims,
             dq.data() + r * dims, p.scale);
  }
}

ATTN_HOT void DkvItem(const Params& p, DType dtype, const BackwardArgs& x, int64_t item) {
  const Shape& s = p.shape;
  const int64_t blocks = (s.kv_len + kBlockKeys - 1) / kBlockKeys;
  const int64_t kb_index = item % blocks, bg = item / blocks;
  const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t j0 = kb_index * kBlockKeys, nk = std::min(kBlockKeys, s.kv_len - j0);
  const int64_t dims = s.head_dim, vdims = s.v_head_dim;
  std::vector<float> kt(dims * kBlockKeys), vt(vdims * kBlockKeys), tmp(std::max(dims, vdims));
  std::vector<float> dk(kBlockKeys * dims, 0.0f), dv(kBlockKeys * vdims, 0.0f);
  std::vector<float> qs(dims), dov(vdims), o(vdims);
  std::vector<float> prob(kBlockKeys), ds(kBlockKeys), tanh_buf(kBlockKeys);
  LoadKeys(p, dtype, x.k, dims, b, g, j0, nk, nullptr, kt.data(), tmp.data());
  LoadKeys(p, dtype, x.v, vdims, b, g, j0, nk, nullptr, vt.data(), tmp.data());
  for (int64_t i = 0; i < s.q_len; ++i) {
    const Range range = Visible(p, b, i);
    const int64_t a = std::max<int64_t>(range.lo - j0, 0);
    const int64_t e = std::min<int64_t>(range.hi - j0, nk);
    if (a >= e) continue;
    for (int64_t hh = 0; hh < group; ++hh) {
      const int64_t h = g * group + hh;
      LoadRow(dtype, x.q, QOffset(s, b, i, h, dims), dims, qs.data());
      for (int64_t d = 0; d < dims; ++d) qs[d] *= p.scale;
      LoadRow(dtype, x.dout, QOffset(s, b, i, h, vdims), vdims, dov.data());
      LoadRow(dtype, x.out, QOffset(s, b, i, h, vdims), vdims, o.data());
      const int64_t at = (b * s.q_heads + h) * s.q_len + i;
      const float delta = RowDelta(dov.data(), o.data(), vdims, x.dlse[at]);
      RowGradients(p, qs.data(), dov.data(), kt.data(), vt.data(), a, e, x.lse[at], delta,
                   prob.data(), ds.data(), tanh_buf.data());
      for (int64_t jj = a; jj < e; ++jj) {
        const float pj = prob[jj], dsj = ds[jj];
        float* dvr = dv.data() + jj * vdims;
        for (int64_t d = 0; d < vdims; ++d) dvr[d] += pj * dov[d];
        float* dkr = dk.data() + jj * dims;
        for (int64_t d = 0; d < dims; ++d) dkr[d] += dsj * qs[d];
      }
    }
  }
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t row = (b * s.kv_len + j0 + jj) * s.kv_heads + g;
    StoreRow(dtype, x.dk, row * dims, dims, dk.data() + jj * dims, 1.0f);
    StoreRow(dtype, x.dv, row * vdims, vdims, dv.data() + jj * vdims, 1.0f);
  }
}

}  // namespace

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  parallel_for(QueryItems(p.shape),
               [&](int64_t item) { ForwardItem(p, dtype, q, k, v, out, lse, item); });
}

void Backward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
              const void* out, const float* lse, const void* dout, const float* dlse,
              void* dq, void* dk, void* dv, const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  const BackwardArgs x{q, k, v, out, dout, lse, dlse, dq, dk, dv};
  const int64_t dq_items = QueryItems(s);
  const int64_t dkv_items = s.batch * s.kv_heads * ((s.kv_len + kBlockKeys - 1) / kBlockKeys);
  // dq and dk/dv are separate items (each recomputes its probabilities), so no
  // two items ever add into the same output.
  parallel_for(dq_items + dkv_items, [&](int64_t item) {
    if (item < dq_items) {
      DqItem(p, dtype, x, item);
    } else {
      DkvItem(p, dtype, x, item - dq_items);
    }
  });
}

}  // namespace attn_native_cpu
