// nvcuda::wmma of the CUDA emulator: 16x16x16 tiles of __half with float (or __half)
// accumulators, and of signed/unsigned char with int accumulators (exact, as IMMA).
//
// Every lane's fragment holds the whole tile (a GPU spreads it over the lanes; code that only
// loads, multiplies and stores cannot tell). Each call is a warp-wide operation, as the
// `_sync` says: all 32 lanes must reach it, and loads, mma_sync and store_matrix_sync do their
// work once per warp, when the last lane arrives, instead of once per lane.
#pragma once
#include "cuda_emu.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16x16x16 tiles only");
    enum { num_elements = 256 };
    T x[256];  // row-major: a (m, k), b (k, n), accumulator (m, n)
};

#define EMU_WMMA_CONVERGE(name) ::emu::warp_op(3, name, __FILE__, __LINE__, 0xffffffffu, nullptr, ::emu::noop_finish)

namespace detail {
// A load, once per warp: the last lane to arrive reads the tile into its fragment and copies
// it to the other lanes'.
template <class Frag, class T>
struct LoadArgs {
    Frag* frag;
    const T* p;
    unsigned ldm;
    int transposed;  // element (r, c) of the fragment at p[c * ldm + r] instead of p[r * ldm + c]
};

template <class Frag, class T>
inline void load_finish(::emu::WarpOp& w) {
    const LoadArgs<Frag, T>* a = static_cast<const LoadArgs<Frag, T>*>(w.args[::emu::self().lane]);
    Frag& f = *a->frag;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = a->transposed ? a->p[c * a->ldm + r] : a->p[r * a->ldm + c];
    for (int lane = 0; lane < 32; ++lane) {
        Frag* other = static_cast<const LoadArgs<Frag, T>*>(w.args[lane])->frag;
        if (other != &f) std::memcpy(other->x, f.x, sizeof f.x);
    }
}

// What the CUDA guide requires of a WMMA load or store, which a GPU does not check: the pointer
// 256-bit (32-byte) aligned, ldm a multiple of 16 bytes.
template <class T>
inline void check_layout(const char* what, const T* p, unsigned ldm) {
    if (reinterpret_cast<uintptr_t>(p) % 32)
        ::emu::fail("%s: the pointer %p is not 32-byte aligned, as WMMA requires", what, (const void*)p);
    if ((ldm * sizeof(T)) % 16)
        ::emu::fail("%s: ldm %u (%zu bytes) is not a multiple of 16 bytes, as WMMA requires", what, ldm,
                    (size_t)ldm * sizeof(T));
}

template <class Frag, class T>
inline void load(Frag& f, const T* p, unsigned ldm, int transposed) {
    check_layout("wmma::load_matrix_sync", p, ldm);
    LoadArgs<Frag, T> args{&f, p, ldm, transposed};
    ::emu::warp_op(6, "wmma::load_matrix_sync", __FILE__, __LINE__, 0xffffffffu, &args, load_finish<Frag, T>);
}
}  // namespace detail

template <class Use, class T, class Layout, class V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, V v) {
    EMU_WMMA_CONVERGE("wmma::fill_fragment");
    for (int i = 0; i < 256; ++i) f.x[i] = T(v);
}

// matrix_a: A(m, k) at p[m * ldm + k] (row_major) or p[k * ldm + m] (col_major);
// matrix_b: B(k, n) at p[k * ldm + n] (row_major) or p[n * ldm + k] (col_major)
template <class Use, class T, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
    static_assert(std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value, "a or b operand");
    detail::load(f, p, ldm, std::is_same<Layout, col_major>::value ? 1 : 0);
}
template <class T>
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const T* p, unsigned ldm, layout_t layout) {
    detail::load(f, p, ldm, layout == mem_col_major);
}

namespace detail {
// D = A B + C once for the warp, from the lanes' operands (equal in every lane), into every lane's D
template <class TD, class TA, class LA, class LB, class TC>
struct MmaArgs {
    fragment<accumulator, 16, 16, 16, TD>* d;
    const fragment<matrix_a, 16, 16, 16, TA, LA>* a;
    const fragment<matrix_b, 16, 16, 16, TA, LB>* b;
    const fragment<accumulator, 16, 16, 16, TC>* c;
};

// 8-bit operands (signed char, unsigned char) with int accumulators: exact int32 sums, as IMMA
template <class TD, class TA, class LA, class LB, class TC>
inline void mma_finish_int(::emu::WarpOp& w) {
    typedef MmaArgs<TD, TA, LA, LB, TC> Args;
    const Args* first = static_cast<const Args*>(w.args[0]);
    int out[256];
    for (int i = 0; i < 256; ++i) out[i] = (int)first->c->x[i];
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 16; ++k) {
            const int am = (int)first->a->x[m * 16 + k];
            for (int n = 0; n < 16; ++n) out[m * 16 + n] += am * (int)first->b->x[k * 16 + n];
        }
    for (int lane = 0; lane < 32; ++lane) {
        const Args* args = static_cast<const Args*>(w.args[lane]);
        for (int i = 0; i < 256; ++i) args->d->x[i] = TD(out[i]);
    }
}

template <class TD, class TA, class LA, class LB, class TC>
inline void mma_finish_float(::emu::WarpOp& w) {
    typedef MmaArgs<TD, TA, LA, LB, TC> Args;
    const Args* first = static_cast<const Args*>(w.args[0]);
    float a[256], b[256], out[256];  // the operands converted once: products of f16 values are exact in f32
    for (int i = 0; i < 256; ++i) {
        a[i] = (float)first->a->x[i];
        b[i] = (float)first->b->x[i];
    }
    for (int i = 0; i < 256; ++i) out[i] = (float)first->c->x[i];
    for (int m = 0; m < 16; ++m)  // k outside n: the inner loop runs along rows of b and out (vectorised)
        for (int k = 0; k < 16; ++k) {
            const float am = a[m * 16 + k];
            for (int n = 0; n < 16; ++n) out[m * 16 + n] += am * b[k * 16 + n];
        }
    for (int lane = 0; lane < 32; ++lane) {
        const Args* args = static_cast<const Args*>(w.args[lane]);
        for (int i = 0; i < 256; ++i) args->d->x[i] = TD(out[i]);
    }
}

template <class TD, class TA, class LA, class LB, class TC>
inline void mma_finish(::emu::WarpOp& w) {
    if constexpr (std::is_integral<TA>::value)
        mma_finish_int<TD, TA, LA, LB, TC>(w);
    else
        mma_finish_float<TD, TA, LA, LB, TC>(w);
}

template <class T>
struct StoreArgs {
    T* p;
    const T* x;
    unsigned ldm;
    layout_t layout;
};

template <class T>
inline void store_finish(::emu::WarpOp& w) {
    const StoreArgs<T>* a = static_cast<const StoreArgs<T>*>(w.args[0]);
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            if (a->layout == mem_row_major) a->p[m * a->ldm + n] = a->x[m * 16 + n];
            else a->p[n * a->ldm + m] = a->x[m * 16 + n];
        }
}
}  // namespace detail

template <class TD, class TA, class LA, class LB, class TC>
inline void mma_sync(fragment<accumulator, 16, 16, 16, TD>& d, const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TA, LB>& b, const fragment<accumulator, 16, 16, 16, TC>& c) {
    detail::MmaArgs<TD, TA, LA, LB, TC> args{&d, &a, &b, &c};
    ::emu::warp_op(4, "wmma::mma_sync", __FILE__, __LINE__, 0xffffffffu, &args, detail::mma_finish<TD, TA, LA, LB, TC>);
}

template <class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm, layout_t layout) {
    detail::check_layout("wmma::store_matrix_sync", p, ldm);
    detail::StoreArgs<T> args{p, f.x, ldm, layout};
    ::emu::warp_op(5, "wmma::store_matrix_sync", __FILE__, __LINE__, 0xffffffffu, &args, detail::store_finish<T>);
}

}  // namespace wmma
}  // namespace nvcuda
