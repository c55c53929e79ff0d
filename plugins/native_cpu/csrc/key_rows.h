// Where a tile's keys are: the dense and paged layouts of K and V (and a
// quantized cache's scales), walked a run of consecutive keys at a time, and
// a block's rows found in place, widened or dequantized (kernel_tiles.h).
#pragma once

#include "kernel_math.h"

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

// Each key's offset from its run's (Keys::Runs): a walk of the pages once per
// block, not a page check per key.
template <class Keys, class F>
void EachOfRuns(const Keys& keys, int64_t kv_heads, int64_t j0, int64_t nk, int64_t width,
                const F& f) {
  const int64_t stride = kv_heads * width;
  keys.Runs(j0, nk, width, [&](int64_t jj, int64_t n, int64_t at) {
    for (int64_t i = 0; i < n; ++i) f(jj + i, at + i * stride);
  });
}

// Where key j of kv head g of batch row b starts in K (or V), width values a
// row. Keys types: Runs calls f(jj, n, offset) for runs of n keys j0 + jj...
// whose rows lie kv_heads * width values apart (offset: the run's first);
// Each calls f(jj, offset) for every key j0 + jj, jj < nk, in order.
struct DenseKeys {
  const Shape& s;
  int64_t b, g;
  template <class F>
  void Runs(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    if (nk > 0) f(0, nk, ((b * s.kv_len + j0) * s.kv_heads + g) * width);
  }
  template <class F>
  void Each(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    EachOfRuns(*this, s.kv_heads, j0, nk, width, f);
  }
};

// Pointers rows[jj] to the rows of K (or V) block [j0, j0 + nk) where they
// lie, T the element (float, or uint16_t for bfloat16's bits).
template <class T, class Keys>
void RowsInPlace(const void* src, int64_t width, const Keys& keys, int64_t j0, int64_t nk,
                 const T** rows) {
  keys.Each(j0, nk, width,
            [&](int64_t jj, int64_t at) { rows[jj] = static_cast<const T*>(src) + at; });
}

// K (or V) block [j0, j0 + nk) as float32 row pointers `rows[jj]`, the rows
// found by `keys` (DenseKeys, PagedKeys): float32 rows are read where they are
// (no copy), bfloat16 ones widened into `scratch` [nk][width].
template <class Keys>
void KeyRows(DType dtype, const void* src, int64_t width, const Keys& keys, int64_t j0,
             int64_t nk, float* scratch, const float** rows) {
  if (dtype == DType::kF32) return RowsInPlace(src, width, keys, j0, nk, rows);
  keys.Each(j0, nk, width, [&](int64_t jj, int64_t at) {
    LoadRow(dtype, src, at, width, scratch + jj * width);
    rows[jj] = scratch + jj * width;
  });
}

// A quantized cache's K (or V) block [j0, j0 + nk) dequantized into `scratch`
// [nk][width] (each row times its position's scale, `scales` indexed as the
// rows are, one per width values), as float32 row pointers `rows[jj]`.
template <class Keys>
void DequantizedRows(CacheType cache, const void* src, const float* scales, int64_t width,
                     const Keys& keys, int64_t j0, int64_t nk, float* scratch,
                     const float** rows) {
  keys.Each(j0, nk, width, [&](int64_t jj, int64_t at) {
    DequantizeRow(cache, src, at, width, scales[at / width], scratch + jj * width);
    rows[jj] = scratch + jj * width;
  });
}

// cols[d][jj] = rows[jj][d]: a key block transposed [width][kBlockKeys], for
// the GEMMs that take keys as columns.
inline void TransposeRows(const float* const* rows, int64_t nk, int64_t width, float* cols) {
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t d = 0; d < width; ++d) cols[d * kBlockKeys + jj] = rows[jj][d];
  }
}

// Paged: key j of sequence seq lives in page table[seq][j / page_size] at
// offset j % page_size of the canonical cache [num_pages, page_size, Hkv, D].
// A page index outside the pool is clamped into it (never read out of bounds).
struct PagedKeys {
  const PagedArgs& a;
  int64_t seq, g, kv_heads;
  // A run per page: one division per block, not per key.
  template <class F>
  void Runs(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    int64_t slot = j0 / a.page_size, in_page = j0 % a.page_size;
    for (int64_t jj = 0; jj < nk; ++slot, in_page = 0) {
      int64_t page = a.page_table[seq * a.table_width + slot];
      page = std::min<int64_t>(std::max<int64_t>(page, 0), a.num_pages - 1);
      const int64_t n = std::min(a.page_size - in_page, nk - jj);
      f(jj, n, ((page * a.page_size + in_page) * kv_heads + g) * width);
      jj += n;
    }
  }
  template <class F>
  void Each(int64_t j0, int64_t nk, int64_t width, const F& f) const {
    EachOfRuns(*this, kv_heads, j0, nk, width, f);
  }
};

}  // namespace
}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
