// strata CUDA kernels: shared helpers. Prepended to every module by strata-cuda (NVRTC has no
// standard headers here, so the integer types and conversions are our own).
//
// Compiled with --fmad=false: a multiply followed by an add is two roundings unless a kernel
// calls fmaf() itself. That keeps the kernels bit-exact with the CPU kernels of
// strata_engine::kernels, which never fuse either.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

// Programmatic dependent launch (sm_90+). Every kernel calls this first: it waits until the
// kernel before it in the stream has finished and its writes are visible (a no-op when the
// launch had no programmatic dependency), then lets the next kernel launch, so that the next
// kernel's launch and block start-up overlap this kernel's run instead of following its end.
// Nothing may read another kernel's output, or write memory another kernel reads, before it.
// The recorded steps launch with programmatic stream serialization (record.rs); the order of
// every kernel's arithmetic is unchanged, so the results are the same bits.
//
// STRATA_TRIGGER_FIRST (the opt-in measuring switch STRATA_CUDA_TRIGGER_FIRST=1,
// strata_cuda::sources): the next kernel is let launch before the wait, so kernels chain ahead
// as far as the SMs hold their waiting blocks. Only reads of weights are then safe before a
// wait (the experts' settled route is not: the launcher turns that off).
__device__ __forceinline__ void grid_dep_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if defined(STRATA_TRIGGER_FIRST)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#else
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}

// Starts pulling `bytes` of read-only data at `p` (a block's weight rows) into L2 with sm_90's
// bulk prefetch, one instruction from the block's first thread; only the whole 16-byte granules
// inside the range. Kernels issue it before grid_dep_sync(): the weights do not depend on the
// kernel before, so their DRAM latency overlaps that kernel's run.
__device__ __forceinline__ void prefetch_l2(const void* p, u64 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const u64 a = ((u64)p + 15) & ~15ull, e = ((u64)p + bytes) & ~15ull;
    if (threadIdx.x == 0 && threadIdx.y == 0 && e > a)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((u32)(e - a)));
#endif
}

#define NEG_INF (__int_as_float(0xff800000))
#define FULL_MASK 0xffffffffu

// Activation formats (strata_engine::kernels::ActFmt::code).
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_Q8_0 2
#define FMT_Q8K 3

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// ggml_fp32_to_bf16: round to nearest even, NaN kept quiet, subnormals not flushed.
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    return (u16)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// Loads from block formats whose fields are only 2-byte aligned.
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32a2(const u8* p) {
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}
__device__ __forceinline__ float ldf16(const u8* p) { return f16_to_f32(ld16(p)); }

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// Per-byte negation where the byte's mask is 0xff (sign bits spread by spread_signs4).
__device__ __forceinline__ int apply_signs(u32 mag, u32 m) { return (int)__vsub4(mag ^ m, m); }

// Four sign bits (bit j for byte j) to byte masks 0x00/0xff.
__device__ __forceinline__ u32 spread_signs4(u32 b) {
    b &= 0xfu;
    u32 s = (b | (b << 7) | (b << 14) | (b << 21)) & 0x01010101u;
    return s * 0xffu;
}

// Butterfly sum: every lane gets the same bits (a + b == b + a in IEEE arithmetic), and the
// pairing is lane i with lane i+16, then +8, +4, +2, +1: strata_engine's reduce_lanes order.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(FULL_MASK, v, s);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, s));
    return v;
}

// Canonical sum over a 256-thread block: warp butterflies, then the 8 warp sums halved (4, 2,
// 1 apart). `sh` holds 8 floats; every thread returns the total.
__device__ __forceinline__ float block_sum256(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float r = (l < 8) ? sh[l] : 0.f;
    r += __shfl_xor_sync(FULL_MASK, r, 4);
    r += __shfl_xor_sync(FULL_MASK, r, 2);
    r += __shfl_xor_sync(FULL_MASK, r, 1);
    return __shfl_sync(FULL_MASK, r, 0);
}

// The element-wise activations (elem.cu and the fused product epilogues share these, so a
// fused kernel's bits are the composed kernels').
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// 1/sqrt(sum/n + eps) with IEEE division and square root (the default --prec-div/--prec-sqrt).
__device__ __forceinline__ float rms_scale(float sumsq, int n, float eps) {
    return 1.0f / sqrtf(sumsq / (float)n + eps);
}

// Rust's `f as i8` after rounding: saturating, NaN to 0.
__device__ __forceinline__ int sat_i8(float f) {
    if (f != f) return 0;
    f = fminf(fmaxf(f, -128.f), 127.f);
    return (int)f;
}

// ggml's nearest_int bit trick (ties to even; garbage out of range, as ggml).
__device__ __forceinline__ int nearest_int(float x) {
    float v = x + 12582912.f;
    return (__float_as_int(v) & 0x007fffff) - 0x00400000;
}

// ---- activation quantizers, one warp per block ------------------------------------------

// Q8_0 block (34 bytes) from this lane's element v (lane = element index): the x86 from_float.
__device__ __forceinline__ void q8_0_warp(float v, u8* blk, int lane) {
    const float m = warp_max(fabsf(v));
    const float d = m / 127.f;
    const float id = (m != 0.f) ? 127.f / m : 0.f;
    blk[2 + lane] = (u8)(i8)sat_i8(rintf(v * id));
    if (lane == 0) *(u16*)blk = f32_to_f16(d);
}

// Q8_K block (292 bytes, 4-byte aligned) from this lane's 8 consecutive elements
// (elements 8*lane .. 8*lane+7): quantize_row_q8_K_ref.
__device__ __forceinline__ void q8k_warp(const float* v, u8* blk, int lane) {
    float amax = 0.f, mx = 0.f;
    int idx = 1 << 30;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float a = fabsf(v[j]);
        if (a > amax) { amax = a; mx = v[j]; idx = 8 * lane + j; }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const float oa = __shfl_xor_sync(FULL_MASK, amax, s);
        const float om = __shfl_xor_sync(FULL_MASK, mx, s);
        const int oi = __shfl_xor_sync(FULL_MASK, idx, s);
        if (oa > amax || (oa == amax && oi < idx)) { amax = oa; mx = om; idx = oi; }
    }
    u32* qw = (u32*)(blk + 4 + 8 * lane);
    if (amax == 0.f) {
        qw[0] = 0u;
        qw[1] = 0u;
        if ((lane & 1) == 0) *(i16*)(blk + 260 + lane) = 0;
        if (lane == 0) *(float*)blk = 0.f;
        return;
    }
    const float iscale = -127.f / mx;
    int s = 0;
    u32 w0 = 0, w1 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        int q = nearest_int(iscale * v[j]);
        q = q < 127 ? q : 127;
        const int qb = (int)(i8)q;
        s += qb;
        if (j < 4) w0 |= ((u32)(u8)qb) << (8 * j);
        else w1 |= ((u32)(u8)qb) << (8 * (j - 4));
    }
    qw[0] = w0;
    qw[1] = w1;
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    if ((lane & 1) == 0) *(i16*)(blk + 260 + lane) = (i16)s;
    if (lane == 0) *(float*)blk = 1.f / iscale;
}

// Asynchronous global → shared copies (sm_80+: cp.async): the copy is in flight while the
// thread computes; cp_async_wait_all() waits for this thread's copies (then a barrier makes
// them visible to the others). For staging a kernel's next inputs behind its current work.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// ---- bulk copies into shared memory (sm_90's TMA, one mbarrier a block) --------------------
// The block's first thread arms `bar` for `bytes` and issues the copies; every thread then
// waits for phase 0 (mbar_wait) after a __syncthreads. Addresses and sizes are multiples of 16
// (the launchers check). One use of the barrier a launch.
__device__ __forceinline__ void mbar_arm(u64* bar, u32 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void bulk_to_smem(void* dst, const void* src, u32 bytes, u64* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(u64* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
        "@!p bra MBAR_WAIT;\n"
        "}\n" ::"r"(smem_addr(bar))
        : "memory");
#endif
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}

