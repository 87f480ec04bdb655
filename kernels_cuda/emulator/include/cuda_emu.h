// The CUDA emulator: what a .cu file needs from CUDA, so that g++ compiles it unchanged and
// its kernels run on the CPU (edgeinfer.kernels_cuda.emulator loads the result via ctypes).
//
// - One fiber per GPU thread; the blocks of a grid run one after another, in forward or in
//   reversed order (threads too), so that a race shows up as a difference between the two.
// - threadIdx / blockIdx / blockDim / gridDim come from the running fiber and launch.
// - __syncthreads is a block-wide wait; __shfl*_sync and the WMMA calls are warp-wide
//   operations: every lane's result is computed before any lane resumes.
// - Static __shared__ variables are function-local statics; the loader finds each kernel's
//   (edgeinfer.kernels_cuda.emulator.build) and they are reset to NaN before every block.
// - Faults a GPU would also show are launch errors, never a wrong answer: a barrier or warp
//   operation not reached by every thread that must reach it, lanes meeting at different
//   ones, a shuffle whose mask names lanes a partial warp lacks, a memory fault (allocations
//   sit against guard pages), an integer division by zero.
// - With EMU_FAST_MATH (the build's --use_fast_math), expf/__expf, tanhf, sincosf, rsqrtf
//   and division carry the error the CUDA documentation allows for them, so a test's
//   tolerance that passes here holds on a GPU too.
#pragma once

#include <cstdarg>
#include <csetjmp>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <cmath>
#include <algorithm>
#include <type_traits>
#include <utility>
#include <ucontext.h>
#include <sys/mman.h>

#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 860
#endif
#define __CUDACC__ 1

#ifdef EMU_SCAN  // the kernel scan: mark kernels and their launch bounds in the preprocessed text
#define __global__ __emu_kernel__
#define __launch_bounds__(...) __emu_launch_bounds__(__VA_ARGS__)
#else
#define __global__
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__ static

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using std::max;
using std::min;

namespace emu {

enum State { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    jmp_buf jb;
    ucontext_t uc;
    bool started;
    State state;
    uint3 tid;
    int warp, lane;
    const char* file;  // where it waits (barrier)
    int line;
};

struct WarpOp;
typedef void (*WarpFinish)(WarpOp&);

// A warp-wide operation in progress: the lanes that must arrive, those that have, and each
// lane's argument; the last lane to arrive computes everyone's result (finish).
struct WarpOp {
    int kind;  // 0: none
    const char* file;
    int line;
    unsigned mask, arrived;
    unsigned exited;  // lanes of the warp that have finished the block
    void* args[32];
    WarpFinish finish;
};

struct Launch {
    const char* kernel;
    dim3 grid, block;
    uint3 grid_u3, block_u3, bidx;
    int nthreads, nwarps;
    int reverse;
    Fiber* fibers;
    Fiber* cur;
    WarpOp* warps;
    jmp_buf sched;
    sigjmp_buf fault;
    volatile sig_atomic_t in_kernel;
    void* fault_addr;
    int fault_sig;
    bool failed;
    char* err;
    int errlen;
    void (*body)(void*);
    void* body_ctx;
};

inline Launch*& current() {
    static Launch* l = nullptr;
    return l;
}

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Stop the launch with a message: from a fiber, back to the scheduler for good.
inline void fail(const char* fmt, ...) {
    Launch* l = current();
    va_list ap;
    va_start(ap, fmt);
    int n = std::snprintf(l->err, l->errlen, "%s: ", l->kernel);
    if (n >= 0 && n < l->errlen) std::vsnprintf(l->err + n, l->errlen - n, fmt, ap);
    va_end(ap);
    l->failed = true;
    _longjmp(l->sched, 1);
}

inline void yield() {
    Launch* l = current();
    if (!_setjmp(l->cur->jb)) _longjmp(l->sched, 1);
}

inline Fiber& self() { return *current()->cur; }

inline unsigned lanes_of(const Launch* l, int warp) {
    const int n = std::min(32, l->nthreads - warp * 32);
    return n == 32 ? 0xffffffffu : ((1u << n) - 1u);
}

inline const char* base(const char* path) {
    const char* s = std::strrchr(path, '/');
    return s ? s + 1 : path;
}

// Arrive at a warp-wide operation; returns once every lane of `mask` has arrived and the
// operation's finish has run.
inline void warp_op(int kind, const char* name, const char* file, int line, unsigned mask, void* arg,
                    WarpFinish finish) {
    Launch* l = current();
    Fiber& f = *l->cur;
    const unsigned have = lanes_of(l, f.warp);
    if (mask & ~have)
        fail("%s at %s:%d with mask 0x%08x in a partial warp of %d lanes (block of %d threads)", name, base(file),
             line, mask, __builtin_popcount(have), l->nthreads);
    if (!((mask >> f.lane) & 1u))
        fail("%s at %s:%d called by lane %d, which its mask 0x%08x leaves out", name, base(file), line, f.lane, mask);
    WarpOp& w = l->warps[f.warp];
    if (w.kind == 0) {
        w.kind = kind;
        w.file = file;
        w.line = line;
        w.mask = mask;
        w.arrived = 0;
        w.finish = finish;
    } else if (w.kind != kind || w.line != line || w.file != file || w.mask != mask) {
        fail("lanes of warp %d (block %u,%u,%u) meet at different warp operations: %s:%d and %s at %s:%d",
             f.warp, l->bidx.x, l->bidx.y, l->bidx.z, base(w.file), w.line, name, base(file), line);
    }
    w.args[f.lane] = arg;
    w.arrived |= 1u << f.lane;
    if (w.exited & w.mask)  // a lane that has exited can never arrive
        fail("%s at %s:%d waits for lane %d of warp %d, which has exited", name, base(file), line,
             __builtin_ctz(w.exited & w.mask), f.warp);
    if (w.arrived == w.mask) {
        w.finish(w);
        w.kind = 0;
        w.arrived = 0;
        for (int i = 0; i < 32; ++i)
            if (((w.mask >> i) & 1u) && i != f.lane) l->fibers[f.warp * 32 + i].state = READY;
        return;
    }
    f.state = AT_WARP;
    yield();
}

inline void syncthreads(const char* file, int line) {
    Fiber& f = self();
    f.state = AT_BARRIER;
    f.file = file;
    f.line = line;
    yield();
}

// -- the scheduler ----------------------------------------------------------------------------

// A fiber runs the kernel body for one block after another: it is started (setcontext) on the
// launch's first block only, and later blocks resume it where it parked after the last one.
inline void fiber_main() {
    for (;;) {
        Launch* l = current();
        l->body(l->body_ctx);
        Fiber& f = *l->cur;
        f.state = DONE;
        WarpOp& w = l->warps[f.warp];
        w.exited |= 1u << f.lane;
        if (w.kind != 0 && ((w.mask >> f.lane) & 1u) && !((w.arrived >> f.lane) & 1u))
            fail("lane %d of warp %d exits while its warp waits at the warp operation at %s:%d", f.lane, f.warp,
                 base(w.file), w.line);
        if (!_setjmp(f.jb)) _longjmp(l->sched, 1);
    }
}

inline void describe_waits(Launch* l, char* out, size_t n) {
    // "224 at attention.cu:141, 32 at a warp operation (attention.cu:30), 0 exited"
    int done = 0, warp = 0;
    const char* wf = "";
    int wl = 0;
    const char* files[4] = {};
    int lines[4] = {}, counts[4] = {};
    int k = 0;
    for (int i = 0; i < l->nthreads; ++i) {
        Fiber& f = l->fibers[i];
        if (f.state == DONE) {
            ++done;
        } else if (f.state == AT_WARP) {
            ++warp;
            wf = l->warps[f.warp].file;
            wl = l->warps[f.warp].line;
        } else if (f.state == AT_BARRIER) {
            int j = 0;
            while (j < k && !(files[j] == f.file && lines[j] == f.line)) ++j;
            if (j == k && k < 4) {
                files[k] = f.file;
                lines[k] = f.line;
                ++k;
            }
            if (j < 4) ++counts[j];
        }
    }
    size_t used = 0;
    for (int j = 0; j < k && used < n; ++j)
        used += std::snprintf(out + used, n - used, "%d at __syncthreads %s:%d, ", counts[j], base(files[j]), lines[j]);
    if (warp && used < n)
        used += std::snprintf(out + used, n - used, "%d at a warp operation %s:%d, ", warp, base(wf), wl);
    if (used < n) std::snprintf(out + used, n - used, "%d exited", done);
}

// Run one block to the end; false when the launch failed (l->err says why).
inline bool run_block(Launch* l) {
    for (int i = 0; i < l->nthreads; ++i) l->fibers[i].state = READY;
    for (int w = 0; w < l->nwarps; ++w) {
        l->warps[w].kind = 0;
        l->warps[w].arrived = 0;
        l->warps[w].exited = 0;
    }
    for (;;) {
        bool ran = false;
        for (int k = 0; k < l->nthreads; ++k) {
            Fiber& f = l->fibers[l->reverse ? l->nthreads - 1 - k : k];
            if (f.state != READY) continue;
            ran = true;
            l->cur = &f;
            if (!_setjmp(l->sched)) {
                if (!f.started) {
                    f.started = true;
                    setcontext(&f.uc);
                }
                _longjmp(f.jb, 1);
            }
            if (l->failed) return false;
        }
        if (ran) continue;
        int live = 0, at_bar = 0, done = 0;
        const char* file = nullptr;
        int line = 0;
        bool same = true;
        for (int i = 0; i < l->nthreads; ++i) {
            Fiber& f = l->fibers[i];
            if (f.state == DONE) {
                ++done;
                continue;
            }
            ++live;
            if (f.state == AT_BARRIER) {
                if (at_bar++ == 0) {
                    file = f.file;
                    line = f.line;
                } else if (f.file != file || f.line != line) {
                    same = false;
                }
            }
        }
        if (live == 0) return true;
        char what[256];
        if (at_bar == live && same && done == 0) {
            for (int i = 0; i < l->nthreads; ++i) l->fibers[i].state = READY;
            continue;
        }
        describe_waits(l, what, sizeof what);
        std::snprintf(l->err, l->errlen,
                      "%s: block (%u,%u,%u) cannot go on: a barrier or warp operation is not reached by every "
                      "thread that must reach it (%s)",
                      l->kernel, l->bidx.x, l->bidx.y, l->bidx.z, what);
        l->failed = true;
        return false;
    }
}

inline void on_fault(int sig, siginfo_t* info, void*) {
    Launch* l = current();
    if (!l || !l->in_kernel) {  // not ours: die as the process would have
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    l->fault_sig = sig;
    l->fault_addr = info->si_addr;
    siglongjmp(l->fault, 1);
}

struct Stacks {  // fiber stacks, kept between launches; a guard page below each
    char* mem = nullptr;
    size_t each = 0;
    int count = 0;
};

inline Stacks& stacks() {
    static Stacks s;
    return s;
}

inline char* fiber_stack(int i, int n, size_t each) {
    Stacks& s = stacks();
    if (s.count < n) {
        if (s.mem) munmap(s.mem, s.each * s.count);
        s.each = each;
        s.count = n;
        s.mem = static_cast<char*>(mmap(nullptr, each * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        if (s.mem == MAP_FAILED) {
            s.mem = nullptr;
            s.count = 0;
            return nullptr;
        }
        for (int k = 0; k < n; ++k) mprotect(s.mem + k * each, 4096, PROT_NONE);
    }
    return s.mem + i * s.each;
}

struct SharedVars {  // the static __shared__ variables a kernel reaches, reset before every block
    char* const* at;
    const long long* size;
    int n;
};

// Run `body` as a kernel over grid x block. Returns 0, or 1 with the reason in err.
inline int launch(const char* kernel, const unsigned* grid, const unsigned* block, int reverse, SharedVars shared,
                  char* err, int errlen, void (*body)(void*), void* ctx) {
    const size_t stack_size = 256 * 1024;
    Launch l{};
    l.kernel = kernel;
    l.grid = dim3(grid[0], grid[1], grid[2]);
    l.block = dim3(block[0], block[1], block[2]);
    l.grid_u3 = {grid[0], grid[1], grid[2]};
    l.block_u3 = {block[0], block[1], block[2]};
    l.nthreads = (int)(block[0] * block[1] * block[2]);
    l.nwarps = (l.nthreads + 31) / 32;
    l.reverse = reverse;
    l.err = err;
    l.errlen = errlen;
    l.body = body;
    l.body_ctx = ctx;
    Fiber* fibers = new Fiber[l.nthreads];
    WarpOp* warps = new WarpOp[l.nwarps];
    l.fibers = fibers;
    l.warps = warps;
    Launch* outer = current();
    current() = &l;
    static char altstack[64 * 1024];
    stack_t ss{}, old_ss{};
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    sigaltstack(&ss, &old_ss);
    struct sigaction sa{}, old_segv{}, old_bus{}, old_fpe{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
    sigaction(SIGFPE, &sa, &old_fpe);
    volatile int rc = 0;
    for (int i = 0; i < l.nthreads; ++i) {
        Fiber& f = fibers[i];
        f.tid = {(unsigned)(i % block[0]), (unsigned)((i / block[0]) % block[1]), (unsigned)(i / (block[0] * block[1]))};
        f.warp = i / 32;
        f.lane = i % 32;
        f.started = false;
        char* stack = fiber_stack(i, l.nthreads, stack_size);
        if (!stack) {
            std::snprintf(err, errlen, "%s: no memory for %d thread stacks", kernel, l.nthreads);
            rc = 1;
            break;
        }
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = stack + 4096;
        f.uc.uc_stack.ss_size = stack_size - 4096;
        f.uc.uc_link = nullptr;
        makecontext(&f.uc, fiber_main, 0);
    }
    const long long nblocks = (long long)grid[0] * grid[1] * grid[2];
    if (rc == 0 && sigsetjmp(l.fault, 1) == 0) {
        for (long long k = 0; k < nblocks && rc == 0; ++k) {
            const long long b = reverse ? nblocks - 1 - k : k;
            l.bidx = {(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]), (unsigned)(b / ((long long)grid[0] * grid[1]))};
            for (int i = 0; i < shared.n; ++i) std::memset(shared.at[i], 0xff, shared.size[i]);  // NaN: f32 and f16
            l.in_kernel = 1;
            const bool ok = run_block(&l);
            l.in_kernel = 0;
            if (!ok) rc = 1;
        }
    } else if (rc == 0) {
        l.in_kernel = 0;
        const Fiber* f = l.cur;
        std::snprintf(err, errlen, "%s: %s at address %p in thread (%u,%u,%u) of block (%u,%u,%u)", kernel,
                      l.fault_sig == SIGFPE ? "arithmetic fault (integer division by zero?)" : "invalid memory access",
                      l.fault_addr, f ? f->tid.x : 0, f ? f->tid.y : 0, f ? f->tid.z : 0, l.bidx.x, l.bidx.y, l.bidx.z);
        rc = 2;
    }
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaction(SIGFPE, &old_fpe, nullptr);
    sigaltstack(&old_ss, nullptr);
    current() = outer;
    delete[] fibers;
    delete[] warps;
    return rc;
}

// -- calling a kernel with the packed arguments -------------------------------------------------

template <class... P, size_t... I>
inline void call_with(void (*fn)(P...), void** args, std::index_sequence<I...>) {
    fn(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

template <class... P>
struct Call {
    void (*fn)(P...);
    void** args;
    static void run(void* self) {
        Call* c = static_cast<Call*>(self);
        call_with(c->fn, c->args, std::index_sequence_for<P...>{});
    }
};

// Parameter kinds for the argument check: 'p' pointer, 'i' signed integer, 'u' unsigned, 'f' float;
// with its size in bytes.
template <class T>
constexpr char kind_of() {
    return std::is_pointer<T>::value ? 'p'
           : std::is_floating_point<T>::value ? 'f'
           : std::is_integral<T>::value ? (std::is_signed<T>::value ? 'i' : 'u')
           : '?';
}

template <class... P>
inline int launch_kernel(const char* name, void (*fn)(P...), void** args, const unsigned* grid, const unsigned* block,
                         int reverse, SharedVars shared, char* err, int errlen) {
    Call<P...> c{fn, args};
    return launch(name, grid, block, reverse, shared, err, errlen, &Call<P...>::run, &c);
}

template <class T>
constexpr int pointee_size() {
    if constexpr (std::is_pointer<T>::value) {
        typedef std::remove_cv_t<std::remove_pointer_t<T>> E;
        if constexpr (std::is_void<E>::value) return 1;
        else return (int)sizeof(E);
    } else {
        return 0;
    }
}

// kinds[i], sizes[i] (bytes) and pointee[i] (bytes a pointer's element takes, 0 otherwise) of
// each parameter; returns the parameter count.
template <class... P>
inline int signature(void (*)(P...), char* kinds, int* sizes, int* pointee, int max) {
    const char k[] = {kind_of<std::remove_cv_t<P>>()..., 0};
    const int s[] = {(int)sizeof(P)..., 0};
    const int t[] = {pointee_size<std::remove_cv_t<P>>()..., 0};
    const int n = (int)sizeof...(P);
    for (int i = 0; i < n && i < max; ++i) {
        kinds[i] = k[i];
        sizes[i] = s[i];
        pointee[i] = t[i];
    }
    return n;
}

// -- warp operations ----------------------------------------------------------------------------

struct Shfl {
    uint64_t in, out;
    int src;
};

inline void shfl_finish(WarpOp& w) {
    for (int i = 0; i < 32; ++i) {
        if (!((w.mask >> i) & 1u)) continue;
        Shfl* s = static_cast<Shfl*>(w.args[i]);
        const int src = s->src;
        if (src < 0 || src > 31 || !((w.mask >> src) & 1u))
            fail("shuffle at %s:%d: lane %d reads lane %d, outside the mask 0x%08x", base(w.file), w.line, i, src,
                 w.mask);
        s->out = static_cast<Shfl*>(w.args[src])->in;
    }
}

template <class T>
inline T shfl(const char* file, int line, unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles move 4 or 8 bytes");
    Shfl s{};
    std::memcpy(&s.in, &v, sizeof(T));
    s.src = src;
    warp_op(1, "shuffle", file, line, mask, &s, shfl_finish);
    T out;
    std::memcpy(&out, &s.out, sizeof(T));
    return out;
}

inline int lane_id() { return self().lane; }

inline void noop_finish(WarpOp&) {}

inline void syncwarp(const char* file, int line, unsigned mask) {
    warp_op(2, "__syncwarp", file, line, mask, nullptr, noop_finish);
}

}  // namespace emu

#define threadIdx (::emu::current()->cur->tid)
#define blockIdx (::emu::current()->bidx)
#define blockDim (::emu::current()->block_u3)
#define gridDim (::emu::current()->grid_u3)
#define warpSize 32
#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::emu::syncwarp(__FILE__, __LINE__, EMU_MASK_OR_FULL(__VA_ARGS__))
#define EMU_MASK_OR_FULL(...) (0xffffffffu __VA_OPT__(& (__VA_ARGS__)))
#define __shfl_sync(mask, v, src, ...) \
    ::emu::shfl(__FILE__, __LINE__, (mask), (v), ::emu::shfl_src_idx((src), ::emu::shfl_width(__VA_ARGS__)))
#define __shfl_xor_sync(mask, v, m, ...) \
    ::emu::shfl(__FILE__, __LINE__, (mask), (v), ::emu::shfl_src_xor((m), ::emu::shfl_width(__VA_ARGS__)))
#define __shfl_down_sync(mask, v, d, ...) \
    ::emu::shfl(__FILE__, __LINE__, (mask), (v), ::emu::shfl_src_down((d), ::emu::shfl_width(__VA_ARGS__)))
#define __shfl_up_sync(mask, v, d, ...) \
    ::emu::shfl(__FILE__, __LINE__, (mask), (v), ::emu::shfl_src_up((d), ::emu::shfl_width(__VA_ARGS__)))

namespace emu {
inline int shfl_width() { return 32; }
inline int shfl_width(int w) { return w; }
// A source lane outside the lane's segment of `width` lanes reads the lane itself (CUDA's rule).
inline int shfl_src_idx(int src, int w) { return (lane_id() & ~(w - 1)) + (src & (w - 1)); }
inline int shfl_src_xor(int m, int w) {
    const int s = lane_id() ^ m;
    return (s & ~(w - 1)) == (lane_id() & ~(w - 1)) ? s : lane_id();
}
inline int shfl_src_down(int d, int w) {
    const int s = lane_id() + d;
    return (s & ~(w - 1)) == (lane_id() & ~(w - 1)) ? s : lane_id();
}
inline int shfl_src_up(int d, int w) {
    const int s = lane_id() - d;
    return s >= 0 && (s & ~(w - 1)) == (lane_id() & ~(w - 1)) ? s : lane_id();
}
}  // namespace emu

#include "emu_half.h"
#include "emu_math.h"
