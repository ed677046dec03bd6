// route: the MoE router body (strata_engine::kernels::route has the contract): per token row,
// fp32 softmax over E expert logits, top-K by repeated argmax (ties to the lower expert id),
// the chosen probabilities renormalised. One warp per row; lane l holds experts l + 32j.
//
// route_base: runtime E and K; the chosen expert is masked with a run-time index into the
//             lane's register array (which sends the array to local memory) and every lane
//             rescans all of its values each round.
// route_opt_E_K: E and K constants; (value, index) as one 64-bit key, its warp max taken by
//             two redux.sync reductions instead of a 5-step shuffle butterfly; masking by
//             an unrolled select so the keys stay in registers; each lane caches its best
//             and rescans only when it lost it.

__device__ __forceinline__ void argmax_warp(float& bv, int& bi) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, s);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, s);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
}

__device__ __forceinline__ void renorm_store(const float* sv, int k, float* w) {
    float s = 0.f;
    for (int r = 0; r < k; ++r) s += sv[r];
    for (int r = 0; r < k; ++r) w[r] = sv[r] / s;
}

extern "C" __global__ void __launch_bounds__(32)
route_base(const float* logits, int* ids, float* wts, int E, int K) {
    grid_dep_sync();
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)blockIdx.x * E;
    // Lanes past E (E not a multiple of 32) hold -inf: exp gives +0, which changes no sum and
    // loses every tie to a real expert (lower ids win).
    const int per = (E + 31) / 32;
    float v[16];
    float m = NEG_INF;
    for (int j = 0; j < per; ++j) {
        v[j] = lane + 32 * j < E ? l[lane + 32 * j] : NEG_INF;
        m = fmaxf(m, v[j]);
    }
    m = warp_max(m);
    float s = 0.f;
    for (int j = 0; j < per; ++j) {
        v[j] = expf(v[j] - m);
        s += v[j];
    }
    s = warp_sum(s);
    for (int j = 0; j < per; ++j) v[j] = v[j] / s;
    float sv[16];
    for (int r = 0; r < K; ++r) {
        float bv = NEG_INF;
        int bi = 1 << 30;
        for (int j = 0; j < per; ++j)
            if (v[j] > bv) { bv = v[j]; bi = lane + 32 * j; }
        argmax_warp(bv, bi);
        if ((bi & 31) == lane) v[bi >> 5] = NEG_INF;
        sv[r] = bv;
        if (lane == 0) ids[(size_t)blockIdx.x * K + r] = bi;
    }
    if (lane == 0) renorm_store(sv, K, wts + (size_t)blockIdx.x * K);
}

// Probabilities are >= +0, so their bits order like unsigned integers: a 64-bit key
// (bits << 32 | ~index) orders by (value, lower index), one max per butterfly step; a taken
// expert's key is 0, below every live key.
__device__ __forceinline__ u64 route_key(float v, int idx) {
    return ((u64)__float_as_uint(v) << 32) | (u64)(u32)(~idx);
}

template <int E, int K>
__device__ __forceinline__ void route_opt(const float* logits, int* ids, float* wts) {
    constexpr int PER = E / 32;
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)blockIdx.x * E + lane;
    float v[PER];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = l[32 * j];
        m = fmaxf(m, v[j]);
    }
    // The max of floats as one integer reduction over an order-preserving map of the bits
    // (the sign of a zero maximum cannot change any v - m).
    const u32 mb = __float_as_uint(m);
    const u32 mo = __reduce_max_sync(FULL_MASK, (mb & 0x80000000u) ? ~mb : (mb | 0x80000000u));
    m = __uint_as_float((mo & 0x80000000u) ? (mo & 0x7fffffffu) : ~mo);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = expf(v[j] - m);
        s += v[j];
    }
    s = warp_sum(s);
    u64 key[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) key[j] = route_key(v[j] / s, lane + 32 * j);
    // The lane's own best, kept across rounds.
    u64 lb = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) lb = key[j] > lb ? key[j] : lb;
    u64 sel[K];
#pragma unroll
    for (int rk = 0; rk < K; ++rk) {
        // The 64-bit max as two 32-bit warp reductions (redux.sync): the value bits, then
        // the index bits among the lanes holding that value.
        const u32 hv = (u32)(lb >> 32);
        const u32 mv = __reduce_max_sync(FULL_MASK, hv);
        const u32 ml = __reduce_max_sync(FULL_MASK, hv == mv ? (u32)lb : 0u);
        const u64 b = ((u64)mv << 32) | ml;
        sel[rk] = b;
        if (b == lb) {
#pragma unroll
            for (int j = 0; j < PER; ++j) key[j] = key[j] == b ? 0ull : key[j];
            lb = 0;
#pragma unroll
            for (int j = 0; j < PER; ++j) lb = key[j] > lb ? key[j] : lb;
        }
    }
    if (lane == 0) {
        float sv[K];
        float sum = 0.f;
#pragma unroll
        for (int rk = 0; rk < K; ++rk) {
            sv[rk] = __uint_as_float((u32)(sel[rk] >> 32));
            sum += sv[rk];
        }
        int* io = ids + (size_t)blockIdx.x * K;
        float* wo = wts + (size_t)blockIdx.x * K;
#pragma unroll
        for (int rk = 0; rk < K; ++rk) {
            io[rk] = (int)(~(u32)sel[rk]);
            wo[rk] = sv[rk] / sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32) route_opt_512_10(const float* l, int* ids, float* w) {
    grid_dep_sync();
    route_opt<512, 10>(l, ids, w);
}
extern "C" __global__ void __launch_bounds__(32) route_opt_256_8(const float* l, int* ids, float* w) {
    grid_dep_sync();
    route_opt<256, 8>(l, ids, w);
}
