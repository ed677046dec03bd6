// moe: the format-independent parts of the routed experts (cpu::moe_experts): grouping a
// step's (row, slot) pairs by expert for the prefill products (gemv.cu moe_matmul_*), and the
// weighted sum of each row's expert outputs in rank order. The products themselves live with
// the GEMV kernels of each weight format (gemv.cu moe_gemv_* / moe_matmul_*, mmq.cu moe_mmq_*).
//
// Graph replay: the expert ids are the router's device output; the pair count is the step's
// shape; the tile count is written to device memory for the product launches to read.

// Counts per expert, the pairs q = row·kslots + slot listed by expert (ascending q within an
// expert: deterministic), and tiles (expert, start, count ≤ 8) over that list, experts in
// order. `offs` holds n_expert + 1 values of scratch. An id outside 0..n_expert sets bit 1 of
// *err and is left out (its outputs stay unwritten; the decode kernels write NaN for it).
// One block: the counts by atomics (order-free), then one warp for what has an order — the
// prefix sums (lane l takes a contiguous range of experts), the tiles, and the list, 32 pairs a
// step with each expert's pairs of a step ranked by lane (__match_any_sync).
extern "C" __global__ void __launch_bounds__(256)
moe_group(const int* ids, int n_pairs, int n_expert, u32* offs, u32* perm, int* tiles, u32* n_tiles, int max_tiles,
          u32* err) {
    grid_dep_sync();
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e <= n_expert; e += blockDim.x) offs[e] = 0;
    __syncthreads();
    for (int q = tid; q < n_pairs; q += blockDim.x) {
        const int e = ids[q];
        if (e < 0 || e >= n_expert) atomicOr(err, 2u);
        else atomicAdd(&offs[e + 1], 1u);
    }
    __syncthreads();
    if (tid >= 32) return;
    // Counts (offs[e + 1]) to starts (offs[e]), in place: lane l owns experts [e0, e1).
    const int per = (n_expert + 31) / 32;
    const int e0 = min(lane * per, n_expert), e1 = min(e0 + per, n_expert);
    u32 cnt = 0, ntl = 0, last = 0;
    for (int e = e0; e < e1; ++e) {
        const u32 c = offs[e + 1];
        cnt += c;
        ntl += (c + 7) / 8;
    }
    if (e1 > e0) last = offs[e1];  // read before lane l + 1 overwrites it with its first start
    u32 ci = cnt, ti = ntl;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const u32 a = __shfl_up_sync(FULL_MASK, ci, s), b = __shfl_up_sync(FULL_MASK, ti, s);
        if (lane >= s) {
            ci += a;
            ti += b;
        }
    }
    const u32 total = __shfl_sync(FULL_MASK, ci, 31), total_tiles = __shfl_sync(FULL_MASK, ti, 31);
    __syncwarp();
    u32 at = ci - cnt, tb = ti - ntl;
    for (int e = e0; e < e1; ++e) {
        const u32 c = e + 1 == e1 ? last : offs[e + 1];
        offs[e] = at;
        for (u32 s = at; s < at + c; s += 8) {
            if (tb < (u32)max_tiles) {
                tiles[3 * tb] = e;
                tiles[3 * tb + 1] = (int)s;
                tiles[3 * tb + 2] = (int)min(8u, at + c - s);
            }
            ++tb;
        }
        at += c;
    }
    if (lane == 0) {
        offs[n_expert] = total;
        if (total_tiles > (u32)max_tiles) atomicOr(err, 1u);
        *n_tiles = min(total_tiles, (u32)max_tiles);
    }
    __syncwarp();
    // The list: each expert's cursor (offs[e]) moves to its end.
    for (int q0 = 0; q0 < n_pairs; q0 += 32) {
        const int q = q0 + lane;
        int e = q < n_pairs ? ids[q] : -1;
        if (e >= n_expert) e = -1;
        if (e < 0) e = -1;
        const u32 m = __match_any_sync(FULL_MASK, e);
        const int leader = __ffs(m) - 1;
        u32 base = 0;
        if (e >= 0 && lane == leader) base = offs[e];
        base = __shfl_sync(FULL_MASK, base, leader);
        if (e >= 0) {
            perm[base + __popc(m & ((1u << lane) - 1u))] = (u32)q;
            if (lane == leader) offs[e] = base + __popc(m);
        }
        __syncwarp();
    }
}

// out[t][j] = Σ_slot w[t][slot] · y[t·kslots + slot][j], slots in rank order from +0.
extern "C" __global__ void moe_combine(const float* y, const float* wts, float* out, int nt, int kslots, int h) {
    grid_dep_sync();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)nt * h; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / h, j = i % h;
        float acc = 0.f;
        for (int s = 0; s < kslots; ++s) acc += wts[t * kslots + s] * y[(t * kslots + s) * h + j];
        out[i] = acc;
    }
}
