// The arithmetic of the kernels, free of attention: OpenBLAS's sgemm, a GEMM
// on vectors (GCC/Clang vector extensions), dot products over rows in place,
// a software prefetcher, the vector exp and the row reductions, each summing
// in an order fixed by the shapes alone; the values they read, widened to
// float32, are vec_values.h's.
//
// Included by the kernels' translation units (attention.cc, decode.cc,
// bf16_forward.cc), which are compiled once per instruction set: ATTN_ISA
// names the namespace and ATTN_VEC_BYTES the vector width (CMakeLists.txt).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <cblas.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention.h"
#include "vec_values.h"

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
// The backward's items in all (when there are key blocks enough), and the most
// memory its partial dq sums may take (KeyChunks, attention.cc).
constexpr int64_t kBackwardItems = 16;
constexpr int64_t kPartialBytes = int64_t{256} << 20;
#ifndef ATTN_DOT_ROWS
#define ATTN_DOT_ROWS 8
#endif
// Tiles of at most this many query rows take their scores by dot products
// over the keys in place (DotScores), larger ones by the GEMM on a transposed
// key block.
constexpr int64_t kDotRows = ATTN_DOT_ROWS;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();


// The stride (in floats) of rows[0..n) if rows[jj] = rows[0] + jj * stride
// for all of them (a block inside one batch row, or widened into scratch), else
// 0 (a paged block across pages). n >= 2 for a stride; one row is its width.
inline int64_t UniformStride(const float* const* rows, int64_t n, int64_t width) {
  if (n < 2) return width;
  const int64_t stride = rows[1] - rows[0];
  if (stride < width) return 0;
  for (int64_t jj = 2; jj < n; ++jj) {
    if (rows[jj] - rows[0] != jj * stride) return 0;
  }
  return stride;
}

// C[m][n] = beta * C + op(A) . op(B), float32 row-major, op = transposed
// where asked: OpenBLAS's sgemm on the calling thread (dispatch.cc sets its
// threads to 1), for the blocks of the dense kernels; measured faster than
// Gemm below on them (README).
inline void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
                    static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
                    static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
                    static_cast<blasint>(ldc));
}

// KeyRows' scratch: none for float32, read in place.
inline std::vector<float> Scratch(DType dtype, int64_t size) {
  return std::vector<float>(dtype == DType::kF32 ? 0 : size);
}

// C[m][n] = (accumulate ? C : 0) + A[m][k] . B[k][n], float32, row strides lda
// and ldc, B's row kk at b[kk] (Strided: a matrix; RowList: rows anywhere), for
// the products Sgemm cannot take as strided matrices (a paged block across
// pages, the few rows of a decode step): tiles of 6 rows x 2 vectors of columns held in
// vectors (GCC/Clang vector extensions: one AVX register each on x86-64-v3,
// one SSE register of 4 on the baseline), k summed in order, so each element's sum
// is the same whatever the tile it falls in.

// Rows of a GEMM tile: each row holds two vector accumulators, so 6 rows (12
// registers) leave room for B's two vectors and A's broadcast in 16 registers.
constexpr int kTileRows = 6;

// One tile: rows [0, R) x columns [j, j + w) of C, w = 2 * kLanes (full) or
// less (the last columns, plain loops).
struct Strided {
  const float* b;
  int64_t ldb;
  const float* operator[](int64_t kk) const { return b + kk * ldb; }
};

template <class T>  // float, or uint16_t for bfloat16
struct RowList {
  const T* const* rows;
  const T* operator[](int64_t kk) const { return rows[kk]; }
};

template <class T>
RowList<T> RowListOf(const T* const* rows) {
  return {rows};
}

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
      const auto* bk = b[kk];
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
      const auto* bk = b[kk];
      for (int64_t x = j; x < j + w; ++x) cr[x] += ar * ToF32(bk[x]);
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

// Pair sums within 128-bit halves: [x0+x1, x2+x3, y0+y1, y2+y3] in each half
// of the result (x's lanes of that half, then y's): one shuffle per operand.
#if ATTN_VEC_BYTES == 32
#define ATTN_EVEN 0, 2, 8, 10, 4, 6, 12, 14
#define ATTN_ODD 1, 3, 9, 11, 5, 7, 13, 15
#else
#define ATTN_EVEN 0, 2, 4, 6
#define ATTN_ODD 1, 3, 5, 7
#endif
#if defined(__clang__)
#define ATTN_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define ATTN_SHUFFLE(x, y, ...) __builtin_shuffle(x, y, VecI{__VA_ARGS__})
#endif
typedef int32_t VecI __attribute__((vector_size(ATTN_VEC_BYTES)));

inline Vec PairSums(Vec x, Vec y) {
  return ATTN_SHUFFLE(x, y, ATTN_EVEN) + ATTN_SHUFFLE(x, y, ATTN_ODD);
}

// Lane i of the result: the sum of v[i]'s lanes, added in a fixed tree
// (adjacent lanes, then adjacent pairs, then the two 128-bit halves), for
// kLanes vectors at once: a transpose by shuffles, not a round trip of each
// vector through memory (measured: plugin README).
inline Vec LaneSums(const Vec* v) {
  Vec p[kLanes / 2], q[kLanes / 4];
  for (int i = 0; i < kLanes / 2; ++i) p[i] = PairSums(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < kLanes / 4; ++i) q[i] = PairSums(p[2 * i], p[2 * i + 1]);
#if ATTN_VEC_BYTES == 32
  return ATTN_SHUFFLE(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         ATTN_SHUFFLE(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
  return q[0];
#endif
}

// Keys per dot tile of R rows: R x J accumulators fill one LaneSums (8 on
// x86-64-v3) and 16 registers.
constexpr int DotKeys(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : 2; }

// s[r][jj] = a[r] . keys[jj] for R rows of a (row stride dims) and keys
// [j, j + J): R x J vector accumulators along the head dim, each key row read
// once for all R rows; then their lanes (LaneSums), then the last dims %
// kLanes products.
template <int R, int J, class T>
inline void DotTile(int64_t j, int64_t dims, const float* a, const T* const* keys, float* s,
                    int64_t lds) {
  constexpr int n = R * J;
  const int64_t body = dims - dims % kLanes;
  Vec acc[n];
  for (int i = 0; i < n; ++i) acc[i] = Vec{};
  for (int64_t d = 0; d < body; d += kLanes) {
    Vec x[J];
    for (int h = 0; h < J; ++h) x[h] = LoadVec(keys[j + h] + d);
    for (int r = 0; r < R; ++r) {
      const Vec ar = LoadVec(a + r * dims + d);
      for (int h = 0; h < J; ++h) acc[r * J + h] += ar * x[h];
    }
  }
  for (int i0 = 0; i0 < n; i0 += kLanes) {
    Vec group[kLanes];
    for (int i = 0; i < kLanes; ++i) group[i] = i0 + i < n ? acc[i0 + i] : Vec{};
    const Vec sums = LaneSums(group);
    for (int i = 0; i < kLanes && i0 + i < n; ++i) {
      const int r = (i0 + i) / J, h = (i0 + i) % J;
      float dot = sums[i];
      for (int64_t d = body; d < dims; ++d) dot += a[r * dims + d] * ToF32(keys[j + h][d]);
      s[r * lds + j + h] = dot;
    }
  }
}

// Software prefetch of the K and V rows a decode pass reads next, spread over
// the passes before it: a decode step does a few products per key byte, too
// few to hide the memory's latency, and the hardware's prefetchers stop at
// every 4 KiB page. Issues, in order, the 64-byte lines of the rows given to
// Add (the lines each row's bytes touch; a row that starts in or right after
// the previous one's lines extends it: the runs of a page's keys, and their
// scales, are one run each).
// Into the outer caches (locality 1: prefetcht2), not L1: a block is larger
// than L1 and its lines would only be evicted there before their turn
// (measured against prefetcht0: plugin README).
class Prefetcher {
 public:
  // Room for `rows` rows from the start: growing it row by row allocated seven
  // times per decode item (perf: 5% of an int8 decode step).
  explicit Prefetcher(size_t rows) { rows_.reserve(rows); }
  void Clear() {
    rows_.clear();
    lines_ = 0;
    row_ = line_ = 0;
  }
  void Add(const void* row, int64_t bytes) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(row);
    const int64_t first = static_cast<int64_t>(at / 64);
    const int64_t end = static_cast<int64_t>((at + bytes + 63) / 64);  // past its last line
    if (!rows_.empty()) {
      Row& last = rows_.back();
      if (first >= last.first && first <= last.first + last.lines) {
        const int64_t grown = std::max<int64_t>(0, end - (last.first + last.lines));
        last.lines += grown;
        lines_ += grown;
        return;
      }
    }
    rows_.push_back({first, end - first});
    lines_ += end - first;
  }
  int64_t Lines() const { return lines_; }
  // Issues the next `count` lines (none once all are issued).
  void Step(int64_t count) {
    // The position stays in locals while prefetching, so that no prefetch
    // waits on the store of the one before (plugin README, "Decode").
    const Row* rows = rows_.data();
    const size_t n = rows_.size();
    size_t row = row_;
    int64_t line = line_;
    while (count > 0 && row < n) {
      const int64_t take = std::min(count, rows[row].lines - line);
      const char* at = reinterpret_cast<const char*>((rows[row].first + line) * 64);
      for (int64_t l = 0; l < take; ++l) __builtin_prefetch(at + 64 * l, 0, 1);
      count -= take;
      line += take;
      if (line == rows[row].lines) {
        line = 0;
        ++row;
      }
    }
    row_ = row;
    line_ = line;
  }

 private:
  struct Row {
    int64_t first, lines;  // the first line's address / 64, and how many
  };
  std::vector<Row> rows_;
  int64_t lines_ = 0, line_ = 0;
  size_t row_ = 0;
};

// f(std::integral_constant<int, n>) for a group's n = 1..4 rows.
template <class F>
inline void ForRowCount(int64_t n, const F& f) {
  switch (n) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// The dot tiles of m rows x nk keys: rows in groups of up to 4 (R), each
// group's keys in tiles of J = KeysPer(R), then single keys (J = 1), as
// tile(R, J, r, j) with R and J std::integral_constants, r the group's first
// row and j the tile's first key; `lines` prefetches of `ahead` (or null)
// spread over the whole tiles, before each.
template <int (*KeysPer)(int), class Tile>
inline void DotTiles(int64_t m, int64_t nk, Prefetcher* ahead, int64_t lines, const Tile& tile) {
  int64_t tiles = 0;
  for (int64_t r = 0; r < m; r += 4) {
    tiles += nk / KeysPer(static_cast<int>(std::min<int64_t>(4, m - r)));
  }
  const int64_t per_tile = (lines + std::max<int64_t>(1, tiles) - 1) / std::max<int64_t>(1, tiles);
  for (int64_t r = 0; r < m; r += 4) {
    ForRowCount(std::min<int64_t>(4, m - r), [&](auto rows) {
      constexpr int J = KeysPer(decltype(rows)::value);
      int64_t j = 0;
      for (; j + J <= nk; j += J) {
        if (ahead != nullptr) ahead->Step(per_tile);
        tile(rows, std::integral_constant<int, J>{}, r, j);
      }
      for (; j < nk; ++j) tile(rows, std::integral_constant<int, 1>{}, r, j);
    });
  }
}

// Scores s[r][jj] = a[r] . keys[jj], r < m, jj < nk, reading the keys where
// they lie (T: float, or uint16_t for bfloat16): for the few rows of a decode
// step, where transposing a key block for the GEMM costs more than the
// products it feeds. `ahead` (or null) gets `lines` more prefetches issued,
// spread over the tiles.
template <class T>
void DotScores(int64_t m, int64_t nk, int64_t dims, const float* a, const T* const* keys,
               float* s, int64_t lds, Prefetcher* ahead, int64_t lines) {
  DotTiles<DotKeys>(m, nk, ahead, lines, [&](auto rows, auto keys_per, int64_t r, int64_t j) {
    DotTile<decltype(rows)::value, decltype(keys_per)::value>(j, dims, a + r * dims, keys,
                                                              s + r * lds, lds);
  });
}

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

}  // namespace
}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
