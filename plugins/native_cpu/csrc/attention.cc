// Flash attention forward and backward on CPU (FlashAttention-2's schedule):
// an online softmax over blocks of keys in float32, the backward recomputing
// the probabilities from the saved log-sum-exp.
//
// Work items: the forward and dq take (batch, kv head, block of query
// positions) and hold the rows of every query head of that kv head's group,
// so a GQA group reads each K/V block once; dk and dv take (batch, kv head,
// block of keys). A decode call (few query rows per kv head) takes (batch
// row, split of the keys) with every kv head's rows instead, reading each
// key's run of heads in address order, and merges the splits in order
// (decode.cc). Every item writes outputs no other item writes, and its
// arithmetic never depends on the thread it runs on, so the answer is the
// same bit for bit at any thread count.
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
                 void* out, float* lse, int64_t item) {
  ForwardTile(p, dtype, DenseView{p, ItemRows(p, item)}, q, k, v, out, lse);
}

void DqItem(const Params& p, DType dtype, const BackwardArgs& x, int64_t item) {
  const Shape& s = p.shape;
  const Rows rows = ItemRows(p, item);
  const int64_t m = rows.count(), dims = s.head_dim, vdims = s.v_head_dim;
  RowTile t;
  LoadRowTile(p, dtype, x, rows, &t);
  std::vector<float> dq(m * dims, 0.0f);
  std::vector<float> k_scratch = Scratch(dtype, kBlockKeys * dims);
  std::vector<float> v_scratch = Scratch(dtype, kBlockKeys * vdims);
  std::vector<const float*> rows_buf(kBlockKeys);
  std::vector<float> prob(m * kBlockKeys), ds(m * kBlockKeys), tanh_buf(kBlockKeys);
  const DenseKeys keys{s, rows.b, rows.g};
  for (int64_t j0 = t.first; j0 < t.last; j0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, t.last - j0);
    const Block kb = LoadBlock(dtype, x.k, dims, keys, j0, nk, k_scratch.data(), &rows_buf);
    const Block vb = LoadBlock(dtype, x.v, vdims, keys, j0, nk, v_scratch.data(), &rows_buf);
    TileGradients(p, t, m, j0, nk, kb, vb, prob.data(), ds.data(), tanh_buf.data());
    Sgemm(false, false, m, dims, nk, ds.data(), kBlockKeys, kb.rows, kb.ld, 1.0f, dq.data(), dims);
  }
  for (int64_t r = 0; r < m; ++r) {
    StoreRow(dtype, x.dq, QOffset(s, rows.b, rows.position(r), rows.head(r), dims), dims,
             dq.data() + r * dims, p.scale);
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
  std::vector<float> k_scratch = Scratch(dtype, kBlockKeys * dims);
  std::vector<float> v_scratch = Scratch(dtype, kBlockKeys * vdims);
  std::vector<const float*> rows_buf(kBlockKeys);
  std::vector<float> dk(kBlockKeys * dims, 0.0f), dv(kBlockKeys * vdims, 0.0f);
  std::vector<float> prob(m_max * kBlockKeys), ds(m_max * kBlockKeys), tanh_buf(kBlockKeys);
  const DenseKeys keys{s, b, g};
  const Block kb = LoadBlock(dtype, x.k, dims, keys, j0, nk, k_scratch.data(), &rows_buf);
  const Block vb = LoadBlock(dtype, x.v, vdims, keys, j0, nk, v_scratch.data(), &rows_buf);
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
    TileGradients(p, t, m, j0, nk, kb, vb, prob.data(), ds.data(), tanh_buf.data());
    // dV += P^T dO, dK += dS^T (scaled Q): the tiles' P and dS read transposed.
    Sgemm(true, false, nk, vdims, m, prob.data(), kBlockKeys, t.dov.data(), vdims, 1.0f,
          dv.data(), vdims);
    Sgemm(true, false, nk, dims, m, ds.data(), kBlockKeys, t.qs.data(), dims, 1.0f, dk.data(),
          dims);
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
  if (IsDecode(p.shape, p.shape.q_len)) {
    return DenseDecode(p, dtype, q, k, v, out, lse, parallel_for);
  }
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
