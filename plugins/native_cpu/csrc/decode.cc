// The decode path and paged attention: items of (batch row or sequence,
// split of the keys) holding every kv head's rows, merged in split order;
// paged prefill rows as tiles (kernel_tiles.h). Compiled once per
// instruction set, as attention.cc.
#include "kernel_tiles.h"

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

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

// One decode item's partial softmax: rows = kv heads x rows per head.
struct Partial {
  float *max, *sum, *acc;  // [rows], [rows], [rows][Dv]
};

// The partials of `items` decode items of `rows` rows each, in a buffer the
// calling thread keeps between calls: a step's partials are about a MiB,
// which malloc maps fresh (and the kernel zeroes page by page) on every call
// when it is freed after each (perf: a tenth of an int8 decode step's samples
// in clear_page). Every partial is written before it is read.
class DecodeWork {
 public:
  DecodeWork(int64_t items, int64_t rows, int64_t vdims) : rows_(rows), vdims_(vdims) {
    thread_local std::vector<float> kept;
    const size_t size = static_cast<size_t>(items * rows * (vdims + 2));
    if (kept.size() < size) kept.resize(size);
    data_ = kept.data();
  }
  Partial at(int64_t item) {
    float* base = data_ + item * rows_ * (vdims_ + 2);
    return {base, base + rows_, base + 2 * rows_};
  }

 private:
  int64_t rows_, vdims_;
  float* data_;
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
  // Bytes per element of K and V: a quantized cache's are one.
  const int64_t elem = view_of(0).cache() != CacheType::kSame ? 1 : dtype == DType::kF32 ? 4 : 2;
  const int64_t k_bytes = s.kv_heads * s.head_dim * elem;
  const int64_t v_bytes = s.kv_heads * s.v_head_dim * elem;
  const auto row_start = view_of(0).keys();  // head 0: where each key's run of heads starts
  Prefetcher ahead(2 * kDecodeBlock);
  for (int64_t j0 = lo; j0 < hi; j0 += kDecodeBlock) {
    const int64_t nk = std::min(kDecodeBlock, hi - j0);
    ahead.Clear();
    // The next block's K rows, then its V rows: two runs in address order
    // (measured faster than K and V alternating, and than blocks of 16 or 128).
    const int64_t next = std::max<int64_t>(0, std::min(hi, j0 + nk + kDecodeBlock) - j0 - nk);
    row_start.Runs(j0 + nk, next, s.head_dim, [&](int64_t, int64_t n, int64_t at) {
      ahead.Add(static_cast<const char*>(k) + at * elem, n * k_bytes);
    });
    row_start.Runs(j0 + nk, next, s.v_head_dim, [&](int64_t, int64_t n, int64_t at) {
      ahead.Add(static_cast<const char*>(v) + at * elem, n * v_bytes);
    });
    // A quantized cache's scales of those keys, every kv head's (index = the
    // position's run of heads, width 1): waited for in a fifth of a step's
    // samples when left to the hardware (perf, int8).
    for (const float* scales : {view_of(0).k_scales(), view_of(0).v_scales()}) {
      if (scales == nullptr) continue;
      row_start.Runs(j0 + nk, next, 1, [&](int64_t, int64_t n, int64_t at) {
        ahead.Add(scales + at, n * s.kv_heads * sizeof(float));
      });
    }
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

struct PagedItem {
  int64_t seq, start, t0, positions, q_len, kv_len;
};

}  // namespace

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

}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
