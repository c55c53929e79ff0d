// Flash attention on CPU: the numerics, free of any XLA type, so the kernels
// can be read (and unit-tested) on their own. ffi.cc binds them to XLA's FFI.
#pragma once

#include <cstdint>
#include <functional>

namespace attn_native_cpu {

// One dense attention call. Layouts are the contract's BTNH, row-major:
// q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv], out [B, Tq, Hq, Dv],
// lse [B, Hq, Tq]. Query head h reads kv head h / (Hq / Hkv).
struct Shape {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim, v_head_dim;
};

// The positional rules of the contract, all of which leave every query row a
// contiguous run of visible keys [lo, hi): causal and the window aligned
// bottom-right by Tk - Tq, per-batch valid query and key lengths.
struct Visibility {
  bool causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
  const int32_t* q_lengths = nullptr;   // [B] or null (every row valid)
  const int32_t* kv_lengths = nullptr;  // [B] or null (every key valid)
};

struct Params {
  Shape shape;
  Visibility vis;
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: none
};

// Runs body(i) for every i in [0, n), in any order on any thread; returns when
// all are done. Each item writes disjoint outputs, so the answer never depends
// on how items fall onto threads.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& body)>;

enum class DType { kF32, kBF16 };

// A ragged paged batch (the paged contract): sequence s owns query rows
// [cu_q_lens[s], cu_q_lens[s+1]) and keys [0, kv_lens[s]), key j in page
// page_table[s][j / page_size]; only the first num_seqs sequences count.
// Caches are canonical: [num_pages, page_size, Hkv, D]. Queries are causal,
// aligned so a sequence's last row sees all its keys; window_left >= 0 bounds
// how far back a row sees.
// How a paged cache stores K and V: in the call's dtype, or quantized (the
// contract's rule: value * scale, one float32 scale per position and kv head,
// scales [num_pages, page_size, Hkv]).
enum class CacheType { kSame, kInt8, kE4M3, kE5M2 };

struct PagedArgs {
  const int32_t* cu_q_lens;   // [seqs + 1]
  const int32_t* kv_lens;     // [seqs]
  const int32_t* page_table;  // [seqs, table_width]
  int64_t num_seqs, seqs, table_width, page_size, num_pages;
  int64_t window_left = -1;
  CacheType cache = CacheType::kSame;
  const float* k_scales = nullptr;  // a quantized cache's: [num_pages, page_size, Hkv]
  const float* v_scales = nullptr;
};

// The kernels, compiled once per instruction set (attention.cc); Forward and
// Backward below run the best one this CPU supports (dispatch.cc).
#define ATTN_NATIVE_CPU_KERNELS                                                             \
  /* out (dtype) and lse (f32) from q, k, v (dtype). */                                    \
  void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,  \
               void* out, float* lse, const ParallelFor& parallel_for);                    \
  /* dq, dk, dv (dtype) from q, k, v, out (dtype), lse, dout (dtype) and d_lse (f32, the  \
     cotangent of lse; non-finite entries count as 0). */                                  \
  void Backward(const Params& p, DType dtype, const void* q, const void* k, const void* v, \
                const void* out, const float* lse, const void* dout, const float* dlse,    \
                void* dq, void* dk, void* dv, const ParallelFor& parallel_for);            \
  /* out [T, Hq, D] (dtype) of q [T, Hq, D] over a paged cache (p.shape: q_len = T,  \
     q_heads, kv_heads, head_dims; batch, kv_len unused), K and V in dtype or quantized \
     (a.cache). */                                                                         \
  void PagedForward(const Params& p, const PagedArgs& a, DType dtype, const void* q,       \
                    const void* k, const void* v, void* out, const ParallelFor& parallel_for);

namespace isa_baseline {
ATTN_NATIVE_CPU_KERNELS
}  // namespace isa_baseline
namespace isa_v3 {
ATTN_NATIVE_CPU_KERNELS
}  // namespace isa_v3
// x86-64-v4 with AVX512_BF16: the dense bfloat16 forward by bfloat16 products
// (bf16_forward.cc), and the paged forward (decode.cc), whose decode tiles of
// bfloat16 queries over a quantized cache take bfloat16 products
// (bf16_decode.h); every other call goes to isa_v3's.
namespace isa_avx512_bf16 {
void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for);
void PagedForward(const Params& p, const PagedArgs& a, DType dtype, const void* q,
                  const void* k, const void* v, void* out, const ParallelFor& parallel_for);
}  // namespace isa_avx512_bf16
ATTN_NATIVE_CPU_KERNELS

// The kernels Forward and Backward run in this process: "avx512-bf16",
// "x86-64-v3" or "baseline" (dispatch.cc).
const char* KernelIsa();

// Whether this CPU runs isa_avx512_bf16::PagedForward where it runs its
// Forward: AVX512_VBMI besides, for the byte tables of its decode tiles (the
// dispatch's test, dispatch.cc).
bool Avx512PagedSupported();

}  // namespace attn_native_cpu
