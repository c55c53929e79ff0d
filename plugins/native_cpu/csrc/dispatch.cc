// Picks the kernels for this CPU once: x86-64-v3 (AVX2 + FMA) where the
// library was built with them (ATTN_NATIVE_CPU_HAVE_V3) and the CPU has them,
// else the baseline build. Both compute the same contract; their roundings
// differ (FMA), so one process always uses one of them.
#include <cblas.h>

#include "attention.h"

namespace attn_native_cpu {
namespace {

bool UseV3() {
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  static const bool use = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return use;
#else
  return false;
#endif
}

// OpenBLAS runs each block's GEMM on the thread that calls it: the work items
// are the parallelism (on XLA's pool), and its own threads would contend with
// them. Set once, before the first kernel runs.
void OneBlasThread() {
  static const bool once = [] {
    scipy_openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

}  // namespace

const char* KernelIsa() { return UseV3() ? "x86-64-v3" : "baseline"; }

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (UseV3()) return isa_v3::Forward(p, dtype, q, k, v, out, lse, parallel_for);
#endif
  isa_baseline::Forward(p, dtype, q, k, v, out, lse, parallel_for);
}

void Backward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
              const void* out, const float* lse, const void* dout, const float* dlse,
              void* dq, void* dk, void* dv, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (UseV3()) {
    return isa_v3::Backward(p, dtype, q, k, v, out, lse, dout, dlse, dq, dk, dv, parallel_for);
  }
#endif
  isa_baseline::Backward(p, dtype, q, k, v, out, lse, dout, dlse, dq, dk, dv, parallel_for);
}

void PagedForward(const Params& p, const PagedArgs& a, DType dtype, const void* q,
                  const void* k, const void* v, void* out, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (UseV3()) return isa_v3::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
#endif
  isa_baseline::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
}

}  // namespace attn_native_cpu
