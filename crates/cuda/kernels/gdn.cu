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
    grid_dep_sync();
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

// conv1d_silu_f32 for a prefill's rows: one thread per (channel, CONV_RT consecutive rows)
// instead of one per channel over every row (10240 channels = 40 blocks, each walking 512 rows), the same
// sum per output (taps in order from +0, then silu); conv1d_hist_f32 then moves the history as
// conv1d_silu_f32's tail does (a second launch: the rows read the old history).
#define CONV_RT 8
extern "C" __global__ void __launch_bounds__(256)
conv1d_rows_f32(const float* x, const float* w, const float* hist, float* out, int n, int c, int k, int dil) {
    grid_dep_sync();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    const int hr = (k - 1) * dil;
    const int t1 = min(n, (int)(blockIdx.y + 1) * CONV_RT);
    for (int t = blockIdx.y * CONV_RT; t < t1; ++t) {
        float acc = 0.f;
        for (int tap = 0; tap < k; ++tap) {
            const int idx = hr + t - (k - 1 - tap) * dil;  // row of [history; x]
            const float v = idx < hr ? hist[(size_t)idx * c + ch] : x[(size_t)(idx - hr) * c + ch];
            acc += w[(size_t)ch * k + tap] * v;
        }
        out[(size_t)t * c + ch] = g_silu(acc);
    }
}

extern "C" __global__ void __launch_bounds__(256)
conv1d_hist_f32(const float* x, float* hist, int n, int c, int k, int dil) {
    grid_dep_sync();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    const int hr = (k - 1) * dil;
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
    // The state was written by this layer's previous step (or a restore), launches back: its
    // load overlaps the kernel before (the conv) instead of following it.
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = sp[(size_t)i * DV];
    grid_dep_sync();
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
                         float* out, int n, int nk, int nv, float eps) {                                \
        gdn_step_t<DK, DV>(qkv, z, alpha, beta, ssm_a, dt_bias, norm, state, out, n, nk, nv, eps);     \
    }
GDN_STEP(128, 128)
GDN_STEP(64, 64)
GDN_STEP(32, 32)
GDN_STEP(16, 16)

// ---- chunked form (prefill) ---------------------------------------------------------------------
// The same recurrence over chunks of C = 16 rows in the WY form: with G_t the cumulative log
// decay in the chunk (γ_t = exp(G_t)), S0 the state at the chunk's start and
//   u_t = β_t (v_t − γ_t k_t·S0 − Σ_{s<t} e^{G_t−G_s} (k_t·k_s) u_s)      (a triangular solve),
//   o_t = γ_t q_t·S0 + Σ_{s≤t} e^{G_t−G_s} (q_t·k_s) u_s,
//   S_C = γ_C S0 + Σ_s e^{G_C−G_s} k_s u_s^T,
// the syncs and serial sums come once a chunk instead of once a row. The q/k normalisation and
// the output norm and gate are the sequential kernel's, in its order; the decays are products
// of exponentials there and exponentials of sums here, and the sums are reassociated: within a
// stated bound of the sequential (exact) mode, not its bits. DK = DV = 128, 128 threads.
#define GC 16
extern "C" __global__ void __launch_bounds__(128)
gdn_chunk_128(const float* qkv, const float* z, const float* alpha, const float* beta, const float* ssm_a,
              const float* dt_bias, const float* norm, float* state, float* out, int n, int nk, int nv, float eps) {
    grid_dep_sync();
    constexpr int DK = 128, DV = 128;
    __shared__ float qs[GC][DK + 1], ks[GC][DK + 1], os[GC][DV];  // +1: the Gram loop reads rows
    __shared__ float kk[GC][GC + 1], qk[GC][GC + 1];
    __shared__ float G[GC], bt[GC], scq[GC], sck[GC], sco[GC];
    const int h = blockIdx.x, j = threadIdx.x, g = h % nk;
    const int conv_dim = 2 * nk * DK + nv * DV;
    float* sp = state + (size_t)h * DK * DV + j;
    float s[DK];
    // The state was written by this layer's previous step (or a restore), launches back: its
    // load overlaps the kernel before (the conv) instead of following it.
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = sp[(size_t)i * DV];
    grid_dep_sync();
    const float qscale = 1.0f / sqrtf((float)DK);
    for (int t0 = 0; t0 < n; t0 += GC) {
        const int cn = min(GC, n - t0);
        for (int t = 0; t < GC; ++t) {
            const float* row = qkv + (size_t)(t0 + t) * conv_dim;
            qs[t][j] = t < cn ? row[g * DK + j] : 0.f;
            ks[t][j] = t < cn ? row[nk * DK + g * DK + j] : 0.f;
        }
        __syncthreads();
        if (j < GC) {
            float a = -0.0f, b = -0.0f;
            for (int i = 0; i < DK; ++i) a += qs[j][i] * qs[j][i];
            for (int i = 0; i < DK; ++i) b += ks[j][i] * ks[j][i];
            scq[j] = 1.0f / sqrtf(a + 1e-6f);
            sck[j] = 1.0f / sqrtf(b + 1e-6f);
            if (j < cn) {
                bt[j] = g_sigmoid(beta[(size_t)(t0 + j) * nv + h]);
                G[j] = ssm_a[h] * g_softplus(alpha[(size_t)(t0 + j) * nv + h] + dt_bias[h]);
            } else {
                bt[j] = 0.f;
                G[j] = 0.f;
            }
        }
        __syncthreads();
        if (j == 0)
            for (int t = 1; t < GC; ++t) G[t] += G[t - 1];
        for (int t = 0; t < GC; ++t) {
            qs[t][j] = (qs[t][j] * scq[t]) * qscale;
            ks[t][j] = ks[t][j] * sck[t];
        }
        __syncthreads();
        // Decayed Gram matrices (each thread two of the 2·GC·GC entries).
        for (int e = j; e < 2 * GC * GC; e += 128) {
            const int which = e / (GC * GC), t = (e / GC) % GC, u = e % GC;
            const float* a = which ? qs[t] : ks[t];
            float acc = 0.f;
            for (int i = 0; i < DK; ++i) acc += a[i] * ks[u][i];
            const bool live = which ? (u <= t) : (u < t);
            const float d = live ? expf(G[t] - G[u]) : 0.f;
            if (which) qk[t][u] = d * acc;
            else kk[t][u] = d * acc;
        }
        __syncthreads();
        float uu[GC];
#pragma unroll
        for (int t = 0; t < GC; ++t) {
            float w = 0.f, qw = 0.f;
#pragma unroll
            for (int i = 0; i < DK; ++i) {
                w += ks[t][i] * s[i];
                qw += qs[t][i] * s[i];
            }
            const float gt = expf(G[t]);
            float acc = gt * w;
#pragma unroll
            for (int u = 0; u < t; ++u) acc += kk[t][u] * uu[u];
            const float vj = t < cn ? qkv[(size_t)(t0 + t) * conv_dim + 2 * nk * DK + h * DV + j] : 0.f;
            uu[t] = t < cn ? bt[t] * (vj - acc) : 0.f;
            float o = gt * qw;
#pragma unroll
            for (int u = 0; u <= t; ++u) o += qk[t][u] * uu[u];
            os[t][j] = o;
        }
        __syncthreads();
        if (j < cn) {
            float ss = -0.0f;
            for (int i = 0; i < DV; ++i) ss += os[j][i] * os[j][i];
            sco[j] = 1.0f / sqrtf(ss / (float)DV + eps);
        }
        __syncthreads();
        for (int t = 0; t < cn; ++t) {
            const size_t at = (size_t)(t0 + t) * nv * DV + h * DV + j;
            out[at] = ((os[t][j] * sco[t]) * norm[j]) * g_sigmoid(z[at]);
        }
        const float gl = G[cn - 1];
        const float gC = expf(gl);
        float ds[GC];
#pragma unroll
        for (int u = 0; u < GC; ++u) ds[u] = u < cn ? expf(gl - G[u]) * uu[u] : 0.f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            float acc = gC * s[i];
#pragma unroll
            for (int u = 0; u < GC; ++u) acc += ks[u][i] * ds[u];
            s[i] = acc;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < DK; ++i) sp[(size_t)i * DV] = s[i];
}

// ---- the recurrent step spread over columns (prefill; bitwise gdn_step_*) ---------------------------
// The state's columns evolve independently given q̂, k̂, β and the decay; only the output norm
// couples them. So: gdn_prep normalises q/k and computes β and the decay per (row, head) with
// gdn_step's expressions in its order; gdn_scan runs one warp per 32 columns of a head (no
// block syncs), each lane the fused kernel's column loop; gdn_out applies the output RMS norm
// (sequential sum) and the gate. Every value is bitwise the fused kernel's.

// Grid (n, nk), DK threads: qn/kn [n][nk][DK]; bd [n][nv][2] = (β, decay) from the g = 0 blocks.
extern "C" __global__ void __launch_bounds__(128)
gdn_prep(const float* qkv, const float* alpha, const float* beta, const float* ssm_a, const float* dt_bias, float* qn,
         float* kn, float* bd, int nk, int nv, int dk, int dv) {
    grid_dep_sync();
    __shared__ float qs[256], ks[256], sc[2];
    const int t = blockIdx.x, g = blockIdx.y, i = threadIdx.x;
    const int conv_dim = 2 * nk * dk + nv * dv;
    const float* row = qkv + (size_t)t * conv_dim;
    for (int e = i; e < dk; e += blockDim.x) {
        qs[e] = row[g * dk + e];
        ks[e] = row[nk * dk + g * dk + e];
    }
    __syncthreads();
    if (i < 2) {
        const float* v = i == 0 ? qs : ks;
        float ss = -0.0f;
        for (int e = 0; e < dk; ++e) ss += v[e] * v[e];
        sc[i] = 1.0f / sqrtf(ss + 1e-6f);
    }
    __syncthreads();
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int e = i; e < dk; e += blockDim.x) {
        qn[((size_t)t * nk + g) * dk + e] = (qs[e] * sc[0]) * qscale;
        kn[((size_t)t * nk + g) * dk + e] = ks[e] * sc[1];
    }
    if (g == 0)
        for (int h = i; h < nv; h += blockDim.x) {
            bd[((size_t)t * nv + h) * 2] = g_sigmoid(beta[(size_t)t * nv + h]);
            bd[((size_t)t * nv + h) * 2 + 1] = expf(ssm_a[h] * g_softplus(alpha[(size_t)t * nv + h] + dt_bias[h]));
        }
}

// Grid (nv, dv/32), 32 threads: lane = column j of head h; oraw [n][nv·dv] before the norm.
template <int DK>
__device__ __forceinline__ void gdn_scan_t(const float* qn, const float* kn, const float* bd, const float* qkv,
                                           float* state, float* oraw, int n, int nk, int nv, int dv) {
    const int h = blockIdx.x, j = blockIdx.y * 32 + threadIdx.x, g = h % nk;
    const int conv_dim = 2 * nk * DK + nv * dv;
    float* sp = state + (size_t)h * DK * dv + j;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = sp[(size_t)i * dv];
    for (int t = 0; t < n; ++t) {
        const float* kq = kn + ((size_t)t * nk + g) * DK;
        const float* qq = qn + ((size_t)t * nk + g) * DK;
        const float bt = bd[((size_t)t * nv + h) * 2], decay = bd[((size_t)t * nv + h) * 2 + 1];
        const float vj = qkv[(size_t)t * conv_dim + 2 * nk * DK + h * dv + j];
        float kS = 0.f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            s[i] *= decay;
            kS += kq[i] * s[i];
        }
        const float delta = bt * (vj - kS);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            s[i] += kq[i] * delta;
            o += qq[i] * s[i];
        }
        oraw[(size_t)t * nv * dv + h * dv + j] = o;
    }
#pragma unroll
    for (int i = 0; i < DK; ++i) sp[(size_t)i * dv] = s[i];
}

#define GDN_SCAN(DK)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32)                                                   \
    gdn_scan_##DK(const float* qn, const float* kn, const float* bd, const float* qkv, float* state,   \
                  float* oraw, int n, int nk, int nv, int dv) { grid_dep_sync();                                        \
        gdn_scan_t<DK>(qn, kn, bd, qkv, state, oraw, n, nk, nv, dv);                                   \
    }
GDN_SCAN(128)
GDN_SCAN(64)
GDN_SCAN(32)

// ---- the scan with its inputs staged (prefill; bitwise gdn_scan_* and gdn_step_*) ---------------
// gdn_scan_t reads each row's k̂ and q̂ from global memory inside its fully unrolled column loops
// (256 dependent-address loads a row, and at DK = 128 the state's 128 registers plus those
// loads spill), and takes the k·S sum of row t + 1 only after the q·S sum of row t. This one
// keeps the same per-element operations in the same order but (1) stages the rows' k̂, q̂, (β,
// decay) and each lane's v in a ring of shared memory, 2·GDN_RC rows, refilled GDN_RC rows at a
// time with cp.async while the previous chunk runs, read back as float4; (2) runs row t's
// update and q·S sum in one loop with row t + 1's decay and k·S sum: per element
// s += k_t·δ_t; o_t += q_t·s; s *= decay_{t+1}; kS_{t+1} += k_{t+1}·s — each element sees its
// operations in the sequential order and each sum runs over i in order from +0, so the two
// independent chains interleave without changing a bit.
#define GDN_RC 16

// Rows t0 .. t0 + GDN_RC (those below n) into their ring slots t % (2·GDN_RC), asynchronously.
template <int DK>
__device__ __forceinline__ void gdn_ring_stage(float4 (*kr)[DK / 4], float4 (*qr)[DK / 4], float (*vr)[32],
                                               float (*br)[2], const float* qn, const float* kn, const float* bd,
                                               const float* qkv, int t0, int n, int nk, int nv, int dv, int g,
                                               int h, int j) {
    constexpr int D4 = DK / 4, RING = 2 * GDN_RC;
    const int lane = threadIdx.x;
    const int conv_dim = 2 * nk * DK + nv * dv;
    for (int e = lane; e < GDN_RC * D4; e += 32) {
        const int u = e / D4, c = e % D4, t = t0 + u;
        if (t < n) {
            cp_async16(&kr[t % RING][c], kn + ((size_t)t * nk + g) * DK + 4 * c);
            cp_async16(&qr[t % RING][c], qn + ((size_t)t * nk + g) * DK + 4 * c);
        }
    }
    for (int u = 0; u < GDN_RC; ++u) {
        const int t = t0 + u;
        if (t < n) cp_async4(&vr[t % RING][lane], qkv + (size_t)t * conv_dim + 2 * nk * DK + h * dv + j);
    }
    if (lane < 2 * GDN_RC) {
        const int t = t0 + (lane >> 1);
        if (t < n) cp_async4(&br[t % RING][lane & 1], bd + ((size_t)t * nv + h) * 2 + (lane & 1));
    }
}

// Grid (nv, dv/32), 32 threads, as gdn_scan_t.
template <int DK>
__device__ __forceinline__ void gdn_scan_ring_t(const float* qn, const float* kn, const float* bd, const float* qkv,
                                                float* state, float* oraw, int n, int nk, int nv, int dv) {
    constexpr int D4 = DK / 4, RING = 2 * GDN_RC;
    __shared__ __align__(16) float4 kr[RING][D4];
    __shared__ __align__(16) float4 qr[RING][D4];
    __shared__ float vr[RING][32];
    __shared__ float br[RING][2];
    const int lane = threadIdx.x;
    const int h = blockIdx.x, j = blockIdx.y * 32 + lane, g = h % nk;
    float* sp = state + (size_t)h * DK * dv + j;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = sp[(size_t)i * dv];
    gdn_ring_stage<DK>(kr, qr, vr, br, qn, kn, bd, qkv, 0, n, nk, nv, dv, g, h, j);
    gdn_ring_stage<DK>(kr, qr, vr, br, qn, kn, bd, qkv, GDN_RC, n, nk, nv, dv, g, h, j);
    cp_async_wait_all();
    __syncwarp();
    // Row 0's decay and k·S.
    float kS = 0.f;
    {
        const float dec = br[0][1];
#pragma unroll
        for (int c = 0; c < D4; ++c) {
            const float4 k4 = kr[0][c];
            const float kk[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * c + e] *= dec;
                kS += kk[e] * s[4 * c + e];
            }
        }
    }
    for (int t = 0; t < n; ++t) {
        const int sl = t % RING;
        const float delta = br[sl][0] * (vr[sl][lane] - kS);
        float o = 0.f;
        if (t + 1 < n) {
            const int sn = (t + 1) % RING;
            const float dec = br[sn][1];
            float kS1 = 0.f;
#pragma unroll
            for (int c = 0; c < D4; ++c) {
                const float4 k4 = kr[sl][c], q4 = qr[sl][c], n4 = kr[sn][c];
                const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w},
                            nn[4] = {n4.x, n4.y, n4.z, n4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[4 * c + e] += kk[e] * delta;
                    o += qq[e] * s[4 * c + e];
                    s[4 * c + e] *= dec;
                    kS1 += nn[e] * s[4 * c + e];
                }
            }
            kS = kS1;
        } else {
#pragma unroll
            for (int c = 0; c < D4; ++c) {
                const float4 k4 = kr[sl][c], q4 = qr[sl][c];
                const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[4 * c + e] += kk[e] * delta;
                    o += qq[e] * s[4 * c + e];
                }
            }
        }
        oraw[(size_t)t * nv * dv + h * dv + j] = o;
        if ((t + 1) % GDN_RC == 0 && t + 1 < n) {
            // Rows t − GDN_RC + 1 ..= t are done (row t + 1's k is in the next chunk): their slots
            // take the chunk after next. The next chunk's copies were issued a chunk ago.
            cp_async_wait_all();
            __syncwarp();
            gdn_ring_stage<DK>(kr, qr, vr, br, qn, kn, bd, qkv, t + 1 + GDN_RC, n, nk, nv, dv, g, h, j);
        }
    }
#pragma unroll
    for (int i = 0; i < DK; ++i) sp[(size_t)i * dv] = s[i];
}

#define GDN_SCAN_RING(DK)                                                                              \
    extern "C" __global__ void __launch_bounds__(32)                                                   \
    gdn_scan_ring_##DK(const float* qn, const float* kn, const float* bd, const float* qkv, float* state, \
                       float* oraw, int n, int nk, int nv, int dv) {                                   \
        grid_dep_sync();                                                                               \
        gdn_scan_ring_t<DK>(qn, kn, bd, qkv, state, oraw, n, nk, nv, dv);                              \
    }
GDN_SCAN_RING(128)
GDN_SCAN_RING(64)
GDN_SCAN_RING(32)

// Grid (n·nv), dv threads: out = ((o · rms(o)) · w) · σ(z), the sum of squares in order.
extern "C" __global__ void __launch_bounds__(256)
gdn_out(const float* oraw, const float* z, const float* norm, float* out, int dv, float eps) {
    grid_dep_sync();
    __shared__ float os[256];
    __shared__ float sc;
    const size_t base = (size_t)blockIdx.x * dv;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) os[j] = oraw[base + j];
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = -0.0f;
        for (int i = 0; i < dv; ++i) ss += os[i] * os[i];
        sc = 1.0f / sqrtf(ss / (float)dv + eps);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < dv; j += blockDim.x) out[base + j] = ((os[j] * sc) * norm[j]) * g_sigmoid(z[base + j]);
}
