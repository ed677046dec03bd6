// gdn: the Gated DeltaNet token mixer's device side (cpu::conv1d_silu, cpu::gdn_step,
// ops::conv_row, ops::gdn_head): the causal depthwise conv with its fixed-capacity history and
// the recurrent step over 1..n rows in order (the exact mode: a prefill chunk through it gives
// bitwise the rows of single steps).
//
// Order: every sum the CPU takes sequentially is taken sequentially here too (the conv taps, the
// k·S and q·S columns, the l2 and output RMS sums), so the only differences from the CPU are the
// device's expf/log1pf (sigmoid, silu, softplus, the decay) against the host libm.
//
// Graph replay: the state and history are fixed-size device buffers updated in place; the row
// count is the step's shape.

__device__ __forceinline__ float g_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float g_silu(float x) { return x * g_sigmoid(x); }
__device__ __forceinline__ float g_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One thread per channel: rows t = 0..n of `x` (`c` channels) after the `(k-1)·dil` history
// rows; kernel `w` is [c][k] (tap k-1 on the current row). The history then becomes the last
// (k-1)·dil rows of [history; x], updated in place in ascending order (row i takes row i + n,
// which has not been overwritten yet).
extern "C" __global__ void __launch_bounds__(256)
conv1d_silu_f32(const float* x, const float* w, float* hist, float* out, int n, int c, int k, int dil) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    const int hr = (k - 1) * dil;
    for (int t = 0; t < n; ++t) {
        float acc = 0.f;
        for (int tap = 0; tap < k; ++tap) {
            const int idx = hr + t - (k - 1 - tap) * dil;  // row of [history; x]
            const float v = idx < hr ? hist[(size_t)idx * c + ch] : x[(size_t)(idx - hr) * c + ch];
            acc += w[(size_t)ch * k + tap] * v;
        }
        out[(size_t)t * c + ch] = g_silu(acc);
    }
    for (int i = 0; i < hr; ++i) {
        const int j = n + i;
        hist[(size_t)i * c + ch] = j < hr ? hist[(size_t)j * c + ch] : x[(size_t)(j - hr) * c + ch];
    }
}

// The recurrent step. Block h = value head (DV threads, one state column each, kept in
// registers across the rows); key head g = h % nk (GGUF's tiled order). Per row t:
//   q, k l2-normalised (sum of squares in order, eps 1e-6), q scaled by 1/sqrt(DK);
//   β = σ(b[t][h]); decay = exp(a_h · softplus(α[t][h] + dt_h));
//   S *= decay; ks_j = Σ_i k_i S_ij; δ_j = β(v_j − ks_j); S_ij += k_i δ_j; o_j = Σ_i q_i S_ij;
//   out_j = ((o_j · rms(o)) · w_j) · σ(z_j).
// `state` is [nv][DK·DV] (row i of a head's matrix holds S_i·); `qkv` rows are [q | k | v].
template <int DK, int DV>
__device__ __forceinline__ void gdn_step_t(const float* qkv, const float* z, const float* alpha, const float* beta,
                                           const float* ssm_a, const float* dt_bias, const float* norm, float* state,
                                           float* out, int n, int nk, int nv, float eps) {
    __shared__ float qs[DK], ks[DK], os[DV];
    __shared__ float sc[3];
    const int h = blockIdx.x, j = threadIdx.x, g = h % nk;
    const int conv_dim = 2 * nk * DK + nv * DV;
    float* sp = state + (size_t)h * DK * DV + j;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = sp[(size_t)i * DV];
    const float qscale = 1.0f / sqrtf((float)DK);
    for (int t = 0; t < n; ++t) {
        const float* row = qkv + (size_t)t * conv_dim;
        for (int i = j; i < DK; i += DV) {
            qs[i] = row[g * DK + i];
            ks[i] = row[nk * DK + g * DK + i];
        }
        __syncthreads();
        if (j < 2) {
            const float* v = j == 0 ? qs : ks;
            float ss = -0.0f;  // Iterator::sum's neutral element
            for (int i = 0; i < DK; ++i) ss += v[i] * v[i];
            sc[j] = 1.0f / sqrtf(ss + 1e-6f);
        }
        __syncthreads();
        for (int i = j; i < DK; i += DV) {
            qs[i] = (qs[i] * sc[0]) * qscale;
            ks[i] = ks[i] * sc[1];
        }
        __syncthreads();
        const float bt = g_sigmoid(beta[(size_t)t * nv + h]);
        const float decay = expf(ssm_a[h] * g_softplus(alpha[(size_t)t * nv + h] + dt_bias[h]));
        const float vj = row[2 * nk * DK + h * DV + j];
        float kS = 0.f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            s[i] *= decay;
            kS += ks[i] * s[i];
        }
        const float delta = bt * (vj - kS);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            s[i] += ks[i] * delta;
            o += qs[i] * s[i];
        }
        os[j] = o;
        __syncthreads();
        if (j == 0) {
            float ss = -0.0f;
            for (int i = 0; i < DV; ++i) ss += os[i] * os[i];
            sc[2] = 1.0f / sqrtf(ss / (float)DV + eps);
        }
        __syncthreads();
        const float zj = z[(size_t)t * nv * DV + h * DV + j];
        out[(size_t)t * nv * DV + h * DV + j] = ((o * sc[2]) * norm[j]) * g_sigmoid(zj);
        __syncthreads();  // qs/ks/os are rewritten by the next row
    }
#pragma unroll
    for (int i = 0; i < DK; ++i) sp[(size_t)i * DV] = s[i];
}

#define GDN_STEP(DK, DV)                                                                               \
    extern "C" __global__ void __launch_bounds__(DV)                                                   \
    gdn_step_##DK##_##DV(const float* qkv, const float* z, const float* alpha, const float* beta,      \
                         const float* ssm_a, const float* dt_bias, const float* norm, float* state,    \
                         float* out, int n, int nk, int nv, float eps) {                               \
        gdn_step_t<DK, DV>(qkv, z, alpha, beta, ssm_a, dt_bias, norm, state, out, n, nk, nv, eps);     \
    }
GDN_STEP(128, 128)
GDN_STEP(64, 64)
GDN_STEP(32, 32)
