// The fused update rules on the CPU: update.cu's rule functors (dpt::MomentumRule, AdamRule,
// LambRule, RmspropRule, through dpt::apply_element) and conversions (host_half.h), compiled by
// the system C++ compiler and run over a range of the flat buffers in one pass.
//
// Built at first use by dptrain/kernels/native.py (native.CXXFLAGS) with
//   -O3 -std=c++17 -ffp-contract=off -fno-math-errno -fPIC -shared, plus -march=native on x86-64.
// -ffp-contract=off is what --fmad=false is to NVRTC: every multiply and add rounds separately, as
// the reference's torch ops do. No fast-math: IEEE division, sqrtf and subnormals. -fno-math-errno
// only lets sqrtf vectorise (its value is the same; errno is never read). The result is the
// reference's bits (kernels.spec.reference): tests/unit/test_native_update.py checks every rule,
// dtype, decay mode and table variant (selfcheck.cases), and kernels.native checks again once per
// process before use.
//
// The loop is this file's, not dpt::update_thread: that one walks a GPU grid in packs of V, this
// one walks [0, n) with the loop-invariant choices (decay mode, tables) as template arguments and
// the 16-bit types moved as uint16_t, which is what lets the compiler vectorise it, so it takes
// well under half the time of update_thread itself run as one thread
// (docs/measurements.md#native-update-loop). Per element it does what update_thread does:
// unscale, R::element, round to the storage type, zero the gradient.
//
// Python calls dptrain_cpu_update through ctypes, which releases the GIL for the call; a large
// update is split into ranges, one per thread (kernels.native.update).

#include "update.cu"

// The rules, as (code, functor) pairs: kernels.native.build passes -DDPT_RULES(X)=X(0, ...) ..., made
// from kernels.spec.RULES, the one table of rules, so this file lists none of them itself.
#ifndef DPT_RULES
#error "DPT_RULES is defined by dptrain.kernels.native.build from kernels.spec.RULES"
#endif

#include <cstdint>
#include <type_traits>
#include <utility>

namespace {

// Every rule's scalars struct is its fp32 floats followed by one int (decay_mode), as spec.py's
// NamedTuples are; the floats arrive in that order.
template <typename S, std::size_t... I> S make_scalars(const float* f, int mode, std::index_sequence<I...>) {
  return S{f[I]..., mode};
}

// The bits a storage type is moved as: float itself, the 16-bit types as uint16_t (a loop that
// copies a struct per element is not vectorised).
template <typename T> struct Raw { using type = std::uint16_t; };
template <> struct Raw<float> { using type = float; };
template <typename T> __forceinline__ typename Raw<T>::type raw(T x) {
  if constexpr (std::is_same<T, float>::value) return x; else return x.x;
}
template <typename T> __forceinline__ T cooked(typename Raw<T>::type x) {
  if constexpr (std::is_same<T, float>::value) return x; else return T{x};
}

// Rule R over [0, n) with the loop-invariant choices as template arguments (decay mode, lr and decay
// tables), so that the compiler sees one branch-free body per variant and vectorises it. Per element
// this is dpt::update_thread's body: the same conversions, Elem and R::element.
template <typename R, typename T, typename M, int Mode, bool HasLr, bool HasDecay>
void run_range(const dpt::Args<T, M>& a, typename R::Scalars c) {
  constexpr int K = R::kStates;
  // fp32 storage: the params are the master (nullptr), unless given a buffer of their own
  const bool write_params = !std::is_same<T, float>::value || a.params != nullptr;
  using RT = typename Raw<T>::type;
  using RM = typename Raw<M>::type;
  c.decay_mode = Mode;
  RT* __restrict grads = reinterpret_cast<RT*>(a.grads);
  float* __restrict master = a.master;
  RT* __restrict params = reinterpret_cast<RT*>(a.params);
  RM* __restrict s0 = reinterpret_cast<RM*>(a.state[0]);
  RM* __restrict s1 = K > 1 ? reinterpret_cast<RM*>(a.state[1]) : nullptr;
  const float* __restrict lr_scale = a.lr_scale;
  const float* __restrict decay_scale = a.decay_scale;
  const RT zero = raw(dpt::from_float<T>(0.0f));
  const long long n = a.n;
  if (*a.found_inf != 0.0f) {  // overflow (or NaN flag): skip the step, only clear the gradient
    for (long long i = 0; i < n; ++i) grads[i] = zero;
    return;
  }
  const float coef = *a.grad_coef;
  const float bc1 = a.bias_correction != nullptr ? a.bias_correction[0] : 1.0f;
  const float bc2 = a.bias_correction != nullptr ? a.bias_correction[1] : 1.0f;
  for (long long i = 0; i < n; ++i) {
    const dpt::Elem e{HasLr ? lr_scale[i] : 1.0f, HasDecay ? decay_scale[i] : 1.0f, HasLr, HasDecay, bc1, bc2};
    M h[K];
    h[0] = cooked<M>(s0[i]);
    if (K > 1) h[K - 1] = cooked<M>(s1[i]);
    float w = master[i];
    const T p = dpt::apply_element<R, T, M>(dpt::to_float(cooked<T>(grads[i])) * coef, w, h, e, c);
    master[i] = w;
    s0[i] = raw(h[0]);
    if (K > 1) s1[i] = raw(h[K - 1]);
    grads[i] = zero;
    if (write_params) params[i] = raw(p);
  }
}

template <typename R, typename T, typename M, int Mode>
void by_tables(const dpt::Args<T, M>& a, const typename R::Scalars& c) {
  const bool lr = a.lr_scale != nullptr, decay = a.decay_scale != nullptr;
  if (lr && decay) run_range<R, T, M, Mode, true, true>(a, c);
  else if (lr) run_range<R, T, M, Mode, true, false>(a, c);
  else if (decay) run_range<R, T, M, Mode, false, true>(a, c);
  else run_range<R, T, M, Mode, false, false>(a, c);
}

// The C entry's arguments, as they arrive: untyped until the storage and state codes are read.
struct Call {
  void* grads;
  float* master;
  void* params;
  void* s0;
  void* s1;
  const float* lr_scale;
  const float* decay_scale;
  const float* grad_coef;
  const float* found_inf;
  const float* bias_correction;
  const float* floats;
  int n_floats;
  int decay_mode;
  long long n;
};

template <typename R, typename T, typename M>
int run(const Call& k) {
  using S = typename R::Scalars;
  constexpr std::size_t kFloats = sizeof(S) / sizeof(float) - 1;
  static_assert(sizeof(S) == (kFloats + 1) * sizeof(float), "scalars are floats then one int");
  if (k.n_floats != static_cast<int>(kFloats)) return -1;  // spec.py's scalars and this struct disagree
  if (k.params == nullptr && !std::is_same<T, float>::value) return -1;  // only fp32 weights can be the master
  if (k.s0 == nullptr || (R::kStates > 1) != (k.s1 != nullptr)) return -1;
  const dpt::Args<T, M> a{static_cast<T*>(k.grads), k.master, static_cast<T*>(k.params),
                          {static_cast<M*>(k.s0), static_cast<M*>(k.s1)}, k.lr_scale, k.decay_scale, k.grad_coef,
                          k.found_inf, k.bias_correction, k.n};
  const S c = make_scalars<S>(k.floats, k.decay_mode, std::make_index_sequence<kFloats>{});
  switch (k.decay_mode) {
    case dpt::kDecayNone: by_tables<R, T, M, dpt::kDecayNone>(a, c); return 0;
    case dpt::kDecayL2: by_tables<R, T, M, dpt::kDecayL2>(a, c); return 0;
    case dpt::kDecayDecoupled: by_tables<R, T, M, dpt::kDecayDecoupled>(a, c); return 0;
    default: return -1;
  }
}

template <typename R, typename T> int by_state(int state, const Call& k) {
  if (state == 0) return run<R, T, float>(k);
  if constexpr (R::kStates == 1) {  // the momentum rules also keep an fp16 history
    if (state == 1) return run<R, T, __half>(k);
  }
  return -1;
}

template <typename R> int by_storage(int storage, int state, const Call& k) {
  switch (storage) {
    case 0: return by_state<R, float>(state, k);
    case 1: return by_state<R, __half>(state, k);
    case 2: return by_state<R, __nv_bfloat16>(state, k);
    default: return -1;
  }
}

}  // namespace

extern "C" {

// One update over elements [0, n) of the given buffers (pointers already offset to the range).
//   rule      the rule's index in kernels.spec.RULES (kernels.native.RULE_CODES; DPT_RULES below)
//   storage   dtype of grads and params: 0 fp32, 1 fp16, 2 bf16
//   state     dtype of the rule's state: 0 fp32, 1 fp16 (sgd and nesterov only)
//   params    nullptr when the params are the master (fp32 storage only); s1 nullptr for one-state rules
//   floats    the rule's fp32 scalars in update.cu's struct order, n_floats of them; decay_mode the int
//             after them
// Returns 0, or -1 for a combination update.cu does not define or a scalar count that is not the
// rule's.
int dptrain_cpu_update(int rule, int storage, int state, void* grads, float* master, void* params, void* s0,
                       void* s1, const float* lr_scale, const float* decay_scale, const float* grad_coef,
                       const float* found_inf, const float* bias_correction, const float* floats, int n_floats,
                       int decay_mode, long long n) {
  const Call k{grads,     master,    params,          s0,     s1,       lr_scale,   decay_scale,
               grad_coef, found_inf, bias_correction, floats, n_floats, decay_mode, n};
  switch (rule) {
#define DPT_RULE_CASE(code, ...) \
  case code:                     \
    return by_storage<__VA_ARGS__>(storage, state, k);
    DPT_RULES(DPT_RULE_CASE)
#undef DPT_RULE_CASE
    default: return -1;
  }
}

}  // extern "C"
