// rms_xprep, xprep (the activation images of strata_engine::kernels::actq) and combine_gnorm.
// One 256-invocation workgroup per row: the sum of squares in the canonical lane order
// (lane t adds x[t + 256k]², k ascending, then block_sum256), the scale with correctly rounded
// division and square root, then the image written one u32 word per invocation step.
//
// Parameters (rms_xprep / xprep): 0 n, 1 eps bits, 2 format code, 3 rows, 4 normalize (1) or
// not (0, xprep: W is then a dummy). combine_gnorm: 0 n, 1 eps bits, 2 streams, 3 tokens.

@group(0) @binding(1) var<storage, read_write> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> WN: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<u32>;

const FMT_F32: u32 = 0u;
const FMT_BF16: u32 = 1u;
const FMT_Q8_0: u32 = 2u;
const FMT_Q8K: u32 = 3u;
// Largest row: 10240 values = 320 Q8_0 blocks (the host checks).
const MAX_BLOCKS: u32 = 320u;

var<workgroup> blk_a: array<f32, 320>;
var<workgroup> blk_b: array<u32, 320>;
var<workgroup> row_scale: f32;
// The parallel block scales: per block the largest |value| bits (order-free) and, for Q8_K,
// the first index holding it (the smallest such index, also order-free).
var<workgroup> bmax: array<atomic<u32>, 320>;
var<workgroup> bidx: array<atomic<u32>, 40>;

// Value i of the row being imaged.
fn yv(base: u32, i: u32, norm: bool) -> f32 {
    if (norm) { return (X[base + i] * row_scale) * WN[i]; }
    return X[base + i];
}

fn q8_0_byte(base: u32, n: u32, norm: bool, byte: u32) -> u32 {
    let b = byte / 34u;
    let o = byte % 34u;
    if (o < 2u) { return (blk_b[b] >> (8u * o)) & 255u; }
    let v = yv(base, 32u * b + o - 2u, norm);
    return bitcast<u32>(sat_i8(rne(nc(v * blk_a[b])))) & 255u;
}

fn q8k_code(base: u32, b: u32, i: u32, norm: bool) -> i32 {
    let q = min(nearest_int(nc(blk_a[b] * yv(base, 256u * b + i, norm))), 127);
    return sext8(bitcast<u32>(q) & 255u);
}

fn q8k_word(base: u32, norm: bool, word: u32) -> u32 {
    let b = (4u * word) / 292u;
    let o = (4u * word) % 292u;
    if (o == 0u) { return blk_b[b]; }
    if (o < 260u) {
        var w = 0u;
        for (var j = 0u; j < 4u; j = j + 1u) {
            w = w | ((bitcast<u32>(q8k_code(base, b, o - 4u + j, norm)) & 255u) << (8u * j));
        }
        return w;
    }
    var w = 0u;
    for (var h = 0u; h < 2u; h = h + 1u) {
        let g = (o - 260u) / 2u + h;
        var s = 0;
        for (var l = 0u; l < 16u; l = l + 1u) { s = s + q8k_code(base, b, 16u * g + l, norm); }
        w = w | ((bitcast<u32>(s) & 0xffffu) << (16u * h));
    }
    return w;
}

// The block scales of image_row with the row spread over the workgroup: every invocation
// takes the values t + 256k, the block maxima meet in workgroup atomics (a maximum of bit
// patterns does not depend on the order it is taken in), so blk_a / blk_b get the serial
// loop's bits. Q8_K keeps the first value of largest magnitude: the smallest index that holds
// the maximum, found the same way.
fn block_scales_par(base: u32, n: u32, fmt: u32, norm: bool, t: u32) {
    var bsz = 32u;
    if (fmt == FMT_Q8K) { bsz = 256u; }
    let nb = n / bsz;
    for (var b = t; b < nb; b = b + 256u) {
        atomicStore(&bmax[b], 0u);
        if (fmt == FMT_Q8K) { atomicStore(&bidx[b], 0xffffffffu); }
    }
    workgroupBarrier();
    for (var i = t; i < n; i = i + 256u) {
        let a = bitcast<u32>(yv(base, i, norm)) & 0x7fffffffu;
        if (a <= 0x7f800000u && a != 0u) { atomicMax(&bmax[i / bsz], a); }
    }
    workgroupBarrier();
    if (fmt == FMT_Q8K) {
        for (var i = t; i < n; i = i + 256u) {
            let a = bitcast<u32>(yv(base, i, norm)) & 0x7fffffffu;
            if (a != 0u && a == atomicLoad(&bmax[i / bsz])) { atomicMin(&bidx[i / bsz], i); }
        }
        workgroupBarrier();
    }
    for (var b = t; b < nb; b = b + 256u) {
        let m = atomicLoad(&bmax[b]);
        if (fmt == FMT_Q8_0) {
            let mf = bitcast<f32>(m);
            blk_b[b] = f32_to_f16(div_rn(mf, 127.0));
            if (m != 0u) { blk_a[b] = div_rn(127.0, mf); } else { blk_a[b] = 0.0; }
        } else if (m == 0u) {
            blk_a[b] = 0.0;
            blk_b[b] = 0u;
        } else {
            let iscale = div_rn(-127.0, yv(base, atomicLoad(&bidx[b]), norm));
            blk_a[b] = iscale;
            blk_b[b] = bitcast<u32>(div_rn(1.0, iscale));
        }
    }
}

// The image of row `row` (n values from X at row·n) into OUT at word row·rb/4; `par`: the
// block scales by block_scales_par (the same bits as the serial loops here).
fn image_row(row: u32, n: u32, fmt: u32, norm: bool, t: u32, par: bool) {
    let base = row * n;
    var rb = 4u * n;
    if (fmt == FMT_BF16) { rb = 2u * n; }
    if (fmt == FMT_Q8_0) { rb = 34u * (n / 32u); }
    if (fmt == FMT_Q8K) { rb = 292u * (n / 256u); }
    let ob = row * (rb / 4u);
    // Block scales first: one invocation per block, in element order (Q8_K keeps the first
    // element of largest magnitude).
    if (par && (fmt == FMT_Q8_0 || fmt == FMT_Q8K)) {
        block_scales_par(base, n, fmt, norm, t);
    } else if (fmt == FMT_Q8_0) {
        for (var b = t; b < n / 32u; b = b + 256u) {
            var m = 0u;
            for (var i = 0u; i < 32u; i = i + 1u) {
                let a = bitcast<u32>(yv(base, 32u * b + i, norm)) & 0x7fffffffu;
                if (a <= 0x7f800000u && a > m) { m = a; }
            }
            let mf = bitcast<f32>(m);
            blk_b[b] = f32_to_f16(div_rn(mf, 127.0));
            if (m != 0u) { blk_a[b] = div_rn(127.0, mf); } else { blk_a[b] = 0.0; }
        }
    } else if (fmt == FMT_Q8K) {
        for (var b = t; b < n / 256u; b = b + 256u) {
            var amax = 0u;
            var mx = 0.0;
            for (var i = 0u; i < 256u; i = i + 1u) {
                let v = yv(base, 256u * b + i, norm);
                let a = bitcast<u32>(v) & 0x7fffffffu;
                if (a <= 0x7f800000u && a > amax) {
                    amax = a;
                    mx = v;
                }
            }
            if (amax == 0u) {
                blk_a[b] = 0.0;
                blk_b[b] = 0u;
            } else {
                let iscale = div_rn(-127.0, mx);
                blk_a[b] = iscale;
                blk_b[b] = bitcast<u32>(div_rn(1.0, iscale));
            }
        }
    }
    workgroupBarrier();
    for (var w = t; w < rb / 4u; w = w + 256u) {
        var word = 0u;
        if (fmt == FMT_F32) {
            word = bitcast<u32>(yv(base, w, norm));
        } else if (fmt == FMT_BF16) {
            word = f32_to_bf16(yv(base, 2u * w, norm)) | (f32_to_bf16(yv(base, 2u * w + 1u, norm)) << 16u);
        } else if (fmt == FMT_Q8_0) {
            for (var j = 0u; j < 4u; j = j + 1u) { word = word | (q8_0_byte(base, n, norm, 4u * w + j) << (8u * j)); }
        } else {
            word = q8k_word(base, norm, w);
        }
        OUT[ob + w] = word;
    }
    workgroupBarrier();
}

fn rms_row(row: u32, n: u32, eps: f32, t: u32) {
    var acc = 0.0;
    for (var i = t; i < n; i = i + 256u) {
        let v = X[row * n + i];
        acc = acc + nc(v * v);
    }
    let s = block_sum256(acc, t);
    if (t == 0u) { row_scale = rms_scale(s, n, eps); }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn rms_xprep_base(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let n = pu(0u);
    let norm = pu(4u) != 0u;
    if (norm) { rms_row(g.x, n, pf(1u), t); }
    image_row(g.x, n, pu(2u), norm, t, false);
}

// rms_xprep_base with the block scales spread over the workgroup (block_scales_par): the same
// parameters and bits. The model backend's activation images.
@compute @workgroup_size(256)
fn rms_xprep_par(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let n = pu(0u);
    let norm = pu(4u) != 0u;
    if (norm) { rms_row(g.x, n, pf(1u), t); }
    image_row(g.x, n, pu(2u), norm, t, true);
}

@compute @workgroup_size(256)
fn rms_xprep_opt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    // SPEC_N, SPEC_FMT and SPEC_NORM are prepended per specialization.
    if (SPEC_NORM) { rms_row(g.x, SPEC_N, pf(1u), t); }
    image_row(g.x, SPEC_N, SPEC_FMT, SPEC_NORM, t, true);
}
