// __half and __half2 of the CUDA emulator: IEEE binary16 with round-to-nearest-even
// conversions, as __float2half does; through the F16C instructions where the build has them
// (the compiler's _Float16 conversions are library calls, a quarter of a GEMM's time).
#pragma once
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace emu {
#ifdef __F16C__
inline float h2f(_Float16 h) {
    unsigned short u;
    std::memcpy(&u, &h, 2);
    return _cvtsh_ss(u);
}
inline _Float16 f2h(float f) {
    const unsigned short u = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    _Float16 h;
    std::memcpy(&h, &u, 2);
    return h;
}
#else
inline float h2f(_Float16 h) { return (float)h; }
inline _Float16 f2h(float f) { return (_Float16)f; }
#endif
}  // namespace emu

struct __half {
    _Float16 v;
    __half() = default;
    __half(float f) : v(emu::f2h(f)) {}
    operator float() const { return emu::h2f(v); }
};
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
};
typedef unsigned short __half_raw_bits;

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return emu::h2f(h.v); }
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    std::memcpy(&h, &u, 2);
    return h;
}
inline unsigned short __half_as_ushort(__half h) {
    unsigned short u;
    std::memcpy(&u, &h, 2);
    return u;
}
inline float2 __half22float2(__half2 h) { return {emu::h2f(h.x.v), emu::h2f(h.y.v)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float22half2_rn(float2 f) { return {__half(f.x), __half(f.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline float __low2float(__half2 h) { return emu::h2f(h.x.v); }
inline float __high2float(__half2 h) { return emu::h2f(h.y.v); }
