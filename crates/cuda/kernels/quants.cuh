// Block formats on the device: geometry, 32-element unit decoders (embed) and unit dot
// products against the paired activation (gemv). Every weight type is read in units of 32
// elements: a Q8_0-family block, half a Q2_0 block, one sub-block of a 256-element K- or
// I-quant block, or 32 BF16 values. Float operations follow ggml's dequantizers exactly
// (strata_engine::kernels::embed::dequant_block), so decoded values are bit-exact.
//
// Needs the lookup tables (iq3s_grid, iq3xxs_grid, ksigns_iq2xs, kvalues_iq4nl,
// kvalues_iq4nl_w) that strata-cuda generates from strata_quant::grids.

// ggml type ids.
#define T_F32 0
#define T_Q4_0 2
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ3_XXS 18
#define T_IQ4_NL 20
#define T_IQ3_S 21
#define T_IQ4_XS 23
#define T_BF16 30
#define T_Q2_0 42

template <int T> struct Fmt;
template <> struct Fmt<T_F32> { static constexpr int QK = 32, TS = 128; };  // as 32-value units
template <> struct Fmt<T_BF16> { static constexpr int QK = 32, TS = 64; };  // as 32-value units
template <> struct Fmt<T_Q8_0> { static constexpr int QK = 32, TS = 34; };
template <> struct Fmt<T_Q4_0> { static constexpr int QK = 32, TS = 18; };
template <> struct Fmt<T_Q5_0> { static constexpr int QK = 32, TS = 22; };
template <> struct Fmt<T_IQ4_NL> { static constexpr int QK = 32, TS = 18; };
template <> struct Fmt<T_Q2_0> { static constexpr int QK = 64, TS = 18; };
template <> struct Fmt<T_IQ4_XS> { static constexpr int QK = 256, TS = 136; };
template <> struct Fmt<T_IQ3_S> { static constexpr int QK = 256, TS = 110; };
template <> struct Fmt<T_IQ3_XXS> { static constexpr int QK = 256, TS = 98; };
template <> struct Fmt<T_Q3_K> { static constexpr int QK = 256, TS = 110; };
template <> struct Fmt<T_Q4_K> { static constexpr int QK = 256, TS = 144; };
template <> struct Fmt<T_Q5_K> { static constexpr int QK = 256, TS = 176; };
template <> struct Fmt<T_Q6_K> { static constexpr int QK = 256, TS = 210; };

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ __forceinline__ int scale_q3_k(int j, const u8* s) {
    const int lo = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
    const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Eight grid magnitudes (two u32 of 4 bytes) with their 8 sign bits, to float: db * (+-m).
__device__ __forceinline__ void grid_pair_to_float(u32 g1, u32 g2, u32 signs, float db, float* v) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int m1 = (g1 >> (8 * j)) & 0xFF, m2 = (g2 >> (8 * j)) & 0xFF;
        v[j] = db * (float)((signs >> j) & 1 ? -m1 : m1);
        v[4 + j] = db * (float)((signs >> (4 + j)) & 1 ? -m2 : m2);
    }
}

// Decodes unit s of block b (32 values).
template <int T>
__device__ __forceinline__ void decode_unit(const u8* b, int s, float* v) {
    if (T == T_BF16) {
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = bf16_to_f32(ld16(b + 2 * j));
    } else if (T == T_Q8_0) {
        const float d = ldf16(b);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = (float)(i8)b[2 + j] * d;
    } else if (T == T_Q4_0) {
        const float d = ldf16(b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = (float)((b[2 + j] & 0xF) - 8) * d;
            v[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
        }
    } else if (T == T_Q5_0) {
        const float d = ldf16(b);
        const u32 qh = ld32a2(b + 2);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int h0 = ((qh >> j) & 1) << 4, h1 = ((qh >> (j + 16)) & 1) << 4;
            v[j] = (float)(((b[6 + j] & 0xF) | h0) - 16) * d;
            v[j + 16] = (float)(((b[6 + j] >> 4) | h1) - 16) * d;
        }
    } else if (T == T_IQ4_NL) {
        const float d = ldf16(b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = d * (float)kvalues_iq4nl[b[2 + j] & 0xF];
            v[j + 16] = d * (float)kvalues_iq4nl[b[2 + j] >> 4];
        }
    } else if (T == T_Q2_0) {
        const float d = ldf16(b);
        const u8* q = b + 2 + 8 * s;
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = (float)(((q[j >> 2] >> (2 * (j & 3))) & 3) - 1) * d;
    } else if (T == T_IQ4_XS) {
        const float d = ldf16(b);
        const int lo = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 0xF;
        const int ls = (lo | (((ld16(b + 2) >> (2 * s)) & 3) << 4)) - 32;
        const float dl = d * (float)ls;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = b[8 + 16 * s + j];
            v[j] = dl * (float)kvalues_iq4nl[q & 0xF];
            v[j + 16] = dl * (float)kvalues_iq4nl[q >> 4];
        }
    } else if (T == T_IQ3_S) {
        const float d = ldf16(b);
        const int sc = (b[106 + (s >> 1)] >> (4 * (s & 1))) & 0xF;
        const float db = d * (float)(1 + 2 * sc);
        const int h = b[66 + s];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int i1 = b[2 + 8 * s + 2 * l] | ((h << (8 - 2 * l)) & 256);
            const int i2 = b[2 + 8 * s + 2 * l + 1] | ((h << (7 - 2 * l)) & 256);
            grid_pair_to_float(iq3s_grid[i1], iq3s_grid[i2], b[74 + 4 * s + l], db, v + 8 * l);
        }
    } else if (T == T_IQ3_XXS) {
        const float d = ldf16(b);
        const u32 aux = ld32a2(b + 66 + 4 * s);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 signs = ksigns_iq2xs[(aux >> (7 * l)) & 127];
            grid_pair_to_float(iq3xxs_grid[b[2 + 8 * s + 2 * l]], iq3xxs_grid[b[2 + 8 * s + 2 * l + 1]],
                               signs, db, v + 8 * l);
        }
    } else if (T == T_Q3_K) {
        const float d = ldf16(b + 108);
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int sg = 2 * s + g;
            const float dl = d * (float)scale_q3_k(sg, b + 96);
            const int half = sg >> 3, j = (sg >> 1) & 3, hh = sg & 1;
            const int bit = 1 << (4 * half + j);
#pragma unroll
            for (int l = 0; l < 16; ++l) {
                const int q = b[32 + 32 * half + 16 * hh + l];
                const int hm = b[16 * hh + l];
                const int val = ((q >> (2 * j)) & 3) - ((hm & bit) ? 0 : 4);
                v[16 * g + l] = dl * (float)val;
            }
        }
    } else if (T == T_Q4_K || T == T_Q5_K) {
        const float d = ldf16(b), dmin = ldf16(b + 2);
        int sc, m;
        scale_min_k4(s, b + 4, sc, m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const u8* q = b + (T == T_Q5_K ? 48 : 16) + 32 * (s >> 1);
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            int x = (q[l] >> (4 * (s & 1))) & 0xF;
            if (T == T_Q5_K) x |= ((b[16 + l] >> s) & 1) << 4;
            v[l] = dl * (float)x - ml;
        }
    } else if (T == T_Q6_K) {
        const float d = ldf16(b + 208);
        const int half = s >> 2, g = s & 3;
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int ql = b[64 * half + 32 * (g & 1) + l];
            const int lo = g < 2 ? (ql & 0xF) : (ql >> 4);
            const int hi = (b[128 + 32 * half + l] >> (2 * g)) & 3;
            const int sc = (i8)b[192 + 2 * s + (l >> 4)];
            v[l] = d * (float)sc * (float)((lo | (hi << 4)) - 32);
        }
    }
}

// The 16 IQ4_NL values for four nibble indices packed in bytes of `q` (one per byte, 0..15).
__device__ __forceinline__ int iq4_lookup4(u32 q, u32 k0, u32 k1, u32 k2, u32 k3) {
    const u32 sel = (q & 0xFu) | ((q >> 4) & 0xF0u) | ((q >> 8) & 0xF00u) | ((q >> 12) & 0xF000u);
    const u32 s7 = sel & 0x7777u;
    const u32 lo = __byte_perm(k0, k1, s7);
    const u32 hi = __byte_perm(k2, k3, s7);
    const u32 pick = 0x3210u + (((sel >> 3) & 0x1111u) << 2);
    return (int)__byte_perm(lo, hi, pick);
}

// The IQ4_NL values of the four nibbles in the low 16 bits of `q`, in nibble order (no
// compaction: the nibbles are the byte_perm selectors themselves).
__device__ __forceinline__ int iq4_lookup4n(u32 q, u32 k0, u32 k1, u32 k2, u32 k3) {
    const u32 s7 = q & 0x7777u;
    const u32 lo = __byte_perm(k0, k1, s7);
    const u32 hi = __byte_perm(k2, k3, s7);
    return (int)__byte_perm(lo, hi, 0x3210u | ((q >> 1) & 0x4444u));
}

// IQ4_XS's activation words in decode_for_dot's order: from the unit's natural words x_k
// (elements 4k..4k+3) and x_{k+4}, the pair (4k, 4k+16, 4k+1, 4k+17), (4k+2, 4k+18, 4k+3,
// 4k+19).
__device__ __forceinline__ void iq4xs_act_pair(u32 xk, u32 xk4, u32& a, u32& b) {
    a = __byte_perm(xk, xk4, 0x5140u);
    b = __byte_perm(xk, xk4, 0x7362u);
}

// Lookup tables a kernel reads (the global ones, or copies it staged in shared memory).
struct Tables {
    const u32* g3s;
    const u32* g3xxs;
    const u8* ks;
};

__device__ __forceinline__ Tables global_tables() { return Tables{iq3s_grid, iq3xxs_grid, ksigns_iq2xs}; }

// A weight unit decoded for integer dot products: eight words of four signed 8-bit weights in
// the activation's word order, two integer scales and two float factors (their meaning is
// per type, see dot_decoded). Decoding depends only on the weights, so a kernel with several
// activation rows decodes a unit once.
struct DecUnit {
    int w[8];
    int s0, s1;
    float f0, f1;
};

// A 32-bit word of a weight block at a 4-byte offset within it: one load where the format's
// blocks keep 4-byte alignment (TS a multiple of 4: Q4_K, Q5_K, IQ4_XS; every weight buffer and
// staged row starts 16-byte aligned and its blocks lie TS apart), else two 16-bit loads.
template <int T>
__device__ __forceinline__ u32 ldw(const u8* p) {
    if constexpr (Fmt<T>::TS % 4 == 0) return *(const u32*)p;
    else return ld32a2(p);
}

// Eight consecutive 32-bit words at `p`, 2-byte aligned (a Q3_K or Q6_K block's field): nine
// aligned words around them and a funnel shift each, instead of sixteen 16-bit loads. The
// aligned words span from 2 bytes before the field (only when it is not 4-byte aligned: then it
// is not the start of a row, which is) to 2 bytes past it (still inside the block: the fields
// read this way end at least 4 bytes before their block's end). The ninth word is loaded even
// when `p` is aligned (branch-free).
__device__ __forceinline__ void ld_words8(const u8* p, u32 (&w)[8]) {
    const u32 mis = (u32)(size_t)p & 2u;
    const u32* a = (const u32*)(p - mis);  // pointer arithmetic keeps the address space
    const u32 sh = mis * 8u;
    u32 v[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) v[i] = a[i];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = __funnelshift_r(v[k], v[k + 1], sh);
}

// WIDE (the row-parallel GEMV, whose rows are staged in shared memory and which has registers
// to spare): the 2-byte-aligned formats' fields read by ld_words8. The same words, so the same
// unit.
template <int T, bool WIDE = false>
__device__ __forceinline__ DecUnit decode_for_dot(const u8* w, int u, Tables tb) {
    constexpr int QK = Fmt<T>::QK, TS = Fmt<T>::TS, UPB = QK / 32;
    const u8* b = w + (size_t)(u / UPB) * TS;
    const int s = u % UPB;
    DecUnit d;
    d.s0 = d.s1 = 0;
    d.f0 = d.f1 = 0.f;
    if (T == T_Q8_0) {
#pragma unroll
        for (int k = 0; k < 8; ++k) d.w[k] = (int)ldw<T>(b + 2 + 4 * k);
        d.f0 = ldf16(b);
    } else if (T == T_Q4_0) {
        // Elements j and j + 16 are the low and high nibbles of qs[j], minus 8.
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 q = ldw<T>(b + 2 + 4 * (k & 3));
            d.w[k] = (int)__vsub4((k < 4 ? q : q >> 4) & 0x0F0F0F0Fu, 0x08080808u);
        }
        d.f0 = ldf16(b);
    } else if (T == T_Q5_0) {
        // As Q4_0 with a fifth bit from qh (bit j for element j), minus 16.
        const u32 qh = ldw<T>(b + 2);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 q = ldw<T>(b + 6 + 4 * (k & 3));
            const u32 hb = (qh >> (4 * k)) & 0xFu;
            const u32 hi = ((hb & 1u) | (hb & 2u) << 7 | (hb & 4u) << 14 | (hb & 8u) << 21) << 4;
            d.w[k] = (int)__vsub4(((k < 4 ? q : q >> 4) & 0x0F0F0F0Fu) | hi, 0x10101010u);
        }
        d.f0 = ldf16(b);
    } else if (T == T_IQ4_NL) {
        const u32 k0 = kvalues_iq4nl_w[0], k1 = kvalues_iq4nl_w[1], k2 = kvalues_iq4nl_w[2], k3 = kvalues_iq4nl_w[3];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 q = ldw<T>(b + 2 + 4 * k);
            d.w[k] = iq4_lookup4(q & 0x0F0F0F0Fu, k0, k1, k2, k3);
            d.w[k + 4] = iq4_lookup4((q >> 4) & 0x0F0F0F0Fu, k0, k1, k2, k3);
        }
        d.f0 = ldf16(b);
    } else if (T == T_Q2_0) {
        // Codes 0..3 as bytes; the -1 offset is applied through the activation sums.
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 c = b[2 + 8 * s + k];
            d.w[k] = (int)((c & 3u) | ((c >> 2) & 3u) << 8 | ((c >> 4) & 3u) << 16 | ((c >> 6) & 3u) << 24);
        }
        d.f0 = ldf16(b);
    } else if (T == T_Q4_K || T == T_Q5_K) {
        scale_min_k4(s, b + 4, d.s0, d.s1);
        d.f0 = ldf16(b);
        d.f1 = ldf16(b + 2);
        const u8* q = b + (T == T_Q5_K ? 48 : 16) + 32 * (s >> 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            u32 v = (ldw<T>(q + 4 * k) >> (4 * (s & 1))) & 0x0F0F0F0Fu;
            if (T == T_Q5_K) v |= ((ldw<T>(b + 16 + 4 * k) >> s) & 0x01010101u) << 4;
            d.w[k] = (int)v;
        }
    } else if (T == T_Q3_K) {
        // Unit s = groups 2s, 2s+1 of 16; element 4k + j (word k, byte j): 2 bits at 2(s&3)
        // of qs word k (the 32 bytes at 32 + 32(s>>2)), plus 4 if bit s of hmask word k (the
        // block's first 32 bytes): 0..7 as bytes. The format's −4 goes through the group sums
        // (dot_decoded: Σ(q − 4)·x = Σq·x − 4·Σx, the same integer; the MMQ staging subtracts
        // it from the weights instead). The two branches below differ only in their loads; one
        // loop over loaded arrays for both keeps a stack frame in the MMQ tiles (nvrtc_compile).
        if constexpr (WIDE) {
            u32 qw[8], hw[8];
            ld_words8(b + 32 + 32 * (s >> 2), qw);
            ld_words8(b, hw);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                d.w[k] = (int)(((qw[k] >> (2 * (s & 3))) & 0x03030303u) | (((hw[k] >> s) & 0x01010101u) << 2));
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const u32 qw = ldw<T>(b + 32 + 32 * (s >> 2) + 4 * k);
                const u32 hw = ldw<T>(b + 4 * k);
                d.w[k] = (int)(((qw >> (2 * (s & 3))) & 0x03030303u) | (((hw >> s) & 0x01010101u) << 2));
            }
        }
        d.s0 = scale_q3_k(2 * s, b + 96);
        d.s1 = scale_q3_k(2 * s + 1, b + 96);
        d.f0 = ldf16(b + 108);
    } else if (T == T_Q6_K) {
        const int half = s >> 2, g = s & 3;
        const u8* ql = b + 64 * half + 32 * (g & 1);
        const u8* qh = b + 128 + 32 * half;
        if constexpr (WIDE) {
            u32 lw[8], hw[8];
            ld_words8(ql, lw);
            ld_words8(qh, hw);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                d.w[k] = (int)(((lw[k] >> (g < 2 ? 0 : 4)) & 0x0F0F0F0Fu) | (((hw[k] >> (2 * g)) & 0x03030303u) << 4));
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const u32 lo = (ldw<T>(ql + 4 * k) >> (g < 2 ? 0 : 4)) & 0x0F0F0F0Fu;
                const u32 hi = ((ldw<T>(qh + 4 * k) >> (2 * g)) & 0x03030303u) << 4;
                d.w[k] = (int)(lo | hi);  // 0..63; the -32 goes through the group sums
            }
        }
        d.s0 = (i8)b[192 + 2 * s];
        d.s1 = (i8)b[193 + 2 * s];
        d.f0 = ldf16(b + 208);
    } else if (T == T_IQ4_XS) {
        const int lo = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 0xF;
        d.s0 = (lo | (((ld16(b + 2) >> (2 * s)) & 3) << 4)) - 32;
        d.f0 = ldf16(b);
        const u32 k0 = kvalues_iq4nl_w[0], k1 = kvalues_iq4nl_w[1], k2 = kvalues_iq4nl_w[2], k3 = kvalues_iq4nl_w[3];
        // Code word k (bytes 4k..4k+3: element 4k + j in byte j's low nibble, 4k + 16 + j in
        // its high one) looked up in its own nibble order: weight words 2k, 2k + 1 hold
        // elements (4k, 4k+16, 4k+1, 4k+17) and (4k+2, 4k+18, 4k+3, 4k+19); dot_decoded and
        // the MMQ staging lay the activation out the same way (iq4xs_act_pair). The unit has
        // one scale, so its integer dot is the same sum in another order.
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 q = ldw<T>(b + 8 + 16 * s + 4 * k);
            d.w[2 * k] = iq4_lookup4n(q, k0, k1, k2, k3);
            d.w[2 * k + 1] = iq4_lookup4n(q >> 16, k0, k1, k2, k3);
        }
    } else if (T == T_IQ3_S) {
        const int sc = (b[106 + (s >> 1)] >> (4 * (s & 1))) & 0xF;
        d.s0 = 1 + 2 * sc;
        d.f0 = ldf16(b);
        const int h = b[66 + s];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int i1 = b[2 + 8 * s + 2 * l] | ((h << (8 - 2 * l)) & 256);
            const int i2 = b[2 + 8 * s + 2 * l + 1] | ((h << (7 - 2 * l)) & 256);
            const u32 sg = b[74 + 4 * s + l];
            d.w[2 * l] = apply_signs(tb.g3s[i1], spread_signs4(sg));
            d.w[2 * l + 1] = apply_signs(tb.g3s[i2], spread_signs4(sg >> 4));
        }
    } else if (T == T_IQ3_XXS) {
        const u32 aux = ldw<T>(b + 66 + 4 * s);
        d.s0 = 2 * (int)(aux >> 28) + 1;
        d.f0 = ldf16(b);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 sg = tb.ks[(aux >> (7 * l)) & 127];
            d.w[2 * l] = apply_signs(tb.g3xxs[b[2 + 8 * s + 2 * l]], spread_signs4(sg));
            d.w[2 * l + 1] = apply_signs(tb.g3xxs[b[2 + 8 * s + 2 * l + 1]], spread_signs4(sg >> 4));
        }
    }
    return d;
}

// The f32 contribution of a decoded unit against unit u of activation row `x` (before the
// type's final factor, see dot_post).
template <int T>
__device__ __forceinline__ float dot_decoded(const DecUnit& d, const u8* x, int u) {
    if (T == T_Q8_0 || T == T_Q2_0 || T == T_Q4_0 || T == T_Q5_0 || T == T_IQ4_NL) {
        const u8* xb = x + 34 * (size_t)u;  // Q8_0 activation block u
        const float dx = ldf16(xb);
        int isum = 0, sx = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int xw = (int)ld32a2(xb + 2 + 4 * k);
            isum = dp4a(d.w[k], xw, isum);
            if (T == T_Q2_0) sx = dp4a(0x01010101, xw, sx);
        }
        if (T == T_Q2_0) isum -= sx;
        return (d.f0 * dx) * (float)isum;
    } else {
        const int s = u & 7;
        const u8* xb = x + 292 * (size_t)(u >> 3);  // Q8_K activation block
        const float dx = *(const float*)xb;
        const u32* xq = (const u32*)(xb + 4 + 32 * s);
        const i16* bs = (const i16*)(xb + 260 + 4 * s);
        if (T == T_Q3_K) {
            int ia = 0, ib = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) ia = dp4a(d.w[k], (int)xq[k], ia);
#pragma unroll
            for (int k = 4; k < 8; ++k) ib = dp4a(d.w[k], (int)xq[k], ib);
            const u32 bw = *(const u32*)bs;  // the two groups' sums (4-byte aligned)
            ia -= 4 * (int)(i16)(bw & 0xffffu);
            ib -= 4 * ((int)bw >> 16);
            return (d.f0 * dx) * (float)(d.s0 * ia + d.s1 * ib);
        }
        if (T == T_Q6_K) {
            int ia = 0, ib = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) ia = dp4a(d.w[k], (int)xq[k], ia);
#pragma unroll
            for (int k = 4; k < 8; ++k) ib = dp4a(d.w[k], (int)xq[k], ib);
            ia -= 32 * (int)bs[0];
            ib -= 32 * (int)bs[1];
            return (d.f0 * dx) * (float)(d.s0 * ia + d.s1 * ib);
        }
        int isum = 0;
        if (T == T_IQ4_XS) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                u32 a, c;
                iq4xs_act_pair(xq[k], xq[k + 4], a, c);
                isum = dp4a(d.w[2 * k], (int)a, isum);
                isum = dp4a(d.w[2 * k + 1], (int)c, isum);
            }
            return (d.f0 * dx) * (float)(d.s0 * isum);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) isum = dp4a(d.w[k], (int)xq[k], isum);
        if (T == T_Q4_K || T == T_Q5_K) {
            const int bsum = (int)bs[0] + (int)bs[1];
            return (d.f0 * dx) * (float)(d.s0 * isum) - (d.f1 * dx) * (float)(d.s1 * bsum);
        }
        return (d.f0 * dx) * (float)(d.s0 * isum);  // IQ4_XS, IQ3_S, IQ3_XXS
    }
}

// Integer dot of unit u of weight row `w` with the paired activation row `x`: the unit's f32
// contribution (before the type's final factor, see dot_post).
template <int T>
__device__ __forceinline__ float unit_dot(const u8* w, const u8* x, int u, Tables tb) {
    if (T == T_F32) {
        const float* b = (const float*)(w + 128 * (size_t)u);
        const float* xb = (const float*)(x + 128 * (size_t)u);
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) a = fmaf(b[j], xb[j], a);
        return a;
    } else if (T == T_BF16) {
        const u8* b = w + 64 * (size_t)u;
        const u8* xb = x + 64 * (size_t)u;
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) a = fmaf(bf16_to_f32(ld16(b + 2 * j)), bf16_to_f32(ld16(xb + 2 * j)), a);
        return a;
    } else {
        return dot_decoded<T>(decode_for_dot<T>(w, u, tb), x, u);
    }
}

// The factor applied to a finished row sum (IQ3_XXS counts its scale in quarters).
template <int T>
__device__ __forceinline__ float dot_post(float s) {
    return T == T_IQ3_XXS ? 0.25f * s : s;
}
