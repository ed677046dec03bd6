// slop_pen and pick (strata_engine::kernels::{slop, pick} have the contracts).
//
// slop_pen_base: one thread does everything, in the CPU kernel's order (the report's
//                baseline: serial class scans, even in mode 0).
// slop_pen_opt:  mode 0 leaves at once; the class tables are compared in parallel; the
//                state is compacted with warp ballots; penalties are applied in parallel
//                (distinct ids, so distinct draft slots); a token hit by several phrase
//                matches is handled by the thread of its first match, in match order.
// pick_base:     one 1024-thread block scans the whole vocabulary.
// pick_opt:      the vocabulary spread over many blocks with 16-byte loads; the last block to
//                finish (an atomic ticket) reduces the per-block results.

#define SLOP_MAX_MATCHES 32
#define SLOP_STATE_LEN (3 + 2 * SLOP_MAX_MATCHES)
#define SLOP_RUN_LIMIT (1 << 30)

__device__ __forceinline__ int bump(int run, bool hit) {
    return hit ? min(run + 1, SLOP_RUN_LIMIT) : 0;
}

__device__ __forceinline__ int draft_of(const int* inverse, int id, int nv) {
    const int d = inverse[id];
    return (d >= 0 && d < nv) ? d : -1;
}

#define SLOP_PARAMS                                                                            \
    float *logits, int nv, const int *inverse, const int *pen_ids, const float *pen_vals,      \
        int n_pen, const int *newline, int n_nl, const int *blank, int n_bl,                   \
        const int *ph_tok, const int *ph_start, const float *ph_pen, int n_ph,                 \
        const int *banned, int n_banned, int cap_nl, int cap_bl, int mode, int prev,           \
        const int *st_in, int *st_out

extern "C" __global__ void __launch_bounds__(32) slop_pen_base(SLOP_PARAMS) {
    grid_dep_sync();
    if (threadIdx.x != 0) return;
    bool is_nl = false, is_bl = false;
    for (int i = 0; i < n_nl; ++i)
        if (newline[i] == prev) is_nl = true;
    for (int i = 0; i < n_bl; ++i)
        if (blank[i] == prev) is_bl = true;
    if (mode == 0) {
        for (int i = 0; i < SLOP_STATE_LEN; ++i) st_out[i] = st_in[i];
        return;
    }
    for (int i = 0; i < SLOP_STATE_LEN; ++i) st_out[i] = 0;
    st_out[0] = prev < 0 ? st_in[0] : bump(st_in[0], is_nl);
    st_out[1] = prev < 0 ? st_in[1] : bump(st_in[1], is_bl);
    if (mode == 2) {
        if (prev < 0) {
            for (int i = 2; i < SLOP_STATE_LEN; ++i) st_out[i] = st_in[i];
        } else {
            int n = 0;
            for (int i = 0; i < st_in[2]; ++i) {
                const int p = st_in[3 + 2 * i], m = st_in[4 + 2 * i];
                const int len = ph_start[p + 1] - ph_start[p];
                if (ph_tok[ph_start[p] + m] == prev && m + 1 < len && n < SLOP_MAX_MATCHES) {
                    st_out[3 + 2 * n] = p;
                    st_out[4 + 2 * n] = m + 1;
                    ++n;
                }
            }
            for (int p = 0; p < n_ph; ++p) {
                const int len = ph_start[p + 1] - ph_start[p];
                if (ph_tok[ph_start[p]] == prev && len > 1 && n < SLOP_MAX_MATCHES) {
                    st_out[3 + 2 * n] = p;
                    st_out[4 + 2 * n] = 1;
                    ++n;
                }
            }
            st_out[2] = n;
        }
    }
    for (int i = 0; i < n_pen; ++i) {
        const int d = draft_of(inverse, pen_ids[i], nv);
        if (d >= 0) logits[d] -= pen_vals[i];
    }
    if (cap_nl > 0 && st_out[0] >= cap_nl)
        for (int i = 0; i < n_nl; ++i) {
            const int d = draft_of(inverse, newline[i], nv);
            if (d >= 0) logits[d] = NEG_INF;
        }
    if (cap_bl > 0 && st_out[1] >= cap_bl)
        for (int i = 0; i < n_bl; ++i) {
            const int d = draft_of(inverse, blank[i], nv);
            if (d >= 0) logits[d] = NEG_INF;
        }
    if (mode < 2) return;
    for (int i = 0; i < st_out[2]; ++i) {
        const int p = st_out[3 + 2 * i], m = st_out[4 + 2 * i];
        const int len = ph_start[p + 1] - ph_start[p];
        const int d = draft_of(inverse, ph_tok[ph_start[p] + m], nv);
        if (d < 0) continue;
        if (m + 1 == len) logits[d] = NEG_INF;
        else logits[d] -= ph_pen[p];
    }
    for (int i = 0; i < n_banned; ++i) {
        const int d = draft_of(inverse, banned[i], nv);
        if (d >= 0) logits[d] = NEG_INF;
    }
}

// The body of slop_pen_opt (the caller waited for the previous launch: grid_dep_sync).
__device__ __forceinline__ void slop_pen_opt_body(SLOP_PARAMS) {
    __shared__ int st[SLOP_STATE_LEN];
    __shared__ int cnt[8];
    __shared__ int nkeep;
    __shared__ int tok[SLOP_MAX_MATCHES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (mode == 0) {
        if (tid < SLOP_STATE_LEN) st_out[tid] = st_in[tid];
        return;
    }
    int nl = 0, bl = 0;
    if (prev >= 0) {
        for (int i = tid; i < n_nl; i += 256) nl |= newline[i] == prev;
        for (int i = tid; i < n_bl; i += 256) bl |= blank[i] == prev;
    }
    nl = __syncthreads_or(nl);
    bl = __syncthreads_or(bl);
    if (tid < SLOP_STATE_LEN) st[tid] = 0;
    __syncthreads();
    if (tid == 0) {
        st[0] = prev < 0 ? st_in[0] : bump(st_in[0], nl != 0);
        st[1] = prev < 0 ? st_in[1] : bump(st_in[1], bl != 0);
    }
    if (mode == 2) {
        if (prev < 0) {
            if (tid >= 2 && tid < SLOP_STATE_LEN) st[tid] = st_in[tid];
        } else {
            const int n_old = st_in[2];
            if (warp == 0) {
                bool keep = false;
                int p = 0, m = 0;
                if (lane < n_old) {
                    p = st_in[3 + 2 * lane];
                    m = st_in[4 + 2 * lane];
                    const int len = ph_start[p + 1] - ph_start[p];
                    keep = ph_tok[ph_start[p] + m] == prev && m + 1 < len;
                }
                const u32 b = __ballot_sync(FULL_MASK, keep);
                const int pos = __popc(b & ((1u << lane) - 1u));
                if (keep) {
                    st[3 + 2 * pos] = p;
                    st[4 + 2 * pos] = m + 1;
                }
                if (lane == 0) nkeep = __popc(b);
            }
            __syncthreads();
            int base = nkeep;
            for (int c = 0; c < n_ph; c += 256) {
                const int p = c + tid;
                bool start = false;
                if (p < n_ph) start = ph_tok[ph_start[p]] == prev && ph_start[p + 1] - ph_start[p] > 1;
                const u32 b = __ballot_sync(FULL_MASK, start);
                if (lane == 0) cnt[warp] = __popc(b);
                __syncthreads();
                int off = base + __popc(b & ((1u << lane) - 1u));
                int total = 0;
                for (int w2 = 0; w2 < 8; ++w2) {
                    if (w2 < warp) off += cnt[w2];
                    total += cnt[w2];
                }
                if (start && off < SLOP_MAX_MATCHES) {
                    st[3 + 2 * off] = p;
                    st[4 + 2 * off] = 1;
                }
                base += total;
                __syncthreads();
            }
            if (tid == 0) st[2] = min(base, SLOP_MAX_MATCHES);
        }
    }
    __syncthreads();
    if (tid < SLOP_STATE_LEN) st_out[tid] = st[tid];
    for (int i = tid; i < n_pen; i += 256) {
        const int d = draft_of(inverse, pen_ids[i], nv);
        if (d >= 0) logits[d] -= pen_vals[i];
    }
    __syncthreads();
    if (cap_nl > 0 && st[0] >= cap_nl)
        for (int i = tid; i < n_nl; i += 256) {
            const int d = draft_of(inverse, newline[i], nv);
            if (d >= 0) logits[d] = NEG_INF;
        }
    if (cap_bl > 0 && st[1] >= cap_bl)
        for (int i = tid; i < n_bl; i += 256) {
            const int d = draft_of(inverse, blank[i], nv);
            if (d >= 0) logits[d] = NEG_INF;
        }
    if (mode < 2) return;
    const int n = st[2];
    if (tid < n) {
        const int p = st[3 + 2 * tid];
        tok[tid] = ph_tok[ph_start[p] + st[4 + 2 * tid]];
    }
    __syncthreads();
    if (tid < n) {
        const int t = tok[tid];
        bool first = true;
        for (int j = 0; j < tid; ++j) first = first && tok[j] != t;
        const int d = draft_of(inverse, t, nv);
        if (first && d >= 0) {
            float v = logits[d];
            for (int j = tid; j < n; ++j) {
                if (tok[j] != t) continue;
                const int p = st[3 + 2 * j], m = st[4 + 2 * j];
                if (m + 1 == ph_start[p + 1] - ph_start[p]) v = NEG_INF;
                else v -= ph_pen[p];
            }
            logits[d] = v;
        }
    }
    __syncthreads();
    for (int i = tid; i < n_banned; i += 256) {
        const int d = draft_of(inverse, banned[i], nv);
        if (d >= 0) logits[d] = NEG_INF;
    }
}

extern "C" __global__ void __launch_bounds__(256) slop_pen_opt(SLOP_PARAMS) {
    grid_dep_sync();
    slop_pen_opt_body(logits, nv, inverse, pen_ids, pen_vals, n_pen, newline, n_nl, blank, n_bl,
                      ph_tok, ph_start, ph_pen, n_ph, banned, n_banned, cap_nl, cap_bl, mode, prev,
                      st_in, st_out);
}

// slop_pen_opt for a draft chain on the device (Backend::slop_pen_draft): the previous draft's
// token is read from device memory (`prev_id[0]`, the previous pick's output; −1 as
// 0xffffffff: none), so the chain needs no host read between drafts.
extern "C" __global__ void __launch_bounds__(256)
slop_pen_chain(float* logits, int nv, const int* inverse, const int* pen_ids, const float* pen_vals,
               int n_pen, const int* newline, int n_nl, const int* blank, int n_bl,
               const int* ph_tok, const int* ph_start, const float* ph_pen, int n_ph,
               const int* banned, int n_banned, int cap_nl, int cap_bl, int mode,
               const int* prev_id, const int* st_in, int* st_out) {
    grid_dep_sync();
    const int prev = prev_id[0];
    slop_pen_opt_body(logits, nv, inverse, pen_ids, pen_vals, n_pen, newline, n_nl, blank, n_bl,
                      ph_tok, ph_start, ph_pen, n_ph, banned, n_banned, cap_nl, cap_bl, mode, prev,
                      st_in, st_out);
}

// ---- pick --------------------------------------------------------------------------------
// out[0] = draft index, out[1] = token id, out[2] = the value's bits.

#define PICK_NONE 0x7fffffff

__device__ __forceinline__ void pick_take(float v, int i, float& bv, int& bi) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

__device__ __forceinline__ void pick_warp(float& bv, int& bi) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, s);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, s);
        pick_take(ov, oi, bv, bi);
    }
}

// Block-wide (value, index) reduction; every thread of warp 0 returns the result.
template <int NW>
__device__ __forceinline__ void pick_block(float& bv, int& bi, float* sv, int* si) {
    pick_warp(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < NW ? sv[lane] : NEG_INF;
        bi = lane < NW ? si[lane] : PICK_NONE;
        pick_warp(bv, bi);
    }
}

__device__ __forceinline__ void pick_write(const float* logits, const int* draft_ids, int bi, int* out) {
    const int i = bi == PICK_NONE ? 0 : bi;
    out[0] = i;
    out[1] = draft_ids[i];
    out[2] = __float_as_int(logits[i]);
}

extern "C" __global__ void __launch_bounds__(1024)
pick_base(const float* logits, const int* draft_ids, int nv, int* out) {
    grid_dep_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = NEG_INF;
    int bi = PICK_NONE;
    for (int i = threadIdx.x; i < nv; i += 1024) pick_take(logits[i], i, bv, bi);
    pick_block<32>(bv, bi, sv, si);
    if (threadIdx.x == 0) pick_write(logits, draft_ids, bi, out);
}

// part: 2 * gridDim.x scratch words; ticket: one zeroed counter (reset by the last block).
extern "C" __global__ void __launch_bounds__(256)
pick_opt(const float* logits, const int* draft_ids, int nv, int* out, float* part_v, int* part_i,
         unsigned int* ticket) {
    grid_dep_sync();
    __shared__ float sv[8];
    __shared__ int si[8];
    __shared__ bool last;
    float bv = NEG_INF;
    int bi = PICK_NONE;
    const int n4 = nv >> 2;
    const int g = blockIdx.x * 256 + threadIdx.x, stride = gridDim.x * 256;
    const float4* l4 = (const float4*)logits;
    for (int i = g; i < n4; i += stride) {
        const float4 q = l4[i];
        pick_take(q.x, 4 * i, bv, bi);
        pick_take(q.y, 4 * i + 1, bv, bi);
        pick_take(q.z, 4 * i + 2, bv, bi);
        pick_take(q.w, 4 * i + 3, bv, bi);
    }
    if (g < (nv & 3)) pick_take(logits[4 * n4 + g], 4 * n4 + g, bv, bi);
    pick_block<8>(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = bv;
        part_i[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = NEG_INF;
    bi = PICK_NONE;
    for (int b = threadIdx.x; b < gridDim.x; b += 256)
        pick_take(((volatile float*)part_v)[b], ((volatile int*)part_i)[b], bv, bi);
    pick_block<8>(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        pick_write(logits, draft_ids, bi, out);
        *ticket = 0u;
    }
}

// ---- pick_rows: the index of each logits row's largest value (Backend::pick_rows / pick_draft)
// One 1024-thread block per row: the largest logit, ties to the lower index (pick_take, the
// catalogue's and the host sampler's order). `nan_err`: a NaN logit sets ERR_NAN_LOGIT in *err
// (the host sampler's argmax refuses NaN); without it NaN is never chosen (the catalogue's pick).
#define ERR_NAN_LOGIT 8u
extern "C" __global__ void __launch_bounds__(1024)
pick_rows(const float* logits, int nv, unsigned int* out, int nan_err, unsigned int* err) {
    grid_dep_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* l = logits + (size_t)blockIdx.x * nv;
    float bv = NEG_INF;
    int bi = PICK_NONE;
    int nan = 0;
    for (int i = threadIdx.x; i < nv; i += 1024) {
        const float v = l[i];
        nan |= v != v;
        pick_take(v, i, bv, bi);
    }
    nan = __syncthreads_or(nan);
    pick_block<32>(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = bi == PICK_NONE ? 0u : (unsigned int)bi;
        if (nan && nan_err) atomicOr(err, ERR_NAN_LOGIT);
    }
}

// ---- pick_draft_map: pick_rows for draft rows, mapped to token ids (Backend::pick_draft_mapped)
// One 1024-thread block per row: the largest logit, ties to the lower index, NaN never chosen
// (the catalogue's pick; every value −∞ or NaN: index 0); `map` (`mapped` != 0) turns the
// index into the draft vocabulary's token id, else the index is the token. The index is below
// `nv` and the map's ids were checked against the vocabulary on the host, so the id is valid.
// `vals` gets the picked logit's bits (−∞ or NaN: every draft logit was removed).
extern "C" __global__ void __launch_bounds__(1024)
pick_draft_map(const float* logits, int nv, const unsigned int* map, int mapped,
               unsigned int* out, unsigned int* vals) {
    grid_dep_sync();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* l = logits + (size_t)blockIdx.x * nv;
    float bv = NEG_INF;
    int bi = PICK_NONE;
    for (int i = threadIdx.x; i < nv; i += 1024) pick_take(l[i], i, bv, bi);
    pick_block<32>(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        const unsigned int i = bi == PICK_NONE ? 0u : (unsigned int)bi;
        out[blockIdx.x] = mapped ? map[i] : i;
        vals[blockIdx.x] = __float_as_uint(l[i]);
    }
}
