// A decode tile's products over a quantized cache by bfloat16 products
// (issue 48's decode aims): the int8 or float8 bytes of K and V widened to
// bfloat16 in registers by a table (exact: every int8 and float8 value is a
// bfloat16 value), multiplied by AVX512_BF16's vdpbf16ps, which sums pairs of
// exact products into float32 lanes: 32 products an instruction, against 8
// for an AVX2 FMA on values first widened to float32 (perf: the int8 step
// spent two thirds of its time there, bound by arithmetic, not memory).
//
// Only the x86-64-v4 + AVX512_BF16 build compiles this (CMakeLists.txt), and
// only calls whose queries are bfloat16 take it, so q is exact in the
// products; a float32 query keeps the float32 products. The weights are
// rounded to bfloat16 for their product with V, their sums kept in float32
// by the softmax, as the dense bfloat16 forward does (bf16_forward.cc).
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "kernel_math.h"

// GCC 12 warns of the _mm512_undefined_* operands inside its own permute and
// shuffle intrinsics (GCC bug 105593, fixed in 13): not this code's values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

// The bfloat16 bits of a cache type's magnitudes, bytes 0-127, as two
// 128-entry byte tables (low and high bytes), vpermt2b's operands: a byte's
// bfloat16 is its magnitude's with the sign bit set, as float8's sign bit
// is. int8 is two's complement: its magnitude (vpabsb) of -128 is 0x80,
// which vpermt2b reads as entry 0 (it takes the index's low 7 bits), so
// entry 0 holds 128 and a zero byte's high byte is masked to 0 instead.
struct ByteTables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};

template <class T>
ByteTables MakeTables() {
  ByteTables t;
  for (int b = 0; b < 128; ++b) {
    T value;
    const uint8_t byte = static_cast<uint8_t>(b);
    std::memcpy(&value, &byte, 1);
    // Exact: an int8 has 7 significant bits, a float8 at most 4, bfloat16 8;
    // float8's NaN and infinity keep their kind.
    const float f = std::is_same<T, int8_t>::value && b == 0 ? 128.0f : ToF32(value);
    const uint16_t bits = F32ToBf16(f);
    t.lo[b] = static_cast<uint8_t>(bits & 0xff);
    t.hi[b] = static_cast<uint8_t>(bits >> 8);
  }
  return t;
}

inline const ByteTables& TablesOf(CacheType cache) {
  static const ByteTables int8 = MakeTables<int8_t>(), e4m3 = MakeTables<E4M3>(),
                          e5m2 = MakeTables<E5M2>();
  return cache == CacheType::kInt8 ? int8 : cache == CacheType::kE4M3 ? e4m3 : e5m2;
}

// The tables in registers; kInt8: bytes are two's complement (else sign and
// magnitude, float8).
template <bool kInt8>
struct Widener {
  __m512i lo[2], hi[2];
  explicit Widener(const ByteTables& t) {
    for (int i = 0; i < 2; ++i) {
      lo[i] = _mm512_load_si512(t.lo + 64 * i);
      hi[i] = _mm512_load_si512(t.hi + 64 * i);
    }
  }
  // 64 bytes x as bfloat16 words: *a holds bytes 0-7 of each 128-bit lane
  // of x, *b bytes 8-15 (the order of vpunpcklbw / vpunpckhbw).
  void Widen(__m512i x, __m512i* a, __m512i* b) const {
    __m512i l, h;
    if (kInt8) {
      // Entry 0 is 128 (0x4300): its low byte is 0's too, its high byte not.
      const __m512i magnitude = _mm512_abs_epi8(x);
      l = _mm512_permutex2var_epi8(lo[0], magnitude, lo[1]);
      h = _mm512_maskz_permutex2var_epi8(_mm512_test_epi8_mask(x, x), hi[0], magnitude, hi[1]);
    } else {
      l = _mm512_permutex2var_epi8(lo[0], x, lo[1]);
      h = _mm512_permutex2var_epi8(hi[0], x, hi[1]);
    }
    // h | (x & 0x80): the byte's sign onto its bfloat16's.
    h = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
    *a = _mm512_unpacklo_epi8(l, h);
    *b = _mm512_unpackhi_epi8(l, h);
  }
};

// f(widener) with the widener of `cache`'s bytes.
template <class F>
inline void WithWidener(CacheType cache, const F& f) {
  if (cache == CacheType::kInt8) return f(Widener<true>(TablesOf(cache)));
  f(Widener<false>(TablesOf(cache)));
}

// q's row (bfloat16 bits, dims values) in the order Widen puts 64 key bytes
// into its two registers, zero-padded to a multiple of 64: out[64c + w] for
// word w of chunk c (w < 32: register a, else b).
inline void PermuteQuery(const uint16_t* q, int64_t dims, uint16_t* out) {
  const int64_t padded = (dims + 63) / 64 * 64;
  for (int64_t c = 0; c < padded; c += 64) {
    for (int w = 0; w < 64; ++w) {
      const int half = w / 32, lane = (w % 32) / 8, k = w % 8;
      const int64_t d = c + 16 * lane + 8 * half + k;
      out[c + w] = d < dims ? q[d] : 0;
    }
  }
}

inline __mmask64 LiveBytes(int64_t n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }

// Lane i of the result: the sum of v[i]'s 16 lanes (a transpose by shuffles,
// in a fixed tree, as LaneSums).
inline __m512 LaneSums16(const __m512* v) {
  __m512 p[8], q[4];
  for (int i = 0; i < 8; ++i) {
    p[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xdd));
  }
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0xdd));
  }
  // q[i]'s 128-bit lane L, element t: lane L's part of v[4i + t]'s sum.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88),
                                   _mm512_shuffle_f32x4(q[0], q[1], 0xdd));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88),
                                   _mm512_shuffle_f32x4(q[2], q[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

// s[r][j + h] = scale * (q[r] . key j + h), R rows x J keys (R * J <= 16
// accumulators), q permuted (PermuteQuery, row stride ldq), the keys' bytes
// read where they lie.
template <int R, int J, class W>
inline void QuantDotTile(const W& wd, int64_t j, int64_t dims, const uint16_t* q,
                         int64_t ldq, const uint8_t* const* keys, float scale, float* s,
                         int64_t lds) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dims; c += 64) {
    const __mmask64 live = LiveBytes(dims - c);
    for (int h = 0; h < J; ++h) {
      __m512i a, b;
      wd.Widen(_mm512_maskz_loadu_epi8(live, keys[j + h] + c), &a, &b);
      for (int r = 0; r < R; ++r) {
        const uint16_t* qr = q + r * ldq + c;
        __m512& x = acc[r * J + h];
        x = _mm512_dpbf16_ps(x, (__m512bh)a, (__m512bh)_mm512_loadu_si512(qr));
        x = _mm512_dpbf16_ps(x, (__m512bh)b, (__m512bh)_mm512_loadu_si512(qr + 32));
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, LaneSums16(acc));
  for (int i = 0; i < R * J; ++i) s[(i / J) * lds + j + i % J] = sums[i] * scale;
}

// Keys per tile of R rows: R x J accumulators fill 16 registers, one LaneSums16.
constexpr int QuantKeys(int rows) { return 16 / rows; }

// Scores s[r][jj] = scale * (q[r] . keys[jj]), r < m, jj < nk: QuantDotTile
// over DotTiles' tiles; `lines` more prefetches of `ahead` (or null) spread
// over the tiles, as DotScores.
inline void QuantScores(CacheType cache, int64_t m, int64_t nk, int64_t dims, const uint16_t* q,
                        int64_t ldq, const uint8_t* const* keys, float scale, float* s,
                        int64_t lds, Prefetcher* ahead, int64_t lines) {
  WithWidener(cache, [&](const auto& wd) {
    DotTiles<QuantKeys>(m, nk, ahead, lines, [&](auto rows, auto keys_per, int64_t r, int64_t j) {
      QuantDotTile<decltype(rows)::value, decltype(keys_per)::value>(
          wd, j, dims, q + r * ldq, ldq, keys, scale, s + r * lds, lds);
    });
  });
}

// vpermb's indices taking [32 bytes of key j | 32 of key j + 1] to the order
// whose Widen gives 32-bit lanes (V[j][d], V[j + 1][d]): register a d 0-15,
// b d 16-31, in order.
inline __m512i PairIndex() {
  alignas(64) uint8_t idx[64];
  for (int lane = 0; lane < 4; ++lane) {
    for (int t = 0; t < 4; ++t) {
      const int d = 4 * lane + t;
      idx[16 * lane + 2 * t] = static_cast<uint8_t>(d);
      idx[16 * lane + 2 * t + 1] = static_cast<uint8_t>(32 + d);
      idx[16 * lane + 8 + 2 * t] = static_cast<uint8_t>(16 + d);
      idx[16 * lane + 8 + 2 * t + 1] = static_cast<uint8_t>(48 + d);
    }
  }
  return _mm512_load_si512(idx);
}

// acc[r][d] += sum_jj w[r][jj] * rows[jj][d] for R rows, d in [d0, d0 + 32)
// (live: those < vdims), over nk keys in pairs; w as bfloat16 pairs wp[r][jp]
// (row stride ldw).
template <int R, class W>
inline void QuantSumChunk(const W& wd, __m512i pair_index, int64_t nk, int64_t d0,
                          int64_t vdims, const uint32_t* wp, int64_t ldw,
                          const uint8_t* const* rows, float* acc, int64_t ldacc) {
  const int64_t n = std::min<int64_t>(32, vdims - d0);
  const __mmask32 live = n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
  const __mmask16 lo = static_cast<__mmask16>(live), hi = static_cast<__mmask16>(live >> 16);
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) {
    a[r][0] = _mm512_maskz_loadu_ps(lo, acc + r * ldacc + d0);
    a[r][1] = _mm512_maskz_loadu_ps(hi, acc + r * ldacc + d0 + 16);
  }
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    // An odd block's last key pairs with zeros (at weight 0: wp's high half),
    // never with a row whose infinity would make 0 * inf a NaN.
    const bool odd = 2 * jp + 1 == nk;
    const __m256i x0 = _mm256_maskz_loadu_epi8(live, rows[2 * jp] + d0);
    const uint8_t* second = rows[odd ? 2 * jp : 2 * jp + 1];
    const __m256i x1 = _mm256_maskz_loadu_epi8(odd ? 0 : live, second + d0);
    const __m512i x = _mm512_permutexvar_epi8(
        pair_index, _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1));
    __m512i va, vb;
    wd.Widen(x, &va, &vb);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[r * ldw + jp]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)va, w);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)vb, w);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(acc + r * ldacc + d0, lo, a[r][0]);
    _mm512_mask_storeu_ps(acc + r * ldacc + d0 + 16, hi, a[r][1]);
  }
}

// acc[r][d] += sum_jj w[r][jj] * rows[jj][d], r < m, jj < nk, d < vdims: the
// weights w (float32, row stride ldw, 0 where a row sees no key) rounded to
// bfloat16 pairs, the values' bytes read where they lie.
inline void QuantWeightedSum(CacheType cache, int64_t m, int64_t nk, int64_t vdims,
                             const float* w, int64_t ldw, const uint8_t* const* rows, float* acc,
                             int64_t ldacc) {
  const __m512i pair_index = PairIndex();
  // Whole 64-byte stores of 32 keys' weights below: the blocks are of whole
  // 32s (kBlockKeys: ATTN_BK, 128 unless a build sets it).
  static_assert(kBlockKeys % 32 == 0, "QuantWeightedSum stores 32 keys' weight pairs at a time");
  constexpr int64_t kPairs = kBlockKeys / 2;
  alignas(64) uint32_t wp[kDotRows][kPairs];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < nk; j += 32) {
      const int64_t n = std::min<int64_t>(32, nk - j);
      const uint32_t live = n >= 32 ? ~0u : (1u << n) - 1;  // the block's keys, as 32 bits
      const __mmask16 lo = static_cast<__mmask16>(live), hi = static_cast<__mmask16>(live >> 16);
      const __m512 first = _mm512_maskz_loadu_ps(lo, w + r * ldw + j);
      const __m512 second = _mm512_maskz_loadu_ps(hi, w + r * ldw + j + 16);
      // Lower words from `second`'s argument position: keys j..j+15 first.
      _mm512_store_si512(wp[r] + j / 2, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
  }
  WithWidener(cache, [&](const auto& wd) {
    for (int64_t r = 0; r < m; r += 4) {
      const uint32_t* wr = wp[r];
      float* ar = acc + r * ldacc;
      for (int64_t d0 = 0; d0 < vdims; d0 += 32) {
        const auto chunk = [&](auto count) {
          QuantSumChunk<decltype(count)::value>(wd, pair_index, nk, d0, vdims, wr, kPairs, rows,
                                                ar, ldacc);
        };
        ForRowCount(std::min<int64_t>(4, m - r), chunk);
      }
    }
  });
}

}  // namespace
}  // namespace ATTN_ISA
}  // namespace attn_native_cpu

#pragma GCC diagnostic pop
