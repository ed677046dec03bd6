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

// ---- Q2_0 against transposed Q8_0 activations (gemv_opt's Q2_0 rows, moe_gate_up_q8_q2t) ------
// The generic decoder spreads each Q2_0 weight byte (four 2-bit codes, element 4k + i at bits
// 2i of byte k) into a word of four bytes, eight times a unit. Here the activation unit is
// transposed instead, once a thread: word i of a 16-element group holds elements i, 4 + i,
// 8 + i, 12 + i, so that (q >> 2i) & 0x03030303 of the group's four weight bytes q lines up
// with it and a unit costs two weight words, eight masks and eight dp4a. Every sum is the
// same integer in another order, so a contribution is bit for bit unit_dot's.
struct Q2W {
    u32 q0, q1;
    float d;
};
struct __align__(16) Q2X {
    int a[4], b[4];  // the two 16-element groups, transposed
    float dx;
    int sx;  // the unit's 32 activation bytes summed (the codes' −1 offset)
};

__device__ __forceinline__ Q2W q2_load(const u8* wr, int u) {
    const u8* blk = wr + 18 * (size_t)(u >> 1);
    const u8* q = blk + 2 + 8 * (u & 1);
    return Q2W{ld32a2(q), ld32a2(q + 4), ldf16(blk)};
}

// Unit u of a Q8_0 activation row, transposed.
__device__ __forceinline__ Q2X q2_act(const u8* x, int u) {
    const u8* xb = x + 34 * (size_t)u;
    u32 w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = ld32a2(xb + 2 + 4 * k);
    Q2X a;
    a.sx = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) a.sx = dp4a(0x01010101, (int)w[k], a.sx);
    int* out[2] = {a.a, a.b};
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const u32 lo01 = __byte_perm(w[4 * g], w[4 * g + 1], 0x5140), lo23 = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x5140);
        const u32 hi01 = __byte_perm(w[4 * g], w[4 * g + 1], 0x7362), hi23 = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x7362);
        out[g][0] = (int)__byte_perm(lo01, lo23, 0x5410);
        out[g][1] = (int)__byte_perm(lo01, lo23, 0x7632);
        out[g][2] = (int)__byte_perm(hi01, hi23, 0x5410);
        out[g][3] = (int)__byte_perm(hi01, hi23, 0x7632);
    }
    a.dx = ldf16(xb);
    return a;
}

__device__ __forceinline__ float q2_dot(const Q2W& w, const Q2X& a) {
    const u32 M = 0x03030303u;
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) isum = dp4a((int)((w.q0 >> (2 * i)) & M), a.a[i], isum);
#pragma unroll
    for (int i = 0; i < 4; ++i) isum = dp4a((int)((w.q1 >> (2 * i)) & M), a.b[i], isum);
    isum -= a.sx;
    return (w.d * a.dx) * (float)isum;
}

template <int T, int K, int NT>
__device__ __forceinline__ void gemv_opt(const u8* w, const u8* x, float* y, int rows) {
    constexpr int U = K / 32, PER = (U + 31) / 32, WARPS = 8;
    constexpr int WRB = (K / Fmt<T>::QK) * Fmt<T>::TS;
    constexpr int XRB = T == T_BF16 ? 2 * K : (T == T_Q8_0 || T == T_Q2_0) ? 34 * (K / 32) : 292 * (K / 256);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * WARPS + warp;
    const int brows = rows - (int)blockIdx.x * WARPS;
    if (brows > 0) prefetch_l2(w + (size_t)blockIdx.x * WARPS * WRB, (u64)(brows < WARPS ? brows : WARPS) * WRB);
    grid_dep_sync();
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
        if constexpr (T == T_Q2_0) {
            // The activation units transposed once a block (q2_act), for q2_dot.
            __shared__ Q2X xt[NT * U];
            for (int i = threadIdx.x; i < NT * U; i += 32 * WARPS) xt[i] = q2_act(x, i);
            if (r < rows) stage<align_of_size<WRB>()>(wsh[warp], w + (size_t)r * WRB, WRB, lane, 32);
            __syncthreads();
            if (r >= rows) return;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int u = lane + 32 * i;
                if (u < U) {
                    const Q2W wu = q2_load(wsh[warp], u);
#pragma unroll
                    for (int t = 0; t < NT; ++t) acc[t] += q2_dot(wu, xt[t * U + u]);
                }
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const float s = warp_sum(acc[t]);
                if (lane == 0) y[(size_t)t * rows + r] = s;
            }
            return;
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
                const DecUnit du = decode_for_dot<T, true>(wsh[warp], u, tb);
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

// gemv_rows4: gemv_opt<T, K, 1>'s rows for a product of many rows at one activation row (the LM
// head: 248,320 Q6_K rows of 2560; the GDN qkv and gate: 6,144–10,240 rows), each warp's rows
// brought into shared memory by one bulk copy issued before the dependency wait (the weights do
// not depend on the kernel before), so no load instruction a weight byte where gemv_opt stages
// each row with 4- to 16-byte loads after its wait. A warp takes RW consecutive rows, the fewest
// whose bytes are whole 16-byte granules (Q6_K: 4 · 2,100 B; Q3_K: 4 · 1,100 B; Q4_K and IQ4_XS:
// one row): 4 warps a block when RW = 4, 8 when RW = 1. The activation row is staged once a
// block. Each row is then summed as gemv_opt sums it — the same decoder, lanes and warp_sum —
// so the same bits.
template <int WRB>
__host__ __device__ constexpr int rows_to_granule() { return WRB % 16 == 0 ? 1 : WRB % 8 == 0 ? 2 : 4; }

template <int T, int K>
__device__ __forceinline__ void gemv_rows4(const u8* w, const u8* x, float* y, int rows) {
    constexpr int U = K / 32, PER = (U + 31) / 32;
    constexpr int WRB = (K / Fmt<T>::QK) * Fmt<T>::TS;
    constexpr int RW = rows_to_granule<WRB>(), WARPS = RW == 1 ? 8 : 4;
    constexpr int XRB = (T == T_Q8_0 || T == T_Q2_0) ? 34 * (K / 32) : 292 * (K / 256);
    static_assert((RW * WRB) % 16 == 0, "a warp's rows are whole 16-byte granules");
    __shared__ __align__(16) u8 xsh[XRB];
    // 16 bytes past each warp's rows: the word decoders read up to a word beyond a field.
    __shared__ __align__(16) u8 wsh[WARPS][RW * WRB + 16];
    __shared__ __align__(8) u64 bar[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * WARPS + warp) * RW;
    const int n = min(RW, rows - r0);
    const u8* src = w + (size_t)r0 * WRB;
    const bool bulk = n == RW && (((u64)src) & 15) == 0;
    if (bulk && lane == 0) {
        mbar_arm(&bar[warp], RW * WRB);
        bulk_to_smem(wsh[warp], src, RW * WRB, &bar[warp]);
    }
    grid_dep_sync();
    stage<align_of_size<XRB>()>(xsh, x, XRB, threadIdx.x, 32 * WARPS);
    if (n > 0 && !bulk) stage<4>(wsh[warp], src, n * WRB, lane, 32);
    __syncthreads();
    if (n <= 0) return;
    if (bulk) mbar_wait(&bar[warp]);
    const Tables tb = global_tables();
    for (int j = 0; j < n; ++j) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int u = lane + 32 * i;
            if (u < U) {
                const DecUnit du = decode_for_dot<T, true>(wsh[warp] + j * WRB, u, tb);
                acc += dot_decoded<T>(du, xsh, u);
            }
        }
        const float s = warp_sum(acc);
        if (lane == 0) y[r0 + j] = dot_post<T>(s);
    }
}

#define GEMV_ROWS4(T, NAME)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    gemv_rows4_##NAME##_k2560(const u8* w, const u8* x, float* y, int rows) {                  \
        gemv_rows4<T, 2560>(w, x, y, rows);                                                    \
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

// ---- unit-parallel products (decode and verify windows: 1..8 activation rows) ----------------
// gemv_base's order with the units' parallelism instead of the rows': every (weight row, unit,
// activation row) contribution c(u) (the unit's f32 value from unit_dot / dot_decoded, computed
// on its own from +0) is written to shared memory by whichever thread computes it; then one
// warp per (row, activation row) adds them as gemv_base's lanes do (lane l: c(l), c(l+32), …
// from +0, then warp_sum). So the outputs are gemv_base's bit for bit, while a product of few
// rows (the hyper-connection down: 320 rows of 10240; the router: 512 of 2560) or of short rows
// (the up: rows of 320, ten units, which leave 22 of gemv_base's 32 lanes idle) keeps every SM
// busy. The fused kernels below (hyper-connection mix, routed experts) are this product with
// the composed kernels' element-wise epilogues (common.cuh's sigmoidf_/siluf_, the same
// expressions under --fmad=false), so they equal the composed launches bit for bit.

// Shared floats for the contributions of one block (nt · rows · units ≤ UNITS_PART; the host
// launchers choose the rows per block to fit), and bytes for the block's activation rows.
#define UNITS_PART 6144
#define UNITS_XSTAGE 16384

// The block's activation rows (`bytes` from x, 256-byte aligned) copied into shared memory
// with wide loads when they fit, so that the unit decoders' many narrow reads hit shared
// memory; returns where the kernel reads them (x itself when they do not fit).
__device__ __forceinline__ const u8* stage_act(const u8* x, u64 bytes, u8* sh) {
    if (bytes > UNITS_XSTAGE || bytes % 4 != 0) return x;
    const int i = threadIdx.x, n = blockDim.x;
    if (bytes % 16 == 0) stage<16>(sh, x, (int)bytes, i, n);
    else if (bytes % 8 == 0) stage<8>(sh, x, (int)bytes, i, n);
    else stage<4>(sh, x, (int)bytes, i, n);
    __syncthreads();
    return sh;
}

// gemv_base's sum of U contributions `c[0..U)` (stride 1) for this lane's warp.
__device__ __forceinline__ float lane_order_sum(const float* c, int U, int lane) {
    float acc = 0.f;
    for (int u = lane; u < U; u += 32) acc += c[u];
    return warp_sum(acc);
}

// A weight unit held in registers between its load and its dots: BF16 keeps its 64 bytes,
// F32 its address (unit_dot reads it), the integer-dot formats their decoded unit.
template <int T>
struct UnitW {
    DecUnit d;
};
template <>
struct UnitW<T_BF16> {
    uint4 v[4];
};
template <>
struct UnitW<T_F32> {
    const u8* p;
};

template <int T>
__device__ __forceinline__ UnitW<T> load_unit(const u8* wr, int u) {
    UnitW<T> w;
    if constexpr (T == T_BF16) {
        const uint4* wq = (const uint4*)(wr + 64 * (size_t)u);
#pragma unroll
        for (int i = 0; i < 4; ++i) w.v[i] = wq[i];
    } else if constexpr (T == T_F32) {
        w.p = wr;
    } else {
        w.d = decode_for_dot<T>(wr, u, global_tables());
    }
    return w;
}

// c_t(u) of a loaded unit against activation row x (unit_dot's value, bit for bit).
template <int T>
__device__ __forceinline__ float unit_dot_w(const UnitW<T>& w, const u8* x, int u) {
    if constexpr (T == T_BF16) {
        return bf16_unit(w.v, (const uint4*)(x + 64 * (size_t)u));
    } else if constexpr (T == T_F32) {
        return unit_dot<T>(w.p, x, u, global_tables());
    } else {
        return dot_decoded<T>(w.d, x, u);
    }
}

// A thread's first contribution of a block (i = threadIdx.x), loaded ahead of the rest: the
// kernels whose weight rows do not depend on the kernel before load it before grid_dep_sync(),
// so its DRAM latency overlaps that kernel instead of following it; the others load it before
// staging their activations, so the two latencies overlap.
template <int T>
struct FirstUnit {
    UnitW<T> w;
    int lr, u;
    bool live;
};

template <int T, typename Row>
__device__ __forceinline__ FirstUnit<T> first_unit(Row row, int stride, int U) {
    FirstUnit<T> f;
    const int i = threadIdx.x;
    f.live = i < stride;
    f.lr = i / U;
    f.u = i - f.lr * U;
    if (f.live) f.w = load_unit<T>(row(f.lr), f.u);
    return f;
}

// Every contribution i < stride of a block (i = local row · U + unit; row(lr): the weight row,
// act(lr): its first activation row, nt rows xrb apart) to part[t·stride + i], the first from
// `f` (loaded by first_unit with the same row and stride).
template <int T, typename Row, typename Act>
__device__ __forceinline__ void unit_contribs_all(const FirstUnit<T>& f, Row row, Act act, int stride, int U,
                                                  u64 xrb, int nt, float* part) {
    const int nth = blockDim.x;
    if (f.live) {
        const u8* x = act(f.lr);
        for (int t = 0; t < nt; ++t) part[t * stride + threadIdx.x] = unit_dot_w<T>(f.w, x + (size_t)t * xrb, f.u);
    }
    for (int i = threadIdx.x + nth; i < stride; i += nth) {
        const int lr = i / U, u = i - lr * U;
        const UnitW<T> w = load_unit<T>(row(lr), u);
        const u8* x = act(lr);
        for (int t = 0; t < nt; ++t) part[t * stride + i] = unit_dot_w<T>(w, x + (size_t)t * xrb, u);
    }
}

// The finished rows of a block from its contributions part[t·nrows·U + lr·U + u] (after a
// __syncthreads): a warp a row, gemv_base's lane order, emit(t, row0 + lr, y).
template <int T, typename Emit>
__device__ __forceinline__ void block_row_sums(const float* part, Emit emit, int row0, int nrows, int U, int nt) {
    const int stride = nrows * U;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = warp; j < nt * nrows; j += nw) {
        const int t = j / nrows, lr = j - t * nrows;
        const float s = lane_order_sum(part + t * stride + lr * U, U, lane);
        if (lane == 0) emit(t, row0 + lr, dot_post<T>(s));
    }
}

// The block's rows row0 .. row0+nrows of a stacked product (wrow(r): row r's bytes) against nt
// activation rows; emit(t, r, y) receives each finished output (after dot_post). `f`: the
// thread's first unit, from first_unit over the block's rows.
template <int T, typename WRow, typename Emit>
__device__ __forceinline__ void units_block(const FirstUnit<T>& f, WRow wrow, Emit emit, int row0, int nrows, int U,
                                            const u8* x, u64 xrb, int nt, float* part) {
    const int stride = nrows * U;  // one activation row's contributions
    unit_contribs_all<T>(f, [&](int lr) { return wrow(row0 + lr); }, [&](int) { return x; }, stride, U, xrb, nt,
                         part);
    __syncthreads();
    block_row_sums<T>(part, emit, row0, nrows, U, nt);
}

// Up to four weights of one format and row length (w0 rows 0..n0, then w1, …) against the same
// activation rows, each to its own output y_i[t][r]: the products of one activation image in
// one launch (gemv_base's bits for each). Grid: ceil(Σn / rb) blocks of 256.
template <int T>
__device__ __forceinline__ void gemv_units_t(const u8* w0, const u8* w1, const u8* w2, const u8* w3, float* y0,
                                             float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3,
                                             const u8* x, int nt, int k, u64 wrb, u64 xrb, int rb) {
    __shared__ float part[UNITS_PART];
    __shared__ __align__(16) u8 xsh[UNITS_XSTAGE];
    const int total = n0 + n1 + n2 + n3;
    const int row0 = blockIdx.x * rb;
    if (row0 >= total) return;
    const int nrows = min(rb, total - row0);
    const int e1 = n0, e2 = n0 + n1, e3 = n0 + n1 + n2;
    {
        // This block's rows of each of the (up to four) weights.
        const u8* ws[4] = {w0, w1, w2, w3};
        const int lo[4] = {0, e1, e2, e3}, hi[4] = {e1, e2, e3, total};
        for (int i = 0; i < 4; ++i) {
            const int a = max(row0, lo[i]), b = min(row0 + nrows, hi[i]);
            if (a < b) prefetch_l2(ws[i] + (size_t)(a - lo[i]) * wrb, (u64)(b - a) * wrb);
        }
    }
    auto wrow = [&](int r) -> const u8* {
        const u8* w = r < e1 ? w0 : r < e2 ? w1 : r < e3 ? w2 : w3;
        const int lr = r < e1 ? r : r < e2 ? r - e1 : r < e3 ? r - e2 : r - e3;
        return w + (size_t)lr * wrb;
    };
    auto emit = [&](int t, int r, float v) {
        if (r < e1) y0[(size_t)t * n0 + r] = v;
        else if (r < e2) y1[(size_t)t * n1 + (r - e1)] = v;
        else if (r < e3) y2[(size_t)t * n2 + (r - e2)] = v;
        else y3[(size_t)t * n3 + (r - e3)] = v;
    };
    const int U = k / 32;
    const FirstUnit<T> f = first_unit<T>([&](int lr) { return wrow(row0 + lr); }, nrows * U, U);
    grid_dep_sync();
    x = stage_act(x, (u64)nt * xrb, xsh);
    units_block<T>(f, wrow, emit, row0, nrows, U, x, xrb, nt, part);
}

// A BF16 weight row's units for lane `lane` of a warp a row (units lane, lane + 32, …), held
// in registers from their loads to their dots; the dots add them from +0 in that order, so a
// warp_sum of the lanes is lane_order_sum's and gemv_opt's sum.
template <int K>
struct Bf16Row {
    static constexpr int U = K / 32, PER = (U + 31) / 32;
    uint4 v[PER][4];
};

template <int K>
__device__ __forceinline__ void bf16_row_load(const uint4* wr, int lane, Bf16Row<K>& w) {
#pragma unroll
    for (int i = 0; i < Bf16Row<K>::PER; ++i) {
        const int u = lane + 32 * i;
        if (u < Bf16Row<K>::U) {
#pragma unroll
            for (int q = 0; q < 4; ++q) w.v[i][q] = wr[4 * u + q];
        }
    }
}

template <int K, int NT>
__device__ __forceinline__ void bf16_row_dots(const Bf16Row<K>& w, const u8* x, int lane, float* acc) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
#pragma unroll
    for (int i = 0; i < Bf16Row<K>::PER; ++i) {
        const int u = lane + 32 * i;
        if (u < Bf16Row<K>::U) {
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[t] += bf16_unit(w.v[i], (const uint4*)(x + (size_t)t * 2 * K) + 4 * u);
        }
    }
}

// gemv_units_bf16's bits with a warp a row for rows of K = 2560 (model::units_w_applies): lane
// l adds its units l, l + 32, l + 64 in order from +0 and the warp sums them (lane_order_sum's
// order over the unit-parallel contributions). Every unit of the lane loaded before the
// dependency wait; four rows a block, the up to four weights' rows stacked as gemv_units_t
// stacks them.
template <int K, int NT>
__device__ __forceinline__ void gemv_w_t(const u8* w0, const u8* w1, const u8* w2, const u8* w3, float* y0,
                                         float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3,
                                         const u8* x) {
    constexpr u64 RB = 2 * (u64)K;
    const int lane = threadIdx.x & 31, r = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int e1 = n0, e2 = n0 + n1, e3 = n0 + n1 + n2, total = e3 + n3;
    if (r >= total) return;
    const u8* wb = r < e1 ? w0 : r < e2 ? w1 : r < e3 ? w2 : w3;
    const int lr = r < e1 ? r : r < e2 ? r - e1 : r < e3 ? r - e2 : r - e3;
    const uint4* wr = (const uint4*)(wb + (size_t)lr * RB);
    Bf16Row<K> wv;
    bf16_row_load(wr, lane, wv);
    grid_dep_sync();
    float acc[NT];
    bf16_row_dots<K, NT>(wv, x, lane, acc);
    float* y = r < e1 ? y0 : r < e2 ? y1 : r < e3 ? y2 : y3;
    const int n = r < e1 ? n0 : r < e2 ? n1 : r < e3 ? n2 : n3;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) y[(size_t)t * n + lr] = v;
    }
}
#if defined(GEMV_BF16)
#define GEMV_W(NT)                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    gemv_w_bf16_k2560_nt##NT(const u8* w0, const u8* w1, const u8* w2, const u8* w3, float* y0, float* y1, \
                             float* y2, float* y3, int n0, int n1, int n2, int n3, const u8* x) {  \
        gemv_w_t<2560, NT>(w0, w1, w2, w3, y0, y1, y2, y3, n0, n1, n2, n3, x);                \
    }
GEMV_W(1) GEMV_W(2) GEMV_W(3) GEMV_W(4) GEMV_W(5) GEMV_W(6) GEMV_W(7) GEMV_W(8)
#endif

// Routed experts, decode: gate and up of pair q (row q / kslots, expert ids[q]) for 32
// consecutive rows of the expert's ff, then swiglu and the Q8_0 block of those 32 values for
// the down product (moe_gemv × 2, swiglu_f32 and xprep's Q8_0 in one launch). Grid (ff/32,
// pairs), GATE_UP_THREADS threads. An expert id outside 0..n_expert sets bit 2 of *err and gives a NaN scale.
template <int T>
__device__ __forceinline__ void moe_gate_up_q8_t(const u8* wg, const u8* wu, u64 slab_bytes, const int* ids,
                                                 int n_expert, const u8* x, int kslots, u8* aq, int ff, int k,
                                                 u64 wrb, u64 xrb, u32* err) {
    __shared__ float part[UNITS_PART];
    __shared__ float gu[64];
    const int q = blockIdx.y, r0 = 32 * blockIdx.x, U = k / 32;
    const int e = ids[q];
    const u64 arb = 34 * (u64)(ff / 32);
    u8* blk = aq + (size_t)q * arb + 34 * (size_t)blockIdx.x;
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x == 0) {
            atomicOr(err, 2u);
            *(u16*)blk = 0x7e00;  // NaN scale: every product of this pair is NaN
        }
        return;
    }
    __shared__ __align__(16) u8 xsh[UNITS_XSTAGE];
    const u8* g = wg + (size_t)e * slab_bytes + (size_t)r0 * wrb;
    const u8* up = wu + (size_t)e * slab_bytes + (size_t)r0 * wrb;
    auto wrow = [&](int r) -> const u8* { return r < 32 ? g + (size_t)r * wrb : up + (size_t)(r - 32) * wrb; };
    auto emit = [&](int, int r, float v) { gu[r] = v; };
    // The first unit loaded before the activation is staged (IQ4_XS after: its decoded unit
    // held across the staging spills under the 256-thread bound).
    constexpr bool EARLY = T != T_IQ4_XS;
    FirstUnit<T> f;
    if constexpr (EARLY) f = first_unit<T>(wrow, 64 * U, U);
    const u8* xr = stage_act(x + (size_t)(q / kslots) * xrb, xrb, xsh);
    if constexpr (!EARLY) f = first_unit<T>(wrow, 64 * U, U);
    units_block<T>(f, wrow, emit, 0, 64, U, xr, xrb, 1, part);
    __syncthreads();
    if (threadIdx.x < 32) q8_0_warp(siluf_(gu[threadIdx.x]) * gu[32 + threadIdx.x], blk, threadIdx.x);
}

// Routed experts, decode: the down products of all kslots pairs of row t for rb consecutive
// output rows, their weighted sum in rank order (moe_combine), and with `shared` the shared
// expert added as add_sigmoid_gated does: out = Σ_s w_s·y_s (+ σ(gate_t)·shared). Grid (h/rb,
// nt).
template <int T, bool SHARED>
__device__ __forceinline__ void moe_down_combine_t(const u8* wd, u64 slab_bytes, const int* ids, int n_expert,
                                                   const u8* aq, const float* wts, int kslots, float* out,
                                                   const float* shared, const float* gate, int h, int k, u64 wrb,
                                                   u64 xrb, int rb, u32* err) {
    __shared__ float part[UNITS_PART];
    __shared__ float ys[256];
    __shared__ __align__(16) u8 xsh[UNITS_XSTAGE];
    const int t = blockIdx.y, r0 = blockIdx.x * rb, U = k / 32;
    const int nrows = min(rb, h - r0);
    grid_dep_sync();
    // Block rows are (slot, output row) pairs: row i = slot i / nrows, output r0 + i % nrows.
    auto wrow = [&](int i) -> const u8* {
        const int s = i / nrows, e = ids[t * kslots + s];
        const int ec = (e < 0 || e >= n_expert) ? 0 : e;
        return wd + (size_t)ec * slab_bytes + (size_t)(r0 + i % nrows) * wrb;
    };
    const int stride = kslots * nrows * U;
    // The row's kslots images are consecutive (pair q = t·kslots + s); each slot's activation
    // row is its own (aq row t·kslots + s). Staged first: a unit held across the staging
    // spills under the 1,024-thread bound.
    const u8* xt = stage_act(aq + (size_t)t * kslots * xrb, (u64)kslots * xrb, xsh);
    const FirstUnit<T> f = first_unit<T>(wrow, stride, U);
    unit_contribs_all<T>(f, wrow, [&](int lr) { return xt + (size_t)(lr / nrows) * xrb; }, stride, U, xrb, 1, part);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = warp; j < kslots * nrows; j += nw) {
        const float sum = lane_order_sum(part + j * U, U, lane);
        if (lane == 0) {
            const int s = j / nrows, e = ids[t * kslots + s];
            float v = dot_post<T>(sum);
            if (e < 0 || e >= n_expert) {
                atomicOr(err, 2u);
                v = __int_as_float(0x7fc00000);
            }
            ys[j] = v;
        }
    }
    __syncthreads();
    for (int jj = threadIdx.x; jj < nrows; jj += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < kslots; ++s) acc += wts[t * kslots + s] * ys[s * nrows + jj];
        const size_t o = (size_t)t * h + r0 + jj;
        if (SHARED) acc = acc + sigmoidf_(gate[t]) * shared[o];
        out[o] = acc;
    }
}


#if defined(GEMV_Q2_0)
// A thread's contributions in the transposed kernels: one unit u of every row r = g, g + G, …
// below `nrows` (row(r): the weight row), four weight loads in flight before their dots.
template <typename Row>
__device__ __forceinline__ void q2_rows(Row row, const Q2X& a, int u, int g, int G, int nrows, int U, float* part,
                                        int part0) {
    for (int r = g; r < nrows; r += 4 * G) {
        Q2W w[4];
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (r + m * G < nrows) w[m] = q2_load(row(r + m * G), u);
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (r + m * G < nrows) part[part0 + (r + m * G) * U + u] = q2_dot(w[m], a);
    }
}

// moe_gate_up_q8_q2_0's bits with a unit a thread fixed: blockDim.x = G·U threads, thread
// (g, u) takes unit u of rows g, g + G, … of the block's 64 (32 gate, 32 up).
//
// (Session 8 pulled the block's rows into L2 before the dependency wait where the route was
// settled, and ran the whole product before it: no gain, and 55 µs a launch against 24;
// moe_gate_up_q2s below stages its rows in shared memory instead.)
extern "C" __global__ void __launch_bounds__(1024)
moe_gate_up_q8_q2t(const u8* wg, const u8* wu, u64 slab_bytes, const int* ids, int n_expert, const u8* x, int kslots,
                   u8* aq, int ff, int k, u64 wrb, u64 xrb, u32* err) {
    __shared__ float part[UNITS_PART];
    __shared__ float gu[64];
    const int q = blockIdx.y, r0 = 32 * blockIdx.x, U = k / 32;
    grid_dep_sync();
    const int e = ids[q];
    const u64 arb = 34 * (u64)(ff / 32);
    u8* blk = aq + (size_t)q * arb + 34 * (size_t)blockIdx.x;
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x == 0) {
            atomicOr(err, 2u);
            *(u16*)blk = 0x7e00;  // NaN scale: every product of this pair is NaN
        }
        return;
    }
    const u8* g = wg + (size_t)e * slab_bytes + (size_t)r0 * wrb;
    const u8* up = wu + (size_t)e * slab_bytes + (size_t)r0 * wrb;
    auto wrow = [&](int r) -> const u8* { return r < 32 ? g + (size_t)r * wrb : up + (size_t)(r - 32) * wrb; };
    const int G = blockDim.x / U, u = threadIdx.x % U, gi = threadIdx.x / U;
    if (gi < G) q2_rows(wrow, q2_act(x + (size_t)(q / kslots) * xrb, u), u, gi, G, 64, U, part, 0);
    __syncthreads();
    block_row_sums<T_Q2_0>(part, [&](int, int r, float v) { gu[r] = v; }, 0, 64, U, 1);
    __syncthreads();
    if (threadIdx.x < 32) q8_0_warp(siluf_(gu[threadIdx.x]) * gu[32 + threadIdx.x], blk, threadIdx.x);
}

// ---- the routed experts with their weights staged by bulk copies (decode rows) -------------
// moe_gate_up_q8_q2t's and moe_down_combine_t's bits, with each block's weight rows (and the
// gate/up's activation row) brought into shared memory by sm_90 bulk copies and every row
// summed by a warp: lane l adds its units l, l + 32, l + 64 from +0, then warp_sum — the order
// of lane_order_sum, so each row is the unit-parallel kernels' value bit for bit, with no
// shared contributions and no row-sum pass. strata_cuda::model::experts_staged says when they
// apply (the launchers check sizes and 16-byte alignment).
//
// `early` (strata_cuda::model::SharedAdd::settled): `ids` and the activation image `x` were
// written two or more waiting launches before (see moe_gate_up_q8_q2t), so the gate/up copies
// and computes its block before the dependency wait, then waits, then writes its Q8_0 block;
// the down copies its weight rows before the wait (its activations are the gate/up's, read
// after it).
#define MQS_STAGE 48800  // 64 Q2_0 rows of 2560 (46,080 bytes) + a Q8_0 row of 2560 (2,720)

// Block (blockIdx.x, q): the pair q's 32 gate and 32 up rows of its Q8_0 block blockIdx.x,
// 512 threads: warp w the rows w, w + 16, w + 32, w + 48 (gate rows below 32, up above).
extern "C" __global__ void __launch_bounds__(512)
moe_gate_up_q2s(const u8* wg, const u8* wu, u64 slab_bytes, const int* ids, int n_expert, const u8* x, int kslots,
                u8* aq, int ff, int k, u64 wrb, u64 xrb, u32* err, int early) {
    __shared__ __align__(128) u8 st[MQS_STAGE];
    __shared__ float gu[64];
    __shared__ __align__(8) u64 bar;
    const int q = blockIdx.y, r0 = 32 * blockIdx.x, U = k / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 half = 32 * (u32)wrb;
    const int e = early ? __ldcg(ids + q) : (grid_dep_sync(), ids[q]);
    const bool ok = e >= 0 && e < n_expert;
    if (ok && tid == 0) {
        mbar_arm(&bar, 2 * half + (u32)xrb);
        bulk_to_smem(st, wg + (size_t)e * slab_bytes + (size_t)r0 * wrb, half, &bar);
        bulk_to_smem(st + half, wu + (size_t)e * slab_bytes + (size_t)r0 * wrb, half, &bar);
        bulk_to_smem(st + 2 * half, x + (size_t)(q / kslots) * xrb, (u32)xrb, &bar);
    }
    u8* blk = aq + (size_t)q * (34 * (u64)(ff / 32)) + 34 * (size_t)blockIdx.x;
    if (!ok) {
        if (early) grid_dep_sync();
        if (tid == 0) {
            atomicOr(err, 2u);
            *(u16*)blk = 0x7e00;  // NaN scale: every product of this pair is NaN
        }
        return;
    }
    __syncthreads();
    mbar_wait(&bar);
    const u8* xs = st + 2 * half;
    Q2X a[3];
#pragma unroll
    for (int m = 0; m < 3; ++m)
        if (lane + 32 * m < U) a[m] = q2_act(xs, lane + 32 * m);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = warp + 16 * i;
        const u8* wr = st + (size_t)r * wrb;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 3; ++m)
            if (lane + 32 * m < U) acc += q2_dot(q2_load(wr, lane + 32 * m), a[m]);
        acc = warp_sum(acc);
        if (lane == 0) gu[r] = dot_post<T_Q2_0>(acc);
    }
    __syncthreads();
    if (early) grid_dep_sync();
    if (warp == 0) q8_0_warp(siluf_(gu[lane]) * gu[32 + lane], blk, lane);
}

#define MDS_ROWS 16       // output rows a block (a warp each)
#define MDS_SLOTS 10      // at most this many slots a row
#define MDS_STAGE 28800   // MDS_SLOTS × MDS_ROWS Q2_0 rows of 640 (180 bytes)
#define MDS_SH_UNITS 20   // the shared expert's Q8_0 rows: at most 20 units (640)

// A transposed activation unit as kept in shared memory (Q2X without its 16-byte alignment).
struct Q2Xs {
    int a[4], b[4];
    float dx;
    int sx;
};

// Block (blockIdx.x, t): output rows r0 .. r0 + 16 of activation row t over its kslots slots,
// 512 threads: warp w the output row r0 + w. Each slot's 16 weight rows are one bulk copy; the
// pairs' Q8_0 images (the gate/up's) are transposed once a block into shared memory.
//
// The shared expert, one of two ways: `shared` (its output, nt × h) added as
// add_sigmoid_gated does; or, with `sw` (its Q8_0 down weight, rows of sff ≤ 640), computed
// here from its gate and up products `sg`, `su` (nt × sff): swiglu_xprep's Q8_0 image of
// silu(g)·u (norm.cu, the same expression), then the block's 16 down rows as the unit-parallel
// product sums them (a warp a row, lane_order_sum's order) — so the bits of swiglu_prepare, the
// product and the add. Its weight rows are copied before the dependency wait always (weights),
// its image computed before it where `early` says sg and su are settled.
extern "C" __global__ void __launch_bounds__(512)
moe_down_q2s(const u8* wd, u64 slab_bytes, const int* ids, int n_expert, const u8* aq, const float* wts, int kslots,
             float* out, const float* shared, const float* gate, int h, int k, u64 wrb, u64 xrb, u32* err,
             int early, const float* sg, const float* su, const u8* sw, int sff, u64 swrb) {
    __shared__ __align__(128) u8 st[MDS_STAGE];
    __shared__ __align__(128) u8 sst[MDS_ROWS * 34 * MDS_SH_UNITS];
    __shared__ __align__(16) u8 sact[34 * MDS_SH_UNITS];
    __shared__ Q2Xs xa[MDS_SLOTS * 20];
    __shared__ __align__(8) u64 bar, bars;
    const int t = blockIdx.y, r0 = MDS_ROWS * blockIdx.x, U = k / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 sb = MDS_ROWS * (u32)wrb;
    const int* id = ids + t * kslots;
    const int SU = sff / 32;
    if (sw && tid == 0) {
        mbar_arm(&bars, MDS_ROWS * (u32)swrb);
        bulk_to_smem(sst, sw + (size_t)r0 * swrb, MDS_ROWS * (u32)swrb, &bars);
    }
    // The shared expert's activation image (swiglu_xprep's warp a 32-element block).
    auto shared_image = [&]() {
        for (int b = warp; b < SU; b += 16) {
            const size_t e = (size_t)t * sff + 32 * b + lane;
            q8_0_warp(siluf_(sg[e]) * su[e], sact + 34 * b, lane);
        }
    };
    if (sw && early) shared_image();
    if (!early) grid_dep_sync();
    // Warp 0's lane s reads slot s's id (all at once: one load latency, not kslots in a row),
    // lane 0 arms the barrier with the valid slots' bytes, then each lane copies its slot.
    if (warp == 0) {
        const int e = lane < kslots ? __ldcg(id + lane) : -1;
        const bool valid = e >= 0 && e < n_expert;
        const u32 n = __popc(__ballot_sync(FULL_MASK, valid));
        if (lane == 0) mbar_arm(&bar, n * sb);
        __syncwarp();
        if (valid) bulk_to_smem(st + lane * sb, wd + (size_t)e * slab_bytes + (size_t)r0 * wrb, sb, &bar);
    }
    if (early) grid_dep_sync();
    if (sw && !early) shared_image();
    // The pairs' activation units, transposed (thread i: slot i / U, unit i % U).
    if (tid < kslots * U) {
        const Q2X x = q2_act(aq + (size_t)(t * kslots + tid / U) * xrb, tid % U);
        Q2Xs& d = xa[tid];
#pragma unroll
        for (int i = 0; i < 4; ++i) d.a[i] = x.a[i], d.b[i] = x.b[i];
        d.dx = x.dx;
        d.sx = x.sx;
    }
    __syncthreads();
    mbar_wait(&bar);
    const int r = r0 + warp;
    // Every slot's row first (independent), then their butterflies side by side.
    float acc[MDS_SLOTS];
#pragma unroll
    for (int s = 0; s < MDS_SLOTS; ++s) {
        acc[s] = 0.f;
        if (s < kslots && lane < U) {
            const Q2Xs& d = xa[s * U + lane];
            Q2X x;
#pragma unroll
            for (int i = 0; i < 4; ++i) x.a[i] = d.a[i], x.b[i] = d.b[i];
            x.dx = d.dx;
            x.sx = d.sx;
            acc[s] += q2_dot(q2_load(st + s * sb + (size_t)warp * wrb, lane), x);
        }
    }
#pragma unroll
    for (int s = 0; s < MDS_SLOTS; ++s) acc[s] = warp_sum(acc[s]);
    float comb = 0.f;
#pragma unroll
    for (int s = 0; s < MDS_SLOTS; ++s) {
        if (s < kslots) {
            const int e = id[s];
            float v = dot_post<T_Q2_0>(acc[s]);
            if (e < 0 || e >= n_expert) {
                if (lane == 0) atomicOr(err, 2u);
                v = __int_as_float(0x7fc00000);
            }
            comb += wts[t * kslots + s] * v;
        }
    }
    float sv = 0.f;
    if (sw) {
        mbar_wait(&bars);
        float a = 0.f;
        if (lane < SU) a += unit_dot_w<T_Q8_0>(load_unit<T_Q8_0>(sst + (size_t)warp * swrb, lane), sact, lane);
        sv = dot_post<T_Q8_0>(warp_sum(a));
    }
    if (lane == 0 && r < h) {
        const size_t o = (size_t)t * h + r;
        if (sw) comb = comb + sigmoidf_(gate[t]) * sv;
        else if (shared) comb = comb + sigmoidf_(gate[t]) * shared[o];
        out[o] = comb;
    }
}

#endif

// Threads of a gate/up block: 512, or 256 where the decoder needs more registers than 512
// threads leave (IQ4_XS, IQ3_XXS; strata_cuda::model::gate_up_threads says the same).
// The fused gate/up kernels' launch bound: 1,024 threads (five units a thread for rows of
// 2560) where the decoder fits 64 registers, fewer where it needs more.
#define GATE_UP_THREADS(T) ((T) == T_IQ4_XS || (T) == T_IQ3_XXS ? 256 : GATE_UP_WIDE(T) ? 1024 : 512)
#define GATE_UP_WIDE(T) ((T) == T_Q2_0 || (T) == T_Q8_0 || (T) == T_Q4_0 || (T) == T_Q5_0 || (T) == T_IQ4_NL)

#define UNITS(T, NAME)                                                                         \
    extern "C" __global__ void __launch_bounds__(1024)                                          \
    gemv_units_##NAME(const u8* w0, const u8* w1, const u8* w2, const u8* w3, float* y0, float* y1, \
                      float* y2, float* y3, int n0, int n1, int n2, int n3, const u8* x, int nt, int k, \
                      u64 wrb, u64 xrb, int rb) {                                              \
        gemv_units_t<T>(w0, w1, w2, w3, y0, y1, y2, y3, n0, n1, n2, n3, x, nt, k, wrb, xrb, rb); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GATE_UP_THREADS(T))                            \
    moe_gate_up_q8_##NAME(const u8* wg, const u8* wu, u64 slab_bytes, const int* ids, int n_expert, \
                          const u8* x, int kslots, u8* aq, int ff, int k, u64 wrb, u64 xrb, u32* err) { grid_dep_sync(); \
        moe_gate_up_q8_t<T>(wg, wu, slab_bytes, ids, n_expert, x, kslots, aq, ff, k, wrb, xrb, err); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(1024)                                          \
    moe_down_combine_##NAME(const u8* wd, u64 slab_bytes, const int* ids, int n_expert, const u8* aq, \
                            const float* wts, int kslots, float* out, int h, int k, u64 wrb, u64 xrb, \
                            int rb, u32* err) {                                                \
        moe_down_combine_t<T, false>(wd, slab_bytes, ids, n_expert, aq, wts, kslots, out, nullptr, \
                                     nullptr, h, k, wrb, xrb, rb, err);                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(1024)                                          \
    moe_down_combine_shared_##NAME(const u8* wd, u64 slab_bytes, const int* ids, int n_expert,  \
                                   const u8* aq, const float* wts, int kslots, float* out,      \
                                   const float* shared, const float* gate, int h, int k, u64 wrb, \
                                   u64 xrb, int rb, u32* err) {                                 \
        moe_down_combine_t<T, true>(wd, slab_bytes, ids, n_expert, aq, wts, kslots, out, shared, \
                                    gate, h, k, wrb, xrb, rb, err);                            \
    }

#define PRODUCTS(T, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    matmul_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb) { grid_dep_sync(); \
        matmul_t<T>(w, x, y, rows, k, nt, wrb, xrb);                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    moe_gemv_##NAME(const u8* w, u64 slab_bytes, const int* ids, int n_expert, const u8* x,    \
                    int x_per_slot, int kslots, float* y, int rows, int k, u64 wrb, u64 xrb,   \
                    u32* err) { grid_dep_sync();                                                                \
        moe_gemv_t<T>(w, slab_bytes, ids, n_expert, x, x_per_slot, kslots, y, rows, k, wrb, xrb, err); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    moe_matmul_##NAME(const u8* w, u64 slab_bytes, const int* tiles, const u32* n_tiles,       \
                      const u32* perm, const u8* x, int x_per_slot, int kslots, float* y,      \
                      int rows, int k, u64 wrb, u64 xrb) { grid_dep_sync();                                     \
        moe_matmul_t<T>(w, slab_bytes, tiles, n_tiles, perm, x, x_per_slot, kslots, y, rows, k, wrb, xrb); \
    }

#define GEMV_BASE(T, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    gemv_base_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb,     \
                     u64 xrb) { grid_dep_sync();                                                                \
        gemv_base<T>(w, x, y, rows, k, nt, wrb, xrb);                                          \
    }
#define GEMV_OPT1(T, NAME, NT)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    gemv_opt_##NAME##_k2560_nt##NT(const u8* w, const u8* x, float* y, int rows) {             \
        gemv_opt<T, 2560, NT>(w, x, y, rows);                                                  \
    }
// One activation row against rows of K ≠ 2560 (the GDN and attention outputs, rows of 6144:
// strata_cuda::model::product), gemv_base's order; more rows would not fit the block's staged
// activations in its static shared memory.
#define GEMV_OPT_LONG(T, NAME, K)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    gemv_opt_##NAME##_k##K##_nt1(const u8* w, const u8* x, float* y, int rows) {              \
        gemv_opt<T, K, 1>(w, x, y, rows);                                                      \
    }
// Each weight format is its own NVRTC program (strata-cuda defines GEMV_<NAME> for one), so
// the nine compile in parallel at start.
#define GEMV_ALL(T, NAME)                                                                      \
    GEMV_BASE(T, NAME)                                                                         \
    PRODUCTS(T, NAME)                                                                          \
    UNITS(T, NAME)                                                                             \
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
GEMV_ROWS4(T_Q4_K, q4_k)
GEMV_OPT_LONG(T_Q4_K, q4_k, 6144)
#endif
#if defined(GEMV_Q5_K)
GEMV_ALL(T_Q5_K, q5_k)
GEMV_OPT_LONG(T_Q5_K, q5_k, 6144)
#endif
#if defined(GEMV_Q6_K)
GEMV_ALL(T_Q6_K, q6_k)
GEMV_ROWS4(T_Q6_K, q6_k)
#endif
#if defined(GEMV_IQ4_XS)
GEMV_ALL(T_IQ4_XS, iq4_xs)
GEMV_ROWS4(T_IQ4_XS, iq4_xs)
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
UNITS(T_F32, f32)
#endif
#if defined(GEMV_Q4_0)
GEMV_BASE(T_Q4_0, q4_0)
PRODUCTS(T_Q4_0, q4_0)
UNITS(T_Q4_0, q4_0)
#endif
#if defined(GEMV_Q5_0)
// Q5_0 (most matrices of the default qwen2 0.5B Q4_K_M file, whose rows of 896 are not whole
// K-quant blocks): products only.
GEMV_BASE(T_Q5_0, q5_0)
PRODUCTS(T_Q5_0, q5_0)
UNITS(T_Q5_0, q5_0)
#endif
#if defined(GEMV_IQ4_NL)
GEMV_BASE(T_IQ4_NL, iq4_nl)
PRODUCTS(T_IQ4_NL, iq4_nl)
UNITS(T_IQ4_NL, iq4_nl)
#endif
#if defined(GEMV_Q3_K)
// Q3_K (the GDN attn_qkv of 18 layers): the model's launcher runs the optimized GEMV for its
// 10240 rows of 2560 (strata_cuda::model::product), gemv_base's order.
GEMV_ALL(T_Q3_K, q3_k)
GEMV_ROWS4(T_Q3_K, q3_k)
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

// ---- the hyper-connection mix, fused (strata_cuda::model::hc_mix_fused) -----------------------
// Three launches with the composed mix's bits (model::hc_mix: rms_norm_f32, xprep, the down
// product, hc_act_bf16, the up product, hc_u_f32, the inject product, hc_inj_f32), optionally
// preceded by the previous block's combine (hc_combine_f32) in the first:
//   hc_norm_bf16 / hc_combine_norm_bf16: block (row, stream): [x_s += inj_s·y], xn_s =
//       RMS(x_s)·w_s (rms_norm_f32's sums), xq = BF16(xn) (the down/inject activation image);
//   hc_down_bf16: the stacked [down; inject] rows against xq (unit-parallel), with
//       aq = BF16(silu(a/S)) and inj = 2σ(v/S) as epilogues;
//   hc_up_u_bf16: block of J columns j: the up rows s·h + j of every stream against aq
//       (unit-parallel), then u_j = (Σ_s σ(g_s,j)·xn_s,j)·(1/S).

// One block of 1024 threads per (row, stream): every thread stages (and combines) a share of
// the stream's h values into shared memory, the first 256 sum squares in rms_norm_f32's order
// (thread t: elements t, t + 256, …; then block_sum256's tree over the eight warp sums), and
// every thread writes its share of the outputs.
#define HC_NORM_MAX_H 4096
template <bool COMBINE>
__device__ __forceinline__ void hc_norm_t(float* x, const float* y, const float* inj, const float* w, float* xn,
                                          u16* xq, int h, int streams, float eps) {
    __shared__ float xs[HC_NORM_MAX_H];
    __shared__ float sh[8];
    constexpr int PER = HC_NORM_MAX_H / 1024;  // a thread's elements (1,024 threads)
    const int tid = threadIdx.x, nth = blockDim.x;
    const int row = blockIdx.x / streams, g = blockIdx.x % streams;
    const size_t base = (size_t)row * streams * h + (size_t)g * h;
    float* xr = x + base;
    const float* wr = w + (size_t)g * h;
    // The norm's weights depend on no kernel: loaded before the wait.
    float wv[PER];
#pragma unroll
    for (int m = 0; m < PER; ++m)
        if (tid + m * nth < h) wv[m] = wr[tid + m * nth];
    grid_dep_sync();
    // Every input of the thread loaded before the first store (x is written in place).
    float xv[PER];
#pragma unroll
    for (int m = 0; m < PER; ++m)
        if (tid + m * nth < h) xv[m] = xr[tid + m * nth];
    if (COMBINE) {
        const float a = inj[(size_t)row * streams + g];
        const float* yr = y + (size_t)row * h;
        float yv[PER];
#pragma unroll
        for (int m = 0; m < PER; ++m)
            if (tid + m * nth < h) yv[m] = yr[tid + m * nth];
#pragma unroll
        for (int m = 0; m < PER; ++m) {
            const int i = tid + m * nth;
            if (i < h) {
                const float v = xv[m] + a * yv[m];
                xr[i] = v;
                xs[i] = v;
            }
        }
    } else {
#pragma unroll
        for (int m = 0; m < PER; ++m)
            if (tid + m * nth < h) xs[tid + m * nth] = xv[m];
    }
    __syncthreads();
    if (tid < 256) {
        float acc = 0.f;
        for (int i = tid; i < h; i += 256) {
            const float v = xs[i];
            acc += v * v;
        }
        acc = warp_sum(acc);
        if ((tid & 31) == 0) sh[tid >> 5] = acc;
    }
    __syncthreads();
    const float sum = ((sh[0] + sh[4]) + (sh[2] + sh[6])) + ((sh[1] + sh[5]) + (sh[3] + sh[7]));
    const float s = rms_scale(sum, h, eps);
#pragma unroll
    for (int m = 0; m < PER; ++m) {
        const int i = tid + m * nth;
        if (i < h) {
            const float o = (xs[i] * s) * wv[m];
            xn[base + i] = o;
            xq[base + i] = f32_to_bf16(o);
        }
    }
}

// (grid_dep_sync() inside hc_norm_t, after the weights' loads.)
extern "C" __global__ void __launch_bounds__(1024)
hc_norm_bf16(const float* x, const float* w, float* xn, u16* xq, int h, int streams, float eps) {
    hc_norm_t<false>((float*)x, nullptr, nullptr, w, xn, xq, h, streams, eps);  // not written
}

extern "C" __global__ void __launch_bounds__(1024)
hc_combine_norm_bf16(float* x, const float* y, const float* inj, const float* w, float* xn, u16* xq, int h,
                     int streams, float eps) {
    hc_norm_t<true>(x, y, inj, w, xn, xq, h, streams, eps);
}

extern "C" __global__ void __launch_bounds__(1024)
hc_down_bf16(const u8* wd, const u8* wi, const u8* xq, u16* aq, float* inj, int rank, int streams, int k, int nt,
             int rb, float inv_s) {
    __shared__ float part[UNITS_PART];
    const int total = rank + streams, row0 = blockIdx.x * rb;
    if (row0 >= total) return;
    const u64 rbytes = 2 * (u64)k;
    {
        const int end = min(row0 + rb, total), a = min(row0, rank), b = min(end, rank);
        if (a < b) prefetch_l2(wd + (size_t)a * rbytes, (u64)(b - a) * rbytes);
        const int c = max(row0, rank);
        if (c < end) prefetch_l2(wi + (size_t)(c - rank) * rbytes, (u64)(end - c) * rbytes);
    }
    auto wrow = [&](int r) -> const u8* {
        return r < rank ? wd + (size_t)r * rbytes : wi + (size_t)(r - rank) * rbytes;
    };
    const int nrows = min(rb, total - row0), U = k / 32;
    const FirstUnit<T_BF16> f = first_unit<T_BF16>([&](int lr) { return wrow(row0 + lr); }, nrows * U, U);
    grid_dep_sync();
    auto emit = [&](int t, int r, float v) {
        if (r < rank) aq[(size_t)t * rank + r] = f32_to_bf16(siluf_(v * inv_s));
        else inj[(size_t)t * streams + (r - rank)] = 2.0f * sigmoidf_(v * inv_s);
    };
    units_block<T_BF16>(f, wrow, emit, row0, nrows, U, xq, rbytes, nt, part);
}

extern "C" __global__ void __launch_bounds__(1024)
hc_up_u_bf16(const u8* wu, const u8* aq, const float* xn, float* u, int h, int streams, int rank, int nt, int J,
             float inv_s) {
    __shared__ float part[UNITS_PART];
    __shared__ float gs[512];
    const int j0 = blockIdx.x * J;
    if (j0 >= h) return;
    const int jn = min(J, h - j0);
    const u64 rbytes = 2 * (u64)rank;
    for (int s = 0; s < streams; ++s) prefetch_l2(wu + ((size_t)s * h + j0) * rbytes, (u64)jn * rbytes);
    auto wrow = [&](int lr) -> const u8* {
        const int s = lr / jn, jj = lr - s * jn;
        return wu + ((size_t)s * h + j0 + jj) * rbytes;
    };
    const int U = rank / 32;
    const FirstUnit<T_BF16> f = first_unit<T_BF16>(wrow, streams * jn * U, U);
    grid_dep_sync();
    __shared__ __align__(16) u8 xsh[UNITS_XSTAGE];
    aq = stage_act(aq, (u64)nt * rbytes, xsh);
    auto emit = [&](int t, int lr, float v) { gs[t * streams * jn + lr] = v; };
    units_block<T_BF16>(f, wrow, emit, 0, streams * jn, U, aq, rbytes, nt, part);
    __syncthreads();
    const size_t sh = (size_t)streams * h;
    for (int i = threadIdx.x; i < nt * jn; i += blockDim.x) {
        const int t = i / jn, jj = i - t * jn;
        const float* xr = xn + (size_t)t * sh + j0 + jj;
        float acc = 0.f;
        for (int s = 0; s < streams; ++s) acc += sigmoidf_(gs[t * streams * jn + s * jn + jj]) * xr[(size_t)s * h];
        u[(size_t)t * h + j0 + jj] = acc * inv_s;
    }
}

// The up product's sums of hc_up_q4_bf16 (the scheme is described at hc_up_q4_bf16, below):
// gs[t·64 + s·J + jj] for the block's J = 64/S columns, after the block's sync. The weights are
// loaded before the dependency wait, aq staged after it.
__device__ __forceinline__ void hc_up4_sums(const u8* wu, const u8* aq, int h, int streams, int rank, int nt,
                                            u8* ash, float* gs) {
    const int q = threadIdx.x & 3, rr = threadIdx.x >> 2;
    const int s = rr % streams, jj = rr / streams, J = 64 / streams;
    const int j0 = blockIdx.x * J, U = rank / 32;
    const u64 rbytes = 2 * (u64)rank;
    const bool live = j0 + jj < h;
    const u8* wr = wu + ((size_t)s * h + (live ? j0 + jj : 0)) * rbytes;
    UnitW<T_BF16> w[3];
#pragma unroll
    for (int m = 0; m < 3; ++m)
        if (live && q + 4 * m < U) w[m] = load_unit<T_BF16>(wr, q + 4 * m);
    grid_dep_sync();
    const u8* a = stage_act(aq, (u64)nt * rbytes, ash);
    for (int t = 0; t < nt; ++t) {
        float v[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = 0.f;
#pragma unroll
        for (int m = 0; m < 3; ++m)
            if (live && q + 4 * m < U) v[m] = 0.f + unit_dot_w<T_BF16>(w[m], a + (size_t)t * rbytes, q + 4 * m);
#pragma unroll
        for (int d = 4; d >= 1; d >>= 1)
#pragma unroll
            for (int m = 0; m < 8; ++m)
                if ((m & d) == 0 && m + d < 8) v[m] = v[m] + v[m + d];
        float r = v[0];
        r += __shfl_xor_sync(FULL_MASK, r, 2);
        r += __shfl_xor_sync(FULL_MASK, r, 1);
        if (q == 0) gs[t * 64 + s * J + jj] = r;
    }
    __syncthreads();
}

// hc_up_u_bf16's bits with four threads a weight row (model::hc_up_q4_applies: rank ≤ 384, so
// at most 12 units, and 1, 2, 4 or 8 streams). A row's units sum as lane_order_sum then
// warp_sum would (lane l: 0 + c_l, the other lanes +0, then the xor butterfly): thread q takes
// the virtual lanes q, q + 4, …, q + 28, runs the butterfly's xor-16, -8 and -4 steps on them
// itself (its units are the lanes below U) and the xor-2 and -1 steps with its three
// neighbours — so the units of a row load in parallel, three a thread, all before the wait,
// with no shared contributions. Block: 64 rows = 64/S columns × S streams; grid ceil(h·S/64).
//
// `early` (model::hc_mix_fused, STRATA_CUDA_HC_UP_EARLY): xn was written two launches back with
// a waiting launch between (the norm, then the down), so it is complete when this grid starts:
// each output's thread (nt · J ≤ 256) loads its S normed values through L2 before the wait,
// and the epilogue after the sums has no load left. The same values, so the same bits.
extern "C" __global__ void __launch_bounds__(256)
hc_up_q4_bf16(const u8* wu, const u8* aq, const float* xn, float* u, int h, int streams, int rank, int nt,
              float inv_s, int early) {
    __shared__ __align__(16) u8 ash[UNITS_XSTAGE];
    __shared__ float gs[8 * 64];
    const int J = 64 / streams, j0 = blockIdx.x * J;
    const int jn = min(J, h - j0);
    const size_t sh = (size_t)streams * h;
    float xv[8];
    if (early && (int)threadIdx.x < nt * jn) {
        const int t = threadIdx.x / jn, c = threadIdx.x - t * jn;
        const float* xr = xn + (size_t)t * sh + j0 + c;
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < streams) xv[g] = __ldcg(xr + (size_t)g * h);
    }
    hc_up4_sums(wu, aq, h, streams, rank, nt, ash, gs);
    for (int i = threadIdx.x; i < nt * jn; i += blockDim.x) {
        const int t = i / jn, c = i - t * jn;
        const float* xr = xn + (size_t)t * sh + j0 + c;
        float acc = 0.f;
        if (early) {
#pragma unroll
            for (int g = 0; g < 8; ++g)
                if (g < streams) acc += sigmoidf_(gs[t * 64 + g * J + c]) * xv[g];
        } else {
            for (int g = 0; g < streams; ++g) acc += sigmoidf_(gs[t * 64 + g * J + c]) * xr[(size_t)g * h];
        }
        u[(size_t)t * h + j0 + c] = acc * inv_s;
    }
}

#endif
