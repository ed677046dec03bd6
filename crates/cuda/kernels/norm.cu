// The MTP norm kernels: rms_xprep, combine_gnorm, xprep (strata_engine::kernels::norm has the
// contract). One 256-thread block per token row; thread t owns elements t + 256k of every
// reduction, so the sums have the canonical order and equal the CPU kernels bit for bit.
//
// *_base: runtime sizes and format, runtime divisions, a re-read of the input.
// *_opt:  the report's ideas: sizes and formats as template constants (full unrolling,
//         pre-offset pointers with immediate offsets, constant divisors), the row kept in
//         registers or shared memory between the reduction and the output pass.

// Writes the activation image of `nblk` blocks whose elements are produced by `val(i)`.
// Generic version used by the baselines: runtime format, warps stride over blocks.
template <typename F>
__device__ __forceinline__ void prep_generic(int fmt, int n, u8* out, F val) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (fmt == FMT_F32) {
        for (int i = tid; i < n; i += blockDim.x) ((float*)out)[i] = val(i);
    } else if (fmt == FMT_BF16) {
        for (int i = tid; i < n; i += blockDim.x) ((u16*)out)[i] = f32_to_bf16(val(i));
    } else if (fmt == FMT_Q8_0) {
        const int nb = n / 32, nw = blockDim.x / 32;
        for (int b = warp; b < nb; b += nw) q8_0_warp(val(32 * b + lane), out + 34 * b, lane);
    } else {
        const int nb = n / 256, nw = blockDim.x / 32;
        for (int b = warp; b < nb; b += nw) {
            float v[8];
            for (int j = 0; j < 8; ++j) v[j] = val(256 * b + 8 * lane + j);
            q8k_warp(v, out + 292 * b, lane);
        }
    }
}

__device__ __forceinline__ size_t act_row_bytes(int fmt, int n) {
    return fmt == FMT_F32 ? (size_t)4 * n
         : fmt == FMT_BF16 ? (size_t)2 * n
         : fmt == FMT_Q8_0 ? (size_t)34 * (n / 32)
                           : (size_t)292 * (n / 256);
}

// ---- rms_xprep ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(256)
rms_xprep_base(const float* x, const float* w, u8* out, int n, float eps, int fmt) {
    grid_dep_sync();
    __shared__ float sh[8];
    const float* xr = x + (size_t)blockIdx.x * n;
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += 256) {
        const float v = xr[i];
        acc += v * v;
    }
    const float r = rms_scale(block_sum256(acc, sh), n, eps);
    u8* o = out + (size_t)blockIdx.x * act_row_bytes(fmt, n);
    prep_generic(fmt, n, o, [&](int i) { return (xr[i] * r) * w[i]; });
}

template <int N, int FMT, int TH>
__device__ __forceinline__ void rms_xprep_opt(const float* x, const float* w, u8* out, float eps) {
    constexpr int K = N / 256;
    __shared__ __align__(16) float xs[N];  // the row (40 KiB at N = 10240)
    __shared__ float sh[8];
    const int tid = threadIdx.x;
    // All TH threads stage the row with 16-byte loads ...
    const float4* x4 = (const float4*)(x + (size_t)blockIdx.x * N);
    for (int i = tid; i < N / 4; i += TH) ((float4*)xs)[i] = x4[i];
    __syncthreads();
    // ... the first 256 reduce it in the canonical order ...
    if (tid < 256) {
        const float* xp = xs + tid;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const float v = xp[256 * k];
            acc += v * v;
        }
        acc = warp_sum(acc);
        if ((tid & 31) == 0) sh[tid >> 5] = acc;
    }
    __syncthreads();
    // ... and the 8 warp sums are halved (4, 2, 1 apart) by every thread.
    const float r = rms_scale(((sh[0] + sh[4]) + (sh[2] + sh[6])) + ((sh[1] + sh[5]) + (sh[3] + sh[7])), N, eps);
    const float4* w4 = (const float4*)w;
    const float4* s4 = (const float4*)xs;
    if (FMT == FMT_F32 || FMT == FMT_BF16) {
        for (int i = tid; i < N / 4; i += TH) {
            const float4 a = s4[i], b = w4[i];
            const float4 y = make_float4((a.x * r) * b.x, (a.y * r) * b.y, (a.z * r) * b.z, (a.w * r) * b.w);
            if (FMT == FMT_F32) {
                ((float4*)out)[(size_t)blockIdx.x * (N / 4) + i] = y;
            } else {
                const u32 lo = (u32)f32_to_bf16(y.x) | ((u32)f32_to_bf16(y.y) << 16);
                const u32 hi = (u32)f32_to_bf16(y.z) | ((u32)f32_to_bf16(y.w) << 16);
                ((uint2*)out)[(size_t)blockIdx.x * (N / 4) + i] = make_uint2(lo, hi);
            }
        }
    } else if (FMT == FMT_Q8_0) {
        // Eight lanes a block, four values a lane: a warp quantizes four blocks at once.
        u8* o = out + (size_t)blockIdx.x * (34 * (N / 32));
        const int sub = tid & 7;
        for (int b = tid >> 3; b < N / 32; b += TH / 8) {
            const float4 a = s4[8 * b + sub], c = w4[8 * b + sub];
            const float y0 = (a.x * r) * c.x, y1 = (a.y * r) * c.y, y2 = (a.z * r) * c.z, y3 = (a.w * r) * c.w;
            float m = fmaxf(fmaxf(fabsf(y0), fabsf(y1)), fmaxf(fabsf(y2), fabsf(y3)));
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 1));
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 2));
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 4));
            const float d = m / 127.f;
            const float id = (m != 0.f) ? 127.f / m : 0.f;
            const u32 q0 = (u8)(i8)sat_i8(rintf(y0 * id)), q1 = (u8)(i8)sat_i8(rintf(y1 * id));
            const u32 q2 = (u8)(i8)sat_i8(rintf(y2 * id)), q3 = (u8)(i8)sat_i8(rintf(y3 * id));
            u16* ob = (u16*)(o + 34 * b + 2 + 4 * sub);
            ob[0] = (u16)(q0 | (q1 << 8));
            ob[1] = (u16)(q2 | (q3 << 8));
            if (sub == 0) *(u16*)(o + 34 * b) = f32_to_f16(d);
        }
    } else {
        u8* o = out + (size_t)blockIdx.x * (292 * (N / 256));
        const int lane = tid & 31;
        for (int b = tid >> 5; b < N / 256; b += TH / 32) {
            const float4 a0 = s4[64 * b + 2 * lane], a1 = s4[64 * b + 2 * lane + 1];
            const float4 c0 = w4[64 * b + 2 * lane], c1 = w4[64 * b + 2 * lane + 1];
            const float y[8] = {(a0.x * r) * c0.x, (a0.y * r) * c0.y, (a0.z * r) * c0.z, (a0.w * r) * c0.w,
                                (a1.x * r) * c1.x, (a1.y * r) * c1.y, (a1.z * r) * c1.z, (a1.w * r) * c1.w};
            q8k_warp(y, o + 292 * b, lane);
        }
    }
}

// 256 threads at N = 2560, 1024 at N = 10240 (the row is staged by all of them; the
// canonical reduction uses the first 256).
#define RMS_XPREP_OPT(N, FMT, NAME, TH)                                                       \
    extern "C" __global__ void __launch_bounds__(TH)                                          \
    rms_xprep_opt_##N##_##NAME(const float* x, const float* w, u8* out, float eps) { grid_dep_sync();          \
        rms_xprep_opt<N, FMT, TH>(x, w, out, eps);                                            \
    }
RMS_XPREP_OPT(2560, FMT_F32, f32, 256)
RMS_XPREP_OPT(2560, FMT_BF16, bf16, 256)
RMS_XPREP_OPT(2560, FMT_Q8_0, q8_0, 256)
RMS_XPREP_OPT(2560, FMT_Q8K, q8_k, 256)
RMS_XPREP_OPT(10240, FMT_F32, f32, 1024)
RMS_XPREP_OPT(10240, FMT_BF16, bf16, 1024)
RMS_XPREP_OPT(10240, FMT_Q8_0, q8_0, 1024)
RMS_XPREP_OPT(10240, FMT_Q8K, q8_k, 1024)

// ---- combine_gnorm -----------------------------------------------------------------------
// r_s = h_s + e; o_s = rms(r_s) * w_s for each stream s (one block per token).

extern "C" __global__ void __launch_bounds__(256)
combine_gnorm_base(const float* h, const float* e, const float* w, float* r, float* o, int n,
                   int streams, float eps) {
    grid_dep_sync();
    __shared__ float sh[8];
    const int t = blockIdx.x;
    for (int s = 0; s < streams; ++s) {
        const size_t base = ((size_t)t * streams + s) * n;
        float acc = 0.f;
        for (int i = threadIdx.x; i < n; i += 256) {
            const float v = h[base + i] + e[(size_t)t * n + i];
            r[base + i] = v;
            acc += v * v;
        }
        const float sc = rms_scale(block_sum256(acc, sh), n, eps);
        for (int i = threadIdx.x; i < n; i += 256) o[base + i] = (r[base + i] * sc) * w[(size_t)s * n + i];
    }
}

// N = 2560, S = 4: one block per (token, stream), so the four grouped norms of a token run on
// four multiprocessors; a thread's 10 values stay in registers between the sum and the output.
extern "C" __global__ void __launch_bounds__(256)
combine_gnorm_opt_2560_4(const float* h, const float* e, const float* w, float* r, float* o,
                         float eps) {
    grid_dep_sync();
    constexpr int N = 2560, S = 4, K = N / 256;
    __shared__ float sh[8];
    const int tid = threadIdx.x;
    const size_t row = (size_t)blockIdx.x * N + tid;  // h, r, o rows are (token, stream)
    const float* hp = h + row;
    const float* ep = e + (size_t)(blockIdx.x / S) * N + tid;
    const float* wp = w + (size_t)(blockIdx.x % S) * N + tid;
    float* rp = r + row;
    float* op = o + row;
    float v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = hp[256 * k] + ep[256 * k];
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        rp[256 * k] = v[k];
        acc += v[k] * v[k];
    }
    const float sc = rms_scale(block_sum256(acc, sh), N, eps);
#pragma unroll
    for (int k = 0; k < K; ++k) op[256 * k] = (v[k] * sc) * wp[256 * k];
}

// ---- xprep -------------------------------------------------------------------------------
// One warp per activation block (32 elements for F32/BF16/Q8_0, 256 for Q8_K); the grid
// covers rows x blocks.

extern "C" __global__ void __launch_bounds__(256)
xprep_base(const float* x, u8* out, int rows, int n, int fmt) {
    grid_dep_sync();
    const int lane = threadIdx.x & 31;
    const int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int bs = fmt == FMT_Q8K ? 256 : 32;
    const int per = n / bs;
    if (g >= rows * per) return;
    const int t = g / per;
    const int b = g % per;
    const float* xb = x + (size_t)t * n + (size_t)b * bs;
    u8* o = out + (size_t)t * act_row_bytes(fmt, n);
    if (fmt == FMT_F32) {
        ((float*)o)[32 * b + lane] = xb[lane];
    } else if (fmt == FMT_BF16) {
        ((u16*)o)[32 * b + lane] = f32_to_bf16(xb[lane]);
    } else if (fmt == FMT_Q8_0) {
        q8_0_warp(xb[lane], o + 34 * b, lane);
    } else {
        float v[8];
        for (int j = 0; j < 8; ++j) v[j] = xb[8 * lane + j];
        q8k_warp(v, o + 292 * b, lane);
    }
}

template <int N, int FMT>
__device__ __forceinline__ void xprep_opt(const float* x, u8* out, int rows) {
    constexpr int BS = FMT == FMT_Q8K ? 256 : 32;
    constexpr int PER = N / BS;
    constexpr int RB = FMT == FMT_F32 ? 4 * N : FMT == FMT_BF16 ? 2 * N : FMT == FMT_Q8_0 ? 34 * PER : 292 * PER;
    const int lane = threadIdx.x & 31;
    const int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (g >= rows * PER) return;
    const int t = g / PER;  // constant divisor
    const int b = g - t * PER;
    const float* xb = x + (size_t)g * BS;  // rows are contiguous: g*BS == t*N + b*BS
    u8* o = out + (size_t)t * RB;
    if (FMT == FMT_F32) {
        ((float*)o)[32 * b + lane] = xb[lane];
    } else if (FMT == FMT_BF16) {
        ((u16*)o)[32 * b + lane] = f32_to_bf16(xb[lane]);
    } else if (FMT == FMT_Q8_0) {
        q8_0_warp(xb[lane], o + 34 * b, lane);
    } else {
        const float4 a = *(const float4*)(xb + 8 * lane);
        const float4 c = *(const float4*)(xb + 8 * lane + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        q8k_warp(v, o + 292 * b, lane);
    }
}

#define XPREP_OPT(N, FMT, NAME)                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                         \
    xprep_opt_##N##_##NAME(const float* x, u8* out, int rows) { grid_dep_sync(); xprep_opt<N, FMT>(x, out, rows); }
XPREP_OPT(2560, FMT_F32, f32)
XPREP_OPT(2560, FMT_BF16, bf16)
XPREP_OPT(2560, FMT_Q8_0, q8_0)
XPREP_OPT(2560, FMT_Q8K, q8_k)

// ---- xprep_multi, swiglu_xprep ---------------------------------------------------------------
// The activation images of every product of one input in one launch (xprep_multi: `fmts` bit 0
// BF16, bit 1 Q8_0, bit 2 Q8_K), and the image of a swiglu's output (swiglu_xprep: silu(g)·u,
// elem.cu's expression). Warp g = (row, 32-element block b) writes block b of the BF16/Q8_0
// images and, where b % 8 == 0, Q8_K block b / 8, with xprep's element functions: every image
// equals xprep's bit for bit.

template <typename F>
__device__ __forceinline__ void prep_blocks(int rows, int n, u8* obf, u8* oq8, u8* oq8k, u8* of32, F val) {
    const int lane = threadIdx.x & 31;
    const int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int per = n / 32;
    if (g >= rows * per) return;
    const int t = g / per, b = g - t * per;
    const size_t e = (size_t)t * n + 32 * b + lane;
    const float v = val(e);
    if (of32) ((float*)of32)[e] = v;
    if (obf) ((u16*)obf)[e] = f32_to_bf16(v);
    if (oq8) q8_0_warp(v, oq8 + (size_t)t * 34 * per + 34 * (size_t)b, lane);
    if (oq8k && (b & 7) == 0) {
        float w[8];
        const size_t e8 = (size_t)t * n + 32 * b + 8 * lane;
        for (int j = 0; j < 8; ++j) w[j] = val(e8 + j);
        q8k_warp(w, oq8k + (size_t)t * 292 * (n / 256) + 292 * (size_t)(b / 8), lane);
    }
}

extern "C" __global__ void __launch_bounds__(256)
xprep_multi(const float* x, u8* obf, u8* oq8, u8* oq8k, int rows, int n) {
    grid_dep_sync();
    prep_blocks(rows, n, obf, oq8, oq8k, nullptr, [&](size_t i) { return x[i]; });
}

extern "C" __global__ void __launch_bounds__(256)
swiglu_xprep(const float* g, const float* u, u8* out, int rows, int n, int fmt) {
    grid_dep_sync();
    u8* bf = fmt == FMT_BF16 ? out : nullptr;
    u8* q8 = fmt == FMT_Q8_0 ? out : nullptr;
    u8* q8k = fmt == FMT_Q8K ? out : nullptr;
    u8* f32 = fmt == FMT_F32 ? out : nullptr;
    prep_blocks(rows, n, bf, q8, q8k, f32, [&](size_t i) { return siluf_(g[i]) * u[i]; });
}

// The floor of a launch: an empty kernel (timed like the others).
extern "C" __global__ void noop() { grid_dep_sync();}
