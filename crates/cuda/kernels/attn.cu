// attn: the attention side of both families (cpu::{append_kv, qsa_pool_blocks, qsa_select,
// attend, attend_causal}, ops::{attend_head, partial_sort_top_k}, attn::causal_head):
//   kv_append       rows written into a fixed-capacity store at the rows' positions (F32, or F32
//                   values rounded through F16 as an F16 cache holds them);
//   qsa_pool        blocks completed by this step's rows: mean of `ratio` raw indexer keys, RMS
//                   norm, rope at the block's first token, written to the block store;
//   qsa_scores      Σ_h relu(<q_h, kb_b>)/sqrt(d) for every complete block (the CPU's sequential
//                   sums: the scores, and hence the selections, are bitwise the CPU's);
//   qsa_select_ref  top budget/ratio blocks (ties to the lower index) + the incomplete tail;
//   qsa_select_llamacpp  llama.cpp's rule, libstdc++'s heap select ported as is (one thread a
//                   row: exact, slow; the reference rule is the default);
//   attend          softmax attention of each (row, head) over a token list or causally 0..=pos.
//
// Graph replay: positions come from a device buffer, and every length that follows from them
// (tokens visible, blocks complete, tokens selected) is derived on the device; grids are sized
// by the stores' capacities. A position outside a store sets bit 0 of `*err` (checked by the
// host after the step) instead of writing out of bounds.

#define ERR_CAPACITY 1u

// ---- KV store ----------------------------------------------------------------------------------
// store[pos[r]] = x[r] (rows of `cols`), rounded through F16 when `f16`.
extern "C" __global__ void __launch_bounds__(256)
kv_append_f32(float* store, u32 cap, const float* x, const u32* pos, int cols, int f16, u32* err) {
    grid_dep_sync();
    const int r = blockIdx.x;
    const u32 p = pos[r];
    if (p >= cap) {
        if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
        return;
    }
    float* o = store + (size_t)p * cols;
    const float* xr = x + (size_t)r * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = xr[i];
        o[i] = f16 ? f16_to_f32(f32_to_f16(v)) : v;
    }
}

// ---- QSA indexer blocks ------------------------------------------------------------------------
// Backend::write_rows / write_kv: as kv_append, but rows whose slot is u32::MAX are skipped
// (a step's rows that complete no pooled block).
extern "C" __global__ void __launch_bounds__(256)
store_rows_f32(float* store, u32 cap, const float* x, const u32* at, int cols, int f16, u32* err) {
    grid_dep_sync();
    const int r = blockIdx.x;
    const u32 p = at[r];
    if (p == 0xffffffffu) return;
    if (p >= cap) {
        if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
        return;
    }
    float* o = store + (size_t)p * cols;
    const float* xr = x + (size_t)r * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = xr[i];
        o[i] = f16 ? f16_to_f32(f32_to_f16(v)) : v;
    }
}

// One 256-thread block per step row r: if row r completes block b ((pos+1) % ratio == 0), the
// block's key is mean(kraw[b·ratio .. (b+1)·ratio]) (summed in order from +0, then / ratio), RMS
// normed over d with `w` (the canonical block sum of elem.cu's rms_norm_f32), rotated at
// position b·ratio (NeoX, `rot` dims, f64 `freqs`), written to blocks[b]. d ≤ 1024.
extern "C" __global__ void __launch_bounds__(256)
qsa_pool(const float* kraw, float* blocks, u32 cap_blocks, const u32* pos, int d, int ratio, const float* w,
         float eps, const double* freqs, int rot, u32* err) {
    grid_dep_sync();
    __shared__ float sh[8];
    __shared__ float pooled[1024];
    const u32 p = pos[blockIdx.x];
    if ((p + 1) % (u32)ratio != 0) return;
    const u32 b = (p + 1) / ratio - 1;
    if (b >= cap_blocks) {
        if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
        return;
    }
    float acc = 0.f;
    for (int i = threadIdx.x; i < d; i += 256) {
        float s = 0.f;
        for (int rr = 0; rr < ratio; ++rr) s += kraw[((size_t)b * ratio + rr) * d + i];
        s = s / (float)ratio;
        pooled[i] = s;
        acc += s * s;
    }
    const float sc = rms_scale(block_sum256(acc, sh), d, eps);
    for (int i = threadIdx.x; i < d; i += 256) pooled[i] = (pooled[i] * sc) * w[i];
    __syncthreads();
    float* o = blocks + (size_t)b * d;
    const int half = rot / 2;
    for (int i = threadIdx.x; i < d; i += 256) {
        if (i < half || (i >= half && i < rot)) {
            const int k = i < half ? i : i - half;
            const double a = (double)(b * (u32)ratio) * freqs[k];
            const float c = (float)cos(a), s = (float)sin(a);
            const float x0 = pooled[k], x1 = pooled[k + half];
            o[i] = i < half ? x0 * c - x1 * s : x1 * c + x0 * s;
        } else {
            o[i] = pooled[i];
        }
    }
}

// ---- QSA row preparation (qwen4exp::ops::qsa_prepare): a step's rows in one launch -------------
// The composition it replaces: deinterleave → rms_norm_f32 → rope_neox_f32 for the queries;
// rms_norm_f32 → rope_neox_f32 → store_rows_f32 for the keys, store_rows_f32 for the values; with
// the indexer store_rows_f32 (raw keys) → qsa_mean_f32 → rms_norm_f32 → rope_neox_f32 →
// store_rows_f32 (blocks), and rms_norm_f32 → rope_neox_f32 for its queries. Grid (hq + hi + hkv +
// 2·(hi > 0), rows), 256 threads; block (s, r) of step row r at position p = pos[r]:
//   s < hq             query head s: q from qg's [q | gate] pair, RMS normed over hd with wq,
//                      rotated at p; q and the gate written to their deinterleaved rows;
//   s < hq + hi        indexer query head s − hq: normed over di with wiq, rotated at p;
//   s < hq + hi + hkv  key head: normed with wk, rotated, written at kc[p]; its value head at vc[p];
//   next               the raw indexer key row written at krawc[p];
//   last               if row r completes block b ((p + 1) % ratio == 0): the mean of the block's
//                      raw keys (this step's rows read from krawin — the host passes consecutive
//                      positions only, so position t is row r − (p − t) — earlier ones from
//                      krawc), normed over di with wik, rotated at b·ratio, written at blocksc[b].
// Every value is the composition's expression in its order (the block sums of rms_norm_f32, the
// rope's f64 angle), so the bits are the composed launches'; stores past their capacity set
// ERR_CAPACITY and write nothing. hd, di ≤ 1024.
__device__ __forceinline__ void prep_norm_rope(const float* x, const float* w, int d, float eps, u32 at,
                                               const double* freqs, int rot, float* buf, float* sh, float* out) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < d; i += 256) {
        const float v = x[i];
        acc += v * v;
    }
    const float s = rms_scale(block_sum256(acc, sh), d, eps);
    for (int i = threadIdx.x; i < d; i += 256) buf[i] = (x[i] * s) * w[i];
    __syncthreads();
    const int half = rot / 2;
    for (int i = threadIdx.x; i < d; i += 256) {
        if (i < half) {
            const double a = (double)at * freqs[i];
            const float c = (float)cos(a), sn = (float)sin(a);
            const float x0 = buf[i], x1 = buf[i + half];
            out[i] = x0 * c - x1 * sn;
            out[i + half] = x1 * c + x0 * sn;
        } else if (i >= rot) {
            out[i] = buf[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
qsa_prep(const float* qg, const float* kin, const float* vin, const float* qiin, const float* krawin,
         const float* wq, const float* wk, const float* wiq, const float* wik, const u32* pos, const double* freqs,
         float* q_out, float* gate_out, float* qi_out, float* kc, float* vc, u32 cap, float* krawc, u32 kraw_cap,
         float* blocksc, u32 blocks_cap, int hq, int hkv, int hd, int hi, int di, int rot, int ratio, float eps,
         u32* err) {
    grid_dep_sync();
    __shared__ float sh[8];
    __shared__ float buf[1024];
    __shared__ float pooled[1024];
    const int s = blockIdx.x, r = blockIdx.y;
    const u32 p = pos[r];
    if (s < hq) {
        const float* src = qg + (size_t)r * 2 * hq * hd + (size_t)2 * s * hd;
        float* g = gate_out + (size_t)r * hq * hd + (size_t)s * hd;
        for (int i = threadIdx.x; i < hd; i += 256) g[i] = src[hd + i];
        prep_norm_rope(src, wq, hd, eps, p, freqs, rot, buf, sh, q_out + (size_t)r * hq * hd + (size_t)s * hd);
    } else if (s < hq + hi) {
        const int h = s - hq;
        const size_t off = (size_t)r * hi * di + (size_t)h * di;
        prep_norm_rope(qiin + off, wiq, di, eps, p, freqs, rot, buf, sh, qi_out + off);
    } else if (s < hq + hi + hkv) {
        const int h = s - hq - hi;
        if (p >= cap) {
            if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
            return;
        }
        const size_t kvc = (size_t)hkv * hd, off = (size_t)h * hd;
        const float* vr = vin + (size_t)r * kvc + off;
        float* vo = vc + (size_t)p * kvc + off;
        for (int i = threadIdx.x; i < hd; i += 256) vo[i] = vr[i];
        prep_norm_rope(kin + (size_t)r * kvc + off, wk, hd, eps, p, freqs, rot, buf, sh, kc + (size_t)p * kvc + off);
    } else if (s == hq + hi + hkv) {
        if (p >= kraw_cap) {
            if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
            return;
        }
        const float* kr = krawin + (size_t)r * di;
        float* o = krawc + (size_t)p * di;
        for (int i = threadIdx.x; i < di; i += 256) o[i] = kr[i];
    } else {
        if ((p + 1) % (u32)ratio != 0) return;
        const u32 b = p / (u32)ratio;
        if ((size_t)(b + 1) * ratio > kraw_cap || b >= blocks_cap) {
            if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
            return;
        }
        const u32 p0 = p - (u32)r;  // the step's first position
        for (int i = threadIdx.x; i < di; i += 256) {
            float v = 0.f;
            for (int k = 0; k < ratio; ++k) {
                const u32 t = b * (u32)ratio + (u32)k;
                v += t >= p0 ? krawin[(size_t)(t - p0) * di + i] : krawc[(size_t)t * di + i];
            }
            pooled[i] = v / (float)ratio;
        }
        __syncthreads();
        prep_norm_rope(pooled, wik, di, eps, b * (u32)ratio, freqs, rot, buf, sh, blocksc + (size_t)b * di);
    }
}

// kv[0..w) = p[0..w) (w ≤ 64), kv[w..64) = 0: sixteen 16-byte loads where p is 16-byte aligned
// and w is 64, else w scalar loads; every load issued before any use.
__device__ __forceinline__ void load64(const float* p, int w, float* kv) {
    if (w == 64 && (((u64)p) & 15) == 0) {
        float4 x[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) x[j] = reinterpret_cast<const float4*>(p)[j];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            kv[4 * j] = x[j].x;
            kv[4 * j + 1] = x[j].y;
            kv[4 * j + 2] = x[j].z;
            kv[4 * j + 3] = x[j].w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 64; ++j) kv[j] = j < w ? p[j] : 0.f;
    }
}

// Before the dependency wait of a decode row's attention block (rh, chunk c): the chunk's key or
// value rows of its kv head pulled into L2, where the row's tokens are 0 ..= p (causal, or a
// list that holds every visible token: p + 1 ≤ stride) and more than `above` of them (the out
// pass skips the rows the scores kernel finishes, which pulled their values itself). The blocks
// of one kv head's `group` heads share the rows (thread t's row where t % group is the block's
// head % group). Only a hint: the position may not be settled yet (rows stay inside the store
// whatever it reads), and the rows are read after the wait as before.
__device__ __forceinline__ void attn_rows_to_l2(const float* store, const u32* pos, u32 cap, int n_head,
                                                int n_head_kv, int d, int stride, int causal, u32 above) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int rh = blockIdx.x, r = rh / n_head, h = rh % n_head, c = blockIdx.y;
    const int group = n_head / n_head_kv, kvc = n_head_kv * d, off = (h / group) * d;
    const u32 n = min(__ldcg(pos + r), cap - 1) + 1;
    const u32 t = (u32)c * 256 + threadIdx.x;
    if ((causal || n <= (u32)stride) && n > above && t < n && (int)threadIdx.x % group == h % group &&
        (d & 3) == 0) {
        const u64 a = (u64)(store + (size_t)t * kvc + off);
        if ((a & 15) == 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((u32)(4 * d)));
    }
#endif
}

// scores[r][b] for b < nb = (pos[r]+1)/ratio, one thread a block: each head's dot in order from
// -0.0 (Iterator::sum), relu (+0 for NaN and -0), heads summed in order from -0.0, times
// 1/sqrt(d). The block keys are staged through shared memory 32 dims at a time (coalesced
// loads; each thread's sums still run over the dims in order). Grid: (cap_blocks / 256 rounded
// up, rows); heads ≤ 8, heads·d ≤ 1024.
extern "C" __global__ void __launch_bounds__(256)
qsa_scores(const float* qi, const float* blocks, const u32* pos, float* scores, u32 cap_blocks, int heads, int d,
           int ratio, int all_blocks, int direct) {
    grid_dep_sync();
    __shared__ float qs[1024];
    __shared__ float kt[256][33];
    const int r = blockIdx.y;
    const u32 nb = min((pos[r] + 1) / (u32)ratio, cap_blocks);
    const u32 b0 = blockIdx.x * 256;
    // Every complete block is selected (nb ≤ all_blocks, the budget's blocks; 0: never
    // skipped): the selection does not read the scores, so none is computed.
    if (b0 >= nb || nb <= (u32)all_blocks) return;
    const float* q = qi + (size_t)r * heads * d;
    for (int i = threadIdx.x; i < heads * d; i += 256) qs[i] = q[i];
    const u32 b = b0 + threadIdx.x;
    float s[8];
#pragma unroll
    for (int h = 0; h < 8; ++h) s[h] = -0.0f;
    if (direct) {
        // Each thread reads its block's key straight from the store, 64 dims a load batch
        // (one memory latency a batch instead of a barrier pair and a latency every 32 dims);
        // each head's sum keeps the dims' order.
        __syncthreads();
        if (b >= nb) return;
        const float* kr = blocks + (size_t)b * d;
        for (int c0 = 0; c0 < d; c0 += 64) {
            const int w = min(64, d - c0);
            float kv[64];
            load64(kr + c0, w, kv);
#pragma unroll
            for (int i = 0; i < 64; ++i)
                if (i < w) {
#pragma unroll
                    for (int h = 0; h < 8; ++h)
                        if (h < heads) s[h] += qs[h * d + c0 + i] * kv[i];
                }
        }
        float tot = -0.0f;
#pragma unroll
        for (int h = 0; h < 8; ++h)
            if (h < heads) tot += s[h] > 0.f ? s[h] : 0.f;
        scores[(size_t)r * cap_blocks + b] = tot * (1.0f / sqrtf((float)d));
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c0 = 0; c0 < d; c0 += 32) {
        const int w = min(32, d - c0);
        __syncthreads();
        // Warp `warp` stages rows warp, warp + 8, …: 32 consecutive floats of a row per load,
        // every row of the pass loaded before the first store.
        float kv[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const u32 bb = b0 + warp + 8 * i;
            kv[i] = (lane < w && bb < nb) ? blocks[(size_t)bb * d + c0 + lane] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (lane < w) kt[warp + 8 * i][lane] = kv[i];
        __syncthreads();
        for (int i = 0; i < w; ++i) {
            const float kv = kt[threadIdx.x][i];
#pragma unroll
            for (int h = 0; h < 8; ++h)
                if (h < heads) s[h] += qs[h * d + c0 + i] * kv;
        }
    }
    if (b >= nb) return;
    float tot = -0.0f;
#pragma unroll
    for (int h = 0; h < 8; ++h)
        if (h < heads) tot += s[h] > 0.f ? s[h] : 0.f;
    scores[(size_t)r * cap_blocks + b] = tot * (1.0f / sqrtf((float)d));
}

// Order-preserving map of float bits to unsigned (larger float, larger key).
__device__ __forceinline__ u32 ord_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over a 1024-thread block; returns this thread's prefix, `total` the sum.
__device__ __forceinline__ int block_scan1024(int v, int* sh, int& total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh[w] = x;
    __syncthreads();
    if (w == 0) {
        int s = sh[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        sh[lane] = s;  // inclusive over warps
    }
    __syncthreads();
    total = sh[31];
    return x - v + (w > 0 ? sh[w - 1] : 0);
}

// The reference rule for row r (one 1024-thread block a row): K = min(budget/ratio, nb) blocks
// with the largest scores, ties to the lower index (a 4-pass radix select of the K-th largest
// key, then the keys equal to it taken in index order), listed ascending as tokens, then the
// tail nb·ratio ..= pos. sel[r] has room for `stride` tokens (≥ budget + ratio − 1); cnt[r] is
// the number written.
extern "C" __global__ void __launch_bounds__(1024)
qsa_select_ref(const float* scores, const u32* pos, u32* sel, u32* cnt, u32 cap_blocks, int ratio, int budget,
               int stride, u32* err, int all_fast) {
    grid_dep_sync();
    __shared__ u32 hist[256];
    __shared__ int scan[32];
    __shared__ u32 s_prefix, s_need;
    const int r = blockIdx.x;
    const u32 p = pos[r];
    const u32 nb = (p + 1) / (u32)ratio;
    const float* sc = scores + (size_t)r * cap_blocks;
    u32* out = sel + (size_t)r * stride;
    const u32 want = min((u32)(budget / ratio), nb);
    const u32 total_tokens = want * ratio + (p + 1 - nb * ratio);
    if (nb > cap_blocks || total_tokens > (u32)stride) {
        if (threadIdx.x == 0) {
            atomicOr(err, ERR_CAPACITY);
            cnt[r] = 0;
        }
        return;
    }
    if (all_fast && want == nb) {
        // Every complete block is selected (qsa_scores computed none): the blocks ascending, then
        // the tail, are the tokens 0 ..= p in order.
        for (u32 t = threadIdx.x; t <= p; t += blockDim.x) out[t] = t;
        if (threadIdx.x == 0) cnt[r] = total_tokens;
        return;
    }
    // Radix select: after the passes, prefix = the want-th largest key, need = how many of the
    // keys equal to it are taken.
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = want;
    }
    u32 mask = 0;
    for (int shift = 24; shift >= 0 && want > 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u32 prefix = s_prefix;
        // Keys of one row share their top bytes, so most of a warp's increments hit one
        // bucket: lanes with equal buckets are counted together (one shared atomic a bucket
        // a warp, not one a key). The loop's trip count is uniform across each warp.
        for (u32 b0 = threadIdx.x & ~31u; b0 < nb; b0 += blockDim.x) {
            const u32 b = b0 + (threadIdx.x & 31u);
            u32 bucket = 256u;  // none
            if (b < nb) {
                const u32 k = ord_key(sc[b]);
                if ((k & mask) == prefix) bucket = (k >> shift) & 255u;
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bucket);
            if (bucket < 256u && (threadIdx.x & 31u) == (u32)(__ffs(peers) - 1))
                atomicAdd(&hist[bucket], (u32)__popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // The bucket d holding the need-th largest key: the largest d whose count from the
            // top, I(d) = Σ_{j ≥ d} hist[j], reaches need (else 0), and need less the keys
            // above it. Lane l holds buckets 8l .. 8l + 7; I by a suffix scan over the lanes.
            const u32 l = threadIdx.x, need0 = s_need;
            u32 h[8], own = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                h[j] = hist[8 * l + j];
                own += h[j];
            }
            u32 above = own;  // Σ over lanes ≥ l, then made exclusive
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_down_sync(0xffffffffu, above, o);
                if (l + o < 32) above += v;
            }
            above -= own;  // Σ_{j ≥ 8l + 8} hist[j]
            u32 cnt = 0, run = above;
#pragma unroll
            for (int j = 7; j >= 0; --j) {
                run += h[j];
                cnt += (run >= need0) ? 1u : 0u;
            }
            u32 reach = cnt;  // buckets with I(d) ≥ need
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) reach += __shfl_xor_sync(0xffffffffu, reach, o);
            const u32 d = reach > 0 ? reach - 1 : 0;
            if (l == d / 8) {
                u32 i_above = above;  // I(d + 1)
#pragma unroll
                for (int j = 7; j >= 0; --j)
                    if ((u32)j > d % 8) i_above += h[j];
                s_need = need0 - i_above;
                s_prefix = prefix | (d << shift);
            }
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const u32 thr = s_prefix, need = s_need;
    // Selected blocks in ascending order: key > thr, or key == thr among the first `need` such.
    int base = 0, eq_base = 0;
    for (u32 b0 = 0; b0 < nb; b0 += blockDim.x) {
        const u32 b = b0 + threadIdx.x;
        const u32 k = b < nb ? ord_key(sc[b]) : 0u;
        const int eq = (want > 0 && b < nb && k == thr) ? 1 : 0;
        int eq_tot;
        const int eq_before = eq_base + block_scan1024(eq, scan, eq_tot);
        const int take = (want > 0 && b < nb && (k > thr || (eq && (u32)eq_before < need))) ? 1 : 0;
        int tot;
        const int at = base + block_scan1024(take, scan, tot);
        if (take)
            for (int t = 0; t < ratio; ++t) out[(size_t)at * ratio + t] = b * ratio + t;
        base += tot;
        eq_base += eq_tot;
    }
    for (u32 t = nb * ratio + threadIdx.x; t <= p; t += blockDim.x) out[(size_t)base * ratio + (t - nb * ratio)] = t;
    if (threadIdx.x == 0) cnt[r] = total_tokens;
}

// libstdc++'s std::__adjust_heap / __push_heap with comp(a, b) = v(a) > v(b), on indices.
struct TokScore {
    const float* sc;
    int ratio;
    u32 nbr;
    __device__ __forceinline__ float operator()(u32 t) const { return t < nbr ? sc[t / ratio] : 1e9f; }
};

__device__ void push_heap_(u32* a, u32 hole, u32 top, u32 value, const TokScore& v) {
    while (hole > top) {
        const u32 parent = (hole - 1) / 2;
        if (!(v(a[parent]) > v(value))) break;
        a[hole] = a[parent];
        hole = parent;
    }
    a[hole] = value;
}

__device__ void adjust_heap_(u32* a, u32 hole, u32 len, u32 value, const TokScore& v) {
    const u32 top = hole;
    u32 second = hole;
    const u32 lim = len >= 1 ? (len - 1) / 2 : 0;
    while (second < lim) {
        second = 2 * (second + 1);
        if (v(a[second]) > v(a[second - 1])) second -= 1;
        a[hole] = a[second];
        hole = second;
    }
    if ((len & 1) == 0 && len >= 2 && second == (len - 2) / 2) {
        second = 2 * (second + 1);
        a[hole] = a[second - 1];
        hole = second - 1;
    }
    push_heap_(a, hole, top, value, v);
}

// The llama.cpp rule for row r (thread 0 of a block a row; `scratch` holds `scratch_stride`
// u32 per row, ≥ pos + 1): every visible token takes its block's score, tail tokens 1e9, the
// first width = min(pos+1, budget+ratio-1) slots of std::partial_sort, listed ascending.
extern "C" __global__ void __launch_bounds__(32)
qsa_select_llamacpp(const float* scores, const u32* pos, u32* sel, u32* cnt, u32* scratch, u32 scratch_stride,
                    u32 cap_blocks, int ratio, int budget, int stride, u32* err) {
    grid_dep_sync();
    if (threadIdx.x != 0) return;
    const int r = blockIdx.x;
    const u32 p = pos[r];
    const u32 n = p + 1, nb = n / (u32)ratio;
    const u32 width = min(n, (u32)(budget + ratio - 1));
    if (nb > cap_blocks || n > scratch_stride || width > (u32)stride) {
        atomicOr(err, ERR_CAPACITY);
        cnt[r] = 0;
        return;
    }
    const TokScore v{scores + (size_t)r * cap_blocks, ratio, nb * ratio};
    u32* a = scratch + (size_t)r * scratch_stride;
    for (u32 i = 0; i < n; ++i) a[i] = i;
    const u32 k = width;
    if (k >= 2) {
        u32 parent = (k - 2) / 2;
        for (;;) {
            adjust_heap_(a, parent, k, a[parent], v);
            if (parent == 0) break;
            --parent;
        }
    }
    if (k > 0)
        for (u32 i = k; i < n; ++i)
            if (v(a[i]) > v(a[0])) {
                const u32 val = a[i];
                a[i] = a[0];
                adjust_heap_(a, 0, k, val, v);
            }
    // Ascending: mark the chosen tokens in the tail of the scratch row's own space (a[k..n] is
    // no longer needed), then list them.
    u32* out = sel + (size_t)r * stride;
    // Insertion sort of the k chosen (k ≤ budget + ratio − 1).
    for (u32 i = 1; i < k; ++i) {
        const u32 x = a[i];
        u32 j = i;
        while (j > 0 && a[j - 1] > x) {
            a[j] = a[j - 1];
            --j;
        }
        a[j] = x;
    }
    for (u32 i = 0; i < k; ++i) out[i] = a[i];
    cnt[r] = k;
}

// ---- attention -----------------------------------------------------------------------------------
// Block (row, head) of 256 threads. Tokens: causal → 0..=pos[r] (scores as attn::causal_head:
// eight interleaved partial dot sums); else sel[r][0..cnt[r]] (ops::attend_head: sequential dot
// from -0.0). Scores are kept in `scratch` (rows·n_head·cap floats). f16: the query, the keys and
// values as read, and each probability are rounded through F16 (a causal store holds its values
// already rounded by kv_append). Output dim j: Σ_t w_t·v_tj in token order from +0.
__device__ __forceinline__ float r16(float x, int f16) { return f16 ? f16_to_f32(f32_to_f16(x)) : x; }

__device__ __forceinline__ float block_max256(float v, float* sh) {
    v = warp_max(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float r = l < 8 ? sh[l] : NEG_INF;
    r = fmaxf(r, __shfl_xor_sync(FULL_MASK, r, 4));
    r = fmaxf(r, __shfl_xor_sync(FULL_MASK, r, 2));
    r = fmaxf(r, __shfl_xor_sync(FULL_MASK, r, 1));
    return __shfl_sync(FULL_MASK, r, 0);
}

extern "C" __global__ void __launch_bounds__(256)
attend_f32(const float* q, const float* kc, const float* vc, const u32* sel, const u32* cnt, const u32* pos,
           float* out, float* scratch, u32 cap, int n_head, int n_head_kv, int d, int stride, int causal, int f16,
           u32* err) {
    grid_dep_sync();
    __shared__ float qs[512];
    __shared__ float sh[8];
    const int r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    const int kvc = n_head_kv * d, off = (h / (n_head / n_head_kv)) * d;
    const u32 T = causal ? pos[r] + 1 : cnt[r];
    float* o = out + ((size_t)r * n_head + h) * d;
    if (T > cap || (causal && T == 0)) {
        if (threadIdx.x == 0) atomicOr(err, ERR_CAPACITY);
        return;
    }
    const float* qh = q + ((size_t)r * n_head + h) * d;
    for (int i = threadIdx.x; i < d; i += 256) qs[i] = r16(qh[i], f16);
    __syncthreads();
    const u32* list = sel + (size_t)r * stride;
    float* sc = scratch + ((size_t)r * n_head + h) * cap;
    const float scale = 1.0f / sqrtf((float)d);
    float m = NEG_INF;
    for (u32 t = threadIdx.x; t < T; t += 256) {
        const u32 tok = causal ? t : list[t];
        float s;
        if (tok >= cap) {
            atomicOr(err, ERR_CAPACITY);
            s = NEG_INF;
        } else if (causal) {
            const float* kr = kc + (size_t)tok * kvc + off;
            float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            const int d8 = d & ~7;
            for (int i = 0; i < d8; i += 8)
#pragma unroll
                for (int l = 0; l < 8; ++l) a[l] += qs[i + l] * kr[i + l];
            for (int i = d8; i < d; ++i) a[i - d8] += qs[i] * kr[i];
            const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
            s = ((s0 + s2) + (s1 + s3)) * scale;
        } else {
            const float* kr = kc + (size_t)tok * kvc + off;
            float acc = -0.0f;
            for (int i = 0; i < d; ++i) acc += qs[i] * r16(kr[i], f16);
            s = acc * scale;
        }
        sc[t] = s;
        m = fmaxf(m, s);
    }
    m = block_max256(m, sh);
    float z = 0.f;
    for (u32 t = threadIdx.x; t < T; t += 256) {
        const float e = expf(sc[t] - m);
        sc[t] = e;
        z += e;
    }
    z = block_sum256(z, sh);
    __syncthreads();
    const float inv = 1.0f / z;
    // Eight tokens' weights and values loaded before they are added (in token order): the loads
    // of a group are in flight together instead of one dependent pair at a time.
    for (int j = threadIdx.x; j < d; j += 256) {
        float acc = 0.f;
        for (u32 t0 = 0; t0 < T; t0 += 8) {
            float wv[8], vv[8];
            bool ok[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const u32 t = t0 + u;
                const u32 tok = t < T ? (causal ? t : list[t]) : cap;
                ok[u] = tok < cap;
                vv[u] = ok[u] ? vc[(size_t)tok * kvc + off + j] : 0.f;
                wv[u] = ok[u] ? (causal ? r16(sc[t] * inv, f16) : r16(sc[t] / z, f16)) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (ok[u]) acc += wv[u] * (causal ? vv[u] : r16(vv[u], f16));
        }
        o[j] = acc;
    }
}

// ---- attention split over chunks of 256 tokens (decode at long context) -----------------------------
// The same scores and the same per-token weights as attend_f32, but (row, head, chunk) blocks
// instead of (row, head): scores and per-chunk (max, Σexp) stats; then each chunk's weighted sum
// of values, every block deriving the same global max m and z = Σ_c z_c·exp(m_c − m) from the
// stats in chunk order; then the chunk partials summed in chunk order. z and the output's sum
// are taken in another order than the CPU's sequential one (a bound, not bits).
__device__ __forceinline__ float attn_score(const float* qs, const float* kr, int d, int causal, int f16, float scale) {
    if (causal) {
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        const int d8 = d & ~7;
        for (int i = 0; i < d8; i += 8)
#pragma unroll
            for (int l = 0; l < 8; ++l) a[l] += qs[i + l] * kr[i + l];
        for (int i = d8; i < d; ++i) a[i - d8] += qs[i] * kr[i];
        const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
        return ((s0 + s2) + (s1 + s3)) * scale;
    }
    float acc = -0.0f;
    for (int i = 0; i < d; ++i) acc += qs[i] * r16(kr[i], f16);
    return acc * scale;
}

// The decode attention kernels' `flags` (strata_cuda::model::attend_split_as; the grouped
// kernels take the argument and ignore it): ATTN_DIRECT, the scores' key rows read straight from
// the store; ATTN_L2, the key and value rows pulled into L2 before the waits; ATTN_FUSE, a row of
// one chunk finished by the scores kernel.
#define ATTN_DIRECT 1
#define ATTN_L2 2
#define ATTN_FUSE 4

// Output dim j of a chunk's weighted value sum: Σ_u w[u]·v[tk[u]][off + j] over its `len`
// tokens in order from +0 (tokens past the store skipped; F16: each value rounded as read), 64
// value rows in flight a thread (gathered by token: each load a memory latency). The out pass
// and the scores kernel's one-chunk rows share it.
__device__ __forceinline__ float attn_value_sum(const float* vc, const u32* tk, const float* w, int len, u32 cap,
                                                int kvc, int off, int j, int causal, int f16) {
    float acc = 0.f;
    for (int u0 = 0; u0 < len; u0 += 64) {
        float vv[64];
#pragma unroll
        for (int u = 0; u < 64; ++u) {
            const bool ok = u0 + u < len && tk[u0 + u] < cap;
            vv[u] = ok ? vc[(size_t)tk[u0 + u] * kvc + off + j] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 64; ++u)
            if (u0 + u < len && tk[u0 + u] < cap) acc += w[u0 + u] * (causal ? vv[u] : r16(vv[u], f16));
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(256)
attend_split_scores(const float* q, const float* kc, const u32* sel, const u32* cnt, const u32* pos, float* scores,
                    float* stats, u32 cap, int n_head, int n_head_kv, int d, int stride, int causal, int f16,
                    int max_chunks, u32* err, int flags, const float* vc, float* out, u64 gate) {
    if (flags & ATTN_L2) {
        attn_rows_to_l2(kc, pos, cap, n_head, n_head_kv, d, stride, causal, 0);
        if (flags & ATTN_FUSE) attn_rows_to_l2(vc, pos, cap, n_head, n_head_kv, d, stride, causal, 0);
    }
    grid_dep_sync();
    __shared__ float qs[512];
    __shared__ float sh[8];
    __shared__ float kt[256][33];
    __shared__ u32 tk[256];
    const int rh = blockIdx.x, r = rh / n_head, h = rh % n_head, c = blockIdx.y;
    const int kvc = n_head_kv * d, off = (h / (n_head / n_head_kv)) * d;
    const u32 T = causal ? pos[r] + 1 : cnt[r];
    if (T > cap || (u32)c * 256 >= T) return;
    const float* qh = q + (size_t)rh * d;
    for (int i = threadIdx.x; i < d; i += 256) qs[i] = r16(qh[i], f16);
    const u32 t = (u32)c * 256 + threadIdx.x;
    u32 tok = cap;
    if (t < T) {
        tok = causal ? t : sel[(size_t)r * stride + t];
        if (tok >= cap) {
            atomicOr(err, ERR_CAPACITY);
            tok = cap;
        }
    }
    tk[threadIdx.x] = tok;
    // The keys staged 32 dims at a time (coalesced); each thread's dot keeps attn_score's order
    // (eight interleaved partials for causal, sequential from -0.0 otherwise).
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float acc = -0.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Only the chunk's live rows are staged (a short context's last chunk is mostly empty);
    // the rows past them belong to threads whose score is -inf whatever they read.
    const int live = (int)min(256u, T - (u32)c * 256);
    if (flags & ATTN_DIRECT) {
        // Each thread reads its token's key row straight from the store, 64 dims a load batch
        // (one memory latency a batch instead of a barrier pair and a latency every 32 dims;
        // at a short context most of the staged passes' threads had no row): the same dots in
        // the same order.
        __syncthreads();
        if (t < T && tok < cap) {
            const float* kr = kc + (size_t)tok * kvc + off;
            for (int c0 = 0; c0 < d; c0 += 64) {
                const int w = min(64, d - c0);
                float kv[64];
                load64(kr + c0, w, kv);
                if (causal) {
#pragma unroll
                    for (int i = 0; i < 64; ++i)
                        if (i < w) a[i & 7] += qs[c0 + i] * kv[i];
                } else {
#pragma unroll
                    for (int i = 0; i < 64; ++i)
                        if (i < w) acc += qs[c0 + i] * r16(kv[i], f16);
                }
            }
        }
    }
    for (int c0 = 0; c0 < d && !(flags & ATTN_DIRECT); c0 += 32) {
        const int w = min(32, d - c0);
        __syncthreads();
        // Every row of the pass loaded before the first store (32 loads in flight a thread:
        // the rows are gathered by token, so one at a time would wait a memory latency each).
        float kv[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int rr = warp + 8 * i;
            const u32 tt = rr < live ? tk[rr] : cap;
            kv[i] = (lane < w && tt < cap) ? kc[(size_t)tt * kvc + off + c0 + lane] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int rr = warp + 8 * i;
            if (rr < live && lane < w) kt[rr][lane] = kv[i];
        }
        __syncthreads();
        if (causal) {
            for (int i = 0; i < w; ++i) a[(c0 + i) & 7] += qs[c0 + i] * kt[threadIdx.x][i];
        } else {
            for (int i = 0; i < w; ++i) acc += qs[c0 + i] * r16(kt[threadIdx.x][i], f16);
        }
    }
    float s = NEG_INF;
    if (t < T && tok < cap) {
        if (causal) {
            // attn::causal_head's dot: the tail past the last whole 8 goes to partials 0.. again.
            const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
            s = ((s0 + s2) + (s1 + s3)) * (1.0f / sqrtf((float)d));
        } else {
            s = acc * (1.0f / sqrtf((float)d));
        }
    }
    if (t < T) scores[(size_t)rh * cap + t] = s;
    const float m = block_max256(s, sh);
    const float e = t < T ? expf(s - m) : 0.f;
    const float z = block_sum256(e, sh);
    if (threadIdx.x == 0) {
        stats[((size_t)rh * max_chunks + c) * 2] = m;
        stats[((size_t)rh * max_chunks + c) * 2 + 1] = z;
    }
    if (!(flags & ATTN_FUSE) || T > 256) return;
    // One chunk holds every token (T ≤ 256, so this is chunk 0): the out pass and the sum done
    // here (ATTN_FUSE; attend_split_out and attend_split_sum then skip the row), their
    // expressions with nc = 1 — m = max(-inf, m), z = 0 + z·exp(m − m), the weights from this
    // block's scores, the value sum in token order from +0, then 0 + part and the gate.
    __shared__ float wsh[256];
    const float mo = fmaxf(NEG_INF, m);
    float zo = 0.f;
    zo += z * expf(m - mo);
    const float inv = 1.0f / zo;
    float wt = 0.f;
    if (t < T) {
        const float p = expf(s - mo);
        wt = causal ? r16(p * inv, f16) : r16(p / zo, f16);
    }
    wsh[threadIdx.x] = wt;
    __syncthreads();
    const int len = (int)T;
    const float* gp = (const float*)gate;
    for (int j = threadIdx.x; j < d; j += 256) {
        const float acc = attn_value_sum(vc, tk, wsh, len, cap, kvc, off, j, causal, f16);
        float o = 0.f;
        o += acc;
        out[(size_t)rh * d + j] = gp ? o * sigmoidf_(gp[(size_t)rh * d + j]) : o;
    }
}

extern "C" __global__ void __launch_bounds__(256)
attend_split_out(const float* vc, const u32* sel, const u32* cnt, const u32* pos, const float* scores,
                 const float* stats, float* part, u32 cap, int n_head, int n_head_kv, int d, int stride, int causal,
                 int f16, int max_chunks, int flags) {
    if (flags & ATTN_L2)
        attn_rows_to_l2(vc, pos, cap, n_head, n_head_kv, d, stride, causal, (flags & ATTN_FUSE) ? 256u : 0u);
    grid_dep_sync();
    __shared__ float w[256];
    __shared__ u32 tk[256];
    const int rh = blockIdx.x, r = rh / n_head, h = rh % n_head, c = blockIdx.y;
    const int kvc = n_head_kv * d, off = (h / (n_head / n_head_kv)) * d;
    const u32 T = causal ? pos[r] + 1 : cnt[r];
    const int nc = (int)((T + 255) / 256);
    // ATTN_FUSE: a row of one chunk was finished by attend_split_scores.
    if (T > cap || c >= nc || ((flags & ATTN_FUSE) && nc == 1)) return;
    const float* st = stats + (size_t)rh * max_chunks * 2;
    float m = NEG_INF;
    for (int i = 0; i < nc; ++i) m = fmaxf(m, st[2 * i]);
    float z = 0.f;
    for (int i = 0; i < nc; ++i) z += st[2 * i + 1] * expf(st[2 * i] - m);
    const float inv = 1.0f / z;
    const u32 t = (u32)c * 256 + threadIdx.x;
    float wt = 0.f;
    u32 tok = cap;
    if (t < T) {
        tok = causal ? t : sel[(size_t)r * stride + t];
        const float p = expf(scores[(size_t)rh * cap + t] - m);
        wt = causal ? r16(p * inv, f16) : r16(p / z, f16);
    }
    w[threadIdx.x] = wt;
    tk[threadIdx.x] = tok;
    __syncthreads();
    const int len = (int)min(256u, T - (u32)c * 256);
    for (int j = threadIdx.x; j < d; j += 256)
        part[((size_t)rh * max_chunks + c) * d + j] = attn_value_sum(vc, tk, w, len, cap, kvc, off, j, causal, f16);
}

extern "C" __global__ void __launch_bounds__(256)
attend_split_sum(const float* part, const u32* cnt, const u32* pos, float* out, u32 cap, int n_head, int d,
                 int causal, int max_chunks, const float* gate, int fused) {
    grid_dep_sync();
    const int rh = blockIdx.x, r = rh / n_head;
    const u32 T = causal ? pos[r] + 1 : cnt[r];
    if (T > cap) return;
    const int nc = (int)((T + 255) / 256);
    // A row of one chunk was finished by attend_split_scores (`fused`: the per-head kernels'
    // ATTN_FUSE).
    if (fused && nc == 1) return;
    for (int j = threadIdx.x; j < d; j += 256) {
        float acc = 0.f;
        for (int c = 0; c < nc; ++c) acc += part[((size_t)rh * max_chunks + c) * d + j];
        // With a gate: mul_sigmoid_f32's expression (qwen4exp's output gate, spec §7.4).
        out[(size_t)rh * d + j] = gate ? acc * sigmoidf_(gate[(size_t)rh * d + j]) : acc;
    }
}

// ---- attention for prefill: the heads that share a kv head, together ---------------------------
// attend_split_scores / attend_split_out for many rows read every key and value row once per
// (row, head): 24 heads over 2 kv heads read each row 12 times, and at 4096 tokens of context
// that traffic (≈ 2 × 256 KB a block from L2) is what grows with the prompt. These take one block
// per (row, group of up to ATTN_AG heads of one kv head, chunk of 256 tokens): each key and value row
// is read once for the group. Every score, chunk statistic, weight and partial sum is the split
// kernels' expression in its order (the scores' dims in order, block_max256 / block_sum256's
// tree, the chunks' stats in chunk order, the values in token order), so the outputs are the
// same bits; attend_split_sum finishes both. d % 32 == 0, d ≤ 256.
#define ATTN_AG 12

// The block's heads: kv head j = gi / per, heads h0 .. h0 + nh of group gi % per.
__device__ __forceinline__ void attn_group(int gi, int n_head, int n_head_kv, int& h0, int& nh) {
    const int g = n_head / n_head_kv, per = (g + ATTN_AG - 1) / ATTN_AG;
    const int j = gi / per, s = gi % per;
    h0 = j * g + s * ATTN_AG;
    nh = min(ATTN_AG, g - s * ATTN_AG);
}

// block_max256 and block_sum256 of ATTN_AG values at once (`sh` holds 8·ATTN_AG floats): the same trees.
__device__ __forceinline__ void block_max256_n(float (&v)[ATTN_AG], int nh, float* sh) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h)
        if (h < nh) v[h] = warp_max(v[h]);
    __syncthreads();
    if (l == 0)
#pragma unroll
        for (int h = 0; h < ATTN_AG; ++h)
            if (h < nh) sh[8 * h + w] = v[h];
    __syncthreads();
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h)
        if (h < nh) {
            const float* s = sh + 8 * h;
            // Lane 0 of block_max256: xor 4, then 2, then 1.
            const float a0 = fmaxf(s[0], s[4]), a1 = fmaxf(s[1], s[5]), a2 = fmaxf(s[2], s[6]),
                        a3 = fmaxf(s[3], s[7]);
            v[h] = fmaxf(fmaxf(a0, a2), fmaxf(a1, a3));
        }
}

__device__ __forceinline__ void block_sum256_n(float (&v)[ATTN_AG], int nh, float* sh) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h)
        if (h < nh) v[h] = warp_sum(v[h]);
    __syncthreads();
    if (l == 0)
#pragma unroll
        for (int h = 0; h < ATTN_AG; ++h)
            if (h < nh) sh[8 * h + w] = v[h];
    __syncthreads();
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h)
        if (h < nh) {
            const float* s = sh + 8 * h;
            v[h] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
        }
}

// Grid (rows · groups, chunks), 256 threads; scratch layouts as attend_split_scores'.
// The keys are staged ATTN_KD dims at a time into two buffers by cp.async: round c + 1's copies are
// in flight while round c is summed.
#define ATTN_KD 16
template <bool CAUSAL>
__device__ __forceinline__ void attend_group_stage(float (*kt)[ATTN_KD + 1], const float* kc, const u32* tk, int live,
                                                   u32 cap, int kvc, int off, int c0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int rr = 2 * warp + (lane >> 4); rr < live; rr += 16) {
        const u32 tt = tk[rr];
        float* dst = &kt[rr][lane & 15];
        if (tt < cap) cp_async4(dst, kc + (size_t)tt * kvc + off + c0 + (lane & 15));
        else *dst = 0.f;
    }
}

template <bool CAUSAL>
__device__ __forceinline__ void attend_group_scores_t(const float* q, const float* kc, const u32* sel, const u32* cnt,
                                                      const u32* pos, float* scores, float* stats, u32 cap,
                                                      int n_head, int n_head_kv, int d, int stride, int f16,
                                                      int max_chunks, u32* err, float* qs,
                                                      float (*kt)[256][ATTN_KD + 1], u32* tk, float* sh) {
    const int groups = n_head_kv * ((n_head / n_head_kv + ATTN_AG - 1) / ATTN_AG);
    const int r = blockIdx.x / groups, c = blockIdx.y;
    int h0, nh;
    attn_group(blockIdx.x % groups, n_head, n_head_kv, h0, nh);
    const int kvc = n_head_kv * d, off = (h0 / (n_head / n_head_kv)) * d;
    const u32 T = CAUSAL ? pos[r] + 1 : cnt[r];
    if (T > cap || (u32)c * 256 >= T) return;
    const float* qh = q + ((size_t)r * n_head + h0) * d;  // the group's heads are consecutive
    for (int i = threadIdx.x; i < nh * d; i += 256) qs[i] = r16(qh[i], f16);
    const u32 t = (u32)c * 256 + threadIdx.x;
    u32 tok = cap;
    if (t < T) {
        tok = CAUSAL ? t : sel[(size_t)r * stride + t];
        if (tok >= cap) {
            atomicOr(err, ERR_CAPACITY);
            tok = cap;
        }
    }
    tk[threadIdx.x] = tok;
    float acc[ATTN_AG], a[CAUSAL ? ATTN_AG : 1][8];
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h) acc[h] = -0.0f;
#pragma unroll
    for (int h = 0; h < (CAUSAL ? ATTN_AG : 1); ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) a[h][e] = 0.f;
    const int live = (int)min(256u, T - (u32)c * 256);
    __syncthreads();  // tk
    attend_group_stage<CAUSAL>(kt[0], kc, tk, live, cap, kvc, off, 0);
    for (int c0 = 0, bi = 0; c0 < d; c0 += ATTN_KD, bi ^= 1) {
        cp_async_wait_all();
        __syncthreads();  // round c0 is in kt[bi] for every thread; kt[bi ^ 1] is free
        if (c0 + ATTN_KD < d) attend_group_stage<CAUSAL>(kt[bi ^ 1], kc, tk, live, cap, kvc, off, c0 + ATTN_KD);
        const float* kr = kt[bi][threadIdx.x];
#pragma unroll
        for (int i = 0; i < ATTN_KD; i += 4) {
            float kv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) kv[e] = CAUSAL ? kr[i + e] : r16(kr[i + e], f16);
#pragma unroll
            for (int h = 0; h < ATTN_AG; ++h)
                if (h < nh) {
                    const float4 q4 = *(const float4*)&qs[h * d + c0 + i];
                    if (CAUSAL) {
                        // attn_score's eight interleaved partials: dim c0 + i + e goes to (i + e) & 7.
                        a[CAUSAL ? h : 0][(i + 0) & 7] += q4.x * kv[0];
                        a[CAUSAL ? h : 0][(i + 1) & 7] += q4.y * kv[1];
                        a[CAUSAL ? h : 0][(i + 2) & 7] += q4.z * kv[2];
                        a[CAUSAL ? h : 0][(i + 3) & 7] += q4.w * kv[3];
                    } else {
                        acc[h] += q4.x * kv[0];
                        acc[h] += q4.y * kv[1];
                        acc[h] += q4.z * kv[2];
                        acc[h] += q4.w * kv[3];
                    }
                }
        }
    }
    float s[ATTN_AG], e[ATTN_AG];
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h) {
        s[h] = NEG_INF;
        if (h < nh && t < T && tok < cap) {
            if (CAUSAL) {
                const int hc = CAUSAL ? h : 0;
                const float s0 = a[hc][0] + a[hc][4], s1 = a[hc][1] + a[hc][5], s2 = a[hc][2] + a[hc][6],
                            s3 = a[hc][3] + a[hc][7];
                s[h] = ((s0 + s2) + (s1 + s3)) * (1.0f / sqrtf((float)d));
            } else {
                s[h] = acc[h] * (1.0f / sqrtf((float)d));
            }
        }
        if (h < nh && t < T) scores[((size_t)r * n_head + h0 + h) * cap + t] = s[h];
        e[h] = s[h];
    }
    block_max256_n(e, nh, sh);  // e = the chunk's max per head
    float m[ATTN_AG];
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h) {
        m[h] = e[h];
        e[h] = t < T ? expf(s[h] - m[h]) : 0.f;
    }
    block_sum256_n(e, nh, sh);
    if (threadIdx.x == 0)
#pragma unroll
        for (int h = 0; h < ATTN_AG; ++h)
            if (h < nh) {
                const size_t at = (((size_t)r * n_head + h0 + h) * max_chunks + c) * 2;
                stats[at] = m[h];
                stats[at + 1] = e[h];
            }
}

// Value rows u0 .. u0 + ATTN_VT of the chunk (those below len with a token in the store) into `vs`.
#define ATTN_VT 16
__device__ __forceinline__ void attend_group_stage_v(float (*vs)[256], const float* vc, const u32* tk, int len,
                                                     int u0, u32 cap, int kvc, int off, int d) {
    const int q4 = d / 4;
    for (int e = threadIdx.x; e < ATTN_VT * q4; e += 256) {
        const int u = e / q4, c4 = e % q4;
        if (u0 + u < len && tk[u0 + u] < cap)
            cp_async16(&vs[u][4 * c4], vc + (size_t)tk[u0 + u] * kvc + off + 4 * c4);
    }
}

template <bool CAUSAL>
__device__ __forceinline__ void attend_group_out_t(const float* vc, const u32* sel, const u32* cnt, const u32* pos,
                                                   const float* scores, const float* stats, float* part, u32 cap,
                                                   int n_head, int n_head_kv, int d, int stride, int f16,
                                                   int max_chunks, float (*w)[256], u32* tk, float (*mz)[2],
                                                   float (*vs)[ATTN_VT][256]) {
    const int groups = n_head_kv * ((n_head / n_head_kv + ATTN_AG - 1) / ATTN_AG);
    const int r = blockIdx.x / groups, c = blockIdx.y;
    int h0, nh;
    attn_group(blockIdx.x % groups, n_head, n_head_kv, h0, nh);
    const int kvc = n_head_kv * d, off = (h0 / (n_head / n_head_kv)) * d;
    const u32 T = CAUSAL ? pos[r] + 1 : cnt[r];
    const int nc = (int)((T + 255) / 256);
    if (T > cap || c >= nc) return;
    if (threadIdx.x < nh) {
        // attend_split_out's m and z, from the chunks' stats in chunk order.
        const float* st = stats + ((size_t)r * n_head + h0 + threadIdx.x) * max_chunks * 2;
        float m = NEG_INF;
        for (int i = 0; i < nc; ++i) m = fmaxf(m, st[2 * i]);
        float z = 0.f;
        for (int i = 0; i < nc; ++i) z += st[2 * i + 1] * expf(st[2 * i] - m);
        mz[threadIdx.x][0] = m;
        mz[threadIdx.x][1] = z;
    }
    const u32 t = (u32)c * 256 + threadIdx.x;
    u32 tok = cap;
    if (t < T) tok = CAUSAL ? t : sel[(size_t)r * stride + t];
    tk[threadIdx.x] = tok;
    __syncthreads();
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h)
        if (h < nh) {
            float wt = 0.f;
            if (t < T) {
                const float m = mz[h][0], z = mz[h][1], inv = 1.0f / z;
                const float p = expf(scores[((size_t)r * n_head + h0 + h) * cap + t] - m);
                wt = CAUSAL ? r16(p * inv, f16) : r16(p / z, f16);
            }
            w[h][threadIdx.x] = wt;
        }
    __syncthreads();
    const int len = (int)min(256u, T - (u32)c * 256);
    // The chunk's value rows ATTN_VT at a time into two buffers by cp.async (the next slab in flight
    // while this one is summed); thread j owns output dim j (d ≤ 256), the tokens in order.
    const int j = threadIdx.x;
    float acc[ATTN_AG];
#pragma unroll
    for (int h = 0; h < ATTN_AG; ++h) acc[h] = 0.f;
    attend_group_stage_v(vs[0], vc, tk, len, 0, cap, kvc, off, d);
    for (int u0 = 0, bi = 0; u0 < len; u0 += ATTN_VT, bi ^= 1) {
        cp_async_wait_all();
        __syncthreads();  // slab u0 is in vs[bi] for every thread; vs[bi ^ 1] is free
        if (u0 + ATTN_VT < len) attend_group_stage_v(vs[bi ^ 1], vc, tk, len, u0 + ATTN_VT, cap, kvc, off, d);
        if (j < d) {
#pragma unroll
            for (int u4 = 0; u4 < ATTN_VT; u4 += 4) {
                float vv[4];
                bool ok[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int u = u0 + u4 + e;
                    ok[e] = u < len && tk[u] < cap;
                    vv[e] = CAUSAL ? vs[bi][u4 + e][j] : r16(vs[bi][u4 + e][j], f16);
                }
#pragma unroll
                for (int h = 0; h < ATTN_AG; ++h)
                    if (h < nh) {
                        const float4 w4 = *(const float4*)&w[h][u0 + u4];
                        if (ok[0]) acc[h] += w4.x * vv[0];
                        if (ok[1]) acc[h] += w4.y * vv[1];
                        if (ok[2]) acc[h] += w4.z * vv[2];
                        if (ok[3]) acc[h] += w4.w * vv[3];
                    }
            }
        }
    }
    if (j < d)
#pragma unroll
        for (int h = 0; h < ATTN_AG; ++h)
            if (h < nh) part[(((size_t)r * n_head + h0 + h) * max_chunks + c) * d + j] = acc[h];
}

extern "C" __global__ void __launch_bounds__(256)
attend_group_scores(const float* q, const float* kc, const u32* sel, const u32* cnt, const u32* pos, float* scores,
                    float* stats, u32 cap, int n_head, int n_head_kv, int d, int stride, int causal, int f16,
                    int max_chunks, u32* err, int flags, const float* vc, float* out, u64 gate) {
    grid_dep_sync();
    __shared__ __align__(16) float qs[ATTN_AG * 256];
    __shared__ float kt[2][256][ATTN_KD + 1];
    __shared__ u32 tk[256];
    __shared__ float sh[8 * ATTN_AG];
    if (causal)
        attend_group_scores_t<true>(q, kc, sel, cnt, pos, scores, stats, cap, n_head, n_head_kv, d, stride, f16,
                                    max_chunks, err, qs, kt, tk, sh);
    else
        attend_group_scores_t<false>(q, kc, sel, cnt, pos, scores, stats, cap, n_head, n_head_kv, d, stride, f16,
                                     max_chunks, err, qs, kt, tk, sh);
}

extern "C" __global__ void __launch_bounds__(256)
attend_group_out(const float* vc, const u32* sel, const u32* cnt, const u32* pos, const float* scores,
                 const float* stats, float* part, u32 cap, int n_head, int n_head_kv, int d, int stride, int causal,
                 int f16, int max_chunks, int flags) {
    grid_dep_sync();
    __shared__ __align__(16) float w[ATTN_AG][256];
    __shared__ u32 tk[256];
    __shared__ float mz[ATTN_AG][2];
    __shared__ __align__(16) float vs[2][ATTN_VT][256];
    if (causal)
        attend_group_out_t<true>(vc, sel, cnt, pos, scores, stats, part, cap, n_head, n_head_kv, d, stride, f16,
                                 max_chunks, w, tk, mz, vs);
    else
        attend_group_out_t<false>(vc, sel, cnt, pos, scores, stats, part, cap, n_head, n_head_kv, d, stride, f16,
                                  max_chunks, w, tk, mz, vs);
}
