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
// A host C++ compiler reads this file too: dptrain/csrc/update_cpu.cc includes it as the CPU update
// (kernels.native). Without __CUDACC__ the fp16/bf16 types come from host_half.h and everything
// device-only (run_rule, block_sum, the __global__ kernels) is left out.
//
// Every rule's kernel takes one argument list (kernels.cuda.update_args):
//   grads, master, params (nullptr: the master), *state, lr_scale (nullptr: 1), decay_scale (nullptr: 1),
//   grad_coef, found_inf, bias_correction (nullptr: none), *the rule's scalars, n
// Types: T (storage) is float, __half or __nv_bfloat16; M (state) per the rule's state_dtypes; V is the
// elements per pack: 16 bytes of T (4 float, 8 __half/__nv_bfloat16: kernels.cuda.vector_elems) when every
// pointer is aligned to V of its elements (flat buffers are: each parameter starts at a multiple of 64
// elements), else 1. A pack of V floats with V = 8 moves as two 16-byte accesses.

#if defined(__CUDACC__)  // NVRTC and nvcc
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#else  // a host C++ compiler: dptrain/csrc/update_cpu.cc, the CPU update (kernels.native)
#include "host_half.h"
#endif

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

// V consecutive elements moved with aligned loads/stores: one 16-byte access for 16 bytes of T, two for 32.
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

template <typename T, int V> __host__ __device__ __forceinline__ Pack<T, V> load_pack(const T* p, long long i) {
  return *reinterpret_cast<const Pack<T, V>*>(p + i);
}
template <typename T, int V> __host__ __device__ __forceinline__ void store_pack(T* p, long long i, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p + i) = x;
}

// The per-element inputs of a rule besides gradient, master and state: the lr and decay multipliers
// (1 when their table is absent, and then not multiplied at all) and the step's bias corrections.
struct Elem {
  float lr_mult;     // lr_scale[i]
  float decay_mult;  // decay_scale[i]
  bool has_lr;       // lr_scale != nullptr
  bool has_decay;    // decay_scale != nullptr
  float bc1;         // bias_correction[0]: 1 - beta1^t (1 without the table)
  float bc2_sqrt;    // bias_correction[1]: sqrt(1 - beta2^t) (1 without the table)
};

__host__ __device__ __forceinline__ float lr_of(float lr, const Elem& e) { return e.has_lr ? lr * e.lr_mult : lr; }

// spec.decay_coefs: the L2 coefficient wd*decay_mult, and the decoupled one (wd_lr, or wd*lr_e with an
// lr table) times decay_mult.
__host__ __device__ __forceinline__ float l2_coef(float wd, const Elem& e) {
  return e.has_decay ? wd * e.decay_mult : wd;
}
__host__ __device__ __forceinline__ float decoupled_coef(float wd, float wd_lr, float lr_e, const Elem& e) {
  const float k = e.has_lr ? wd * lr_e : wd_lr;
  return e.has_decay ? k * e.decay_mult : k;
}

// ------------------------------------------------------------------------------------ SGD, Nesterov

struct SgdScalars {
  float lr;             // fp32(lr)
  float momentum_coef;  // fp32(momentum_coef)
  float weight_decay;   // fp32(weight_decay)
  float wd_lr;          // fp32(weight_decay * lr), product taken in double on the host
  int decay_mode;       // kDecayNone | kDecayL2 | kDecayDecoupled
};

// fp32 momentum, Caffe form: h = m*h + lr_e*g; the step is h (Nesterov: (1+m)*h - m*h0).
__host__ __device__ __forceinline__ float momentum_step(float& h, float m, float lr_e, float g, bool nesterov) {
  const float h0 = h;
  h = m * h + lr_e * g;
  return nesterov ? (1.0f + m) * h - m * h0 : h;
}

// fp16 momentum, lr-factored form (NVIDIA mixed-precision slides): G = half(m*G + g); the step is
// lr_e*G in fp32 (Nesterov: lr_e*((1+m)*G - m*G0)), so lr*g never has to be representable in fp16.
__host__ __device__ __forceinline__ float momentum_step(__half& h, float m, float lr_e, float g, bool nesterov) {
  const float h0 = __half2float(h);
  h = __float2half_rn(m * h0 + g);
  const float hist = nesterov ? (1.0f + m) * __half2float(h) - m * h0 : __half2float(h);
  return lr_e * hist;
}

// spec.sgd_math / spec.nesterov_math, one element. h[0] is the momentum.
template <bool Nesterov> struct MomentumRule {
  static constexpr int kStates = 1;
  using Scalars = SgdScalars;
  template <typename M>
  __host__ __device__ static void element(float g, float& w, M* h, const Elem& e, const Scalars& c) {
    const float lr_e = lr_of(c.lr, e);
    if (c.decay_mode == kDecayL2) g = g + l2_coef(c.weight_decay, e) * w;
    float step = momentum_step(h[0], c.momentum_coef, lr_e, g, Nesterov);
    if (c.decay_mode == kDecayDecoupled) step = step + decoupled_coef(c.weight_decay, c.wd_lr, lr_e, e) * w;
    w = w - step;
  }
};

// ------------------------------------------------------------------------------------ Adam, LAMB

struct AdamScalars {
  float lr;               // fp32(lr)
  float beta1;            // fp32(beta1)
  float one_minus_beta1;  // fp32(1 - beta1), difference taken in double on the host
  float beta2;            // fp32(beta2)
  float one_minus_beta2;  // fp32(1 - beta2), likewise
  float eps;              // fp32(eps)
  float weight_decay;     // fp32(weight_decay)
  float wd_lr;            // fp32(weight_decay * lr), product taken in double (adam's decoupled decay)
  int decay_mode;         // kDecayNone | kDecayL2 | kDecayDecoupled
};

// spec._adam_direction: updates the moments h[0] (m) and h[1] (v), returns u = m_hat / (sqrt(v_hat) + eps).
__host__ __device__ __forceinline__ float adam_direction(float g, float w, float* h, const Elem& e,
                                                         const AdamScalars& c) {
  if (c.decay_mode == kDecayL2) g = g + l2_coef(c.weight_decay, e) * w;
  h[0] = c.beta1 * h[0] + c.one_minus_beta1 * g;
  h[1] = c.beta2 * h[1] + c.one_minus_beta2 * (g * g);
  return (h[0] / e.bc1) / (sqrtf(h[1]) / e.bc2_sqrt + c.eps);
}

// spec.adam_math (decay_mode l2: Adam; decoupled: AdamW), one element.
struct AdamRule {
  static constexpr int kStates = 2;
  using Scalars = AdamScalars;
  __host__ __device__ static void element(float g, float& w, float* h, const Elem& e, const Scalars& c) {
    const float lr_e = lr_of(c.lr, e);
    float step = lr_e * adam_direction(g, w, h, e, c);
    if (c.decay_mode == kDecayDecoupled) step = step + decoupled_coef(c.weight_decay, c.wd_lr, lr_e, e) * w;
    w = w - step;
  }
};

// spec.lamb_math, one element: the direction takes the decoupled decay, and lr_scale carries the
// parameter's trust ratio (computed by the optimizer before this pass).
struct LambRule {
  static constexpr int kStates = 2;
  using Scalars = AdamScalars;
  __host__ __device__ static void element(float g, float& w, float* h, const Elem& e, const Scalars& c) {
    float u = adam_direction(g, w, h, e, c);
    if (c.decay_mode == kDecayDecoupled) u = u + l2_coef(c.weight_decay, e) * w;
    w = w - lr_of(c.lr, e) * u;
  }
};

// ------------------------------------------------------------------------------------ RMSProp

struct RmspropScalars {
  float lr;                   // fp32(lr)
  float momentum_coef;        // fp32(momentum)
  float rms_decay;            // fp32(rms_decay)
  float one_minus_rms_decay;  // fp32(1 - rms_decay), difference taken in double on the host
  float eps;                  // fp32(eps)
  float weight_decay;         // fp32(weight_decay)
  float wd_lr;                // fp32(weight_decay * lr), product taken in double
  int decay_mode;             // kDecayNone | kDecayL2 | kDecayDecoupled
};

// spec.rmsprop_math, one element: h[0] is the mean square, h[1] the momentum buffer.
struct RmspropRule {
  static constexpr int kStates = 2;
  using Scalars = RmspropScalars;
  __host__ __device__ static void element(float g, float& w, float* h, const Elem& e, const Scalars& c) {
    const float lr_e = lr_of(c.lr, e);
    if (c.decay_mode == kDecayL2) g = g + l2_coef(c.weight_decay, e) * w;
    h[0] = c.rms_decay * h[0] + c.one_minus_rms_decay * (g * g);
    h[1] = c.momentum_coef * h[1] + g / (sqrtf(h[0]) + c.eps);
    float step = lr_e * h[1];
    if (c.decay_mode == kDecayDecoupled) step = step + decoupled_coef(c.weight_decay, c.wd_lr, lr_e, e) * w;
    w = w - step;
  }
};

// ------------------------------------------------------------------------------------ the common loop

constexpr int kMaxStates = 2;

template <typename T, typename M> struct Args {
  T* grads;                      // [n] storage dtype, zeroed
  float* master;                 // [n] fp32
  T* params;                     // [n] storage dtype, or nullptr when params is master (fp32 storage)
  M* state[kMaxStates];          // [n] each; the rule's kStates first are used
  const float* lr_scale;         // [n] fp32, or nullptr
  const float* decay_scale;      // [n] fp32, or nullptr
  const float* grad_coef;        // [1] fp32
  const float* found_inf;        // [1] fp32
  const float* bias_correction;  // [2] fp32, or nullptr
  long long n;
};

// Element i of every buffer through R::element; the state passes through registers of type M.
template <typename R, typename T, typename M>
__host__ __device__ __forceinline__ T apply_element(float g, float& w, M* h, const Elem& e, const typename R::Scalars& c) {
  R::element(g, w, h, e, c);
  return from_float<T>(w);
}

// Everything thread `tid` of `nthreads` does for rule R: vectors tid, tid+nthreads, ... of V elements,
// then the scalar tail [n/V*V, n) in the same grid-stride pattern. Elements are independent, so running
// the threads one after another (host emulation) gives the same bits as running them in parallel.
template <typename R, typename T, typename M, int V>
__host__ __device__ void update_thread(const Args<T, M>& a, const typename R::Scalars& c, long long tid,
                                       long long nthreads) {
  constexpr int K = R::kStates;
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
  Elem e{1.0f, 1.0f, a.lr_scale != nullptr, a.decay_scale != nullptr, 1.0f, 1.0f};
  if (a.bias_correction != nullptr) {
    e.bc1 = a.bias_correction[0];
    e.bc2_sqrt = a.bias_correction[1];
  }
  for (long long v = tid; v < nvec; v += nthreads) {
    const long long i = v * V;
    Pack<T, V> g = load_pack<T, V>(a.grads, i);
    Pack<float, V> w = load_pack<float, V>(a.master, i);
    Pack<M, V> h[K];
    for (int j = 0; j < K; ++j) h[j] = load_pack<M, V>(a.state[j], i);
    Pack<float, V> s, d;
    for (int k = 0; k < V; ++k) s.v[k] = d.v[k] = 1.0f;
    if (e.has_lr) s = load_pack<float, V>(a.lr_scale, i);
    if (e.has_decay) d = load_pack<float, V>(a.decay_scale, i);
    Pack<T, V> p;
    for (int k = 0; k < V; ++k) {
      M hk[K];
      for (int j = 0; j < K; ++j) hk[j] = h[j].v[k];
      e.lr_mult = s.v[k];
      e.decay_mult = d.v[k];
      p.v[k] = apply_element<R, T, M>(to_float(g.v[k]) * coef, w.v[k], hk, e, c);
      for (int j = 0; j < K; ++j) h[j].v[k] = hk[j];
      g.v[k] = zero;
    }
    store_pack<float, V>(a.master, i, w);
    for (int j = 0; j < K; ++j) store_pack<M, V>(a.state[j], i, h[j]);
    store_pack<T, V>(a.grads, i, g);
    if (a.params != nullptr) store_pack<T, V>(a.params, i, p);
  }
  for (long long i = nvec * V + tid; i < a.n; i += nthreads) {
    float w = a.master[i];
    M hk[K];
    for (int j = 0; j < K; ++j) hk[j] = a.state[j][i];
    e.lr_mult = e.has_lr ? a.lr_scale[i] : 1.0f;
    e.decay_mult = e.has_decay ? a.decay_scale[i] : 1.0f;
    const T p = apply_element<R, T, M>(to_float(a.grads[i]) * coef, w, hk, e, c);
    a.master[i] = w;
    for (int j = 0; j < K; ++j) a.state[j][i] = hk[j];
    a.grads[i] = zero;
    if (a.params != nullptr) a.params[i] = p;
  }
}

#if defined(__CUDACC__)
// The body of every update kernel: rule R over this thread's share of the grid.
template <typename R, typename T, typename M, int V>
__device__ __forceinline__ void run_rule(const Args<T, M>& a, const typename R::Scalars& c) {
  const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  update_thread<R, T, M, V>(a, c, tid, static_cast<long long>(gridDim.x) * blockDim.x);
}
#endif  // __CUDACC__

// Sum of squares, in fp32, of the elements thread `tid` of `nthreads` visits (same pattern as above).
// Non-finite inputs propagate: inf -> inf, NaN -> NaN. kNormUnroll packs are loaded before any is
// summed, into as many accumulators (more bytes in flight per thread; the grid is capped), which are
// added in a fixed order at the end: the sum order stays a function of n and the alignment.
constexpr int kNormUnroll = 4;

template <typename T, int V>
__host__ __device__ float sumsq_thread(const T* x, long long n, long long tid, long long nthreads) {
  const long long nvec = n / V;
  float acc[kNormUnroll];
  for (int u = 0; u < kNormUnroll; ++u) acc[u] = 0.0f;
  long long v = tid;
  for (; v + (kNormUnroll - 1) * nthreads < nvec; v += kNormUnroll * nthreads) {
    Pack<T, V> p[kNormUnroll];
    for (int u = 0; u < kNormUnroll; ++u) p[u] = load_pack<T, V>(x, (v + u * nthreads) * V);
    for (int u = 0; u < kNormUnroll; ++u) {
      for (int k = 0; k < V; ++k) {
        const float f = to_float(p[u].v[k]);
        acc[u] = acc[u] + f * f;
      }
    }
  }
  for (; v < nvec; v += nthreads) {  // the last < kNormUnroll packs of this thread
    const Pack<T, V> p = load_pack<T, V>(x, v * V);
    for (int k = 0; k < V; ++k) {
      const float f = to_float(p.v[k]);
      acc[0] = acc[0] + f * f;
    }
  }
  for (long long i = nvec * V + tid; i < n; i += nthreads) {
    const float f = to_float(x[i]);
    acc[0] = acc[0] + f * f;
  }
  float total = acc[0];
  for (int u = 1; u < kNormUnroll; ++u) total = total + acc[u];
  return total;
}

#if defined(__CUDACC__)
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

#endif  // __CUDACC__

}  // namespace dpt

#if defined(__CUDACC__)  // the kernels; a host compiler stops here

// ---------------------------------------------------------------------------------------------
// The update kernels, one per rule: one fused step over one flat group (NVCaffe's
// SGDRegUpdateAllAndClear for sgd): unscale + clip (grad_coef), weight decay, the rule's state update,
// fp32 master update, storage-dtype weight write-back, gradient zeroing; a set found_inf skips all of it
// except the zeroing, so master, params and state stay bit-identical.
// Host wrapper: kernels.cuda.update (via kernels.update), on torch's current stream.
// Launch: grid (min(cdiv(n/V, 256), 2 waves of resident blocks per the occupancy API),), block (256,);
// grid-stride, any grid works.
// Arguments common to every rule, in this order (all 1-D, contiguous, same length n and layout; each
// pointer aligned to V of its elements when V > 1):
//   grads            T*            [n] storage dtype, loss-scaled summed gradient; zeroed on return
//   master           float*        [n] fp32 master weights
//   params           T*            [n] storage dtype weights := T(master), or nullptr when they are the
//                                  master (fp32 storage). Precondition: params == T(master) on entry,
//                                  so a skipped step leaves them as they are.
//   <state>          M*            [n] each, the rule's state (below)
//   lr_scale         const float*  [n] fp32 per-element lr multiplier (lr_mult, LARC, LAMB's trust ratio),
//                                  or nullptr for 1
//   decay_scale      const float*  [n] fp32 per-element weight-decay multiplier (decay_mult), or nullptr
//   grad_coef        const float*  [1] fp32 device scalar: 1/(S*world_size) times the clip factor
//   found_inf        const float*  [1] fp32 device scalar: non-zero (or NaN) skips the step
//   bias_correction  const float*  [2] fp32 device scalars (1 - beta1^t, sqrt(1 - beta2^t)) computed on the
//                                  device by the optimizer (spec.bias_corrections); nullptr for (1, 1).
//                                  Read by adam and lamb only.
//   <scalars>                      the rule's scalars struct, field by field (fp32 floats, int flags)
//   n                long long     elements

// dptrain_sgd_update<T, M, V>, dptrain_nesterov_update<T, M, V>:
//   state    momentum  M* [n] fp32 (Caffe form) or fp16 (lr-factored form) history
//   scalars  lr, momentum_coef, weight_decay, wd_lr (fp32(weight_decay * lr), double product), decay_mode
template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_sgd_update(T* grads, float* master, T* params, M* momentum, const float* lr_scale, const float* decay_scale,
                   const float* grad_coef, const float* found_inf, const float* bias_correction, float lr,
                   float momentum_coef, float weight_decay, float wd_lr, int decay_mode, long long n) {
  const dpt::Args<T, M> a{grads, master, params, {momentum, nullptr}, lr_scale, decay_scale, grad_coef, found_inf,
                          bias_correction, n};
  dpt::run_rule<dpt::MomentumRule<false>, T, M, V>(a, dpt::SgdScalars{lr, momentum_coef, weight_decay, wd_lr,
                                                                    decay_mode});
}

template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_nesterov_update(T* grads, float* master, T* params, M* momentum, const float* lr_scale,
                        const float* decay_scale, const float* grad_coef, const float* found_inf,
                        const float* bias_correction, float lr, float momentum_coef, float weight_decay, float wd_lr,
                        int decay_mode, long long n) {
  const dpt::Args<T, M> a{grads, master, params, {momentum, nullptr}, lr_scale, decay_scale, grad_coef, found_inf,
                          bias_correction, n};
  dpt::run_rule<dpt::MomentumRule<true>, T, M, V>(a, dpt::SgdScalars{lr, momentum_coef, weight_decay, wd_lr,
                                                                    decay_mode});
}

// dptrain_adam_update<T, float, V> (decay_mode 1: Adam; 2: AdamW), dptrain_lamb_update<T, float, V>:
//   state    exp_avg, exp_avg_sq  float* [n] fp32 first and second moments
//   scalars  lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, wd_lr, decay_mode
//            (the 1 - beta differences and wd*lr taken in double on the host, rounded once)
// LAMB's lr_scale holds each parameter's trust ratio |w|/|u| (times its lr_mult), computed before the
// launch by the optimizer from spec.lamb_direction.
template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_adam_update(T* grads, float* master, T* params, M* exp_avg, M* exp_avg_sq, const float* lr_scale,
                    const float* decay_scale, const float* grad_coef, const float* found_inf,
                    const float* bias_correction, float lr, float beta1, float one_minus_beta1, float beta2,
                    float one_minus_beta2, float eps, float weight_decay, float wd_lr, int decay_mode, long long n) {
  const dpt::Args<T, M> a{grads, master, params, {exp_avg, exp_avg_sq}, lr_scale, decay_scale, grad_coef, found_inf,
                          bias_correction, n};
  dpt::run_rule<dpt::AdamRule, T, M, V>(
      a, dpt::AdamScalars{lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, wd_lr, decay_mode});
}

template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_lamb_update(T* grads, float* master, T* params, M* exp_avg, M* exp_avg_sq, const float* lr_scale,
                    const float* decay_scale, const float* grad_coef, const float* found_inf,
                    const float* bias_correction, float lr, float beta1, float one_minus_beta1, float beta2,
                    float one_minus_beta2, float eps, float weight_decay, float wd_lr, int decay_mode, long long n) {
  const dpt::Args<T, M> a{grads, master, params, {exp_avg, exp_avg_sq}, lr_scale, decay_scale, grad_coef, found_inf,
                          bias_correction, n};
  dpt::run_rule<dpt::LambRule, T, M, V>(
      a, dpt::AdamScalars{lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, wd_lr, decay_mode});
}

// dptrain_rmsprop_update<T, float, V>:
//   state    square_avg, momentum  float* [n] fp32 mean square and momentum buffer
//   scalars  lr, momentum_coef, rms_decay, one_minus_rms_decay, eps, weight_decay, wd_lr, decay_mode
template <typename T, typename M, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_rmsprop_update(T* grads, float* master, T* params, M* square_avg, M* momentum, const float* lr_scale,
                       const float* decay_scale, const float* grad_coef, const float* found_inf,
                       const float* bias_correction, float lr, float momentum_coef, float rms_decay,
                       float one_minus_rms_decay, float eps, float weight_decay, float wd_lr, int decay_mode,
                       long long n) {
  const dpt::Args<T, M> a{grads, master, params, {square_avg, momentum}, lr_scale, decay_scale, grad_coef, found_inf,
                          bias_correction, n};
  dpt::run_rule<dpt::RmspropRule, T, M, V>(
      a, dpt::RmspropScalars{lr, momentum_coef, rms_decay, one_minus_rms_decay, eps, weight_decay, wd_lr, decay_mode});
}

// ---------------------------------------------------------------------------------------------
// dptrain_norm<T, V>: the L2 norm in one launch: out[0] = sqrt(sum of squares), in fp32.
// Each block writes the fp32 sum of squares of the elements its threads visit (grid-stride) to
// partials[blockIdx.x]; the block that arrives last (an atomicInc on `arrived`, after a fence) sums
// the partials in index order, thread t taking t, t + 256, ..., then a block reduction, and writes
// the root. That order depends only on the grid, and the grid only on n, so the result is
// deterministic for a given n and alignment, whichever block is last. No atomicAdd of floats.
// atomicInc wraps at gridDim.x - 1, so `arrived` is 0 again when the kernel ends: the host zeroes it
// once and reuses it on its stream. One launch instead of two halves the host's share of a call.
// Host wrapper: kernels.cuda.grad_norm (via kernels.grad_norm), on torch's current stream.
// Launch: grid (min(cdiv(n/V, 256), 1024),) -- a function of n only, for determinism; block (256,).
// Arguments:
//   x         const T*        [n] storage dtype gradient buffer, contiguous (16-byte aligned if V > 1)
//   n         long long       elements
//   partials  float*          [>= gridDim.x] fp32 scratch, one per block
//   arrived   unsigned int*   [1] blocks done so far; 0 before the launch, and 0 again after it
//   out       float*          [] fp32 result: the L2 norm (inf/NaN when any input was)
template <typename T, int V>
__global__ void __launch_bounds__(dpt::kBlockThreads)
dptrain_norm(const T* x, long long n, float* partials, unsigned int* arrived, float* out) {
  const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float acc = dpt::block_sum(dpt::sumsq_thread<T, V>(x, n, tid, static_cast<long long>(gridDim.x) * blockDim.x));
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = acc;
    __threadfence();  // this block's partial is visible to every block before its arrival is counted
    last = atomicInc(arrived, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();  // `last` is read below, and block_sum's shared sums are free for the second reduction
  if (!last) return;
  __threadfence();  // acquire: the partials the other blocks fenced before counting in are read after it
  float total = 0.0f;
  for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += blockDim.x) total = total + __ldcg(partials + i);
  total = dpt::block_sum(total);
  if (threadIdx.x == 0) out[0] = sqrtf(total);
}
#endif  // __CUDACC__
