// mmq: exact tensor-core products for prefill-sized batches (beyond the GEMV window), for the
// integer-dot weight formats. Appended to each gemv_<type> module (sources.rs), so one module
// per format holds its GEMVs, its tiled products (the baseline, gemv.cu matmul_* / moe_matmul_*)
// and these.
//
// Why they are bitwise the GEMV's: gemv_base's output (row r, token t) is
// dot_post(warp_sum(acc_l)) with acc_l = 0.f + c(l) + c(l+32) + … in increasing unit order, and
// c(u) the f32 expression dot_decoded applies to the unit's INTEGER dot(s). Integer dots are
// exact in any order, so int8 MMA (mma.sync m16n8k32 s8: one unit for 16 rows × 8 tokens;
// two m16n8k16 for Q3_K / Q6_K, whose units have two 16-element scales) gives the same
// integers; the per-unit float expression below is dot_decoded's, operation for operation
// (the kernels are compiled with --fmad=false); each unit's value is added to the accumulator
// of its lane class u mod 32 in increasing u; and the 32 class sums are combined by the
// butterfly's own tree (xor 16, 8, 4, 2, 1 as lane 0 sees it). The tiling changes nothing.
//
// Layout: a block of 8 warps computes a tile of 32 weight rows × BN tokens (BN = 16 dense,
// 8 for an expert tile of moe_group). Warp w takes the units u ≡ w (mod 8), i.e. the lane
// classes w, w+8, w+16, w+24, for the whole tile (4 accumulators per output and class), and
// folds them at the end to the tree's level-8 sum s8[w] = (v[w] + v[w+16]) + (v[w+8] + v[w+24]);
// the block then finishes s4, s2, s1 from the 8 warps' sums in shared memory. Units are
// staged 16 at a time: weights decoded once per tile (decode_for_dot) into int8 words, the
// activations' words and scales beside them; a warp stages 16 consecutive units of two rows
// (or tokens), so its loads touch a few contiguous lines (the first version mapped lanes to
// rows: every 2-byte load touched 32 lines, which by that count made its staging L1-bound). A unit's 8 words are stored in the order
// 0,4,1,5,2,6,3,7 so a lane's two fragment words (t and 4+t) are one 8-byte load (rows or
// tokens 32 bytes apart: conflict-free).

#define MMQ_NW 8   // warps a block
#define MMQ_BM 32  // weight rows a block
#define MMQ_KC 16  // units staged a chunk (two chunks a round of 32 lane classes)

__device__ __forceinline__ void mma_k32(int (&c)[4], uint2 alo, uint2 ahi, uint2 b) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(alo.x), "r"(ahi.x), "r"(alo.y), "r"(ahi.y), "r"(b.x), "r"(b.y), "r"(0), "r"(0), "r"(0), "r"(0));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], u32 alo, u32 ahi, u32 b) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(alo), "r"(ahi), "r"(b), "r"(0), "r"(0), "r"(0), "r"(0));
}

// Q3_K and Q6_K scale each 16-element half of a unit: two integer dots (ia, ib).
template <int T>
__host__ __device__ constexpr bool mmq_split() { return T == T_Q3_K || T == T_Q6_K; }

// A unit's contribution from its integer dot(s): dot_decoded's float expression exactly.
// ws = weight (f0, f1, s0, s1 as int bits); xs = activation (dx, the two 16-element sums of a
// Q8_K sub-block packed as i16 halves).
template <int T>
__device__ __forceinline__ float mmq_contrib(float4 ws, float2 xs, int ia, int ib) {
    const float f0 = ws.x, f1 = ws.y, dx = xs.x;
    const int s0 = __float_as_int(ws.z), s1 = __float_as_int(ws.w);
    const int bw = __float_as_int(xs.y);
    const int bs0 = (int)(i16)(bw & 0xffff), bs1 = bw >> 16;
    if (T == T_Q8_0 || T == T_Q2_0 || T == T_Q4_0 || T == T_Q5_0 || T == T_IQ4_NL) {
        return (f0 * dx) * (float)ia;  // Q2_0: the −sx of dot_decoded is in the weights (−1..2)
    } else if (T == T_Q3_K) {
        return (f0 * dx) * (float)(s0 * ia + s1 * ib);  // the weights −4..3 (mmq_stage_w)
    } else if (T == T_Q6_K) {
        ia -= 32 * bs0;
        ib -= 32 * bs1;
        return (f0 * dx) * (float)(s0 * ia + s1 * ib);
    } else if (T == T_Q4_K || T == T_Q5_K) {
        const int bsum = bs0 + bs1;
        return (f0 * dx) * (float)(s0 * ia) - (f1 * dx) * (float)(s1 * bsum);
    } else {
        return (f0 * dx) * (float)(s0 * ia);  // IQ4_XS, IQ3_S, IQ3_XXS
    }
}

// Q2_0 in the transposed element order (session 7's q2_act idea, for the MMA staging): a
// unit's integer dot is a sum over its 32 (weight, activation) byte pairs, exact in any order,
// so both sides may list the elements in another order as long as it is the same one. Weight
// word m (m < 4) takes code m of each of the unit's code bytes 0..3 (element 4k + m in byte k:
// one shift and mask of the code word instead of spreading each byte), word 4 + m the same of
// bytes 4..7; the activation words are transposed to match (byte k of word m = element 4k + m,
// a 4×4 byte transpose). STRATA_CUDA_MMQ_Q2T=0 (the kernels' q2t argument) keeps the byte-wise
// decoder.
__device__ __forceinline__ void mmq_transpose4(u32& v0, u32& v1, u32& v2, u32& v3) {
    const u32 t0 = __byte_perm(v0, v1, 0x5140), t1 = __byte_perm(v0, v1, 0x7362);
    const u32 t2 = __byte_perm(v2, v3, 0x5140), t3 = __byte_perm(v2, v3, 0x7362);
    v0 = __byte_perm(t0, t2, 0x5410);
    v1 = __byte_perm(t0, t2, 0x7632);
    v2 = __byte_perm(t1, t3, 0x5410);
    v3 = __byte_perm(t1, t3, 0x7632);
}

// Weight unit u of row `wr` (nullptr: a row past the matrix, zeros) into the staging layout.
template <int T>
__device__ __forceinline__ void mmq_stage_w(const u8* wr, int u, uint2* wq, float4* ws, int q2t) {
    if (wr == nullptr) {
#pragma unroll
        for (int k = 0; k < 4; ++k) wq[k] = make_uint2(0u, 0u);
        *ws = make_float4(0.f, 0.f, 0.f, 0.f);
        return;
    }
    if (T == T_Q2_0 && q2t) {
        const u8* b = wr + (size_t)(u >> 1) * 18;  // two units a block: f16 scale, 16 code bytes
        const u8* c = b + 2 + 8 * (u & 1);
        const u32 c0 = ld32a2(c), c1 = ld32a2(c + 4);
#pragma unroll
        for (int m = 0; m < 4; ++m)
            wq[m] = make_uint2(__vsub4((c0 >> (2 * m)) & 0x03030303u, 0x01010101u),
                               __vsub4((c1 >> (2 * m)) & 0x03030303u, 0x01010101u));
        *ws = make_float4(ldf16(b), 0.f, __int_as_float(0), __int_as_float(0));
        return;
    }
    DecUnit d = decode_for_dot<T>(wr, u, global_tables());
    if (T == T_Q2_0) {
        // Codes 0..3 minus 1: Σ(c − 1)·x = isum − sx, the integer dot_decoded forms.
#pragma unroll
        for (int k = 0; k < 8; ++k) d.w[k] = (int)__vsub4((u32)d.w[k], 0x01010101u);
    }
    if (T == T_Q3_K) {
        // Codes 0..7 minus 4 (the weights themselves; dot_decoded takes the −4 through the
        // group sums instead): the same integer dots.
#pragma unroll
        for (int k = 0; k < 8; ++k) d.w[k] = (int)__vsub4((u32)d.w[k], 0x04040404u);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) wq[k] = make_uint2((u32)d.w[k], (u32)d.w[k + 4]);
    *ws = make_float4(d.f0, d.f1, __int_as_float(d.s0), __int_as_float(d.s1));
}

// Activation unit u of row `xr` (nullptr: a token past the tile, zeros) into the staging layout.
template <int T>
__device__ __forceinline__ void mmq_stage_x(const u8* xr, int u, uint2* xq, float2* xs, int q2t) {
    if (xr == nullptr) {
#pragma unroll
        for (int k = 0; k < 4; ++k) xq[k] = make_uint2(0u, 0u);
        *xs = make_float2(0.f, 0.f);
        return;
    }
    u32 v[8];
    float dx;
    u32 bw = 0;
    if (T == T_Q8_0 || T == T_Q2_0 || T == T_Q4_0 || T == T_Q5_0 || T == T_IQ4_NL) {
        const u8* xb = xr + 34 * (size_t)u;  // Q8_0 block u (2-byte aligned)
        dx = ldf16(xb);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = ld32a2(xb + 2 + 4 * k);
        if (T == T_Q2_0 && q2t) {
            mmq_transpose4(v[0], v[1], v[2], v[3]);
            mmq_transpose4(v[4], v[5], v[6], v[7]);
        }
    } else {
        const int s = u & 7;
        const u8* xb = xr + 292 * (size_t)(u >> 3);  // Q8_K block (4-byte aligned)
        dx = *(const float*)xb;
        const u32* q = (const u32*)(xb + 4 + 32 * s);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = q[k];
        if (T == T_IQ4_XS) {
            // decode_for_dot's element order (iq4xs_act_pair)
            u32 t[8];
#pragma unroll
            for (int k = 0; k < 4; ++k) iq4xs_act_pair(v[k], v[k + 4], t[2 * k], t[2 * k + 1]);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = t[k];
        }
        const i16* bs = (const i16*)(xb + 260 + 4 * s);
        bw = (u32)(u16)bs[0] | ((u32)(u16)bs[1] << 16);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) xq[k] = make_uint2(v[k], v[k + 4]);
    *xs = make_float2(dx, __int_as_float((int)bw));
}

// The shared tile: 32 rows from row r0 of slab `w`, BN tokens whose activation rows and output
// rows the caller put in xrow / yrow (−1: no token), NW warps (8: each takes the lane classes
// w, w+8, w+16, w+24; 16, the wide dense tile: w and w+16). Stores y[yrow · rows + r].
template <int T, int BN, int NW = MMQ_NW>
__device__ __forceinline__ void mmq_tile(const u8* w, int rows, int k, u64 wrb, const u8* x, u64 xrb, float* y,
                                         int r0, const int* xrow, const int* yrow, int q2t) {
    constexpr int NI = BN / 8, MI = MMQ_BM / 16, CPW = 32 / NW;
    // Per staged unit: a row's 4 uint2 (or a token's), strides padded to odd counts so the
    // staging stores of 16 consecutive units hit distinct banks.
    constexpr int SWQ = MMQ_BM * 4 + 1, SWS = MMQ_BM + 1, SXQ = BN * 4 + 1, SXS = BN + 1;
    constexpr int WQ = MMQ_KC * SWQ, XQ = MMQ_KC * SXQ;  // uint2 each
    constexpr int BYTES = 8 * WQ + 16 * MMQ_KC * SWS + 8 * XQ + 8 * MMQ_KC * SXS;
    // The class sums pass through the staging space in NS slices of BW tokens.
    constexpr int NS = NW * MMQ_BM * BN * 4 <= BYTES ? 1 : NI, BW = BN / NS;
    static_assert(NW * MMQ_BM * BW * 4 <= BYTES, "a slice of the class sums fits in the staging space");
    __shared__ __align__(16) u8 smem[BYTES];
    uint2* wq = (uint2*)smem;
    float4* ws = (float4*)(smem + 8 * WQ);
    uint2* xq = (uint2*)(smem + 8 * WQ + 16 * MMQ_KC * SWS);
    float2* xs = (float2*)(smem + 8 * WQ + 16 * MMQ_KC * SWS + 8 * XQ);
    float* part = (float*)smem;  // after the loop: [warp][row][token] level-NW sums

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int units = k / 32;

    // This thread's staging jobs: unit tid % 16 of weight rows tid / 16 and tid / 16 + 16, and
    // of activation token tid / 16 (threads below BN · 16). A warp reads 16 consecutive units of
    // two rows: a few contiguous lines per load, not one line per lane.
    const int su = tid % MMQ_KC, sr = tid / MMQ_KC;
    constexpr int SROWS = 32 * NW / MMQ_KC;  // rows a staging pass covers
    static_assert(MMQ_BM % SROWS == 0, "whole staging passes");
    const u8* wrs[MMQ_BM / SROWS];
#pragma unroll
    for (int j = 0; j < MMQ_BM / SROWS; ++j) {
        const int r = r0 + sr + SROWS * j;
        wrs[j] = r < rows ? w + (size_t)r * wrb : nullptr;
    }
    const int st = tid / MMQ_KC, sxu = tid % MMQ_KC;
    const bool xjob = tid < BN * MMQ_KC;
    const u8* xr = xjob && xrow[st] >= 0 ? x + (size_t)xrow[st] * xrb : nullptr;

    float acc[CPW][MI][NI][4];
#pragma unroll
    for (int q = 0; q < CPW; ++q)
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[q][mi][ni][e] = 0.f;

    for (int c0 = 0; c0 < units; c0 += 32) {
#pragma unroll
        for (int h = 0; h < 32 / MMQ_KC; ++h) {
            const int cb = c0 + MMQ_KC * h;
            if (cb < units) {
                __syncthreads();  // the previous chunk is consumed
#pragma unroll
                for (int j = 0; j < MMQ_BM / SROWS; ++j) {
                    const int u = cb + su, r = sr + SROWS * j;
                    mmq_stage_w<T>(u < units ? wrs[j] : nullptr, u, wq + su * SWQ + r * 4, ws + su * SWS + r, q2t);
                }
                if (xjob) {
                    const int u = cb + sxu;
                    mmq_stage_x<T>(u < units ? xr : nullptr, u, xq + sxu * SXQ + st * 4, xs + sxu * SXS + st, q2t);
                }
                __syncthreads();
#pragma unroll
                for (int i = 0; i < MMQ_KC / NW; ++i) {
                    // Unit cb + ul has lane class (KC·h + ul) mod 32 = warp + NW·q.
                    const int ul = warp + NW * i, u = cb + ul;
                    constexpr int QB = (MMQ_KC / NW);
                    const int q = QB * h + i;
                    if (u < units) {
                        uint2 b[NI];
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni) b[ni] = xq[ul * SXQ + (8 * ni + g) * 4 + tq];
                        float2 xsc[NI][2];
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni) {
                            xsc[ni][0] = xs[ul * SXS + 8 * ni + 2 * tq];
                            xsc[ni][1] = xs[ul * SXS + 8 * ni + 2 * tq + 1];
                        }
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi) {
                            const uint2 alo = wq[ul * SWQ + (16 * mi + g) * 4 + tq];
                            const uint2 ahi = wq[ul * SWQ + (16 * mi + g + 8) * 4 + tq];
                            const float4 wlo = ws[ul * SWS + 16 * mi + g];
                            const float4 whi = ws[ul * SWS + 16 * mi + g + 8];
#pragma unroll
                            for (int ni = 0; ni < NI; ++ni) {
                                int ca[4], cbv[4] = {0, 0, 0, 0};
                                if constexpr (mmq_split<T>()) {
                                    mma_k16(ca, alo.x, ahi.x, b[ni].x);
                                    mma_k16(cbv, alo.y, ahi.y, b[ni].y);
                                } else {
                                    mma_k32(ca, alo, ahi, b[ni]);
                                }
                                // c0, c1: row g, tokens 2tq, 2tq+1; c2, c3: row g+8.
                                acc[q][mi][ni][0] += mmq_contrib<T>(wlo, xsc[ni][0], ca[0], cbv[0]);
                                acc[q][mi][ni][1] += mmq_contrib<T>(wlo, xsc[ni][1], ca[1], cbv[1]);
                                acc[q][mi][ni][2] += mmq_contrib<T>(whi, xsc[ni][0], ca[2], cbv[2]);
                                acc[q][mi][ni][3] += mmq_contrib<T>(whi, xsc[ni][1], ca[3], cbv[3]);
                            }
                        }
                    }
                }
            }
        }
    }

    // The warp's classes folded as the butterfly folds them (stride 16, then 8 for 8 warps),
    // then the block's NW level-NW sums (strides NW/2, …, 1): the butterfly's tree.
    for (int sl = 0; sl < NS; ++sl) {
        __syncthreads();  // the staging space (or the previous slice) becomes the class sums
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                if (NS > 1 && ni != sl) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v[CPW];
#pragma unroll
                    for (int q = 0; q < CPW; ++q) v[q] = acc[q][mi][ni][e];
#pragma unroll
                    for (int hh = CPW / 2; hh >= 1; hh /= 2)
#pragma unroll
                        for (int q = 0; q < hh; ++q) v[q] = v[q] + v[q + hh];
                    const int rr = 16 * mi + g + 8 * (e >> 1), tt = 8 * ni + 2 * tq + (e & 1);
                    part[(warp * MMQ_BM + rr) * BW + tt - sl * BW] = v[0];
                }
            }
        __syncthreads();
        for (int o = tid; o < MMQ_BM * BW; o += 32 * NW) {
            const int rr = o / BW, tl = o % BW, tt = sl * BW + tl;
            float p[NW];
#pragma unroll
            for (int i = 0; i < NW; ++i) p[i] = part[(i * MMQ_BM + rr) * BW + tl];
#pragma unroll
            for (int hh = NW / 2; hh >= 1; hh /= 2)
#pragma unroll
                for (int i = 0; i < hh; ++i) p[i] = p[i] + p[i + hh];
            const int r = r0 + rr;
            if (r < rows && yrow[tt] >= 0) y[(size_t)yrow[tt] * rows + r] = dot_post<T>(p[0]);
        }
    }
}

// y[t][r] = W[r]·x_t, grid (ceil(rows / 32), ceil(nt / BN)), 32·NW threads: BN = 16 with 8
// warps (mmq_*), or the wide tile BN = 32 with 16 warps (mmqw_*: each weight unit decoded once
// for 32 tokens and each activation unit once for 32 rows, twice the reuse of both; the same
// bits, every output's sum is independent of the tile).
template <int T, int BN = 16, int NW = MMQ_NW>
__device__ __forceinline__ void mmq_dense(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb,
                                          u64 xrb, int q2t) {
    __shared__ int xrow[BN], yrow[BN];
    const int t0 = blockIdx.y * BN;
    if (threadIdx.x < BN) {
        const int t = t0 + threadIdx.x;
        xrow[threadIdx.x] = yrow[threadIdx.x] = t < nt ? t : -1;
    }
    __syncthreads();
    mmq_tile<T, BN, NW>(w, rows, k, wrb, x, xrb, y, blockIdx.x * MMQ_BM, xrow, yrow, q2t);
}

// The expert-grouped product: tile blockIdx.y = (expert, start, count ≤ 8) of moe_group's
// expert-sorted pair list; grid (ceil(rows / 32), max_tiles), tiles past *n_tiles exit.
template <int T>
__device__ __forceinline__ void mmq_moe(const u8* w, u64 slab_bytes, const int* tiles, const u32* n_tiles,
                                        const u32* perm, const u8* x, int x_per_slot, int kslots, float* y, int rows,
                                        int k, u64 wrb, u64 xrb, int q2t) {
    constexpr int BN = 8;
    __shared__ int xrow[BN], yrow[BN];
    const u32 tile = blockIdx.y;
    if (tile >= *n_tiles) return;  // uniform over the block
    const int e = tiles[3 * tile], start = tiles[3 * tile + 1], tn = tiles[3 * tile + 2];
    if (threadIdx.x < BN) {
        const int j = threadIdx.x;
        const int q = j < tn ? (int)perm[start + j] : -1;
        yrow[j] = q;
        xrow[j] = q < 0 ? -1 : x_per_slot ? q : q / kslots;
    }
    __syncthreads();
    mmq_tile<T, BN>(w + (size_t)e * slab_bytes, rows, k, wrb, x, xrb, y, blockIdx.x * MMQ_BM, xrow, yrow, q2t);
}

// ---- BF16 beyond the GEMV window -------------------------------------------------------------
//
// No tensor cores here (a BF16 MMA does not add in unit_dot's order), but the tiled kernel's
// cost was its loads (one 2-byte global load per FMA). This one keeps gemv_base's order exactly
// — lane l takes units l, l+32, …; a unit's value is bf16_unit's fmaf chain over its 32
// elements from 0.f; acc += value; warp_sum — and gives each lane a register tile of 4 weight
// rows × 8 tokens, so every 16-byte load feeds 8 or 4 chains (32 independent FMAs per element
// step). A block of 8 warps owns 32 rows × 8 tokens. Rows and tokens past the matrix are
// computed from the last valid one and not stored.
//
// HALVES (rows of at most 16 units, the hyper-connection up product's K = 320): lane classes
// 16..31 hold no unit, so the butterfly's first step adds +0 to each of lanes 0..15; the two
// half-warps then take 8 tokens each, form v + 0 themselves and finish with steps 8, 4, 2, 1
// inside the half — the same operations on the same values (the block owns 32 × 16).
template <bool HALVES>
__device__ __forceinline__ void mmt_bf16_t(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb,
                                           u64 xrb) {
    constexpr int RB = 4, TB = 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = HALVES ? lane >> 4 : 0;
    const int r0 = blockIdx.x * (8 * RB) + warp * RB, t0 = blockIdx.y * (HALVES ? 2 * TB : TB) + half * TB;
    if (r0 >= rows) return;  // whole warp
    const uint4* wr[RB];
    const uint4* xr[TB];
#pragma unroll
    for (int i = 0; i < RB; ++i) wr[i] = (const uint4*)(w + (size_t)min(r0 + i, rows - 1) * wrb);
#pragma unroll
    for (int t = 0; t < TB; ++t) xr[t] = (const uint4*)(x + (size_t)min(t0 + t, nt - 1) * xrb);
    float acc[RB][TB];
#pragma unroll
    for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[i][t] = 0.f;
    const int units = k / 32;
    for (int u = HALVES ? lane & 15 : lane; u < units; u += 32) {  // HALVES: units ≤ 16, once
        float a[RB][TB];
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int t = 0; t < TB; ++t) a[i][t] = 0.f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint4 wv[RB], xv[TB];
#pragma unroll
            for (int i = 0; i < RB; ++i) wv[i] = wr[i][4 * u + q];
#pragma unroll
            for (int t = 0; t < TB; ++t) xv[t] = xr[t][4 * u + q];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                // Elements 8q + 2m (low half of word m) and 8q + 2m + 1 (high half), in order.
#pragma unroll
                for (int hi = 0; hi < 2; ++hi) {
#pragma unroll
                    for (int i = 0; i < RB; ++i) {
                        const u32 ww = m == 0 ? wv[i].x : m == 1 ? wv[i].y : m == 2 ? wv[i].z : wv[i].w;
                        const float wf = __uint_as_float(hi ? ww & 0xffff0000u : ww << 16);
#pragma unroll
                        for (int t = 0; t < TB; ++t) {
                            const u32 xw = m == 0 ? xv[t].x : m == 1 ? xv[t].y : m == 2 ? xv[t].z : xv[t].w;
                            const float xf = __uint_as_float(hi ? xw & 0xffff0000u : xw << 16);
                            a[i][t] = fmaf(wf, xf, a[i][t]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int t = 0; t < TB; ++t) acc[i][t] += a[i][t];
    }
#pragma unroll
    for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            float s;
            if (HALVES) {
                s = acc[i][t] + 0.f;  // the xor-16 step: class l + class l + 16 (no unit: +0)
#pragma unroll
                for (int d = 8; d > 0; d >>= 1) s += __shfl_xor_sync(FULL_MASK, s, d);
            } else {
                s = warp_sum(acc[i][t]);
            }
            const int owner = HALVES ? (lane & 15) == ((i * TB + t) & 15) : lane == ((i * TB + t) & 31);
            if (owner && r0 + i < rows && t0 + t < nt) y[(size_t)(t0 + t) * rows + r0 + i] = dot_post<T_BF16>(s);
        }
}

#if defined(GEMV_BF16)
// y[t][r] = W[r]·x_t, BF16 weights and activations; grid (ceil(rows / 32), ceil(nt / 8)), 256
// threads; mmt_bf16_h for rows of at most 16 units, grid (ceil(rows / 32), ceil(nt / 16)).
extern "C" __global__ void __launch_bounds__(256)
mmt_bf16(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb) {
    grid_dep_sync();
    mmt_bf16_t<false>(w, x, y, rows, k, nt, wrb, xrb);
}
extern "C" __global__ void __launch_bounds__(256)
mmt_bf16_h(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb) {
    grid_dep_sync();
    mmt_bf16_t<true>(w, x, y, rows, k, nt, wrb, xrb);
}
#endif

#define MMQ(T, NAME)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    mmq_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb, int q2t) { \
        grid_dep_sync();                                                                       \
        mmq_dense<T>(w, x, y, rows, k, nt, wrb, xrb, q2t);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    moe_mmq_##NAME(const u8* w, u64 slab_bytes, const int* tiles, const u32* n_tiles,          \
                   const u32* perm, const u8* x, int x_per_slot, int kslots, float* y,         \
                   int rows, int k, u64 wrb, u64 xrb, int q2t) {                               \
        grid_dep_sync();                                                                       \
        mmq_moe<T>(w, slab_bytes, tiles, n_tiles, perm, x, x_per_slot, kslots, y, rows, k, wrb, xrb, q2t); \
    }
// The wide dense tile (not for Q6_K: its decoder does not fit beside it in 128 registers).
#define MMQW(T, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(512, 1)                                       \
    mmqw_##NAME(const u8* w, const u8* x, float* y, int rows, int k, int nt, u64 wrb, u64 xrb, int q2t) { \
        grid_dep_sync();                                                                       \
        mmq_dense<T, 32, 16>(w, x, y, rows, k, nt, wrb, xrb, q2t);                             \
    }
#if defined(GEMV_Q8_0)
MMQ(T_Q8_0, q8_0)
MMQW(T_Q8_0, q8_0)
#endif
#if defined(GEMV_Q4_0)
MMQ(T_Q4_0, q4_0)
MMQW(T_Q4_0, q4_0)
#endif
#if defined(GEMV_Q5_0)
MMQ(T_Q5_0, q5_0)
MMQW(T_Q5_0, q5_0)
#endif
#if defined(GEMV_IQ4_NL)
MMQ(T_IQ4_NL, iq4_nl)
MMQW(T_IQ4_NL, iq4_nl)
#endif
#if defined(GEMV_Q2_0)
MMQ(T_Q2_0, q2_0)
MMQW(T_Q2_0, q2_0)
#endif
#if defined(GEMV_Q3_K)
MMQ(T_Q3_K, q3_k)
MMQW(T_Q3_K, q3_k)
#endif
#if defined(GEMV_Q4_K)
MMQ(T_Q4_K, q4_k)
MMQW(T_Q4_K, q4_k)
#endif
#if defined(GEMV_Q5_K)
MMQ(T_Q5_K, q5_k)
MMQW(T_Q5_K, q5_k)
#endif
#if defined(GEMV_Q6_K)
MMQ(T_Q6_K, q6_k)
#endif
#if defined(GEMV_IQ4_XS)
MMQ(T_IQ4_XS, iq4_xs)
MMQW(T_IQ4_XS, iq4_xs)
#endif
#if defined(GEMV_IQ3_S)
MMQ(T_IQ3_S, iq3_s)
MMQW(T_IQ3_S, iq3_s)
#endif
#if defined(GEMV_IQ3_XXS)
MMQ(T_IQ3_XXS, iq3_xxs)
MMQW(T_IQ3_XXS, iq3_xxs)
#endif
