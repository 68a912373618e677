// The fused update rules and the gradient L2 norm over dptrain's flat buffers.
//
// Compiled at run time by NVRTC through dptrain/kernels/nvrtc.py (never by CuPy, whose own
// options include -ftz=true), by kernels.cuda.compile_module, with
//   options          kernels.cuda.NVRTC_OPTIONS: --std=c++17 --fmad=false --ftz=false --prec-div=true
//                    --prec-sqrt=true -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__,
//                    -I<the CUDA headers beside NVRTC> and -arch=sm_<device>
//   name_expressions kernels.cuda.name_expressions() (every template instance below)
// then loaded by CuPy from the cubin and launched on torch's current stream with raw data_ptr()
// pointers (no copies, no host sync). tests/unit/test_kernels.py compiles this file the same way for
// sm_80 and sm_90 on a machine without a GPU.
//
// The torch reference in dptrain/kernels/spec.py defines the semantics; tests/unit/test_kernels.py
// (host emulation) and tests/gpu/test_kernels_gpu.py check every rule bit-exactly against it, and
// kernels/selfcheck.py does so at first use on each GPU. Bit-exactness needs:
//   * every multiply and add rounded separately, as the reference's separate torch ops do:
//     --fmad=false stops the compiler contracting a*b+c into one FMA (which rounds once);
//   * fp32 subnormals kept (--ftz=false), as torch's CUDA kernels keep them;
//   * host scalars rounded as spec.py rounds them (Rule.scalars: fp32 of each hyper-parameter, and
//     fp32(weight_decay*lr) computed in double for the decoupled decay);
//   * round-to-nearest-even conversions (__float2half_rn, __float2bfloat16_rn), as torch's casts.
// The *_thread functions are __host__ __device__ so the CPU tests can run the exact per-thread code.
//
// Every rule's kernel takes one argument list (kernels.cuda.update_args):
//   grads, master, params (nullptr: the master), *state, lr_scale (nullptr: 1), grad_coef, found_inf,
//   *the rule's scalars, n
// Types: T (storage) is float, __half or __nv_bfloat16; M (state) per the rule's state_dtypes; V is the
// elements per vector access: 4 when every pointer is aligned to 4 elements (flat buffers are: each
// parameter starts at a multiple of 64 elements), else 1.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace dpt {

constexpr int kBlockThreads = 256;  // kernels.cuda.BLOCK_THREADS; the block reductions assume it
constexpr int kDecayNone = 0;       // weight_decay == 0
constexpr int kDecayL2 = 1;         // Caffe: g += wd * w
constexpr int kDecayDecoupled = 2;  // w -= wd * lr * w beside the momentum step
static_assert(kDecayNone == 0 && kDecayL2 == 1 && kDecayDecoupled == 2, "decay modes are spec.DECAY_* in kernels/spec.py");

__host__ __device__ __forceinline__ float to_float(float x) { return x; }
__host__ __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __host__ __device__ __forceinline__ T from_float(float x);
template <> __host__ __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __host__ __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __host__ __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// V consecutive elements moved with one aligned load/store (8 or 16 bytes for V = 4).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

template <typename T, int V> __host__ __device__ __forceinline__ Pack<T, V> load_pack(const T* p, long long i) {
  return *reinterpret_cast<const Pack<T, V>*>(p + i);
}
template <typename T, int V> __host__ __device__ __forceinline__ void store_pack(T* p, long long i, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p + i) = x;
}

struct SgdScalars {
  float lr;             // fp32(lr)
  float momentum_coef;  // fp32(momentum_coef)
  float weight_decay;   // fp32(weight_decay)
  float wd_lr;          // fp32(weight_decay * lr), product taken in double on the host
  int decay_mode;       // kDecayNone | kDecayL2 | kDecayDecoupled
};

// fp32 momentum, Caffe form: h = m*h + lr_e*g; the step is h.
__host__ __device__ __forceinline__ float momentum_step(float& h, float m, float lr_e, float g) {
  h = m * h + lr_e * g;
  return h;
}

// fp16 momentum, lr-factored form (NVIDIA mixed-precision slides): G = half(m*G + g); the step is
// lr_e*G in fp32, so lr*g never has to be representable in fp16.
__host__ __device__ __forceinline__ float momentum_step(__half& h, float m, float lr_e, float g) {
  h = __float2half_rn(m * __half2float(h) + g);
  return lr_e * __half2float(h);
}

// One element of spec.sgd_math: g16 is float(grads[i]), w the fp32 master (in/out),
// h the momentum (in/out), s the LARC lr multiplier (used only when has_scale).
template <typename M>
__host__ __device__ __forceinline__ void sgd_element(float g16, float coef, float s, bool has_scale,
                                                     const SgdScalars& c, float& w, M& h) {
  float g = g16 * coef;
  if (c.decay_mode == kDecayL2) g = g + c.weight_decay * w;
  const float lr_e = has_scale ? c.lr * s : c.lr;
  float step = momentum_step(h, c.momentum_coef, lr_e, g);
  if (c.decay_mode == kDecayDecoupled) step = step + (has_scale ? c.weight_decay * lr_e : c.wd_lr) * w;
  w = w - step;
}

template <typename T, typename M> struct SgdArgs {
  T* grads;               // [n] storage dtype, zeroed
  float* master;          // [n] fp32
  T* params;              // [n] storage dtype, or nullptr when params is master (fp32 storage)
  M* momentum;            // [n]
  const float* lr_scale;  // [n] fp32, or nullptr
  const float* grad_coef; // [1] fp32
  const float* found_inf; // [1] fp32
  SgdScalars s;
  long long n;
};

// Everything thread `tid` of `nthreads` does: vectors tid, tid+nthreads, ... of V elements, then the
// scalar tail [n/V*V, n) in the same grid-stride pattern. Elements are independent, so running the
// threads one after another (host emulation) gives the same bits as running them in parallel.
template <typename T, typename M, int V>
__host__ __device__ void sgd_update_thread(const SgdArgs<T, M>& a, long long tid, long long nthreads) {
  const long long nvec = a.n / V;
  const T zero = from_float<T>(0.0f);
  if (*a.found_inf != 0.0f) {  // overflow (or NaN flag): skip the step, only clear the gradient
    Pack<T, V> z;
    for (int k = 0; k < V; ++k) z.v[k] = zero;
    for (long long v = tid; v < nvec; v += nthreads) store_pack<T, V>(a.grads, v * V, z);
    for (long long i = nvec * V + tid; i < a.n; i += nthreads) a.grads[i] = zero;
    return;
  }
  const float coef = *a.grad_coef;
  const bool has_scale = a.lr_scale != nullptr;
  for (long long v = tid; v < nvec; v += nthreads) {
    const long long i = v * V;
    Pack<T, V> g = load_pack<T, V>(a.grads, i);
    Pack<float, V> w = load_pack<float, V>(a.master, i);
    Pack<M, V> h = load_pack<M, V>(a.momentum, i);
    Pack<float, V> s;
    if (has_scale) {
      s = load_pack<float, V>(a.lr_scale, i);
    } else {
      for (int k = 0; k < V; ++k) s.v[k] = 1.0f;
    }
    Pack<T, V> p;
    for (int k = 0; k < V; ++k) {
      sgd_element<M>(to_float(g.v[k]), coef, s.v[k], has_scale, a.s, w.v[k], h.v[k]);
      p.v[k] = from_float<T>(w.v[k]);
      g.v[k] = zero;
    }
    store_pack<float, V>(a.master, i, w);
    store_pack<M, V>(a.momentum, i, h);
    store_pack<T, V>(a.grads, i, g);
    if (a.params != nullptr) store_pack<T, V>(a.params, i, p);
  }
  for (long long i = nvec * V + tid; i < a.n; i += nthreads) {
    float w = a.master[i];
    M h = a.momentum[i];
    sgd_element<M>(to_float(a.grads[i]), coef, has_scale ? a.lr_scale[i] : 1.0f, has_scale, a.s, w, h);
    a.master[i] = w;
    a.momentum[i] = h;
    a.grads[i] = zero;
    if (a.params != nullptr) a.params[i] = from_float<T>(w);
  }
}

// Sum of squares, in fp32, of the elements thread `tid` of `nthreads` visits (same pattern as above).
// Non-finite inputs propagate: inf -> inf, NaN -> NaN.
template <typename T, int V>
__host__ __device__ float sumsq_thread(const T* x, long long n, long long tid, long long nthreads) {
  const long long nvec = n / V;
  float acc = 0.0f;
  for (long long v = tid; v < nvec; v += nthreads) {
    const Pack<T, V> p = load_pack<T, V>(x, v * V);
    for (int k = 0; k < V; ++k) {
      const float f = to_float(p.v[k]);
      acc = acc + f * f;
    }
  }
  for (long long i = nvec * V + tid; i < n; i += nthreads) {
    const float f = to_float(x[i]);
    acc = acc + f * f;
  }
  return acc;
}

// Sum of `v` over a block of kBlockThreads threads; the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kBlockThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kBlockThreads / 32 ? warp_sums[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

}  // namespace dpt

// ---------------------------------------------------------------------------------------------
// dptrain_sgd_update<T, M, V>: one fused SGD step over one flat group (NVCaffe's
// SGDRegUpdateAllAndClear): unscale + clip (grad_coef), weight decay, momentum, fp32 master
// update, storage-dtype weight write-back, gradient zeroing; a set found_inf skips all of it
// except the zeroing, so master, params and momentum stay bit-identical.
// Host wrapper: kernels.cuda.update (via kernels.update), on torch's current stream.
// Launch: grid (min(cdiv(n/V, 256), 2 waves of resident blocks per the occupancy API),), block (256,);
// grid-stride, any grid works.
// Arguments (all 1-D, contiguous, same length n and layout; pointers 4*sizeof aligned when V = 4):
//   grads          T*            [n] storage dtype, loss-scaled summed gradient; zeroed on return
//   master         float*        [n] fp32 master weights
//   params         T*            [n] storage dtype weights := T(master), or nullptr when they are the
//                                master (fp32 storage). Precondition: params == T(master) on entry,
//                                so a skipped step leaves them as they are.
//   momentum       M*            [n] fp32 (Caffe form) or fp16 (lr-factored form) history
//   lr_scale       const float*  [n] fp32 per-element lr multiplier (LARC), or nullptr for 1
//   grad_coef      const float*  [1] fp32 device scalar: 1/(S*world_size) times the clip factor
//   found_inf      const float*  [1] fp32 device scalar: non-zero (or NaN) skips the step
//   lr             float         fp32(lr)
//   momentum_coef  float         fp32(momentum)
//   weight_decay   float         fp32(weight_decay)
//   wd_lr          float         fp32(weight_decay * lr) (double product), decoupled decay without lr_scale
//   decay_mode     int           0 none, 1 l2, 2 decoupled
//   n              long long     elements
template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_sgd_update(T* grads, float* master, T* params, M* momentum, const float* lr_scale,
                   const float* grad_coef, const float* found_inf, float lr, float momentum_coef,
                   float weight_decay, float wd_lr, int decay_mode, long long n) {
  const dpt::SgdArgs<T, M> a{grads, master, params, momentum, lr_scale, grad_coef, found_inf,
                             dpt::SgdScalars{lr, momentum_coef, weight_decay, wd_lr, decay_mode}, n};
  const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  dpt::sgd_update_thread<T, M, V>(a, tid, static_cast<long long>(gridDim.x) * blockDim.x);
}

// ---------------------------------------------------------------------------------------------
// dptrain_sumsq_partial<T, V>: stage 1 of the L2 norm. Each block writes the fp32 sum of squares of
// the elements its threads visit (grid-stride) to partials[blockIdx.x]. Two stages instead of
// atomicAdd keep the result deterministic for a given n and alignment.
// Host wrapper: kernels.cuda.grad_norm (via kernels.grad_norm), on torch's current stream.
// Launch: grid (min(cdiv(n/V, 256), 1024),) -- a function of n only, for determinism; block (256,).
// Arguments:
//   x         const T*   [n] storage dtype gradient buffer, contiguous (4*sizeof(T) aligned if V = 4)
//   n         long long  elements
//   partials  float*     [gridDim.x] fp32 scratch, one per block
template <typename T, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_sumsq_partial(const T* x, long long n, float* partials) {
  const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float acc = dpt::block_sum(dpt::sumsq_thread<T, V>(x, n, tid, static_cast<long long>(gridDim.x) * blockDim.x));
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// ---------------------------------------------------------------------------------------------
// dptrain_norm_finish: stage 2 of the L2 norm: out[0] = sqrt(sum(partials)), in fp32.
// Host wrapper: kernels.cuda.grad_norm, right after dptrain_sumsq_partial on the same stream.
// Launch: grid (1,), block (256,).
// Arguments:
//   partials  const float*  [count] fp32 block sums from stage 1
//   count     int           number of partials (<= 1024)
//   out       float*        [] fp32 result: the L2 norm (inf/NaN when any input was)
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_norm_finish(const float* partials, int count, float* out) {
  float acc = 0.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc = acc + partials[i];
  acc = dpt::block_sum(acc);
  if (threadIdx.x == 0) out[0] = sqrtf(acc);
}
