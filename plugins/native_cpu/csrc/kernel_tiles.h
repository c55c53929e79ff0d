// Tiles of query rows: the contract's visibility rules, the rows' views of
// the dense and paged calls (their keys' layouts: key_rows.h), and the online
// softmax of one tile over blocks of keys (TileState), shared by the dense
// forward (attention.cc) and the decode and paged paths (decode.cc).
#pragma once

#include "key_rows.h"
#if defined(__AVX512BF16__)
#include "bf16_decode.h"
#endif

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

// Whether this build's dot tiles over a quantized cache take bf16_decode.h's
// products (bfloat16 queries only).
#if defined(__AVX512BF16__)
constexpr bool kBf16Decode = true;
#else
constexpr bool kBf16Decode = false;
#endif

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

// Softcap in place over a row's keys [a, e): s = cap * tanh(s / cap), keeping
// tanh for the backward when tanh_out is given.
inline void Softcap(const Params& p, int64_t a, int64_t e, float* s, float* tanh_out) {
  const float cap = p.softcap, inv = 1.0f / p.softcap;
  for (int64_t jj = a; jj < e; ++jj) {
    const float t = std::tanh(s[jj] * inv);
    if (tanh_out != nullptr) tanh_out[jj] = t;
    s[jj] = cap * t;
  }
}

// The visible keys of row range r in a block starting at j0 of nk keys, as
// offsets [a, e) into the block (a >= e: none).
inline void BlockSpan(const Range& range, int64_t j0, int64_t nk, int64_t* a, int64_t* e) {
  *a = std::max<int64_t>(range.lo - j0, 0);
  *e = std::min<int64_t>(range.hi - j0, nk);
}

// One row's online softmax step over the scores sr [nk] of keys [j0, j0 + nk):
// sr becomes the weights exp(s - new max) over the row's visible keys and 0
// elsewhere; the running max and sum are updated and the unnormalised output
// acc [vdims] rescaled to the new max.
inline void SoftmaxStep(const Params& p, const Range& range, int64_t j0, int64_t nk, float* sr,
                        float* row_max, float* row_sum, float* acc, int64_t vdims) {
  int64_t a, e;
  BlockSpan(range, j0, nk, &a, &e);
  if (a >= e) {  // this row sees none of the block: it adds nothing
    for (int64_t jj = 0; jj < nk; ++jj) sr[jj] = 0.0f;
    return;
  }
  if (p.softcap > 0.0f) Softcap(p, a, e, sr, nullptr);
  const float new_max = std::max(*row_max, MaxRange(sr, a, e));
  const float alpha = std::exp(*row_max - new_max);  // 0 on the row's first block
  ExpShifted(sr, a, e, new_max);
  const float sum = SumRange(sr, a, e);
  ZeroOutside(sr, a, e, nk);
  *row_sum = *row_sum * alpha + sum;
  *row_max = new_max;
  // Most blocks leave a row's max as it was (alpha exactly 1).
  if (alpha != 1.0f) {
    for (int64_t d = 0; d < vdims; ++d) acc[d] *= alpha;
  }
}

// The rows of an item: query head (g * group + hh) at position i0 + ii.
struct Rows {
  int64_t b, g, i0, positions, group;
  int64_t count() const { return positions * group; }
  int64_t head(int64_t r) const { return g * group + r / positions; }
  int64_t position(int64_t r) const { return i0 + r % positions; }
};

inline Rows ItemRows(const Params& p, int64_t item) {
  const Shape& s = p.shape;
  const int64_t per = PositionsPerItem(s);
  const int64_t blocks = (s.q_len + per - 1) / per;
  const int64_t qb = item % blocks, bg = item / blocks;
  const int64_t i0 = qb * per;
  return {bg / s.kv_heads, bg % s.kv_heads, i0, std::min(per, s.q_len - i0),
          s.q_heads / s.kv_heads};
}

inline int64_t QueryItems(const Shape& s) {
  const int64_t per = PositionsPerItem(s);
  return s.batch * s.kv_heads * ((s.q_len + per - 1) / per);
}

inline int64_t QOffset(const Shape& s, int64_t b, int64_t i, int64_t h, int64_t width) {
  return ((b * s.q_len + i) * s.q_heads + h) * width;
}

// The rows of a dense item (Rows) as ForwardTile reads them.
struct DenseView {
  const Params& p;
  Rows rows;
  // K transposed, [batch][kv head][head_dim][kv_len] float32 (KeyColumns), or
  // null: the scores then read K's rows in place.
  const float* k_columns = nullptr;
  // This item's kv head of k_columns, [head_dim][kv_len], or null.
  const float* key_columns() const {
    if (k_columns == nullptr) return nullptr;
    const Shape& s = p.shape;
    return k_columns + (rows.b * s.kv_heads + rows.g) * s.head_dim * s.kv_len;
  }
  int64_t count() const { return rows.count(); }
  int64_t q_offset(int64_t r, int64_t width) const {
    return QOffset(p.shape, rows.b, rows.position(r), rows.head(r), width);
  }
  int64_t lse_index(int64_t r) const {
    return (rows.b * p.shape.q_heads + rows.head(r)) * p.shape.q_len + rows.position(r);
  }
  Range range(int64_t r) const { return Visible(p, rows.b, rows.position(r)); }
  DenseKeys keys() const { return {p.shape, rows.b, rows.g}; }
  CacheType cache() const { return CacheType::kSame; }
  const float* k_scales() const { return nullptr; }
  const float* v_scales() const { return nullptr; }
};

// The online softmax of one tile of query rows (a View: count, q_offset,
// lse_index, range, keys) over blocks of keys: scaled queries, running max and
// sum, the unnormalised output acc [m][Dv].
template <class View>
struct TileState {
  const Params& p;
  DType dtype;
  View view;
  int64_t m, dims, vdims;
  bool dot;  // scores by DotScores (few rows), else by the GEMM on transposed keys
  // A quantized cache (PagedView): a dot tile reads its values in place and
  // applies the scales to the scores (K's) and to the weights (V's); a GEMM
  // tile dequantizes each block into scratch.
  CacheType cache;
  // A dot tile of bfloat16 queries over a quantized cache, in the build with
  // AVX512_BF16 (bf16_decode.h): its scores read qb, not qs.
  bool bf16_products;
  std::vector<float> qs, acc, row_max, row_sum, kt, sc, scratch, block_scales;
  std::vector<const float*> krows, vrows;
  std::vector<const uint16_t*> hrows;  // a dot tile's bfloat16 rows, read in place
  std::vector<const int8_t*> i8rows;   // a dot tile's quantized rows, read in place
  std::vector<const E4M3*> e4rows;
  std::vector<const E5M2*> e5rows;
  // A dot tile over a quantized cache: each key's run index (position * Hkv
  // + kv head) in the block, found by one walk of its pages, whence its rows
  // and scales.
  std::vector<int64_t> slots;
  // bf16_products': q permuted as its products read it [m][dims rounded up to
  // 64], and the block's rows as bytes.
  std::vector<uint16_t> qb;
  std::vector<const uint8_t*> byte_rows;
  std::vector<Range> range;
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;  // the rows' visible keys

  TileState(const Params& params, DType type, const View& v, const void* q)
      : p(params), dtype(type), view(v), m(v.count()), dims(params.shape.head_dim),
        vdims(params.shape.v_head_dim), dot(m <= kDotRows), cache(v.cache()),
        bf16_products(kBf16Decode && dot && cache != CacheType::kSame && type == DType::kBF16),
        qs(bf16_products ? 0 : m * dims),
        acc(m * vdims, 0.0f), row_max(m, kNegInf), row_sum(m, 0.0f),
        kt(dot || v.key_columns() != nullptr ? 0 : dims * kBlockKeys),
        sc(m * kBlockKeys),
        // One widening scratch for a GEMM tile's bfloat16 or quantized K then
        // V: K's rows are done with once the scores are. Dot tiles widen as
        // they read.
        scratch(dot || (type == DType::kF32 && cache == CacheType::kSame)
                    ? 0 : kBlockKeys * std::max(dims, vdims)),
        block_scales(dot && cache != CacheType::kSame ? kBlockKeys : 0), krows(kBlockKeys),
        vrows(kBlockKeys),
        hrows(dot && type != DType::kF32 && cache == CacheType::kSame ? kBlockKeys : 0),
        i8rows(dot && cache == CacheType::kInt8 ? kBlockKeys : 0),
        e4rows(dot && cache == CacheType::kE4M3 ? kBlockKeys : 0),
        e5rows(dot && cache == CacheType::kE5M2 ? kBlockKeys : 0),
        slots(dot && cache != CacheType::kSame ? kBlockKeys : 0),
        qb(bf16_products ? m * QueryWords() : 0), byte_rows(bf16_products ? kBlockKeys : 0),
        range(m) {
    for (int64_t r = 0; r < m; ++r) {
      range[r] = view.range(r);
      if (range[r].lo < range[r].hi) {
        first = std::min(first, range[r].lo);
        last = std::max(last, range[r].hi);
      }
#if defined(__AVX512BF16__)
      if (bf16_products) {
        PermuteQuery(static_cast<const uint16_t*>(q) + view.q_offset(r, dims), dims,
                     qb.data() + r * QueryWords());
        continue;
      }
#endif
      LoadRow(dtype, q, view.q_offset(r, dims), dims, qs.data() + r * dims);
      for (int64_t d = 0; d < dims; ++d) qs[r * dims + d] *= p.scale;
    }
  }

  int64_t QueryWords() const { return (dims + 63) / 64 * 64; }

  // rows[jj]: the block's K (or V) rows of a quantized cache (one byte an
  // element), by slots.
  template <class T>
  void RowsOfSlots(const void* src, int64_t width, int64_t nk, const T** rows) const {
    for (int64_t jj = 0; jj < nk; ++jj) rows[jj] = static_cast<const T*>(src) + slots[jj] * width;
  }

  // Keys [j0, j0 + nk), nk <= kBlockKeys; `lines` prefetches of `ahead` (or
  // null) are issued along the way.
  void AddBlock(const void* k, const void* v, int64_t j0, int64_t nk, Prefetcher* ahead,
                int64_t lines) {
    const auto keys = view.keys();
    if (!slots.empty()) {
      keys.Each(j0, nk, 1, [&](int64_t jj, int64_t at) { slots[jj] = at; });
    }
    if (bf16_products) {
#if defined(__AVX512BF16__)
      RowsOfSlots(k, dims, nk, byte_rows.data());
      QuantScores(cache, m, nk, dims, qb.data(), QueryWords(), byte_rows.data(), p.scale,
                  sc.data(), kBlockKeys, ahead, lines);
#endif
      ScaleVisible(view.k_scales(), j0, nk);
    } else if (dot) {
      InPlace(k, dims, j0, nk, [&](auto rows) {
        DotScores(m, nk, dims, qs.data(), rows, sc.data(), kBlockKeys, ahead, lines);
      });
      if (cache != CacheType::kSame) ScaleVisible(view.k_scales(), j0, nk);
    } else if (cache != CacheType::kSame) {
      DequantizedRows(cache, k, view.k_scales(), dims, keys, j0, nk, scratch.data(),
                      krows.data());
      Sgemm(false, true, m, nk, dims, qs.data(), dims, krows[0], dims, 0.0f, sc.data(),
            kBlockKeys);
    } else if (const float* cols = view.key_columns()) {  // S = Q K^T, K^T stored: no packing
      Sgemm(false, false, m, nk, dims, qs.data(), dims, cols + j0, p.shape.kv_len, 0.0f,
            sc.data(), kBlockKeys);
    } else {
      KeyRows(dtype, k, dims, keys, j0, nk, scratch.data(), krows.data());
      const int64_t k_stride = UniformStride(krows.data(), nk, dims);
      if (k_stride > 0) {  // OpenBLAS: S = Q K^T, K's rows where they are
        Sgemm(false, true, m, nk, dims, qs.data(), dims, krows[0], k_stride, 0.0f, sc.data(),
              kBlockKeys);
      } else {  // rows across pages: the transposed block and our GEMM
        TransposeRows(krows.data(), nk, dims, kt.data());
        Gemm(m, nk, dims, qs.data(), dims, kt.data(), kBlockKeys, sc.data(), kBlockKeys, false);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      SoftmaxStep(p, range[r], j0, nk, sc.data() + r * kBlockKeys, &row_max[r], &row_sum[r],
                  acc.data() + r * vdims, vdims);
    }
    if (dot) {
      // The weights of a quantized cache's keys times V's scales: acc gets
      // p * (value * scale), the sums above took p alone.
      if (cache != CacheType::kSame) ScaleVisible(view.v_scales(), j0, nk);
#if defined(__AVX512BF16__)
      if (bf16_products) {
        RowsOfSlots(v, vdims, nk, byte_rows.data());
        return QuantWeightedSum(cache, m, nk, vdims, sc.data(), kBlockKeys, byte_rows.data(),
                                acc.data(), vdims);
      }
#endif
      InPlace(v, vdims, j0, nk, [&](auto rows) {
        Gemm(m, vdims, nk, sc.data(), kBlockKeys, RowListOf(rows), acc.data(), vdims, true);
      });
      return;
    }
    if (cache != CacheType::kSame) {
      DequantizedRows(cache, v, view.v_scales(), vdims, keys, j0, nk, scratch.data(),
                      vrows.data());
    } else {
      KeyRows(dtype, v, vdims, keys, j0, nk, scratch.data(), vrows.data());
    }
    const int64_t v_stride = UniformStride(vrows.data(), nk, vdims);
    if (v_stride > 0) {  // OpenBLAS: acc += P V
      Sgemm(false, false, m, vdims, nk, sc.data(), kBlockKeys, vrows[0], v_stride, 1.0f,
            acc.data(), vdims);
    } else {
      Gemm(m, vdims, nk, sc.data(), kBlockKeys, RowListOf(vrows.data()), acc.data(), vdims, true);
    }
  }

  // sc[r][jj] *= scales of key j0 + jj (a quantized cache's, [num_pages,
  // page_size, Hkv]) over each row's visible keys only: a NaN scale (a
  // non-finite token) never reaches a row that does not see its key.
  void ScaleVisible(const float* scales, int64_t j0, int64_t nk) {
    for (int64_t jj = 0; jj < nk; ++jj) block_scales[jj] = scales[slots[jj]];
    for (int64_t r = 0; r < m; ++r) {
      int64_t a, e;
      BlockSpan(range[r], j0, nk, &a, &e);
      float* sr = sc.data() + r * kBlockKeys;
      for (int64_t jj = a; jj < e; ++jj) sr[jj] *= block_scales[jj];
    }
  }

  // f(rows): the rows of K or V block [j0, j0 + nk) where they lie: a
  // quantized cache's values (int8_t, E4M3, E5M2; by slots, which AddBlock
  // filled), else float32 or bfloat16 (uint16_t) by the call's dtype.
  template <class F>
  void InPlace(const void* src, int64_t width, int64_t j0, int64_t nk, const F& f) {
    switch (cache) {
      case CacheType::kInt8:
        RowsOfSlots(src, width, nk, i8rows.data());
        return f(i8rows.data());
      case CacheType::kE4M3:
        RowsOfSlots(src, width, nk, e4rows.data());
        return f(e4rows.data());
      case CacheType::kE5M2:
        RowsOfSlots(src, width, nk, e5rows.data());
        return f(e5rows.data());
      case CacheType::kSame:
        break;
    }
    if (dtype == DType::kF32) {
      RowsInPlace(src, width, view.keys(), j0, nk, krows.data());
      f(krows.data());
    } else {
      RowsInPlace(src, width, view.keys(), j0, nk, hrows.data());
      f(hrows.data());
    }
  }
};

// Row r's output acc / sum (zeros where the row saw no key) and lse.
inline void StoreNormalised(DType dtype, void* out, int64_t at, int64_t vdims, const float* acc,
                            float max, float sum, float* lse) {
  const bool any = sum > 0.0f;
  StoreRow(dtype, out, at, vdims, acc, any ? 1.0f / sum : 0.0f);
  if (lse != nullptr) *lse = any ? max + std::log(sum) : kNegInf;
}

// The forward of one tile of query rows, all its visible key blocks. lse may be null.
template <class View>
void ForwardTile(const Params& p, DType dtype, const View& view, const void* q, const void* k,
                 const void* v, void* out, float* lse) {
  TileState<View> t(p, dtype, view, q);
  for (int64_t j0 = t.first; j0 < t.last; j0 += kBlockKeys) {
    t.AddBlock(k, v, j0, std::min(kBlockKeys, t.last - j0), nullptr, 0);
  }
  for (int64_t r = 0; r < t.m; ++r) {
    StoreNormalised(dtype, out, view.q_offset(r, t.vdims), t.vdims, t.acc.data() + r * t.vdims,
                    t.row_max[r], t.row_sum[r], lse == nullptr ? nullptr : lse + view.lse_index(r));
  }
}

// Rows [t0, t0 + positions) of sequence seq (its rows start at `start`), every
// query head of kv head g; q and out are [T, Hq, D].
struct PagedView {
  const Params& p;
  const PagedArgs& a;
  int64_t seq, g, start, t0, positions, q_len, kv_len;
  int64_t group() const { return p.shape.q_heads / p.shape.kv_heads; }
  int64_t count() const { return positions * group(); }
  int64_t row(int64_t r) const { return t0 + r % positions; }
  int64_t head(int64_t r) const { return g * group() + r / positions; }
  int64_t q_offset(int64_t r, int64_t width) const {
    return (row(r) * p.shape.q_heads + head(r)) * width;
  }
  int64_t lse_index(int64_t) const { return 0; }
  Range range(int64_t r) const {
    // Causal: row t sees keys up to its own position kv_len - q_len + (t - start).
    const int64_t pos = kv_len - q_len + (row(r) - start);
    const int64_t hi = std::min(pos + 1, kv_len);
    const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, pos - a.window_left) : 0;
    return {lo, hi};
  }
  PagedKeys keys() const { return {a, seq, g, p.shape.kv_heads}; }
  const float* key_columns() const { return nullptr; }  // pages are read in place
  CacheType cache() const { return a.cache; }
  const float* k_scales() const { return a.k_scales; }
  const float* v_scales() const { return a.v_scales; }
};

// Calls with few query rows per kv head (group x positions <= kDotRows) take
// the decode path (decode.cc).
inline bool IsDecode(const Shape& s, int64_t positions) {
  return positions * (s.q_heads / s.kv_heads) <= kDotRows;
}

}  // namespace

// The dense forward of a decode call (decode.cc).
void DenseDecode(const Params& p, DType dtype, const void* q, const void* k, const void* v,
                 void* out, float* lse, const ParallelFor& parallel_for);

}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
