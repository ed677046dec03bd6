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

template <int N, int FMT>
__device__ __forceinline__ void rms_xprep_opt(const float* x, const float* w, u8* out, float eps) {
    constexpr int K = N / 256;
    __shared__ float sh[8];
    __shared__ float xs[N];  // the row, kept for the output pass (40 KiB at N = 10240)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* xp = x + (size_t)blockIdx.x * N + tid;
    float* sp = xs + tid;
    float v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = xp[256 * k];
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        acc += v[k] * v[k];
        sp[256 * k] = v[k];
    }
    const float r = rms_scale(block_sum256(acc, sh), N, eps);  // its barriers publish xs
    if (FMT == FMT_F32 || FMT == FMT_BF16) {
        // Same thread-to-element map as the reduction: no shared memory needed.
        const float* wp = w + tid;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const float y = (v[k] * r) * wp[256 * k];
            if (FMT == FMT_F32) ((float*)out)[(size_t)blockIdx.x * N + tid + 256 * k] = y;
            else ((u16*)out)[(size_t)blockIdx.x * N + tid + 256 * k] = f32_to_bf16(y);
        }
    } else if (FMT == FMT_Q8_0) {
        constexpr int NB = N / 32, PER = NB / 8;  // blocks per warp: 10 (2560) or 40 (10240)
        u8* o = out + (size_t)blockIdx.x * (34 * NB) + 34 * warp;
        const float* xw = xs + 32 * warp + lane;
        const float* ww = w + 32 * warp + lane;
#pragma unroll
        for (int k = 0; k < PER; ++k) q8_0_warp((xw[256 * k] * r) * ww[256 * k], o + 34 * 8 * k, lane);
    } else {
        constexpr int NB = N / 256;
        u8* o = out + (size_t)blockIdx.x * (292 * NB);
#pragma unroll
        for (int k = 0; k < (NB + 7) / 8; ++k) {
            const int b = warp + 8 * k;
            if (b < NB) {
                float y[8];
                const float* xb = xs + 256 * b + 8 * lane;
                const float* wb = w + 256 * b + 8 * lane;
#pragma unroll
                for (int j = 0; j < 8; ++j) y[j] = (xb[j] * r) * wb[j];
                q8k_warp(y, o + 292 * b, lane);
            }
        }
    }
}

#define RMS_XPREP_OPT(N, FMT, NAME)                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                         \
    rms_xprep_opt_##N##_##NAME(const float* x, const float* w, u8* out, float eps) {          \
        rms_xprep_opt<N, FMT>(x, w, out, eps);                                                \
    }
RMS_XPREP_OPT(2560, FMT_F32, f32)
RMS_XPREP_OPT(2560, FMT_BF16, bf16)
RMS_XPREP_OPT(2560, FMT_Q8_0, q8_0)
RMS_XPREP_OPT(2560, FMT_Q8K, q8_k)
RMS_XPREP_OPT(10240, FMT_F32, f32)
RMS_XPREP_OPT(10240, FMT_BF16, bf16)
RMS_XPREP_OPT(10240, FMT_Q8_0, q8_0)
RMS_XPREP_OPT(10240, FMT_Q8K, q8_k)

// ---- combine_gnorm -----------------------------------------------------------------------
// r_s = h_s + e; o_s = rms(r_s) * w_s for each stream s (one block per token).

extern "C" __global__ void __launch_bounds__(256)
combine_gnorm_base(const float* h, const float* e, const float* w, float* r, float* o, int n,
                   int streams, float eps) {
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

// N = 2560, S = 4: 40 elements a thread held in registers, the four sums reduced together.
extern "C" __global__ void __launch_bounds__(256)
combine_gnorm_opt_2560_4(const float* h, const float* e, const float* w, float* r, float* o,
                         float eps) {
    constexpr int N = 2560, S = 4, K = N / 256;
    __shared__ float sh[8][S];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t row = (size_t)blockIdx.x * S * N + tid;
    const float* hp = h + row;
    const float* ep = e + (size_t)blockIdx.x * N + tid;
    float* rp = r + row;
    float ev[K];
#pragma unroll
    for (int k = 0; k < K; ++k) ev[k] = ep[256 * k];
    float rv[S][K];
    float acc[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
        acc[s] = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const float v = hp[s * N + 256 * k] + ev[k];
            rv[s][k] = v;
            rp[s * N + 256 * k] = v;
            acc[s] += v * v;
        }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) acc[s] = warp_sum(acc[s]);
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < S; ++s) sh[warp][s] = acc[s];
    }
    __syncthreads();
    float sc[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
        float q = (lane < 8) ? sh[lane][s] : 0.f;
        q += __shfl_xor_sync(FULL_MASK, q, 4);
        q += __shfl_xor_sync(FULL_MASK, q, 2);
        q += __shfl_xor_sync(FULL_MASK, q, 1);
        sc[s] = rms_scale(__shfl_sync(FULL_MASK, q, 0), N, eps);
    }
    float* op = o + row;
    const float* wp = w + tid;
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int k = 0; k < K; ++k) op[s * N + 256 * k] = (rv[s][k] * sc[s]) * wp[s * N + 256 * k];
    }
}

// ---- xprep -------------------------------------------------------------------------------
// One warp per activation block (32 elements for F32/BF16/Q8_0, 256 for Q8_K); the grid
// covers rows x blocks.

extern "C" __global__ void __launch_bounds__(256)
xprep_base(const float* x, u8* out, int rows, int n, int fmt) {
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
    xprep_opt_##N##_##NAME(const float* x, u8* out, int rows) { xprep_opt<N, FMT>(x, out, rows); }
XPREP_OPT(2560, FMT_F32, f32)
XPREP_OPT(2560, FMT_BF16, bf16)
XPREP_OPT(2560, FMT_Q8_0, q8_0)
XPREP_OPT(2560, FMT_Q8K, q8_k)
