// The XLA FFI handlers: decode buffers and attributes, run the kernels of
// attention.cc on XLA's intra-op thread pool. Registered from Python through
// jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu").
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace an = attn_native_cpu;

namespace {

// Items are claimed from a shared counter by the calling thread and by up to
// workers - 1 tasks on XLA's pool. The caller waits only for items that were
// claimed, never for a task to start: a task that starts after the last item
// finds none and touches nothing but the shared state it co-owns, so a busy
// pool (every thread inside some other handler) costs parallelism, not a hang.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  const std::function<void(int64_t)>* body = nullptr;
  std::mutex mu;
  std::condition_variable cv;

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < total;) {
      (*body)(i);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

an::ParallelFor PoolFor(ffi::ThreadPool& pool, int64_t threads) {
  return [&pool, threads](int64_t n, const std::function<void(int64_t)>& body) {
    const int64_t workers = std::min<int64_t>(n, threads > 0 ? threads : pool.num_threads());
    if (workers <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    auto shared = std::make_shared<Shared>();
    shared->total = n;
    shared->body = &body;
    for (int64_t w = 1; w < workers; ++w) pool.Schedule([shared] { shared->Drain(); });
    shared->Drain();
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == n; });
  };
}

// q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv]: the shape, or an error.
ffi::Error ReadShape(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     an::Shape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("attn_native_cpu: q, k, v must be rank 4 [B, T, H, D]");
  }
  *shape = {qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3]};
  if (shape->kv_heads == 0 || shape->q_heads % shape->kv_heads != 0) {
    return ffi::Error::InvalidArgument("attn_native_cpu: Hq must be a multiple of Hkv");
  }
  return ffi::Error::Success();
}

ffi::Error ReadDType(const ffi::AnyBuffer& q, an::DType* dtype) {
  switch (q.element_type()) {
    case ffi::DataType::F32:
      *dtype = an::DType::kF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *dtype = an::DType::kBF16;
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("attn_native_cpu: dtype must be float32 or bfloat16");
  }
}

an::Params MakeParams(const an::Shape& shape, ffi::Buffer<ffi::S32> q_lengths,
                      ffi::Buffer<ffi::S32> kv_lengths, float scale, float softcap,
                      int64_t causal, int64_t window_left, int64_t window_right,
                      int64_t has_lengths) {
  an::Params p;
  p.shape = shape;
  p.scale = scale;
  p.softcap = softcap;
  p.vis.causal = causal != 0;
  p.vis.window_left = window_left;
  p.vis.window_right = window_right;
  if (has_lengths & 1) p.vis.q_lengths = q_lengths.typed_data();
  if (has_lengths & 2) p.vis.kv_lengths = kv_lengths.typed_data();
  return p;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float softcap,
                       int64_t causal, int64_t window_left, int64_t window_right,
                       int64_t has_lengths, int64_t threads) {
  an::Shape shape;
  an::DType dtype;
  if (auto e = ReadShape(q, k, v, &shape); e.failure()) return e;
  if (auto e = ReadDType(q, &dtype); e.failure()) return e;
  const an::Params p = MakeParams(shape, q_lengths, kv_lengths, scale, softcap, causal,
                                  window_left, window_right, has_lengths);
  an::Forward(p, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
              out->untyped_data(), lse->typed_data(), PoolFor(pool, threads));
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                        ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                        ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, float scale, float softcap,
                        int64_t causal, int64_t window_left, int64_t window_right,
                        int64_t has_lengths, int64_t threads) {
  an::Shape shape;
  an::DType dtype;
  if (auto e = ReadShape(q, k, v, &shape); e.failure()) return e;
  if (auto e = ReadDType(q, &dtype); e.failure()) return e;
  const an::Params p = MakeParams(shape, q_lengths, kv_lengths, scale, softcap, causal,
                                  window_left, window_right, has_lengths);
  an::Backward(p, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
               out.untyped_data(), lse.typed_data(), dout.untyped_data(), dlse.typed_data(),
               dq->untyped_data(), dk->untyped_data(), dv->untyped_data(),
               PoolFor(pool, threads));
  return ffi::Error::Success();
}

// A quantized cache's type and scales (kSame: none).
struct Quantized {
  an::CacheType cache;
  const float* k_scales;
  const float* v_scales;
};

// q [T, Hq, D]; k_pages, v_pages [num_pages, page_size, Hkv, D] (canonical);
// cu_q_lens [S+1], kv_lens [S], page_table [S, P], num_seqs [1], all int32.
ffi::Error RunPaged(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> cu_q_lens,
                    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                    ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                    float scale, float softcap, int64_t window_left, int64_t threads,
                    Quantized quantized) {
  an::DType dtype;
  if (auto e = ReadDType(q, &dtype); e.failure()) return e;
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      kv_lens.dimensions().size() != 1 || num_seqs.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "attn_native_cpu paged: expected q [T, Hq, D], pages [N, page_size, Hkv, D], "
        "page_table [S, P], kv_lens [S], num_seqs [1]");
  }
  an::Params p;
  p.shape = {1, qd[0], 0, qd[1], kd[2], qd[2], qd[2]};
  p.scale = scale;
  p.softcap = softcap;
  an::PagedArgs a{cu_q_lens.typed_data(), kv_lens.typed_data(), page_table.typed_data(),
                  num_seqs.typed_data()[0], td[0], td[1], kd[1], kd[0], window_left,
                  quantized.cache, quantized.k_scales, quantized.v_scales};
  if (a.num_pages == 0 || a.page_size == 0) a.num_seqs = 0;  // no key can be read
  an::PagedForward(p, a, dtype, q.untyped_data(), k_pages.untyped_data(),
                   v_pages.untyped_data(), out->untyped_data(), PoolFor(pool, threads));
  return ffi::Error::Success();
}

ffi::Error PagedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                     ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                     float scale, float softcap, int64_t window_left, int64_t threads) {
  if (k_pages.element_type() != q.element_type() ||
      v_pages.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("attn_native_cpu paged: K and V in q's dtype");
  }
  return RunPaged(pool, q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, out,
                  scale, softcap, window_left, threads, {an::CacheType::kSame, nullptr, nullptr});
}

// PagedImpl over a quantized cache: k_pages, v_pages int8 or float8 (e4m3fn,
// e5m2) [num_pages, page_size, Hkv, D], read in place; k_scales, v_scales
// float32 [num_pages, page_size, Hkv].
ffi::Error PagedQuantizedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                              ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                              float scale, float softcap, int64_t window_left,
                              int64_t threads) {
  an::CacheType cache;
  switch (k_pages.element_type()) {
    case ffi::DataType::S8: cache = an::CacheType::kInt8; break;
    case ffi::DataType::F8E4M3FN: cache = an::CacheType::kE4M3; break;
    case ffi::DataType::F8E5M2: cache = an::CacheType::kE5M2; break;
    default:
      return ffi::Error::InvalidArgument(
          "attn_native_cpu paged: a quantized cache is int8, float8_e4m3fn or float8_e5m2");
  }
  if (v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("attn_native_cpu paged: K and V of one dtype");
  }
  auto kd = k_pages.dimensions(), sd = k_scales.dimensions();
  if (kd.size() != 4 || sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[2] ||
      v_scales.element_count() != k_scales.element_count()) {
    return ffi::Error::InvalidArgument(
        "attn_native_cpu paged: expected scales [num_pages, page_size, Hkv] beside pages "
        "[num_pages, page_size, Hkv, D]");
  }
  return RunPaged(pool, q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, out,
                  scale, softcap, window_left, threads,
                  {cache, k_scales.typed_data(), v_scales.typed_data()});
}

}  // namespace

// The paged handlers' arguments after the cache's (the batch), result and attributes.
#define ATTN_NATIVE_CPU_PAGED_TAIL(binding)                                         \
  binding.Arg<ffi::Buffer<ffi::S32>>() /* cu_q_lens */                              \
      .Arg<ffi::Buffer<ffi::S32>>()    /* kv_lens */                                \
      .Arg<ffi::Buffer<ffi::S32>>()    /* page_table */                             \
      .Arg<ffi::Buffer<ffi::S32>>()    /* num_seqs */                               \
      .Ret<ffi::AnyBuffer>()           /* out */                                    \
      .Attr<float>("scale")                                                         \
      .Attr<float>("softcap")                                                       \
      .Attr<int64_t>("window_left")                                                 \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnNativeCpuPagedQuantized, PagedQuantizedImpl,
                              ATTN_NATIVE_CPU_PAGED_TAIL(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::ThreadPool>()
                                      .Arg<ffi::AnyBuffer>()           // q
                                      .Arg<ffi::AnyBuffer>()           // k_pages
                                      .Arg<ffi::AnyBuffer>()           // v_pages
                                      .Arg<ffi::Buffer<ffi::F32>>()    // k_scales
                                      .Arg<ffi::Buffer<ffi::F32>>())); // v_scales

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnNativeCpuPaged, PagedImpl,
                              ATTN_NATIVE_CPU_PAGED_TAIL(ffi::Ffi::Bind()
                                                             .Ctx<ffi::ThreadPool>()
                                                             .Arg<ffi::AnyBuffer>()    // q
                                                             .Arg<ffi::AnyBuffer>()    // k_pages
                                                             .Arg<ffi::AnyBuffer>())); // v_pages

#define ATTN_NATIVE_CPU_ATTRS(binding)                                              \
  binding.Attr<float>("scale")                                                      \
      .Attr<float>("softcap")                                                       \
      .Attr<int64_t>("causal")                                                      \
      .Attr<int64_t>("window_left")                                                 \
      .Attr<int64_t>("window_right")                                                \
      .Attr<int64_t>("has_lengths")                                                 \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnNativeCpuForward, ForwardImpl,
                              ATTN_NATIVE_CPU_ATTRS(ffi::Ffi::Bind()
                                                        .Ctx<ffi::ThreadPool>()
                                                        .Arg<ffi::AnyBuffer>()  // q
                                                        .Arg<ffi::AnyBuffer>()  // k
                                                        .Arg<ffi::AnyBuffer>()  // v
                                                        .Arg<ffi::Buffer<ffi::S32>>()
                                                        .Arg<ffi::Buffer<ffi::S32>>()
                                                        .Ret<ffi::AnyBuffer>()  // out
                                                        .Ret<ffi::Buffer<ffi::F32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnNativeCpuBackward, BackwardImpl,
                              ATTN_NATIVE_CPU_ATTRS(ffi::Ffi::Bind()
                                                        .Ctx<ffi::ThreadPool>()
                                                        .Arg<ffi::AnyBuffer>()  // q
                                                        .Arg<ffi::AnyBuffer>()  // k
                                                        .Arg<ffi::AnyBuffer>()  // v
                                                        .Arg<ffi::AnyBuffer>()  // out
                                                        .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                                        .Arg<ffi::AnyBuffer>()  // dout
                                                        .Arg<ffi::Buffer<ffi::F32>>()  // dlse
                                                        .Arg<ffi::Buffer<ffi::S32>>()
                                                        .Arg<ffi::Buffer<ffi::S32>>()
                                                        .Ret<ffi::AnyBuffer>()  // dq
                                                        .Ret<ffi::AnyBuffer>()  // dk
                                                        .Ret<ffi::AnyBuffer>()));  // dv

// Which kernels this CPU runs ("x86-64-v3" or "baseline"), for diagnostics
// (attn_backend_native_cpu._library.kernel_isa()).
extern "C" const char* AttnNativeCpuKernelIsa() { return attn_native_cpu::KernelIsa(); }
