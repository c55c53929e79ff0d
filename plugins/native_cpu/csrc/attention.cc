// Flash attention forward and backward on CPU (FlashAttention-2's schedule):
// an online softmax over blocks of keys in float32, the backward recomputing
// the probabilities from the saved log-sum-exp.
//
// Work items: the forward takes (batch, kv head, block of query positions)
// and holds the rows of every query head of that kv head's group, so a GQA
// group reads each K/V block once. The backward takes (batch, kv head, chunk
// of key blocks): each (query tile, key block) pair's probabilities and dS
// are computed once and give dk and dv of the block (complete: the item holds
// every query tile) and the chunk's share of dq, kept apart per chunk and
// summed in chunk order at the end. A decode call (few query rows per kv
// head) takes (batch row, split of the keys) with every kv head's rows
// instead, reading each key's run of heads in address order, and merges the
// splits in order (decode.cc). Every item writes outputs no other item
// writes, the chunks are a function of the shape, and no arithmetic depends
// on the thread it runs on, so the answer is the same bit for bit at any
// thread count.
//
// Vectorisation: the dense blocks' products are OpenBLAS sgemm calls on the
// calling thread, a few rows' scores dot products over the keys in place, the
// exponentials a branch-free vector polynomial (GCC/Clang vector extensions);
// the rest are plain loops over contiguous float32 the compiler vectorises. No
// -ffast-math: every sum runs in an order fixed by the shapes alone
// (kernel_math.h). This file and decode.cc are compiled once per instruction
// set (CMakeLists.txt): for x86-64-v3
// (AVX2 + FMA; ATTN_ISA isa_v3) and for the baseline (ATTN_ISA
// isa_baseline); dispatch.cc picks one by the CPU's features at load.
#include "kernel_tiles.h"

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

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

// A dense K (or V) block as one matrix [nk][width] at `rows`, row stride ld:
// in place for float32, widened into scratch for bfloat16.
struct Block {
  const float* rows;
  int64_t ld;
};

Block LoadBlock(DType dtype, const void* src, int64_t width, const DenseKeys& keys, int64_t j0,
                int64_t nk, float* scratch, std::vector<const float*>* rows) {
  KeyRows(dtype, src, width, keys, j0, nk, scratch, rows->data());
  return {(*rows)[0], UniformStride(rows->data(), nk, width)};
}

// Probabilities P and dS of a tile's rows against one key block (K and V), each
// [m][kBlockKeys], zero outside every row's visible keys:
// p = exp(s - lse), ds = p * (dp - delta), times 1 - tanh^2 under softcap.
void TileGradients(const Params& p, const RowTile& t, int64_t m, int64_t j0, int64_t nk,
                   const Block& k, const Block& v, float* prob, float* ds, float* tanh_buf) {
  const int64_t dims = p.shape.head_dim, vdims = p.shape.v_head_dim;
  Sgemm(false, true, m, nk, dims, t.qs.data(), dims, k.rows, k.ld, 0.0f, prob, kBlockKeys);
  Sgemm(false, true, m, nk, vdims, t.dov.data(), vdims, v.rows, v.ld, 0.0f, ds, kBlockKeys);
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

void ForwardItem(const Params& p, DType dtype, const void* q, const void* k, const void* v,
                 const float* k_columns, void* out, float* lse, int64_t item) {
  ForwardTile(p, dtype, DenseView{p, ItemRows(p, item), k_columns}, q, k, v, out, lse);
}

// K transposed and float32, [batch][kv head][head_dim][kv_len], one (batch,
// kv head) per item: every query tile's scores are then a product of two
// row-major matrices, which OpenBLAS runs without packing the key block
// (each block is read by up to kv_len / kRowsPerItem tiles, and packed
// anew for each when read as K's rows; S=4096 causal forward 1.01-1.02x ->
// 0.88-0.91x PyTorch SDPA's time, plugin README). Its memory is K's size in
// float32, held while the forward runs.
std::vector<float> KeyColumns(const Params& p, DType dtype, const void* k,
                              const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  const int64_t dims = s.head_dim, n = s.kv_len;
  std::vector<float> cols(s.batch * s.kv_heads * dims * n);
  parallel_for(s.batch * s.kv_heads, [&](int64_t bg) {
    const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads;
    float* out = cols.data() + bg * dims * n;
    std::vector<float> row(dims);
    for (int64_t j = 0; j < n; ++j) {
      LoadRow(dtype, k, ((b * n + j) * s.kv_heads + g) * dims, dims, row.data());
      for (int64_t d = 0; d < dims; ++d) out[d * n + j] = row[d];
    }
  });
  return cols;
}

// The backward's split of each (batch row, kv head) into chunks of key blocks:
// chunk c holds blocks c, c + chunks, ... (interleaved, so a causal call's
// chunks do about the same work). Enough chunks for kBackwardItems items in
// all, as many as there are blocks at most, and within kPartialBytes of
// partial dq (one float32 dq per chunk). A function of the shape alone.
struct KeyChunks {
  int64_t chunks, blocks, tiles, per, m_max;

  explicit KeyChunks(const Shape& s)
      : blocks((s.kv_len + kBlockKeys - 1) / kBlockKeys), per(PositionsPerItem(s)),
        m_max(PositionsPerItem(s) * (s.q_heads / s.kv_heads)) {
    tiles = (s.q_len + per - 1) / per;
    const int64_t heads = s.batch * s.kv_heads;
    const int64_t one = heads * tiles * m_max * s.head_dim * int64_t{sizeof(float)};
    chunks = std::min<int64_t>(blocks, (kBackwardItems + heads - 1) / heads);
    chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, kPartialBytes / std::max<int64_t>(one, 1)));
  }
  // Floats of one item's partial dq: [tiles][m_max][D].
  int64_t item_floats(const Shape& s) const { return tiles * m_max * s.head_dim; }
};

// One (batch row, kv head, chunk): for each of the chunk's key blocks and each
// query tile that sees it, P and dS once, then dV += P^T dO, dK += dS^T (scaled
// Q) for the block and dQ += dS K into the chunk's partial dq.
void BackwardItem(const Params& p, DType dtype, const BackwardArgs& x, const KeyChunks& kc,
                  float* dq_partial, int64_t item) {
  const Shape& s = p.shape;
  const int64_t chunk = item % kc.chunks, bg = item / kc.chunks;
  const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t dims = s.head_dim, vdims = s.v_head_dim;
  std::vector<float> k_scratch = Scratch(dtype, kBlockKeys * dims);
  std::vector<float> v_scratch = Scratch(dtype, kBlockKeys * vdims);
  std::vector<const float*> rows_buf(kBlockKeys);
  std::vector<float> dk(kBlockKeys * dims), dv(kBlockKeys * vdims);
  std::vector<float> prob(kc.m_max * kBlockKeys), ds(kc.m_max * kBlockKeys);
  std::vector<float> tanh_buf(kBlockKeys);
  const DenseKeys keys{s, b, g};
  RowTile t;
  for (int64_t kb_index = chunk; kb_index < kc.blocks; kb_index += kc.chunks) {
    const int64_t j0 = kb_index * kBlockKeys, nk = std::min(kBlockKeys, s.kv_len - j0);
    const Block kb = LoadBlock(dtype, x.k, dims, keys, j0, nk, k_scratch.data(), &rows_buf);
    const Block vb = LoadBlock(dtype, x.v, vdims, keys, j0, nk, v_scratch.data(), &rows_buf);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    for (int64_t tile = 0; tile < kc.tiles; ++tile) {
      const int64_t i0 = tile * kc.per, positions = std::min(kc.per, s.q_len - i0);
      bool sees = false;  // does any position of this tile see the block?
      for (int64_t i = i0; i < i0 + positions && !sees; ++i) {
        const Range r = Visible(p, b, i);
        sees = std::max(r.lo, j0) < std::min(r.hi, j0 + nk);
      }
      if (!sees) continue;
      const Rows rows{b, g, i0, positions, group};
      const int64_t m = rows.count();
      LoadRowTile(p, dtype, x, rows, &t);
      TileGradients(p, t, m, j0, nk, kb, vb, prob.data(), ds.data(), tanh_buf.data());
      // dV += P^T dO, dK += dS^T (scaled Q): the tile's P and dS read transposed.
      Sgemm(true, false, nk, vdims, m, prob.data(), kBlockKeys, t.dov.data(), vdims, 1.0f,
            dv.data(), vdims);
      Sgemm(true, false, nk, dims, m, ds.data(), kBlockKeys, t.qs.data(), dims, 1.0f,
            dk.data(), dims);
      Sgemm(false, false, m, dims, nk, ds.data(), kBlockKeys, kb.rows, kb.ld, 1.0f,
            dq_partial + (item * kc.tiles + tile) * kc.m_max * dims, dims);
    }
    for (int64_t jj = 0; jj < nk; ++jj) {
      const int64_t row = (b * s.kv_len + j0 + jj) * s.kv_heads + g;
      StoreRow(dtype, x.dk, row * dims, dims, dk.data() + jj * dims, 1.0f);
      StoreRow(dtype, x.dv, row * vdims, vdims, dv.data() + jj * vdims, 1.0f);
    }
  }
}

// dq of one query tile of one (batch row, kv head): its chunks' partials summed
// in chunk order, times the scale (the partials are against scaled Q's keys).
void StoreDq(const Params& p, DType dtype, const BackwardArgs& x, const KeyChunks& kc,
             const float* dq_partial, int64_t index) {
  const Shape& s = p.shape;
  const int64_t tile = index % kc.tiles, bg = index / kc.tiles, dims = s.head_dim;
  const Rows rows{bg / s.kv_heads, bg % s.kv_heads, tile * kc.per,
                  std::min(kc.per, s.q_len - tile * kc.per), s.q_heads / s.kv_heads};
  std::vector<float> sum(dims);
  for (int64_t r = 0; r < rows.count(); ++r) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t c = 0; c < kc.chunks; ++c) {
      const float* part = dq_partial + ((bg * kc.chunks + c) * kc.tiles + tile) * kc.m_max * dims;
      for (int64_t d = 0; d < dims; ++d) sum[d] += part[r * dims + d];
    }
    StoreRow(dtype, x.dq, QOffset(s, rows.b, rows.position(r), rows.head(r), dims), dims,
             sum.data(), p.scale);
  }
}

}  // namespace

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  if (IsDecode(p.shape, p.shape.q_len)) {
    return DenseDecode(p, dtype, q, k, v, out, lse, parallel_for);
  }
  const std::vector<float> k_columns = KeyColumns(p, dtype, k, parallel_for);
  parallel_for(QueryItems(p.shape), [&](int64_t item) {
    ForwardItem(p, dtype, q, k, v, k_columns.data(), out, lse, item);
  });
}

void Backward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
              const void* out, const float* lse, const void* dout, const float* dlse,
              void* dq, void* dk, void* dv, const ParallelFor& parallel_for) {
  const Shape& s = p.shape;
  const BackwardArgs x{q, k, v, out, dout, lse, dlse, dq, dk, dv};
  const KeyChunks kc(s);
  const int64_t items = s.batch * s.kv_heads * kc.chunks;
  // Every item's partial dq, zeroed: rows no key block reaches stay 0.
  std::vector<float> dq_partial(items * kc.item_floats(s), 0.0f);
  parallel_for(items, [&](int64_t item) {
    BackwardItem(p, dtype, x, kc, dq_partial.data(), item);
  });
  parallel_for(s.batch * s.kv_heads * kc.tiles, [&](int64_t index) {
    StoreDq(p, dtype, x, kc, dq_partial.data(), index);
  });
}

}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
