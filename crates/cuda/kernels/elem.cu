// elem: the model's row-wise and element-wise operations (strata_engine's Backend contract,
// CPU implementation in crates/engine/src/cpu/{mod.rs,ops.rs}): grouped RMS norm, rope, the
// hyper-connection pieces around the BF16 products (hc_act, hc_u, hc_inj, hc_combine), add,
// add_bias, swiglu, mul_sigmoid, add_sigmoid_gated, deinterleave, repeat_rows, ple_gate.
//
// Arithmetic follows the CPU expressions operation for operation (--fmad=false: no
// contraction), so purely arithmetic element-wise results are bitwise the CPU's. Where the CPU
// calls exp/ln (sigmoid, silu, softplus) the device's expf/log1pf differ from the host libm by
// an ulp or two; where it sums a row sequentially the device sums in the canonical block order
// (common.cuh block_sum256). Those differences are bounded in crates/cuda/tests/model_ops.rs.
//
// Graph replay: nothing here takes a per-step value as a kernel argument. Sizes are the step's
// shape; positions are read from a device buffer.


#define GRID_STRIDE(i, n) for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)(n); i += (size_t)gridDim.x * blockDim.x)

// ---- RMS norm over groups ----------------------------------------------------------------
// Block (row, group) of 256 threads: `x` rows of `cols`, groups of `group`; weight `w` holds
// `cols` values or `group` values broadcast over the groups (w_len says which). out may not
// alias x.
extern "C" __global__ void __launch_bounds__(256)
rms_norm_f32(const float* x, const float* w, float* out, int cols, int group, int w_len, float eps) {
    grid_dep_sync();
    __shared__ float sh[8];
    const int groups = cols / group;
    const int row = blockIdx.x / groups, g = blockIdx.x % groups;
    const float* xr = x + (size_t)row * cols + (size_t)g * group;
    const float* wr = w + (w_len == group ? 0 : (size_t)g * group);
    float* o = out + (size_t)row * cols + (size_t)g * group;
    float acc = 0.f;
    for (int i = threadIdx.x; i < group; i += 256) {
        const float v = xr[i];
        acc += v * v;
    }
    const float s = rms_scale(block_sum256(acc, sh), group, eps);
    for (int i = threadIdx.x; i < group; i += 256) o[i] = (xr[i] * s) * wr[i];
}

// ---- rope (NeoX halves) --------------------------------------------------------------------
// Row r rotated at position pos[r] (a device buffer: written once per step, read at replay).
// `freqs` are the rot/2 inverse frequencies in f64, computed on the host exactly as the CPU
// computes them (ops::rope_freqs), so only cos/sin of pos·f differ in their last f64 bits.
extern "C" __global__ void __launch_bounds__(256)
rope_neox_f32(float* x, const u32* pos, const double* freqs, int rows, int cols, int head_dim, int rot) {
    grid_dep_sync();
    const int half = rot / 2, heads = cols / head_dim;
    GRID_STRIDE(i, (size_t)rows * heads * half) {
        const int k = (int)(i % half);
        const size_t rh = i / half;
        const int row = (int)(rh / heads), h = (int)(rh % heads);
        const double a = (double)pos[row] * freqs[k];
        const float c = (float)cos(a), s = (float)sin(a);
        float* hp = x + (size_t)row * cols + (size_t)h * head_dim;
        const float x0 = hp[k], x1 = hp[k + half];
        hp[k] = x0 * c - x1 * s;
        hp[k + half] = x1 * c + x0 * s;
    }
}

// ---- element-wise ----------------------------------------------------------------------------

// out = x + y.
extern "C" __global__ void add_f32(const float* x, const float* y, float* out, u64 n) {
    grid_dep_sync();
    GRID_STRIDE(i, n) out[i] = x[i] + y[i];
}

// x += y.
extern "C" __global__ void add_assign_f32(float* x, const float* y, u64 n) {
    grid_dep_sync();
    GRID_STRIDE(i, n) x[i] = x[i] + y[i];
}

// x[r][c] += b[c].
extern "C" __global__ void add_bias_f32(float* x, const float* b, u64 n, int cols) {
    grid_dep_sync();
    GRID_STRIDE(i, n) x[i] = x[i] + b[i % cols];
}

// out = silu(g) * u.
extern "C" __global__ void swiglu_f32(const float* g, const float* u, float* out, u64 n) {
    grid_dep_sync();
    GRID_STRIDE(i, n) out[i] = siluf_(g[i]) * u[i];
}

// out = x * sigmoid(gate).
extern "C" __global__ void mul_sigmoid_f32(const float* x, const float* gate, float* out, u64 n) {
    grid_dep_sync();
    GRID_STRIDE(i, n) out[i] = x[i] * sigmoidf_(gate[i]);
}

// y[r][c] += sigmoid(gate[r]) * x[r][c].
extern "C" __global__ void add_sigmoid_gated_f32(float* y, const float* x, const float* gate, u64 n, int cols) {
    grid_dep_sync();
    GRID_STRIDE(i, n) y[i] = y[i] + sigmoidf_(gate[i / cols]) * x[i];
}

// Rows laid out as repeated [part 0 (chunk) | part 1 (chunk) | ...] split into the parts; part p
// is written at out + p·(n / parts) (one buffer, part-major).
extern "C" __global__ void deinterleave_f32(const float* x, float* out, u64 n, int chunk, int parts) {
    grid_dep_sync();
    const size_t part_len = n / parts;
    GRID_STRIDE(i, n) {
        const size_t ci = i / chunk, within = i % chunk;
        const size_t p = ci % parts, at = (ci / parts) * chunk + within;
        out[p * part_len + at] = x[i];
    }
}

// out[r] = [x[r]; x[r]; …] (`copies` times): the hyper-connection streams start as copies.
extern "C" __global__ void repeat_rows_f32(const float* x, float* out, u64 n_out, int cols, int copies) {
    grid_dep_sync();
    GRID_STRIDE(i, n_out) {
        const size_t row = i / ((size_t)cols * copies), c = i % cols;
        out[i] = x[row * cols + c];
    }
}

// ---- hyper-connection pieces (cpu::hc_mix, hc_combine) ------------------------------------------

// The down product's activation for the up product: silu(v · inv_s), rounded to BF16 (the up
// weight's paired format; the same bits as xprep of the f32 value).
extern "C" __global__ void hc_act_bf16(const float* a, u16* out, u64 n, float inv_s) {
    grid_dep_sync();
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(siluf_(a[i] * inv_s));
}

// As hc_act_bf16 for an up weight paired with f32 activations: silu(v · inv_s).
extern "C" __global__ void hc_act_f32(const float* a, float* out, u64 n, float inv_s) {
    grid_dep_sync();
    GRID_STRIDE(i, n) out[i] = siluf_(a[i] * inv_s);
}

// u[r][j] = (Σ_s σ(g[r][s·h + j]) · xn[r][s·h + j]) · inv_s, streams in order from +0.
extern "C" __global__ void hc_u_f32(const float* g, const float* xn, float* u, int rows, int h, int streams, float inv_s) {
    grid_dep_sync();
    GRID_STRIDE(i, (size_t)rows * h) {
        const size_t r = i / h, j = i % h;
        const float* gr = g + r * streams * h;
        const float* xr = xn + r * streams * h;
        float acc = 0.f;
        for (int s = 0; s < streams; ++s) acc += sigmoidf_(gr[(size_t)s * h + j]) * xr[(size_t)s * h + j];
        u[i] = acc * inv_s;
    }
}

// inj = 2σ(v · inv_s), in place.
extern "C" __global__ void hc_inj_f32(float* v, u64 n, float inv_s) {
    grid_dep_sync();
    GRID_STRIDE(i, n) v[i] = 2.0f * sigmoidf_(v[i] * inv_s);
}

// x[r][s·h + j] += inj[r][s] · y[r][j].
extern "C" __global__ void hc_combine_f32(float* x, const float* y, const float* inj, int rows, int h, int streams) {
    grid_dep_sync();
    GRID_STRIDE(i, (size_t)rows * streams * h) {
        const size_t r = i / ((size_t)streams * h), s = (i / h) % streams, j = i % h;
        x[i] = x[i] + inj[r * streams + s] * y[r * h + j];
    }
}

// ---- PLE gate (cpu::ple_gate) -----------------------------------------------------------------
// Block (row, stream): z = <K_s, Q_s>/sqrt(H) (canonical block sum), γ = σ(sign(z)·sqrt(max(|z|,
// 1e-6))), out[r][s] = γ·V[r].
extern "C" __global__ void __launch_bounds__(256)
ple_gate_f32(const float* k, const float* q, const float* v, float* out, int h, int streams) {
    grid_dep_sync();
    __shared__ float sh[8];
    const int r = blockIdx.x / streams, s = blockIdx.x % streams;
    const float* kr = k + ((size_t)r * streams + s) * h;
    const float* qr = q + ((size_t)r * streams + s) * h;
    float acc = 0.f;
    for (int i = threadIdx.x; i < h; i += 256) acc += kr[i] * qr[i];
    const float inv = 1.0f / sqrtf((float)h);
    const float z = block_sum256(acc, sh) * inv;
    float sg = 0.f;
    if (z > 0.f) sg = sqrtf(fmaxf(fabsf(z), 1e-6f));
    else if (z < 0.f) sg = -sqrtf(fmaxf(fabsf(z), 1e-6f));
    const float gamma = sigmoidf_(sg);
    float* o = out + ((size_t)r * streams + s) * h;
    const float* vr = v + (size_t)r * h;
    for (int i = threadIdx.x; i < h; i += 256) o[i] = gamma * vr[i];
}

// ---- views and gathers (strata_cuda::backend) ---------------------------------------------

// out[r][j] = x[r][start + j], rows of `cols` to rows of `len`.
extern "C" __global__ void slice_cols_f32(const float* x, float* out, u64 n, int cols, int start, int len) {
    grid_dep_sync();
    GRID_STRIDE(i, n) {
        const size_t r = i / len, j = i % len;
        out[i] = x[r * cols + start + j];
    }
}

// out[r][j] = y[r][ids[j]]: columns `ids` (m of them) of rows of `cols` (the draft vocabulary's
// rows of a full product). An id at or past `cols` gives NaN and sets err bit 1.
extern "C" __global__ void gather_cols_f32(const float* y, const u32* ids, float* out, u64 n, int cols, int m,
                                           u32* err) {
    grid_dep_sync();
    GRID_STRIDE(i, n) {
        const size_t r = i / m, j = i % m;
        const u32 c = ids[j];
        if (c >= (u32)cols) {
            atomicOr(err, 1u);
            out[i] = __int_as_float(0x7fc00000);
        } else {
            out[i] = y[r * cols + c];
        }
    }
}

// out[r] = [table[ids[r]]; …] (`copies` times) from an f32 image of a table of `n_rows` rows of
// `cols` (tables whose format or row length the embed kernels do not take). An id at or past
// `n_rows` gives a NaN row (the model checks ids before the step).
extern "C" __global__ void gather_rows_f32(const float* table, u32 n_rows, const u32* ids, float* out, u64 n_out,
                                           int cols, int copies) {
    grid_dep_sync();
    GRID_STRIDE(i, n_out) {
        const size_t row = i / ((size_t)cols * copies), c = i % cols;
        const u32 id = ids[row];
        out[i] = id < n_rows ? table[(size_t)id * cols + c] : __int_as_float(0x7fc00000);
    }
}

// QSA block means (cpu qsa_pool_blocks): row r, at position p = pos[r], completes block
// b = p / ratio when (p + 1) % ratio == 0; its row is the mean of raw keys b·ratio ..
// (b+1)·ratio (summed in order from +0, then / ratio); other rows are zeros. Keys past the
// store's `cap` rows set err bit 1. One thread per output value.
extern "C" __global__ void qsa_mean_f32(const float* kraw, u32 cap, const u32* pos, float* out, u64 n, int d,
                                        int ratio, u32* err) {
    grid_dep_sync();
    GRID_STRIDE(i, n) {
        const size_t r = i / d, c = i % d;
        const u32 p = pos[r];
        float s = 0.f;
        if ((p + 1) % (u32)ratio == 0) {
            const u32 b = p / (u32)ratio;
            if ((size_t)(b + 1) * ratio > cap) {
                atomicOr(err, 1u);
                s = __int_as_float(0x7fc00000);
            } else {
                for (int k = 0; k < ratio; ++k) s += kraw[((size_t)b * ratio + k) * d + c];
                s = s / (float)ratio;
            }
        }
        out[i] = s;
    }
}

// y[t][r] = Σ_i w[r][i] · x[t][i] for F32 (wty 0) or BF16 (wty 1) weights whose rows are not
// whole 32-element units (the unit kernels' granularity): one warp per (row r, token t), lane l
// takes elements l, l + 32, … with fmaf in order, then the warp sum. Against BF16 weights the
// activation takes BF16 values first (the pairing). Grid (rows / 8, nt), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
matmul_float_any(const u8* w, const float* x, float* y, int rows, int k, int wty) {
    grid_dep_sync();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= rows) return;
    float a = 0.f;
    for (int i = lane; i < k; i += 32) {
        const size_t wi = (size_t)r * k + i;
        const float wv = wty == 0 ? ((const float*)w)[wi] : bf16_to_f32(((const u16*)w)[wi]);
        float xv = x[(size_t)t * k + i];
        if (wty == 1) xv = bf16_to_f32(f32_to_bf16(xv));
        a = fmaf(wv, xv, a);
    }
    a = warp_sum(a);
    if (lane == 0) y[(size_t)t * rows + r] = a;
}

// matmul_float_any for the (row, slot) pairs of routed experts: pair q = t·kslots + slot uses
// expert ids[q] (a slab of `rows · k` values, `slab` elements apart) against activation row
// x_per_slot ? q : t. Ids outside the experts give NaN and set err bit 2. Grid (rows / 8,
// pairs).
extern "C" __global__ void __launch_bounds__(256)
moe_float_any(const u8* w, u64 slab, const int* ids, int n_expert, const float* x, int x_per_slot, int kslots,
              float* y, int rows, int k, int wty, u32* err) {
    grid_dep_sync();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int q = blockIdx.y;
    if (r >= rows) return;
    const int e = ids[q];
    if (e < 0 || e >= n_expert) {
        if (lane == 0) {
            atomicOr(err, 2u);
            y[(size_t)q * rows + r] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const float* xr = x + (size_t)(x_per_slot ? q : q / kslots) * k;
    float a = 0.f;
    for (int i = lane; i < k; i += 32) {
        const size_t wi = (size_t)e * slab + (size_t)r * k + i;
        const float wv = wty == 0 ? ((const float*)w)[wi] : bf16_to_f32(((const u16*)w)[wi]);
        float xv = xr[i];
        if (wty == 1) xv = bf16_to_f32(f32_to_bf16(xv));
        a = fmaf(wv, xv, a);
    }
    a = warp_sum(a);
    if (lane == 0) y[(size_t)q * rows + r] = a;
}
