#pragma once
// ATen SIMD helpers shared by the CPU kernels: up to 2 * Vec::size() elements of any storage
// type as two vectors of its accumulation type (float; double for double), and back. Forced
// inline: as calls, they cost the kernels' loops 60% of their speed.

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

namespace torch_bigbatch {

template <typename T>
using cpu_acc_t = at::opmath_type<T>;

template <typename T>
using AccVec = at::vec::Vectorized<cpu_acc_t<T>>;

// float and double: two loads of their own vectors.
template <typename A, std::enable_if_t<std::is_same_v<A, cpu_acc_t<A>>, int> = 0>
C10_ALWAYS_INLINE void load_pair(const A* src, int64_t count, AccVec<A>& lo, AccVec<A>& hi) {
  using Vec = AccVec<A>;
  lo = Vec::loadu(src, std::min<int64_t>(count, Vec::size()));
  hi = count > Vec::size() ? Vec::loadu(src + Vec::size(), count - Vec::size()) : Vec(A(0));
}
template <typename A, std::enable_if_t<std::is_same_v<A, cpu_acc_t<A>>, int> = 0>
C10_ALWAYS_INLINE void store_pair(A* dst, int64_t count, const AccVec<A>& lo,
                                  const AccVec<A>& hi) {
  lo.store(dst, std::min<int64_t>(count, AccVec<A>::size()));
  if (count > AccVec<A>::size()) hi.store(dst + AccVec<A>::size(), count - AccVec<A>::size());
}

// Half and BFloat16: one load of 2 * Vec::size() elements, converted to two float vectors.
template <typename T, std::enable_if_t<!std::is_same_v<T, cpu_acc_t<T>>, int> = 0>
C10_ALWAYS_INLINE void load_pair(const T* src, int64_t count, AccVec<T>& lo, AccVec<T>& hi) {
  std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src, count));
}
template <typename T, std::enable_if_t<!std::is_same_v<T, cpu_acc_t<T>>, int> = 0>
C10_ALWAYS_INLINE void store_pair(T* dst, int64_t count, const AccVec<T>& lo,
                                  const AccVec<T>& hi) {
  at::vec::convert_from_float<T>(lo, hi).store(dst, count);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// One instruction for 32 values (round to nearest even, as ATen's integer sequence does,
// except that subnormal results, below 1.2e-38, are flushed to 0): bf16 then stores as fast
// as fp16.
template <>
C10_ALWAYS_INLINE void store_pair(at::BFloat16* dst, int64_t count, const AccVec<float>& lo,
                                  const AccVec<float>& hi) {
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  at::vec::Vectorized<at::BFloat16>(packed).store(dst, count);
}
#endif

}  // namespace torch_bigbatch
