// route: the MoE router body (strata_engine::kernels::route has the contract): per token row,
// fp32 softmax over E expert logits, top-K by repeated argmax (ties to the lower expert id),
// the chosen probabilities renormalised. One warp per row; lane l holds experts l + 32j.
//
// route_base: runtime E and K; the chosen expert is masked with a run-time index into the
//             lane's register array (which sends the array to local memory) and every lane
//             rescans all of its values each round.
// route_opt_E_K: E and K constants; masking by an unrolled select so the values stay in
//             registers, and each lane caches its best and rescans only when it lost it.

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
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)blockIdx.x * E;
    const int per = E / 32;
    float v[16];
    float m = NEG_INF;
    for (int j = 0; j < per; ++j) {
        v[j] = l[lane + 32 * j];
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
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = expf(v[j] - m);
        s += v[j];
    }
    s = warp_sum(s);
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = v[j] / s;
    // The lane's own best, kept across rounds.
    float lb = NEG_INF;
    int li = 1 << 30;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (v[j] > lb) { lb = v[j]; li = lane + 32 * j; }
    float sv[K];
    int si[K];
#pragma unroll
    for (int r = 0; r < K; ++r) {
        float bv = lb;
        int bi = li;
        argmax_warp(bv, bi);
        sv[r] = bv;
        si[r] = bi;
        if (bi == li) {
#pragma unroll
            for (int j = 0; j < PER; ++j) v[j] = (bi == lane + 32 * j) ? NEG_INF : v[j];
            lb = NEG_INF;
            li = 1 << 30;
#pragma unroll
            for (int j = 0; j < PER; ++j)
                if (v[j] > lb) { lb = v[j]; li = lane + 32 * j; }
        }
    }
    if (lane == 0) {
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < K; ++r) sum += sv[r];
        int* io = ids + (size_t)blockIdx.x * K;
        float* wo = wts + (size_t)blockIdx.x * K;
#pragma unroll
        for (int r = 0; r < K; ++r) {
            io[r] = si[r];
            wo[r] = sv[r] / sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32) route_opt_512_10(const float* l, int* ids, float* w) {
    route_opt<512, 10>(l, ids, w);
}
extern "C" __global__ void __launch_bounds__(32) route_opt_256_8(const float* l, int* ids, float* w) {
    route_opt<256, 8>(l, ids, w);
}
