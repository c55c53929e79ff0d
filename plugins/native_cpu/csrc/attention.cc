// Flash attention forward and backward on CPU (FlashAttention-2's schedule):
// an online softmax over blocks of keys in float32, the backward recomputing
// the probabilities from the saved log-sum-exp.
//
// Work items: the forward and dq take (batch, kv head, block of query
// positions) and hold the rows of every query head of that kv head's group,
// so a GQA group reads each K/V block once; dk and dv take (batch, kv head,
// block of keys). A decode call (few query rows per kv head) takes (batch
// row, split of the keys) with every kv head's rows instead, reading each
// key's run of heads in address order, and merges the splits in order (see
// DecodeSplit). Every item writes outputs no other item writes, and its
// arithmetic never depends on the thread it runs on, so the answer is the
// same bit for bit at any thread count.
//
// Vectorisation: the products are one GEMM shape on vectors (GCC/Clang
// vector extensions), or for a few rows dot products over the keys in place;
// the exponentials a branch-free vector polynomial; the
// rest are plain loops over contiguous float32 the compiler vectorises. No
// -ffast-math: every sum runs in an order fixed by the shapes alone. This
// file is compiled once per instruction set (CMakeLists.txt): for x86-64-v3
// (AVX2 + FMA; ATTN_ISA isa_v3) and for the baseline (ATTN_ISA
// isa_baseline); dispatch.cc picks one by the CPU's features at load.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifndef ATTN_ISA
#define ATTN_ISA isa_baseline
#endif
// The vector width in bytes: 32 (8 floats, one AVX register) for x86-64-v3, 16
// (4 floats, one SSE register) for the baseline: a vector wider than the
// target's registers is kept in memory by the compiler (30x slower, measured).
#ifndef ATTN_VEC_BYTES
#define ATTN_VEC_BYTES 16
#endif

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

#ifndef ATTN_BK
#define ATTN_BK 128
#endif
#ifndef ATTN_ROWS
#define ATTN_ROWS 64
#endif
constexpr int64_t kBlockKeys = ATTN_BK;  // keys per block (scratch rows of K, V, S)
constexpr int64_t kRowsPerItem = ATTN_ROWS;  // query rows (heads x positions) per item
#ifndef ATTN_DOT_ROWS
#define ATTN_DOT_ROWS 8
#endif
// Tiles of at most this many query rows take their scores by dot products
// over the keys in place (DotScores), larger ones by the GEMM on a transposed
// key block.
constexpr int64_t kDotRows = ATTN_DOT_ROWS;
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

// Where key j of kv head g of batch row b starts in K (or V), width values a row.
// Keys types: f(jj, offset) for keys j0 + jj, jj < nk, in order.
struct DenseKeys {
  const Shape& s;
  int64_t b, g;
  template <class F>
  void Each(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    const int64_t start = ((b * s.kv_len + j0) * s.kv_heads + g) * width;
    for (int64_t jj = 0; jj < nk; ++jj) f(jj, start + jj * s.kv_heads * width);
  }
};

// K (or V) block [j0, j0 + nk) as float32 row pointers `rows[jj]`, the rows
// found by `keys` (DenseKeys, PagedKeys): float32 rows are read where they are
// (no copy), bfloat16 ones widened into `scratch` [nk][width].
template <class Keys>
void KeyRows(DType dtype, const void* src, int64_t width, const Keys& keys, int64_t j0,
             int64_t nk, float* scratch, const float** rows) {
  keys.Each(j0, nk, width, [&](int64_t jj, int64_t at) {
    if (dtype == DType::kF32) {
      rows[jj] = static_cast<const float*>(src) + at;
    } else {
      LoadRow(dtype, src, at, width, scratch + jj * width);
      rows[jj] = scratch + jj * width;
    }
  });
}

// KeyRows' scratch: none for float32, read in place.
inline std::vector<float> Scratch(DType dtype, int64_t size) {
  return std::vector<float>(dtype == DType::kF32 ? 0 : size);
}

// cols[d][jj] = rows[jj][d]: a key block transposed [width][kBlockKeys], for
// the GEMMs that take keys as columns.
inline void TransposeRows(const float* const* rows, int64_t nk, int64_t width, float* cols) {
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t d = 0; d < width; ++d) cols[d * kBlockKeys + jj] = rows[jj][d];
  }
}

// C[m][n] = (accumulate ? C : 0) + A[m][k] . B[k][n], float32, row strides lda
// and ldc, B's row kk at b[kk] (Strided: a matrix; RowList: rows anywhere). Every product of the kernels is this one shape (K, V, P and dS are
// laid out or transposed for it): tiles of 6 rows x 2 vectors of columns held in
// vectors (GCC/Clang vector extensions: one AVX register each on x86-64-v3,
// one SSE register of 4 on the baseline), k summed in order, so each element's sum
// is the same whatever the tile it falls in.
typedef float Vec __attribute__((vector_size(ATTN_VEC_BYTES)));
constexpr int kLanes = ATTN_VEC_BYTES / 4;

// Rows of a GEMM tile: each row holds two vector accumulators, so 6 rows (12
// registers) leave room for B's two vectors and A's broadcast in 16 registers.
constexpr int kTileRows = 6;

inline Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void StoreVec(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// One tile: rows [0, R) x columns [j, j + w) of C, w = 2 * kLanes (full) or
// less (the last columns, plain loops).
struct Strided {
  const float* b;
  int64_t ldb;
  const float* operator[](int64_t kk) const { return b + kk * ldb; }
};

struct RowList {
  const float* const* rows;
  const float* operator[](int64_t kk) const { return rows[kk]; }
};

template <int R, class BRows>
inline void GemmTile(int64_t j, int64_t w, int64_t k, const float* a, int64_t lda,
                     const BRows& b, float* c, int64_t ldc, bool accumulate) {
  if (w == 2 * kLanes) {
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = accumulate ? LoadVec(c + r * ldc + j + kLanes * h) : Vec{};
      }
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* bk = b[kk];
      const Vec b0 = LoadVec(bk + j), b1 = LoadVec(bk + j + kLanes);
      for (int r = 0; r < R; ++r) {
        const float ar = a[r * lda + kk];
        acc[r][0] += ar * b0;
        acc[r][1] += ar * b1;
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) StoreVec(c + r * ldc + j + kLanes * h, acc[r][h]);
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (!accumulate) {
      for (int64_t x = j; x < j + w; ++x) cr[x] = 0.0f;
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      const float ar = a[r * lda + kk];
      const float* bk = b[kk];
      for (int64_t x = j; x < j + w; ++x) cr[x] += ar * bk[x];
    }
  }
}

// Columns outer, rows inner: one panel of B (k x 2 kLanes) stays in L1 while
// every row tile of A passes over it. The last m % kTileRows rows take a tile
// of their own height (a 1-row tile has 2 accumulators: latency-bound).
template <class BRows>
inline void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const BRows& b,
                 float* c, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < n; j += 2 * kLanes) {
    const int64_t w = std::min<int64_t>(2 * kLanes, n - j);
    int64_t i = 0;
    for (; i + kTileRows <= m; i += kTileRows) {
      GemmTile<kTileRows>(j, w, k, a + i * lda, lda, b, c + i * ldc, ldc, accumulate);
    }
    const float* ai = a + i * lda;
    float* ci = c + i * ldc;
    switch (m - i) {
      case 5: GemmTile<5>(j, w, k, ai, lda, b, ci, ldc, accumulate); break;
      case 4: GemmTile<4>(j, w, k, ai, lda, b, ci, ldc, accumulate); break;
      case 3: GemmTile<3>(j, w, k, ai, lda, b, ci, ldc, accumulate); break;
      case 2: GemmTile<2>(j, w, k, ai, lda, b, ci, ldc, accumulate); break;
      case 1: GemmTile<1>(j, w, k, ai, lda, b, ci, ldc, accumulate); break;
      default: break;
    }
  }
}

inline void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  Gemm(m, n, k, a, lda, Strided{b, ldb}, c, ldc, accumulate);
}

// The sum of a vector's lanes, halves added pairwise: a fixed order.
inline float SumLanes(Vec v) {
  float t[kLanes];
  std::memcpy(t, &v, sizeof t);
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  }
  return t[0];
}

// s[r][jj] = a[r] . keys[jj] for R rows of a (row stride dims) and keys
// [j, j + J): R x J vector accumulators along the head dim, each key row read
// once for all R rows; then the lanes, then the last dims % kLanes products.
template <int R, int J>
inline void DotTile(int64_t j, int64_t dims, const float* a, const float* const* keys, float* s,
                    int64_t lds) {
  const int64_t body = dims - dims % kLanes;
  Vec acc[R][J] = {};
  for (int64_t d = 0; d < body; d += kLanes) {
    Vec x[J];
    for (int h = 0; h < J; ++h) x[h] = LoadVec(keys[j + h] + d);
    for (int r = 0; r < R; ++r) {
      const Vec ar = LoadVec(a + r * dims + d);
      for (int h = 0; h < J; ++h) acc[r][h] += ar * x[h];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < J; ++h) {
      float dot = SumLanes(acc[r][h]);
      for (int64_t d = body; d < dims; ++d) dot += a[r * dims + d] * keys[j + h][d];
      s[r * lds + j + h] = dot;
    }
  }
}

// Software prefetch of the keys a decode pass reads next, spread over the
// passes before it: a decode step does a few products per key byte, too few
// to hide the memory's latency, and the hardware's prefetchers stop at every
// 4 KiB page. Lines [0, lines) from `rows` of `row_bytes` each.
class Prefetcher {
 public:
  void Clear() {
    rows_.clear();
    lines_ = 0;
    row_ = line_ = 0;
  }
  void Add(const void* row, int64_t bytes) {
    const int64_t lines = (bytes + 63) / 64;
    rows_.push_back({static_cast<const char*>(row), lines});
    lines_ += lines;
  }
  int64_t Lines() const { return lines_; }
  // Issues the next `count` lines (none once all are issued).
  void Step(int64_t count) {
    for (; count > 0 && row_ < rows_.size(); --count) {
      __builtin_prefetch(rows_[row_].start + 64 * line_, 0, 3);
      if (++line_ == rows_[row_].lines) {
        line_ = 0;
        ++row_;
      }
    }
  }

 private:
  struct Row {
    const char* start;
    int64_t lines;
  };
  std::vector<Row> rows_;
  int64_t lines_ = 0, line_ = 0;
  size_t row_ = 0;
};

template <int R>
inline void DotRows(int64_t nk, int64_t dims, const float* a, const float* const* keys, float* s,
                    int64_t lds, Prefetcher* ahead, int64_t per_pair) {
  int64_t j = 0;
  for (; j + 2 <= nk; j += 2) {
    if (ahead != nullptr) ahead->Step(per_pair);
    DotTile<R, 2>(j, dims, a, keys, s, lds);
  }
  if (j < nk) DotTile<R, 1>(j, dims, a, keys, s, lds);
}

// Scores s[r][jj] = a[r] . keys[jj], r < m, jj < nk, reading the keys where
// they lie: for the few rows of a decode step, where transposing a key block
// for the GEMM costs more than the products it feeds. `ahead` (or null) gets
// `lines` more prefetches issued, spread over the key pairs.
inline void DotScores(int64_t m, int64_t nk, int64_t dims, const float* a,
                      const float* const* keys, float* s, int64_t lds, Prefetcher* ahead,
                      int64_t lines) {
  const int64_t passes = (m + 3) / 4 * std::max<int64_t>(1, nk / 2);
  const int64_t per_pair = (lines + passes - 1) / passes;
  for (int64_t r = 0; r < m; r += 4) {
    const float* ar = a + r * dims;
    float* sr = s + r * lds;
    switch (std::min<int64_t>(4, m - r)) {
      case 4: DotRows<4>(nk, dims, ar, keys, sr, lds, ahead, per_pair); break;
      case 3: DotRows<3>(nk, dims, ar, keys, sr, lds, ahead, per_pair); break;
      case 2: DotRows<2>(nk, dims, ar, keys, sr, lds, ahead, per_pair); break;
      default: DotRows<1>(nk, dims, ar, keys, sr, lds, ahead, per_pair); break;
    }
  }
}

typedef int32_t VecI __attribute__((vector_size(ATTN_VEC_BYTES)));

inline Vec Splat(float f) { return Vec{} + f; }

// exp(x) per lane, branch-free: 2^n * e^r with n = round(x / ln2) (the
// 1.5 * 2^23 trick) and |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (relative error below 2e-7). x is clamped to [-87, 88]: callers pass scores
// minus a running maximum or the lse (<= ~0), and zero masked lanes themselves.
// (A C-style cast between vector types of one size reinterprets the bits.)
inline Vec ExpVec(Vec x) {
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  x = x > Splat(88.0f) ? Splat(88.0f) : x;
  const Vec shifted = x * 1.44269504088896341f + 12582912.0f;
  const Vec nf = shifted - 12582912.0f;
  const VecI n = (VecI)shifted - 0x4B400000;
  const Vec r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  Vec poly = Splat(1.0f / 5040.0f);
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const VecI bits = (n + 127) << 23;
  return poly * (Vec)bits;
}

// s[jj] = exp(s[jj] - shift) over whole vectors covering [a, e): the lanes
// just outside it (within the row's kBlockKeys, a multiple of kLanes) are
// overwritten too, and callers zero everything outside [a, e) afterwards.
inline void ExpShifted(float* s, int64_t a, int64_t e, float shift) {
  for (int64_t jj = a & ~int64_t{kLanes - 1}; jj < e; jj += kLanes) {
    StoreVec(s + jj, ExpVec(LoadVec(s + jj) - shift));
  }
}

// Reductions over [a, e) in a fixed order (vector lanes, then the lanes in turn,
// then the tail): the same bits on any thread.
inline float MaxRange(const float* s, int64_t a, int64_t e) {
  Vec m = Splat(kNegInf);
  int64_t jj = a;
  for (; jj + kLanes <= e; jj += kLanes) {
    const Vec x = LoadVec(s + jj);
    m = x > m ? x : m;
  }
  float out = kNegInf;
  for (int l = 0; l < kLanes; ++l) out = std::max(out, m[l]);
  for (; jj < e; ++jj) out = std::max(out, s[jj]);
  return out;
}

inline float SumRange(const float* s, int64_t a, int64_t e) {
  Vec acc{};
  int64_t jj = a;
  for (; jj + kLanes <= e; jj += kLanes) acc += LoadVec(s + jj);
  float out = 0.0f;
  for (int l = 0; l < kLanes; ++l) out += acc[l];
  for (; jj < e; ++jj) out += s[jj];
  return out;
}

// Zero a row of nk keys outside [a, e).
inline void ZeroOutside(float* s, int64_t a, int64_t e, int64_t nk) {
  for (int64_t jj = 0; jj < std::min(a, nk); ++jj) s[jj] = 0.0f;
  for (int64_t jj = std::max<int64_t>(e, 0); jj < nk; ++jj) s[jj] = 0.0f;
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

// delta = rowsum(dout * out) - d_lse, the softmax backward's per-row constant.
inline float RowDelta(const float* dov, const float* o, int64_t vdims, float dlse) {
  float delta = 0.0f;
  for (int64_t d = 0; d < vdims; ++d) delta += dov[d] * o[d];
  return delta - (std::isfinite(dlse) ? dlse : 0.0f);
}

// What the backward keeps per row of a tile: scaled q, dout, lse, delta, range.
struct RowTile {
  std::vector<float> qs, dov, lse, delta;
  std::vector<Range> range;
  int64_t first, last;  // the union of the rows' visible keys
};

struct BackwardArgs {
  const void *q, *k, *v, *out, *dout;
  const float *lse, *dlse;
  void *dq, *dk, *dv;
};

// Loads `rows` of the backward: row r is head rows.head(r) at rows.position(r).
void LoadRowTile(const Params& p, DType dtype, const BackwardArgs& x, const Rows& rows,
                 RowTile* t) {
  const Shape& s = p.shape;
  const int64_t m = rows.count(), dims = s.head_dim, vdims = s.v_head_dim;
  t->qs.resize(m * dims);
  t->dov.resize(m * vdims);
  t->lse.resize(m);
  t->delta.resize(m);
  t->range.resize(m);
  t->first = s.kv_len;
  t->last = 0;
  std::vector<float> o(vdims);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = rows.position(r), h = rows.head(r);
    t->range[r] = Visible(p, rows.b, i);
    if (t->range[r].lo < t->range[r].hi) {
      t->first = std::min(t->first, t->range[r].lo);
      t->last = std::max(t->last, t->range[r].hi);
    }
    LoadRow(dtype, x.q, QOffset(s, rows.b, i, h, dims), dims, t->qs.data() + r * dims);
    for (int64_t d = 0; d < dims; ++d) t->qs[r * dims + d] *= p.scale;
    LoadRow(dtype, x.dout, QOffset(s, rows.b, i, h, vdims), vdims, t->dov.data() + r * vdims);
    LoadRow(dtype, x.out, QOffset(s, rows.b, i, h, vdims), vdims, o.data());
    const int64_t at = (rows.b * s.q_heads + h) * s.q_len + i;
    t->lse[r] = x.lse[at];
    t->delta[r] = RowDelta(t->dov.data() + r * vdims, o.data(), vdims, x.dlse[at]);
  }
}

// Probabilities P and dS of a tile's rows against one key block (kt: K
// transposed [D][kBlockKeys], vt: V transposed [Dv][kBlockKeys]), each
// [m][kBlockKeys], zero outside every row's visible keys:
// p = exp(s - lse), ds = p * (dp - delta), times 1 - tanh^2 under softcap.
void TileGradients(const Params& p, const RowTile& t, int64_t m, int64_t j0, int64_t nk,
                   const float* kt, const float* vt, float* prob, float* ds, float* tanh_buf) {
  const int64_t dims = p.shape.head_dim, vdims = p.shape.v_head_dim;
  Gemm(m, nk, dims, t.qs.data(), dims, kt, kBlockKeys, prob, kBlockKeys, false);
  Gemm(m, nk, vdims, t.dov.data(), vdims, vt, kBlockKeys, ds, kBlockKeys, false);
  for (int64_t r = 0; r < m; ++r) {
    int64_t a, e;
    BlockSpan(t.range[r], j0, nk, &a, &e);
    float* pr = prob + r * kBlockKeys;
    float* dr = ds + r * kBlockKeys;
    if (a < e) {
      if (p.softcap > 0.0f) Softcap(p, a, e, pr, tanh_buf);
      const float delta = t.delta[r];
      ExpShifted(pr, a, e, t.lse[r]);
      for (int64_t jj = a; jj < e; ++jj) dr[jj] = pr[jj] * (dr[jj] - delta);
      if (p.softcap > 0.0f) {
        for (int64_t jj = a; jj < e; ++jj) dr[jj] *= 1.0f - tanh_buf[jj] * tanh_buf[jj];
      }
    } else {
      a = e = 0;
    }
    ZeroOutside(pr, a, e, nk);
    ZeroOutside(dr, a, e, nk);
  }
}

// The rows of a dense item (Rows) as ForwardTile reads them.
struct DenseView {
  const Params& p;
  Rows rows;
  int64_t count() const { return rows.count(); }
  int64_t q_offset(int64_t r, int64_t width) const {
    return QOffset(p.shape, rows.b, rows.position(r), rows.head(r), width);
  }
  int64_t lse_index(int64_t r) const {
    return (rows.b * p.shape.q_heads + rows.head(r)) * p.shape.q_len + rows.position(r);
  }
  Range range(int64_t r) const { return Visible(p, rows.b, rows.position(r)); }
  DenseKeys keys() const { return {p.shape, rows.b, rows.g}; }
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
  std::vector<float> qs, acc, row_max, row_sum, kt, sc, scratch;
  std::vector<const float*> krows, vrows;
  std::vector<Range> range;
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;  // the rows' visible keys

  TileState(const Params& params, DType type, const View& v, const void* q)
      : p(params), dtype(type), view(v), m(v.count()), dims(params.shape.head_dim),
        vdims(params.shape.v_head_dim), dot(m <= kDotRows), qs(m * dims), acc(m * vdims, 0.0f),
        row_max(m, kNegInf), row_sum(m, 0.0f), kt(dot ? 0 : dims * kBlockKeys),
        sc(m * kBlockKeys),
        // One widening scratch for bfloat16 K then V: K's rows are done with
        // once the scores are.
        scratch(Scratch(type, kBlockKeys * std::max(dims, vdims))), krows(kBlockKeys),
        vrows(kBlockKeys), range(m) {
    for (int64_t r = 0; r < m; ++r) {
      range[r] = view.range(r);
      if (range[r].lo < range[r].hi) {
        first = std::min(first, range[r].lo);
        last = std::max(last, range[r].hi);
      }
      LoadRow(dtype, q, view.q_offset(r, dims), dims, qs.data() + r * dims);
      for (int64_t d = 0; d < dims; ++d) qs[r * dims + d] *= p.scale;
    }
  }

  // Keys [j0, j0 + nk), nk <= kBlockKeys; `lines` prefetches of `ahead` (or
  // null) are issued along the way.
  void AddBlock(const void* k, const void* v, int64_t j0, int64_t nk, Prefetcher* ahead,
                int64_t lines) {
    const auto keys = view.keys();
    KeyRows(dtype, k, dims, keys, j0, nk, scratch.data(), krows.data());
    if (dot) {
      DotScores(m, nk, dims, qs.data(), krows.data(), sc.data(), kBlockKeys, ahead, lines);
    } else {
      TransposeRows(krows.data(), nk, dims, kt.data());
      Gemm(m, nk, dims, qs.data(), dims, kt.data(), kBlockKeys, sc.data(), kBlockKeys, false);
    }
    for (int64_t r = 0; r < m; ++r) {
      int64_t a, e;
      BlockSpan(range[r], j0, nk, &a, &e);
      float* sr = sc.data() + r * kBlockKeys;
      if (a >= e) {  // this row sees none of the block: it adds nothing
        for (int64_t jj = 0; jj < nk; ++jj) sr[jj] = 0.0f;
        continue;
      }
      if (p.softcap > 0.0f) Softcap(p, a, e, sr, nullptr);
      const float new_max = std::max(row_max[r], MaxRange(sr, a, e));
      const float alpha = std::exp(row_max[r] - new_max);  // 0 on the row's first block
      ExpShifted(sr, a, e, new_max);
      const float sum = SumRange(sr, a, e);
      ZeroOutside(sr, a, e, nk);
      row_sum[r] = row_sum[r] * alpha + sum;
      row_max[r] = new_max;
      float* o = acc.data() + r * vdims;
      for (int64_t d = 0; d < vdims; ++d) o[d] *= alpha;
    }
    KeyRows(dtype, v, vdims, keys, j0, nk, scratch.data(), vrows.data());
    Gemm(m, vdims, nk, sc.data(), kBlockKeys, RowList{vrows.data()}, acc.data(), vdims, true);
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

void ForwardItem(const Params& p, DType dtype, const void* q, const void* k, const void* v,
                 void* out, float* lse, int64_t item) {
  ForwardTile(p, dtype, DenseView{p, ItemRows(p, item)}, q, k, v, out, lse);
}

// Paged: key j of sequence seq lives in page table[seq][j / page_size] at
// offset j % page_size of the canonical cache [num_pages, page_size, Hkv, D].
// A page index outside the pool is clamped into it (never read out of bounds).
struct PagedKeys {
  const PagedArgs& a;
  int64_t seq, g, kv_heads;
  // One division per block, not per key: a block walks its pages in order.
  template <class F>
  void Each(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    int64_t slot = j0 / a.page_size, in_page = j0 % a.page_size, start = 0;
    for (int64_t jj = 0; jj < nk; ++jj) {
      if (jj == 0 || in_page == 0) {
        int64_t page = a.page_table[seq * a.table_width + slot];
        page = std::min<int64_t>(std::max<int64_t>(page, 0), a.num_pages - 1);
        start = page * a.page_size;
      }
      f(jj, ((start + in_page) * kv_heads + g) * width);
      if (++in_page == a.page_size) {
        in_page = 0;
        ++slot;
      }
    }
  }
};

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
};

// Decode: calls with few query rows per kv head (group x positions <=
// kDotRows), where the time is the reading of K and V. A decode item is one
// batch row (or sequence) and one split of kSplitKeys keys, holding the rows
// of every kv head: block by block it reads keys [j0, j0 + kDecodeBlock) of all
// heads (one contiguous run per key in the dense and the paged layouts) and
// prefetches the next block while it computes on this one. Its partial softmax
// (max, sum and unnormalised output of each row) goes to a workspace that
// MergeSplits combines in split order; the splits depend on the shapes alone,
// so the answer does not depend on the threads.
constexpr int64_t kDecodeBlock = 32;
constexpr int64_t kSplitKeys = 512;

inline bool IsDecode(const Shape& s, int64_t positions) {
  return positions * (s.q_heads / s.kv_heads) <= kDotRows;
}

// One decode item's partial softmax: rows = kv heads x rows per head.
struct Partial {
  float *max, *sum, *acc;  // [rows], [rows], [rows][Dv]
};

// The partials of `items` decode items of `rows` rows each.
class DecodeWork {
 public:
  DecodeWork(int64_t items, int64_t rows, int64_t vdims)
      : rows_(rows), vdims_(vdims), data_(items * rows * (vdims + 2)) {}
  Partial at(int64_t item) {
    float* base = data_.data() + item * rows_ * (vdims_ + 2);
    return {base, base + rows_, base + 2 * rows_};
  }

 private:
  int64_t rows_, vdims_;
  std::vector<float> data_;
};

// Keys [lo, hi) of one batch row or sequence, view_of(g) the View of kv head
// g's rows (every position), into `part`.
template <class ViewOf>
void DecodeSplit(const Params& p, DType dtype, const ViewOf& view_of, int64_t lo, int64_t hi,
                 const void* q, const void* k, const void* v, Partial part) {
  using View = decltype(view_of(0));
  const Shape& s = p.shape;
  std::vector<TileState<View>> heads;
  heads.reserve(s.kv_heads);
  for (int64_t g = 0; g < s.kv_heads; ++g) heads.emplace_back(p, dtype, view_of(g), q);
  // Every head's rows are the same positions, so see the same keys.
  lo = std::max(lo, heads[0].first);
  hi = std::min(hi, heads[0].last);
  const int64_t elem = dtype == DType::kF32 ? 4 : 2;
  const int64_t k_bytes = s.kv_heads * s.head_dim * elem, v_bytes = s.kv_heads * s.v_head_dim * elem;
  const auto row_start = view_of(0).keys();  // head 0: where each key's run of heads starts
  Prefetcher ahead;
  for (int64_t j0 = lo; j0 < hi; j0 += kDecodeBlock) {
    const int64_t nk = std::min(kDecodeBlock, hi - j0);
    ahead.Clear();
    // The next block's K rows, then its V rows: two runs in address order
    // (measured faster than K and V alternating, and than blocks of 16 or 128).
    const int64_t next = std::max<int64_t>(0, std::min(hi, j0 + nk + kDecodeBlock) - j0 - nk);
    row_start.Each(j0 + nk, next, s.head_dim, [&](int64_t, int64_t at) {
      ahead.Add(static_cast<const char*>(k) + at * elem, k_bytes);
    });
    row_start.Each(j0 + nk, next, s.v_head_dim, [&](int64_t, int64_t at) {
      ahead.Add(static_cast<const char*>(v) + at * elem, v_bytes);
    });
    const int64_t per_head = (ahead.Lines() + s.kv_heads - 1) / s.kv_heads;
    for (auto& head : heads) head.AddBlock(k, v, j0, nk, &ahead, per_head);
  }
  const int64_t m = heads[0].m, vdims = s.v_head_dim;
  for (int64_t g = 0; g < s.kv_heads; ++g) {
    for (int64_t r = 0; r < m; ++r) {
      part.max[g * m + r] = heads[g].row_max[r];
      part.sum[g * m + r] = heads[g].row_sum[r];
    }
    std::memcpy(part.acc + g * m * vdims, heads[g].acc.data(), m * vdims * sizeof(float));
  }
}

// out (and lse, if not null) of one batch row or sequence from its splits'
// partials, combined in split order.
template <class ViewOf>
void MergeSplits(const Params& p, DType dtype, const ViewOf& view_of, const Partial* parts,
                 int64_t splits, void* out, float* lse) {
  const Shape& s = p.shape;
  const int64_t vdims = s.v_head_dim;
  std::vector<float> o(vdims);
  for (int64_t g = 0; g < s.kv_heads; ++g) {
    const auto view = view_of(g);
    const int64_t m = view.count();
    for (int64_t r = 0; r < m; ++r) {
      const int64_t row = g * m + r;
      float max = kNegInf, sum = 0.0f;
      for (int64_t i = 0; i < splits; ++i) {
        if (parts[i].sum[row] > 0.0f) max = std::max(max, parts[i].max[row]);
      }
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t i = 0; i < splits; ++i) {
        if (!(parts[i].sum[row] > 0.0f)) continue;
        const float w = std::exp(parts[i].max[row] - max);
        sum += parts[i].sum[row] * w;
        const float* acc = parts[i].acc + row * vdims;
        for (int64_t d = 0; d < vdims; ++d) o[d] += acc[d] * w;
      }
      StoreNormalised(dtype, out, view.q_offset(r, vdims), vdims, o.data(), max, sum,
                      lse == nullptr ? nullptr : lse + view.lse_index(r));
    }
  }
}

inline int64_t Splits(int64_t kv_len) { return (kv_len + kSplitKeys - 1) / kSplitKeys; }

// The dense forward of a decode call: items (batch row, split), then a merge per batch row.
void DenseDecode(const Params& p, DType dtype, const void* q, const void* k, const void* v,
                 void* out, float* lse, const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  const int64_t group = s.q_heads / s.kv_heads, splits = Splits(s.kv_len);
  auto view_of = [&p, &s, group](int64_t b) {
    return [&p, &s, group, b](int64_t g) { return DenseView{p, Rows{b, g, 0, s.q_len, group}}; };
  };
  DecodeWork work(s.batch * splits, s.q_heads * s.q_len, s.v_head_dim);
  std::vector<Partial> parts(s.batch * splits);
  for (int64_t i = 0; i < s.batch * splits; ++i) parts[i] = work.at(i);
  parallel_for(s.batch * splits, [&](int64_t item) {
    const int64_t split = item % splits;
    DecodeSplit(p, dtype, view_of(item / splits), split * kSplitKeys, (split + 1) * kSplitKeys,
                q, k, v, parts[item]);
  });
  parallel_for(s.batch, [&](int64_t b) {
    MergeSplits(p, dtype, view_of(b), parts.data() + b * splits, splits, out, lse);
  });
}

void DqItem(const Params& p, DType dtype, const BackwardArgs& x, int64_t item) {
  const Shape& s = p.shape;
  const Rows rows = ItemRows(p, item);
  const int64_t m = rows.count(), dims = s.head_dim, vdims = s.v_head_dim;
  RowTile t;
  LoadRowTile(p, dtype, x, rows, &t);
  std::vector<float> dq(m * dims, 0.0f);
  std::vector<float> kt(dims * kBlockKeys), vt(vdims * kBlockKeys);
  std::vector<float> k_scratch = Scratch(dtype, kBlockKeys * dims);
  std::vector<float> v_scratch = Scratch(dtype, kBlockKeys * vdims);
  std::vector<const float*> krows(kBlockKeys), vrows(kBlockKeys);
  std::vector<float> prob(m * kBlockKeys), ds(m * kBlockKeys), tanh_buf(kBlockKeys);
  const DenseKeys keys{s, rows.b, rows.g};
  for (int64_t j0 = t.first; j0 < t.last; j0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, t.last - j0);
    KeyRows(dtype, x.k, dims, keys, j0, nk, k_scratch.data(), krows.data());
    TransposeRows(krows.data(), nk, dims, kt.data());
    KeyRows(dtype, x.v, vdims, keys, j0, nk, v_scratch.data(), vrows.data());
    TransposeRows(vrows.data(), nk, vdims, vt.data());
    TileGradients(p, t, m, j0, nk, kt.data(), vt.data(), prob.data(), ds.data(),
                  tanh_buf.data());
    Gemm(m, dims, nk, ds.data(), kBlockKeys, RowList{krows.data()}, dq.data(), dims, true);
  }
  for (int64_t r = 0; r < m; ++r) {
    StoreRow(dtype, x.dq, QOffset(s, rows.b, rows.position(r), rows.head(r), dims), dims,
             dq.data() + r * dims, p.scale);
  }
}

// dst[c][r] = src[r][c] for r < rows, c < cols (src row stride kBlockKeys).
inline void Transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * kBlockKeys + c];
  }
}

void DkvItem(const Params& p, DType dtype, const BackwardArgs& x, int64_t item) {
  const Shape& s = p.shape;
  const int64_t blocks = (s.kv_len + kBlockKeys - 1) / kBlockKeys;
  const int64_t kb_index = item % blocks, bg = item / blocks;
  const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t j0 = kb_index * kBlockKeys, nk = std::min(kBlockKeys, s.kv_len - j0);
  const int64_t dims = s.head_dim, vdims = s.v_head_dim, per = PositionsPerItem(s);
  const int64_t m_max = per * group;
  std::vector<float> kt(dims * kBlockKeys), vt(vdims * kBlockKeys);
  std::vector<float> scratch = Scratch(dtype, kBlockKeys * std::max(dims, vdims));
  std::vector<const float*> key_rows(kBlockKeys);
  std::vector<float> dk(kBlockKeys * dims, 0.0f), dv(kBlockKeys * vdims, 0.0f);
  std::vector<float> prob(m_max * kBlockKeys), ds(m_max * kBlockKeys), tanh_buf(kBlockKeys);
  std::vector<float> pt(kBlockKeys * m_max), dst(kBlockKeys * m_max);
  KeyRows(dtype, x.k, dims, DenseKeys{s, b, g}, j0, nk, scratch.data(), key_rows.data());
  TransposeRows(key_rows.data(), nk, dims, kt.data());
  KeyRows(dtype, x.v, vdims, DenseKeys{s, b, g}, j0, nk, scratch.data(), key_rows.data());
  TransposeRows(key_rows.data(), nk, vdims, vt.data());
  RowTile t;
  for (int64_t i0 = 0; i0 < s.q_len; i0 += per) {
    const int64_t positions = std::min(per, s.q_len - i0);
    bool sees = false;  // does any position of this tile see the block?
    for (int64_t i = i0; i < i0 + positions && !sees; ++i) {
      const Range r = Visible(p, b, i);
      sees = std::max(r.lo, j0) < std::min(r.hi, j0 + nk);
    }
    if (!sees) continue;
    const Rows rows{b, g, i0, positions, group};
    const int64_t m = rows.count();
    LoadRowTile(p, dtype, x, rows, &t);
    TileGradients(p, t, m, j0, nk, kt.data(), vt.data(), prob.data(), ds.data(),
                  tanh_buf.data());
    Transpose(prob.data(), m, nk, pt.data());
    Transpose(ds.data(), m, nk, dst.data());
    Gemm(nk, vdims, m, pt.data(), m, t.dov.data(), vdims, dv.data(), vdims, true);
    Gemm(nk, dims, m, dst.data(), m, t.qs.data(), dims, dk.data(), dims, true);
  }
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t row = (b * s.kv_len + j0 + jj) * s.kv_heads + g;
    StoreRow(dtype, x.dk, row * dims, dims, dk.data() + jj * dims, 1.0f);
    StoreRow(dtype, x.dv, row * vdims, vdims, dv.data() + jj * vdims, 1.0f);
  }
}

struct PagedItem {
  int64_t seq, start, t0, positions, q_len, kv_len;
};

}  // namespace

void PagedForward(const Params& p, const PagedArgs& a, DType dtype, const void* q,
                  const void* k, const void* v, void* out, const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  const int64_t rows = s.q_len, width = s.q_heads * s.v_head_dim;
  // Rows no counted sequence owns are zeros; so is every row first, so an
  // inconsistent cu_q_lens leaves zeros, never uninitialised memory.
  const size_t bytes = (dtype == DType::kF32 ? 4 : 2) * static_cast<size_t>(rows * width);
  std::memset(out, 0, bytes);
  const int64_t seqs = std::min<int64_t>(std::max<int64_t>(a.num_seqs, 0), a.seqs);
  const int64_t per = PositionsPerItem(s), capacity = a.table_width * a.page_size;
  // Sequences with few rows per kv head take the decode items (one per split,
  // then a merge per sequence), the others tiles of rows per kv head.
  std::vector<PagedItem> tiles, decodes;
  std::vector<int64_t> first_split;  // per decode sequence, its first item; then the total
  int64_t end = 0, splits = 0;
  for (int64_t seq = 0; seq < seqs; ++seq) {
    const int64_t start = std::max<int64_t>(end, std::min<int64_t>(a.cu_q_lens[seq], rows));
    end = std::max<int64_t>(start, std::min<int64_t>(a.cu_q_lens[seq + 1], rows));
    const int64_t kv_len = std::min<int64_t>(std::max<int64_t>(a.kv_lens[seq], 0), capacity);
    if (start < end && IsDecode(s, end - start)) {
      decodes.push_back({seq, start, start, end - start, end - start, kv_len});
      first_split.push_back(splits);
      splits += Splits(kv_len);
      continue;
    }
    for (int64_t t0 = start; t0 < end; t0 += per) {
      tiles.push_back({seq, start, t0, std::min(per, end - t0), end - start, kv_len});
    }
  }
  first_split.push_back(splits);
  const int64_t heads = s.kv_heads, tile_items = static_cast<int64_t>(tiles.size()) * heads;
  auto view_of = [&p, &a](const PagedItem& it) {
    return [&p, &a, it](int64_t g) {
      return PagedView{p, a, it.seq, g, it.start, it.t0, it.positions, it.q_len, it.kv_len};
    };
  };
  // Work rows per item: the widest decode sequence's (every one fits in kDotRows per head).
  int64_t widest = 0;
  for (const PagedItem& it : decodes) widest = std::max(widest, s.q_heads * it.positions);
  DecodeWork work(splits, widest, s.v_head_dim);
  std::vector<Partial> parts(splits);
  std::vector<int64_t> owner(splits);  // the decode sequence of each split item
  for (size_t d = 0; d < decodes.size(); ++d) {
    for (int64_t i = first_split[d]; i < first_split[d + 1]; ++i) {
      parts[i] = work.at(i);
      owner[i] = static_cast<int64_t>(d);
    }
  }
  parallel_for(tile_items + splits, [&](int64_t i) {
    if (i < tile_items) {
      const PagedItem& it = tiles[i / heads];
      ForwardTile(p, dtype, view_of(it)(i % heads), q, k, v, out, nullptr);
      return;
    }
    const int64_t item = i - tile_items, d = owner[item], split = item - first_split[d];
    DecodeSplit(p, dtype, view_of(decodes[d]), split * kSplitKeys, (split + 1) * kSplitKeys, q,
                k, v, parts[item]);
  });
  parallel_for(static_cast<int64_t>(decodes.size()), [&](int64_t d) {
    MergeSplits(p, dtype, view_of(decodes[d]), parts.data() + first_split[d],
                first_split[d + 1] - first_split[d], out, nullptr);
  });
}

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  if (IsDecode(p.shape, p.shape.q_len)) return DenseDecode(p, dtype, q, k, v, out, lse, parallel_for);
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

}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
