// The device math of the CUDA emulator. Exact functions are the C library's. Under
// EMU_FAST_MATH (nvcc's --use_fast_math) the functions it turns into approximate
// instructions return a result off by the error the CUDA C Programming Guide allows them
// (its "Intrinsic Functions" tables), in a direction that depends on the input: a test's
// tolerance that passes here then also holds on a GPU.
#pragma once

namespace emu {

inline uint32_t mix(float x) {  // a sign per input, stable across runs
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u ^= u >> 16;
    u *= 0x7feb352du;
    u ^= u >> 15;
    u *= 0x846ca68bu;
    return u ^ (u >> 16);
}

inline float ulp(float y) {
    int e;
    std::frexp(y, &e);
    return std::ldexp(1.0f, e - 24);
}

inline float off_ulps(float y, float ulps, float x) {
    if (!std::isfinite(y) || y == 0.0f) return y;
    return (mix(x) & 1u) ? y + ulps * ulp(y) : y - ulps * ulp(y);
}

inline float off_abs(float y, float err, float x) { return (mix(x) & 1u) ? y + err : y - err; }

inline float off_rel(float y, float rel, float x) { return (mix(x) & 1u) ? y * (1.0f + rel) : y * (1.0f - rel); }

// __expf: 2 + floor(|1.173 x|) ulp
inline float fast_expf(float x) {
    return off_ulps(std::exp(x), 2.0f + std::floor(std::fabs(1.173f * x)), x);
}
// __sinf / __cosf: 2^-21.41 absolute in [-pi, pi], worse outside
inline float fast_sin_cos_err(float x) {
    return std::fabs(x) <= 3.14159265f ? 3.5762787e-7f : 3.5762787e-7f * (1.0f + std::fabs(x));
}
inline float fast_sinf(float x) { return off_abs(std::sin(x), fast_sin_cos_err(x), x); }
inline float fast_cosf(float x) { return off_abs(std::cos(x), fast_sin_cos_err(x), x + 1.0f); }
// tanh.approx.f32: relative error 2^-10.987
inline float fast_tanhf(float x) { return off_rel(std::tanh(x), 4.9e-4f, x); }
// __logf: 2^-21.41 absolute in [0.5, 2], else 3 ulp
inline float fast_logf(float x) {
    const float y = std::log(x);
    return (x >= 0.5f && x <= 2.0f) ? off_abs(y, 3.5762787e-7f, x) : off_ulps(y, 3.0f, x);
}

}  // namespace emu

inline float rsqrtf(float x) { return emu::off_ulps(1.0f / std::sqrt(x), 2.0f, x); }  // 2 ulp always
inline float __expf(float x) { return emu::fast_expf(x); }
inline float __sinf(float x) { return emu::fast_sinf(x); }
inline float __cosf(float x) { return emu::fast_cosf(x); }
inline void __sincosf(float x, float* s, float* c) {
    *s = emu::fast_sinf(x);
    *c = emu::fast_cosf(x);
}
inline float __logf(float x) { return emu::fast_logf(x); }
inline float __fdividef(float a, float b) { return emu::off_ulps(a / b, 2.0f, a + b); }
// IEEE round-to-nearest operations that --use_fast_math leaves exact (the host's float ops are;
// g++ is not given FMA contraction here)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }  // the default mode: half to even
inline int __float2int_rz(float x) { return (int)x; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }

#ifdef EMU_FAST_MATH
#define expf(x) emu::fast_expf(x)
#define tanhf(x) emu::fast_tanhf(x)
#define sinf(x) emu::fast_sinf(x)
#define cosf(x) emu::fast_cosf(x)
#define logf(x) emu::fast_logf(x)
#define sincosf(x, s, c) __sincosf((x), (s), (c))
#endif  // without it, sincosf is the C library's (a GNU extension g++ declares)

// Atomics: fibers of a launch never run at once, so a plain read-modify-write is atomic.
template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
