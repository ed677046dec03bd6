// moe: the format-independent parts of the routed experts (cpu::moe_experts): grouping a
// step's (row, slot) pairs by expert for the prefill products (gemv.cu moe_matmul_*), and the
// weighted sum of each row's expert outputs in rank order. The products themselves live with
// the GEMV kernels of each weight format (gemv.cu moe_gemv_* / moe_matmul_*).
//
// Graph replay: the expert ids are the router's device output; the pair count is the step's
// shape; the tile count is written to device memory for the product launches to read.

// One thread: counts per expert, the pairs q = row·kslots + slot listed by expert (ascending q
// within an expert: deterministic), and tiles (expert, start, count ≤ 8) over that list. `offs`
// holds n_expert + 1 values of scratch. An id outside 0..n_expert sets bit 1 of *err and is left
// out (its outputs stay unwritten; the decode kernels write NaN for it).
extern "C" __global__ void __launch_bounds__(32)
moe_group(const int* ids, int n_pairs, int n_expert, u32* offs, u32* perm, int* tiles, u32* n_tiles, int max_tiles,
          u32* err) {
    if (threadIdx.x != 0) return;
    for (int e = 0; e <= n_expert; ++e) offs[e] = 0;
    for (int q = 0; q < n_pairs; ++q) {
        const int e = ids[q];
        if (e < 0 || e >= n_expert) {
            atomicOr(err, 2u);
            continue;
        }
        offs[e + 1] += 1;
    }
    for (int e = 0; e < n_expert; ++e) offs[e + 1] += offs[e];
    int nt = 0;
    for (int e = 0; e < n_expert; ++e) {
        const u32 a = offs[e], b = offs[e + 1];
        for (u32 s = a; s < b; s += 8) {
            if (nt < max_tiles) {
                tiles[3 * nt] = e;
                tiles[3 * nt + 1] = (int)s;
                tiles[3 * nt + 2] = (int)min(8u, b - s);
            }
            ++nt;
        }
    }
    if (nt > max_tiles) atomicOr(err, 1u);
    *n_tiles = (u32)min(nt, max_tiles);
    // Fill by expert with a cursor per expert (offs[e] moves to offs[e + 1]'s old value).
    for (int q = 0; q < n_pairs; ++q) {
        const int e = ids[q];
        if (e < 0 || e >= n_expert) continue;
        perm[offs[e]++] = (u32)q;
    }
}

// out[t][j] = Σ_slot w[t][slot] · y[t·kslots + slot][j], slots in rank order from +0.
extern "C" __global__ void moe_combine(const float* y, const float* wts, float* out, int nt, int kslots, int h) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)nt * h; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / h, j = i % h;
        float acc = 0.f;
        for (int s = 0; s < kslots; ++s) acc += wts[t * kslots + s] * y[(t * kslots + s) * h + j];
        out[i] = acc;
    }
}
