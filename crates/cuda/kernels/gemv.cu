// gemv: y[t][r] = W[r] . x_t for 1..8 activation rows (decode and verify windows), weights in
// their file format, activations in the paired format. One warp per weight row; lane l takes
// units l, l+32, ... in order and adds each unit's contribution to its accumulator per token;
// the lanes are then combined by warp_sum. Both variants follow that order exactly, so they
// agree bit for bit; against the CPU reference (a different order) they agree within
// rounding.
//
// gemv_base_*: runtime row length and token count (the accumulators indexed at run time).
// gemv_opt_*_k2560_nt*: the row length and token count as template constants (every loop
//                       unrolled, accumulators in registers); 8 rows a block; each weight row
//                       and the activation rows staged in shared memory with 16/8/4-byte
//                       coalesced loads (the GGUF blocks are only 2-byte aligned, but whole
//                       rows are); each unit decoded once for all nt rows; BF16 read with
//                       16-byte loads directly.

template <int T>
__device__ __forceinline__ void gemv_base(const u8* w, const u8* x, float* y, int rows, int k,
                                          int nt, u64 wrb, u64 xrb) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const u8* wr = w + (size_t)r * wrb;
    float acc[8];
    for (int t = 0; t < nt; ++t) acc[t] = 0.f;
    const int units = k / 32;
    for (int u = lane; u < units; u += 32)
        for (int t = 0; t < nt; ++t) acc[t] += unit_dot<T>(wr, x + (size_t)t * xrb, u, global_tables());
    for (int t = 0; t < nt; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) y[(size_t)t * rows + r] = dot_post<T>(s);
    }
}

// Copies `bytes` (a multiple of 4) from global to shared memory with the widest loads the
// alignment allows (A: 16, 8 or 4), `n` threads from thread `i` on.
template <int A>
__device__ __forceinline__ void stage(u8* dst, const u8* src, int bytes, int i, int n) {
    if (A == 16) {
        for (int k = i; k < bytes / 16; k += n) ((uint4*)dst)[k] = ((const uint4*)src)[k];
    } else if (A == 8) {
        for (int k = i; k < bytes / 8; k += n) ((uint2*)dst)[k] = ((const uint2*)src)[k];
    } else {
        for (int k = i; k < bytes / 4; k += n) ((u32*)dst)[k] = ((const u32*)src)[k];
    }
}

template <int B>
__host__ __device__ constexpr int align_of_size() { return B % 16 == 0 ? 16 : B % 8 == 0 ? 8 : 4; }

// One BF16 unit (32 values) against one activation unit, both 16-byte aligned, in the same
// fmaf order as unit_dot<T_BF16>.
__device__ __forceinline__ float bf16_unit(const uint4* wv, const uint4* xp) {
    float a = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const uint4 xv = xp[q];
        const u32 ws[4] = {wv[q].x, wv[q].y, wv[q].z, wv[q].w};
        const u32 xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            a = fmaf(__uint_as_float(ws[m] << 16), __uint_as_float(xs[m] << 16), a);
            a = fmaf(__uint_as_float(ws[m] & 0xffff0000u), __uint_as_float(xs[m] & 0xffff0000u), a);
        }
    }
    return a;
}

template <int T, int K, int NT>
__device__ __forceinline__ void gemv_opt(const u8* w, const u8* x, float* y, int rows) {
    constexpr int U = K / 32, PER = (U + 31) / 32, WARPS = 8;
    constexpr int WRB = (K / Fmt<T>::QK) * Fmt<T>::TS;
    constexpr int XRB = T == T_BF16 ? 2 * K : (T == T_Q8_0 || T == T_Q2_0) ? 34 * (K / 32) : 292 * (K / 256);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * WARPS + warp;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    if constexpr (T == T_BF16) {
        // Aligned rows: 16-byte loads straight from global memory, four per unit and operand.
        if (r >= rows) return;
        const uint4* wr = (const uint4*)(w + (size_t)r * WRB);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = lane + 32 * i;
            if (u < U) {
                const uint4 wv[4] = {wr[4 * u], wr[4 * u + 1], wr[4 * u + 2], wr[4 * u + 3]};
#pragma unroll
                for (int t = 0; t < NT; ++t) acc[t] += bf16_unit(wv, (const uint4*)(x + (size_t)t * XRB) + 4 * u);
            }
        }
    } else {
        // The block's activation rows and each warp's weight row staged in shared memory with
        // wide coalesced loads; the unit decoders then read bytes at any alignment.
        __shared__ __align__(16) u8 xsh[NT * XRB];
        __shared__ __align__(16) u8 wsh[WARPS][(WRB + 15) / 16 * 16];
        // The I-quant grids too: lanes look up different entries, which shared memory serves
        // in one pass where the global tables take one transaction per distinct line.
        constexpr int G3S = T == T_IQ3_S ? 512 : 1, G3XXS = T == T_IQ3_XXS ? 256 : 1, KS = T == T_IQ3_XXS ? 128 : 4;
        __shared__ u32 g3s[G3S];
        __shared__ u32 g3xxs[G3XXS];
        __shared__ __align__(4) u8 ks[KS];
        Tables tb = global_tables();
        if constexpr (T == T_IQ3_S) {
            for (int i = threadIdx.x; i < 512; i += 32 * WARPS) g3s[i] = iq3s_grid[i];
            tb.g3s = g3s;
        }
        if constexpr (T == T_IQ3_XXS) {
            for (int i = threadIdx.x; i < 256; i += 32 * WARPS) g3xxs[i] = iq3xxs_grid[i];
            if (threadIdx.x < 128) ks[threadIdx.x] = ksigns_iq2xs[threadIdx.x];
            tb.g3xxs = g3xxs;
            tb.ks = ks;
        }
        stage<align_of_size<NT * XRB>()>(xsh, x, NT * XRB, threadIdx.x, 32 * WARPS);
        if (r < rows) stage<align_of_size<WRB>()>(wsh[warp], w + (size_t)r * WRB, WRB, lane, 32);
        __syncthreads();
        if (r >= rows) return;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = lane + 32 * i;
            if (u < U) {
                // Decoded once, used for every activation row.
                const DecUnit du = decode_for_dot<T>(wsh[warp], u, tb);
#pragma unroll
                for (int t = 0; t < NT; ++t) acc[t] += dot_decoded<T>(du, xsh + t * XRB, u);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) y[(size_t)t * rows + r] = dot_post<T>(s);
    }
}

// ---- products beyond the GEMV window (each (weight row, activation row) dot has gemv_base's
// order: lane l takes units l, l+32, …, then warp_sum — so every output equals the GEMV's bit
// for bit, whatever the batch, the tile or the expert grouping) ------------------------------

// matmul: y[t][r] = W[r]·x_t for any number of activation rows. Grid (rows/4, nt/8): four warps a
// block, one weight row a warp, eight activation rows a tile, each weight unit decoded once per
// tile. A correct tiled kernel for prefill-sized batches (tensor cores are a later variant).
template <int T>
__device__ __forceinline__ void matmul_t(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb,
                                         u64 xrb) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * 8;
    if (r >= rows || t0 >= nt) return;
    const int tn = min(8, nt - t0);
    const u8* wr = w + (size_t)r * wrb;
    const u8* xt = x + (size_t)t0 * xrb;
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] = 0.f;
    const int units = k / 32;
    for (int u = lane; u < units; u += 32) {
        if constexpr (T == T_BF16 || T == T_F32) {
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (t < tn) acc[t] += unit_dot<T>(wr, xt + (size_t)t * xrb, u, global_tables());
        } else {
            const DecUnit du = decode_for_dot<T>(wr, u, global_tables());
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (t < tn) acc[t] += dot_decoded<T>(du, xt + (size_t)t * xrb, u);
        }
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < tn) y[(size_t)(t0 + t) * rows + r] = dot_post<T>(s);
    }
}

// One (activation row, slot) pair q against expert ids[q]'s slab (w + e·slab_bytes): the row's
// k experts of a decode step in one launch. The activation row is x[q] (x_per_slot: the down
// product's per-slot inputs) or x[q / kslots] (gate/up: one input per token). An expert id
// outside 0..n_expert sets *err and gives NaN outputs.
template <int T>
__device__ __forceinline__ float pair_dot(const u8* wr, const u8* xr, int k) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int u = lane; u < k / 32; u += 32) acc += unit_dot<T>(wr, xr, u, global_tables());
    return dot_post<T>(warp_sum(acc));
}

template <int T>
__device__ __forceinline__ void moe_gemv_t(const u8* w, u64 slab_bytes, const int* ids, int n_expert, const u8* x,
                                           int x_per_slot, int kslots, float* y, int rows, int k, u64 wrb, u64 xrb,
                                           u32* err) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int q = blockIdx.y;
    if (r >= rows) return;
    const int e = ids[q];
    if (e < 0 || e >= n_expert) {
        if (lane == 0) {
            atomicOr(err, 2u);
            y[(size_t)q * rows + r] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const u8* wr = w + (size_t)e * slab_bytes + (size_t)r * wrb;
    const u8* xr = x + (size_t)(x_per_slot ? q : q / kslots) * xrb;
    const float s = pair_dot<T>(wr, xr, k);
    if (lane == 0) y[(size_t)q * rows + r] = s;
}

// Prefill grouped by expert: tile i = (expert, start, count ≤ 8) of the expert-sorted pair list
// `perm` (moe.cu moe_group); each weight unit decoded once per tile. Grid (rows/4, max_tiles);
// tiles past *n_tiles exit (the bound is the step's shape, the count the device's).
template <int T>
__device__ __forceinline__ void moe_matmul_t(const u8* w, u64 slab_bytes, const int* tiles, const u32* n_tiles,
                                             const u32* perm, const u8* x, int x_per_slot, int kslots, float* y,
                                             int rows, int k, u64 wrb, u64 xrb) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 tile = blockIdx.y;
    if (r >= rows || tile >= *n_tiles) return;
    const int e = tiles[3 * tile], start = tiles[3 * tile + 1], tn = tiles[3 * tile + 2];
    const u8* wr = w + (size_t)e * slab_bytes + (size_t)r * wrb;
    u32 qs[8];
    const u8* xs[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        qs[t] = t < tn ? perm[start + t] : 0u;
        xs[t] = x + (size_t)(x_per_slot ? qs[t] : qs[t] / kslots) * xrb;
    }
    float acc[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] = 0.f;
    for (int u = lane; u < k / 32; u += 32) {
        if constexpr (T == T_BF16 || T == T_F32) {
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (t < tn) acc[t] += unit_dot<T>(wr, xs[t], u, global_tables());
        } else {
            const DecUnit du = decode_for_dot<T>(wr, u, global_tables());
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (t < tn) acc[t] += dot_decoded<T>(du, xs[t], u);
        }
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < tn) y[(size_t)qs[t] * rows + r] = dot_post<T>(s);
    }
}

#define PRODUCTS(T, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    matmul_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb) { \
        matmul_t<T>(w, x, y, rows, k, nt, wrb, xrb);                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    moe_gemv_##NAME(const u8* w, u64 slab_bytes, const int* ids, int n_expert, const u8* x,    \
                    int x_per_slot, int kslots, float* y, int rows, int k, u64 wrb, u64 xrb,   \
                    u32* err) {                                                                \
        moe_gemv_t<T>(w, slab_bytes, ids, n_expert, x, x_per_slot, kslots, y, rows, k, wrb, xrb, err); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    moe_matmul_##NAME(const u8* w, u64 slab_bytes, const int* tiles, const u32* n_tiles,       \
                      const u32* perm, const u8* x, int x_per_slot, int kslots, float* y,      \
                      int rows, int k, u64 wrb, u64 xrb) {                                     \
        moe_matmul_t<T>(w, slab_bytes, tiles, n_tiles, perm, x, x_per_slot, kslots, y, rows, k, wrb, xrb); \
    }

#define GEMV_BASE(T, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    gemv_base_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb,     \
                     u64 xrb) {                                                                \
        gemv_base<T>(w, x, y, rows, k, nt, wrb, xrb);                                          \
    }
#define GEMV_OPT1(T, NAME, NT)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    gemv_opt_##NAME##_k2560_nt##NT(const u8* w, const u8* x, float* y, int rows) {             \
        gemv_opt<T, 2560, NT>(w, x, y, rows);                                                  \
    }
// Each weight format is its own NVRTC program (strata-cuda defines GEMV_<NAME> for one), so
// the nine compile in parallel at start.
#define GEMV_ALL(T, NAME)                                                                      \
    GEMV_BASE(T, NAME)                                                                         \
    PRODUCTS(T, NAME)                                                                          \
    GEMV_OPT1(T, NAME, 1) GEMV_OPT1(T, NAME, 2) GEMV_OPT1(T, NAME, 3) GEMV_OPT1(T, NAME, 4)    \
    GEMV_OPT1(T, NAME, 5) GEMV_OPT1(T, NAME, 6) GEMV_OPT1(T, NAME, 7) GEMV_OPT1(T, NAME, 8)

#if defined(GEMV_Q2_0)
GEMV_ALL(T_Q2_0, q2_0)
#endif
#if defined(GEMV_Q8_0)
GEMV_ALL(T_Q8_0, q8_0)
#endif
#if defined(GEMV_Q4_K)
GEMV_ALL(T_Q4_K, q4_k)
#endif
#if defined(GEMV_Q5_K)
GEMV_ALL(T_Q5_K, q5_k)
#endif
#if defined(GEMV_Q6_K)
GEMV_ALL(T_Q6_K, q6_k)
#endif
#if defined(GEMV_IQ4_XS)
GEMV_ALL(T_IQ4_XS, iq4_xs)
#endif
#if defined(GEMV_IQ3_S)
GEMV_ALL(T_IQ3_S, iq3_s)
#endif
#if defined(GEMV_IQ3_XXS)
GEMV_ALL(T_IQ3_XXS, iq3_xxs)
#endif
#if defined(GEMV_F32)
// F32 weights (small or test models): products only, f32 activations, fmaf in order.
GEMV_BASE(T_F32, f32)
PRODUCTS(T_F32, f32)
#endif
#if defined(GEMV_Q4_0)
GEMV_BASE(T_Q4_0, q4_0)
PRODUCTS(T_Q4_0, q4_0)
#endif
#if defined(GEMV_Q5_0)
// Q5_0 (most matrices of the default qwen2 0.5B Q4_K_M file, whose rows of 896 are not whole
// K-quant blocks): products only.
GEMV_BASE(T_Q5_0, q5_0)
PRODUCTS(T_Q5_0, q5_0)
#endif
#if defined(GEMV_IQ4_NL)
GEMV_BASE(T_IQ4_NL, iq4_nl)
PRODUCTS(T_IQ4_NL, iq4_nl)
#endif
#if defined(GEMV_Q3_K)
// Q3_K (the GDN attn_qkv of 18 layers): products only, no optimized GEMV yet (the model's
// launcher runs the tiled kernel for every batch, gemv_base's order).
GEMV_BASE(T_Q3_K, q3_k)
PRODUCTS(T_Q3_K, q3_k)
#endif
#if defined(GEMV_BF16)
GEMV_ALL(T_BF16, bf16)
// The hyper-connection down / inject products (rows of 4·2560 = 10240), for the model's launcher
// (strata_cuda::model::product); same order as gemv_base. (At K = 320, the up product, the
// template keeps an 8-byte stack frame at nt = 6; that product runs the tiled kernel.)
#define GEMV_OPT_K(T, NAME, K, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    gemv_opt_##NAME##_k##K##_nt##NT(const u8* w, const u8* x, float* y, int rows) {            \
        gemv_opt<T, K, NT>(w, x, y, rows);                                                     \
    }
#define GEMV_OPT_K_ALL(T, NAME, K)                                                             \
    GEMV_OPT_K(T, NAME, K, 1) GEMV_OPT_K(T, NAME, K, 2) GEMV_OPT_K(T, NAME, K, 3)              \
    GEMV_OPT_K(T, NAME, K, 4) GEMV_OPT_K(T, NAME, K, 5) GEMV_OPT_K(T, NAME, K, 6)              \
    GEMV_OPT_K(T, NAME, K, 7) GEMV_OPT_K(T, NAME, K, 8)
GEMV_OPT_K_ALL(T_BF16, bf16, 10240)
#endif
