// embed: rows of token ids dequantized from a table in any of the 13 report formats
// (strata_engine::kernels::embed has the contract; the values are bit-exact).
//
// embed_base: one thread per element, each decoding its own 32-value unit and keeping one
//             value (the scale fields are decoded 32 times over), runtime format switch.
// embed_opt_*: one thread per unit, the format a template constant, 16-byte stores, and the
//             row length a constant (2560: the model's hidden width).

template <int T>
__device__ __forceinline__ float elem_generic(const u8* row, int i) {
    constexpr int QK = Fmt<T>::QK, TS = Fmt<T>::TS;
    const int u = i / 32;
    float v[32];
    decode_unit<T>(row + (size_t)(u / (QK / 32)) * TS, u % (QK / 32), v);
    float r = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) r = (j == (i & 31)) ? v[j] : r;
    return r;
}

__device__ float elem_any(int type, const u8* row, int i) {
    switch (type) {
        case T_BF16: return elem_generic<T_BF16>(row, i);
        case T_Q8_0: return elem_generic<T_Q8_0>(row, i);
        case T_Q4_0: return elem_generic<T_Q4_0>(row, i);
        case T_Q5_0: return elem_generic<T_Q5_0>(row, i);
        case T_IQ4_NL: return elem_generic<T_IQ4_NL>(row, i);
        case T_Q2_0: return elem_generic<T_Q2_0>(row, i);
        case T_IQ4_XS: return elem_generic<T_IQ4_XS>(row, i);
        case T_IQ3_S: return elem_generic<T_IQ3_S>(row, i);
        case T_IQ3_XXS: return elem_generic<T_IQ3_XXS>(row, i);
        case T_Q3_K: return elem_generic<T_Q3_K>(row, i);
        case T_Q4_K: return elem_generic<T_Q4_K>(row, i);
        case T_Q5_K: return elem_generic<T_Q5_K>(row, i);
        case T_Q6_K: return elem_generic<T_Q6_K>(row, i);
        default: return __int_as_float(0x7fc00000);
    }
}

// An id outside the table (bad input that slipped past the host) yields a row of NaN rather
// than a read out of bounds.
extern "C" __global__ void __launch_bounds__(256)
embed_base(const u8* table, u32 n_rows, const u32* ids, float* out, int row_len, u64 row_bytes, int type) {
    grid_dep_sync();
    const u32 id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * row_len;
    if (id >= n_rows) {
        for (int i = threadIdx.x; i < row_len; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* row = table + (size_t)id * row_bytes;
    for (int i = threadIdx.x; i < row_len; i += blockDim.x) o[i] = elem_any(type, row, i);
}

template <int T, int N>
__device__ __forceinline__ void embed_opt(const u8* table, u32 n_rows, const u32* ids, float* out) {
    constexpr int QK = Fmt<T>::QK, TS = Fmt<T>::TS, UPB = QK / 32, U = N / 32;
    constexpr size_t RB = (size_t)(N / QK) * TS;
    const int u = threadIdx.x;
    if (u >= U) return;
    const u32 id = ids[blockIdx.x];
    float4* o = (float4*)(out + (size_t)blockIdx.x * N + 32 * u);
    if (id >= n_rows) {
        const float q = __int_as_float(0x7fc00000);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = make_float4(q, q, q, q);
        return;
    }
    const u8* row = table + (size_t)id * RB;
    float v[32];
    decode_unit<T>(row + (u / UPB) * TS, u % UPB, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

#define EMBED_OPT(T, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                          \
    embed_opt_2560_##NAME(const u8* table, u32 n_rows, const u32* ids, float* out) { grid_dep_sync();           \
        embed_opt<T, 2560>(table, n_rows, ids, out);                                           \
    }
EMBED_OPT(T_BF16, bf16)
EMBED_OPT(T_Q8_0, q8_0)
EMBED_OPT(T_Q4_0, q4_0)
EMBED_OPT(T_Q5_0, q5_0)
EMBED_OPT(T_IQ4_NL, iq4_nl)
EMBED_OPT(T_IQ4_XS, iq4_xs)
EMBED_OPT(T_Q2_0, q2_0)
EMBED_OPT(T_IQ3_S, iq3_s)
EMBED_OPT(T_Q3_K, q3_k)
EMBED_OPT(T_Q4_K, q4_k)
EMBED_OPT(T_Q5_K, q5_k)
EMBED_OPT(T_Q6_K, q6_k)
EMBED_OPT(T_IQ3_XXS, iq3_xxs)

// dequant_bf16_*: a whole weight matrix dequantized to BF16 (round to nearest even) for the
// fast prefill's tensor-core products (cuBLAS, docs/CUDA.md "Fast prefill"): one thread per
// 32-value unit, `units` a row, rows `row_bytes` apart; the values are decode_unit's, so each
// element is the CPU's dequantized value rounded once to BF16.
template <int T>
__device__ __forceinline__ void dequant_bf16(const u8* w, u16* out, u32 rows, u32 units, u64 row_bytes) {
    constexpr int QK = Fmt<T>::QK, TS = Fmt<T>::TS, UPB = QK / 32;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)rows * units) return;
    const u64 r = i / units;
    const u32 u = (u32)(i - r * units);
    float v[32];
    decode_unit<T>(w + r * row_bytes + (u64)(u / UPB) * TS, u % UPB, v);
    uint4* o = (uint4*)(out + i * 32);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            p[j] = (u32)f32_to_bf16(v[8 * k + 2 * j]) | ((u32)f32_to_bf16(v[8 * k + 2 * j + 1]) << 16);
        o[k] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

#define DEQUANT_BF16(T, NAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    dequant_bf16_##NAME(const u8* w, u16* out, u32 rows, u32 units, u64 row_bytes) {           \
        grid_dep_sync();                                                                       \
        dequant_bf16<T>(w, out, rows, units, row_bytes);                                       \
    }
DEQUANT_BF16(T_Q8_0, q8_0)
DEQUANT_BF16(T_Q4_0, q4_0)
DEQUANT_BF16(T_Q5_0, q5_0)
DEQUANT_BF16(T_IQ4_NL, iq4_nl)
DEQUANT_BF16(T_IQ4_XS, iq4_xs)
DEQUANT_BF16(T_Q2_0, q2_0)
DEQUANT_BF16(T_IQ3_S, iq3_s)
DEQUANT_BF16(T_Q3_K, q3_k)
DEQUANT_BF16(T_Q4_K, q4_k)
DEQUANT_BF16(T_Q5_K, q5_k)
DEQUANT_BF16(T_Q6_K, q6_k)
DEQUANT_BF16(T_IQ3_XXS, iq3_xxs)
