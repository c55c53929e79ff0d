// The dense bfloat16 forward with bfloat16 products: AVX512_BF16's vdpbf16ps
// multiplies pairs of bfloat16 values exactly and adds them into float32
// lanes, 32 products an instruction where an FMA on widened values does 16
// (issue 48, item 5: the forward on widened values took float32's time).
//
// The schedule is the dense forward's (attention.cc): work items of 64 query
// rows of one kv head's group, an online softmax in float32 over blocks of 128
// keys. What differs is the operands, packed once per call per (batch row,
// kv head) so the products read them as vdpbf16ps wants them:
//   K as pairs of head dims, [D/2][kv_pad] 32-bit words: word (p, j) holds
//     K[j][2p] (low half) and K[j][2p + 1]; one broadcast word of Q's row
//     against 16 keys' words gives 16 scores' next two terms;
//   V as pairs of keys, [kv_pad/2][dv_pad] words: word (jp, d) holds V[2jp][d]
//     and V[2jp + 1][d]; the weights, rounded to bfloat16, pair the same way.
// Keys at or past a batch row's kv_length are packed as zeros (never read:
// a 0 weight times a NaN there would be NaN). Q is read unscaled (exact in
// bfloat16) and the scale applied to the float32 scores; the weights are
// rounded to bfloat16 for the product with V, their sum taken in float32
// before rounding (as FlashAttention-2 does on GPUs).
//
// Compiled once, for x86-64-v4 with AVX512_BF16 (CMakeLists.txt), and run by
// dispatch.cc where the CPU has AVX512_BF16. Sums run in an order fixed by
// the shapes: the same bits at every thread count.
#include "kernel_tiles.h"

#include <immintrin.h>

#include <type_traits>

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

constexpr int64_t kWords = 16;    // 32-bit words (bfloat16 pairs, float32 lanes) per register
constexpr int64_t kKeyStep = 64;  // keys per score tile: four registers
constexpr int kPairRows = 6;      // query rows per tile: 6 x 4 accumulators + 4 + 1 registers
static_assert(kBlockKeys % kKeyStep == 0, "a block of keys is whole score tiles");

inline int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Both operands of one call, packed per (batch row, kv head) `bg`.
struct Packed {
  int64_t pairs, kv_pad, dv_pad;  // D/2 rounded up, keys to kKeyStep, Dv to kWords
  std::vector<uint32_t> k, v;
  const uint32_t* k_of(int64_t bg) const { return k.data() + bg * pairs * kv_pad; }
  const uint32_t* v_of(int64_t bg) const { return v.data() + bg * (kv_pad / 2) * dv_pad; }
};

// The bfloat16 bits of K (or V) row j of (b, g), element d; 0 past `width`.
inline uint32_t Element(const uint16_t* x, const Shape& s, int64_t b, int64_t g, int64_t j,
                        int64_t d, int64_t width) {
  return d < width ? x[((b * s.kv_len + j) * s.kv_heads + g) * width + d] : 0u;
}

Packed Pack(const Params& p, const uint16_t* k, const uint16_t* v,
            const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  Packed pk{(s.head_dim + 1) / 2, RoundUp(s.kv_len, kKeyStep), RoundUp(s.v_head_dim, kWords),
            {}, {}};
  const int64_t heads = s.batch * s.kv_heads;
  pk.k.assign(heads * pk.pairs * pk.kv_pad, 0u);
  pk.v.assign(heads * (pk.kv_pad / 2) * pk.dv_pad, 0u);
  parallel_for(heads, [&](int64_t bg) {
    const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads;
    int64_t keys = s.kv_len;
    if (p.vis.kv_lengths != nullptr) {
      keys = std::max<int64_t>(0, std::min<int64_t>(keys, p.vis.kv_lengths[b]));
    }
    uint32_t* kp = pk.k.data() + bg * pk.pairs * pk.kv_pad;
    uint32_t* vp = pk.v.data() + bg * (pk.kv_pad / 2) * pk.dv_pad;
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t q = 0; q < pk.pairs; ++q) {
        kp[q * pk.kv_pad + j] = Element(k, s, b, g, j, 2 * q, s.head_dim) |
                                Element(k, s, b, g, j, 2 * q + 1, s.head_dim) << 16;
      }
      const int shift = j % 2 == 0 ? 0 : 16;
      for (int64_t d = 0; d < s.v_head_dim; ++d) {
        vp[(j / 2) * pk.dv_pad + d] |= Element(v, s, b, g, j, d, s.v_head_dim) << shift;
      }
    }
  });
  return pk;
}

inline __m512bh AsPairs(__m512i x) { return (__m512bh)x; }

// s[r][c] = scale * (Q row r . K key c) for R rows and kKeyStep keys: qp
// [R][pairs] words (row stride pairs), kp the first key's column of the packed
// K (row stride kv_pad), s row stride lds.
template <int R>
inline void ScoreTile(const uint32_t* qp, int64_t pairs, const uint32_t* kp, int64_t kv_pad,
                      float scale, float* s, int64_t lds) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t q = 0; q < pairs; ++q) {
    const uint32_t* kq = kp + q * kv_pad;
    __m512bh b[4];
    for (int c = 0; c < 4; ++c) b[c] = AsPairs(_mm512_loadu_si512(kq + c * kWords));
    for (int r = 0; r < R; ++r) {
      const __m512bh a = AsPairs(_mm512_set1_epi32(static_cast<int>(qp[r * pairs + q])));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * lds + c * kWords, acc[r][c] * sv);
  }
}

// acc[r][c] += sum over key pairs jp of weights pw[r][jp] . V pair jp, for R
// rows and C registers of Dv: pw [R][jpairs] words (row stride ldw), vp the
// first pair's row of the packed V (row stride dv_pad), acc row stride lda.
template <int R, int C>
inline void ValueTile(const uint32_t* pw, int64_t ldw, int64_t jpairs, const uint32_t* vp,
                      int64_t dv_pad, float* acc, int64_t lda) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_loadu_ps(acc + r * lda + c * kWords);
  }
  for (int64_t jp = 0; jp < jpairs; ++jp) {
    const uint32_t* vj = vp + jp * dv_pad;
    __m512bh b[C];
    for (int c = 0; c < C; ++c) b[c] = AsPairs(_mm512_loadu_si512(vj + c * kWords));
    for (int r = 0; r < R; ++r) {
      const __m512bh a = AsPairs(_mm512_set1_epi32(static_cast<int>(pw[r * ldw + jp])));
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * lda + c * kWords, o[r][c]);
  }
}

template <int R>
void ValueRows(const uint32_t* pw, int64_t ldw, int64_t jpairs, const uint32_t* vp,
               int64_t dv_pad, float* acc) {
  for (int64_t c0 = 0; c0 < dv_pad; c0 += 4 * kWords) {
    float* a = acc + c0;
    const uint32_t* v = vp + c0;
    switch (std::min<int64_t>(4, (dv_pad - c0) / kWords)) {
      case 4: ValueTile<R, 4>(pw, ldw, jpairs, v, dv_pad, a, dv_pad); break;
      case 3: ValueTile<R, 3>(pw, ldw, jpairs, v, dv_pad, a, dv_pad); break;
      case 2: ValueTile<R, 2>(pw, ldw, jpairs, v, dv_pad, a, dv_pad); break;
      default: ValueTile<R, 1>(pw, ldw, jpairs, v, dv_pad, a, dv_pad); break;
    }
  }
}

// f(R, r): row groups of kPairRows (the last one shorter) with R a constant.
template <class F>
inline void RowGroups(int64_t m, const F& f) {
  for (int64_t r = 0; r < m; r += kPairRows) {
    switch (std::min<int64_t>(kPairRows, m - r)) {
      case 6: f(std::integral_constant<int, 6>{}, r); break;
      case 5: f(std::integral_constant<int, 5>{}, r); break;
      case 4: f(std::integral_constant<int, 4>{}, r); break;
      case 3: f(std::integral_constant<int, 3>{}, r); break;
      case 2: f(std::integral_constant<int, 2>{}, r); break;
      default: f(std::integral_constant<int, 1>{}, r); break;
    }
  }
}

// Weights row w [n] (n a multiple of 32) rounded to bfloat16 pairs at out.
inline void ToPairs(const float* w, int64_t n, uint32_t* out) {
  for (int64_t jj = 0; jj < n; jj += 2 * kWords) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + jj + kWords), _mm512_loadu_ps(w + jj));
    _mm512_storeu_si512(out + jj / 2, (__m512i)h);
  }
}

// One item's rows over the keys they see, blocks of kBlockKeys from the first
// visible key rounded down to kKeyStep (pairs of keys never straddle a block).
void ForwardItem(const Params& p, const Packed& pk, const uint16_t* q, uint16_t* out,
                 float* lse, int64_t item) {
  const Shape& s = p.shape;
  const DenseView view{p, ItemRows(p, item)};
  const int64_t m = view.count(), vdims = s.v_head_dim, bg = view.rows.b * s.kv_heads + view.rows.g;
  std::vector<uint32_t> qp(m * pk.pairs, 0u), pw(m * kBlockKeys / 2);
  std::vector<float> acc(m * pk.dv_pad, 0.0f), sc(m * kBlockKeys), row_max(m, kNegInf),
      row_sum(m, 0.0f);
  std::vector<Range> range(m);
  int64_t first = s.kv_len, last = 0;
  for (int64_t r = 0; r < m; ++r) {
    range[r] = view.range(r);
    if (range[r].lo < range[r].hi) {
      first = std::min(first, range[r].lo);
      last = std::max(last, range[r].hi);
    }
    std::memcpy(qp.data() + r * pk.pairs, q + view.q_offset(r, s.head_dim),
                s.head_dim * sizeof(uint16_t));
  }
  const uint32_t* kp = pk.k_of(bg);
  const uint32_t* vp = pk.v_of(bg);
  for (int64_t j0 = first / kKeyStep * kKeyStep; j0 < last; j0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, RoundUp(last, kKeyStep) - j0);
    RowGroups(m, [&](auto rows, int64_t r) {
      for (int64_t c = 0; c < nk; c += kKeyStep) {
        ScoreTile<decltype(rows)::value>(qp.data() + r * pk.pairs, pk.pairs, kp + j0 + c, pk.kv_pad, p.scale,
                          sc.data() + r * kBlockKeys + c, kBlockKeys);
      }
    });
    for (int64_t r = 0; r < m; ++r) {
      float* sr = sc.data() + r * kBlockKeys;
      SoftmaxStep(p, range[r], j0, nk, sr, &row_max[r], &row_sum[r],
                  acc.data() + r * pk.dv_pad, vdims);
      ToPairs(sr, nk, pw.data() + r * kBlockKeys / 2);
    }
    RowGroups(m, [&](auto rows, int64_t r) {
      ValueRows<decltype(rows)::value>(pw.data() + r * kBlockKeys / 2, kBlockKeys / 2, nk / 2,
                        vp + (j0 / 2) * pk.dv_pad, pk.dv_pad, acc.data() + r * pk.dv_pad);
    });
  }
  for (int64_t r = 0; r < m; ++r) {
    StoreNormalised(DType::kBF16, out, view.q_offset(r, vdims), vdims,
                    acc.data() + r * pk.dv_pad, row_max[r], row_sum[r],
                    lse == nullptr ? nullptr : lse + view.lse_index(r));
  }
}

}  // namespace

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  // float32 calls, and decode calls (a few rows: bound by reading K and V,
  // decode.cc), run x86-64-v3's kernels.
  if (dtype != DType::kBF16 || IsDecode(p.shape, p.shape.q_len)) {
    return isa_v3::Forward(p, dtype, q, k, v, out, lse, parallel_for);
  }
  const Packed pk = Pack(p, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                         parallel_for);
  parallel_for(QueryItems(p.shape), [&](int64_t item) {
    ForwardItem(p, pk, static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out), lse, item);
  });
}

}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
