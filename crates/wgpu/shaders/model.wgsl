// model: the whole-model operations of the backend boundary that read f32 activations (the
// quantized products and gathers are mq.wgsl). Each entry mirrors the CPU backend's arithmetic
// (crates/engine/src/cpu): the same operations in the same order per output value, every
// product that feeds an add behind nc() and the divisions and square roots correctly rounded,
// so an entry is bit-exact against the CPU wherever the CPU uses no exp/ln (copies, stores,
// adds, RMS norm, RoPE with the host's f64 table, pooling, the QSA scores and rules); with exp
// (sigmoid, silu, softplus, softmax) only the driver's exp differs.
//
// Bindings (all entries): 1..5 f32 buffers A..E, 6..8 u32 buffers I, J, K. Unused ones get
// dummies. Element-wise entries run 64 invocations a group over a 2-D grid (`lin`).

@group(0) @binding(1) var<storage, read_write> A: array<f32>;
@group(0) @binding(2) var<storage, read_write> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;
@group(0) @binding(4) var<storage, read_write> D: array<f32>;
@group(0) @binding(5) var<storage, read_write> E: array<f32>;
@group(0) @binding(6) var<storage, read_write> I: array<u32>;
@group(0) @binding(7) var<storage, read_write> J: array<u32>;
@group(0) @binding(8) var<storage, read_write> K: array<u32>;

const NONE: u32 = 0xffffffffu;

fn lin(g: vec3<u32>, n: vec3<u32>, l: u32) -> u32 { return (g.y * n.x + g.x) * 64u + l; }

fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    return log(1.0 + exp(x));
}
// Rust's f32::max (a NaN operand gives the other operand).
fn fmax(a: f32, b: f32) -> f32 {
    if (is_nan(a)) { return b; }
    if (is_nan(b)) { return a; }
    if (b > a) { return b; }
    return a;
}
fn f16r(x: f32) -> f32 { return f16_to_f32(f32_to_f16(x)); }

// ---- memory -------------------------------------------------------------------------------

// B[r·p4 + p5 + c] = A[r·p2 + p3 + c] for r < p0, c < p1.
@compute @workgroup_size(64)
fn copy_rows(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
             @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    if (i >= pu(0u) * pu(1u)) { return; }
    let r = i / pu(1u);
    let c = i % pu(1u);
    B[r * pu(4u) + pu(5u) + c] = A[r * pu(2u) + pu(3u) + c];
}

// Row r of A (p0 rows of p1) into row I[p3 + r] − p5 of B, a store's part holding rows
// p5..p5 + p2 (a row outside it is another part's, or NONE: skipped); p4: round to F16.
@compute @workgroup_size(64)
fn write_rows(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
              @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let cols = pu(1u);
    if (i >= pu(0u) * cols) { return; }
    let r = i / cols;
    let slot = I[pu(3u) + r];
    if (slot == NONE || slot < pu(5u) || slot - pu(5u) >= pu(2u)) { return; }
    var v = A[i];
    if (pu(4u) != 0u) { v = f16r(v); }
    B[(slot - pu(5u)) * cols + i % cols] = v;
}

// ---- element-wise -------------------------------------------------------------------------

// p0 values; p1 op: 0 A += B, 1 A += B[i % p2] (bias), 2 C = A·σ(B), 3 C = silu(A)·B,
// 4 A += σ(C[i / p2])·B, 5 A = silu(A·p3), 6 A = 2σ(A·p3), 7 C = A rounded to F16 (the
// activation image of F16 weights).
@compute @workgroup_size(64)
fn eltwise(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
           @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    if (i >= pu(0u)) { return; }
    switch pu(1u) {
        case 0u: { A[i] = A[i] + B[i]; }
        case 1u: { A[i] = A[i] + B[i % pu(2u)]; }
        case 2u: { C[i] = A[i] * sigm(B[i]); }
        case 3u: { C[i] = silu(A[i]) * B[i]; }
        case 4u: { A[i] = A[i] + nc(sigm(C[i / pu(2u)]) * B[i]); }
        case 5u: { A[i] = silu(nc(A[i] * pf(3u))); }
        case 6u: { A[i] = 2.0 * sigm(nc(A[i] * pf(3u))); }
        case 7u: { C[i] = f16r(A[i]); }
        default: {}
    }
}

// RMS norm of each p2-wide group of rows of p1 (p0 rows), × weight B (p4 = p2: broadcast).
// One invocation per group: the CPU's sequential sum of squares, then its rms_scale.
@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
            @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let group = pu(2u);
    let per_row = pu(1u) / group;
    if (i >= pu(0u) * per_row) { return; }
    let base = i * group;
    var ss = 0.0;
    for (var j = 0u; j < group; j = j + 1u) {
        let v = A[base + j];
        ss = ss + nc(v * v);
    }
    let s = rms_scale(ss, group, pf(3u));
    var woff = (i % per_row) * group;
    if (pu(4u) == group) { woff = 0u; }
    for (var j = 0u; j < group; j = j + 1u) {
        C[base + j] = nc(A[base + j] * s) * B[woff + j];
    }
}

// The same norm in the canonical 256-lane order (strata_engine::kernels::norm::rms_norm_lanes,
// CUDA's rms_norm_f32): lane t adds x[t + 256k]², k ascending, then block_sum256's tree. Two
// layouts with the same bits: `rms_norm_lanes1` one invocation per group keeping the 256 lane
// sums itself (the baseline; CPU adapters, where a 256-wide workgroup's barriers are coroutine
// switches), `rms_norm_wg` one 256-wide workgroup per group (GPUs: the sum is 256 short chains
// instead of one of `group` dependent adds). Same parameters as rms_norm; rms_norm_wg's groups
// over a 2-D grid, p5 groups in x.
@compute @workgroup_size(64)
fn rms_norm_lanes1(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
                   @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let group = pu(2u);
    let per_row = pu(1u) / group;
    if (i >= pu(0u) * per_row) { return; }
    let base = i * group;
    let nl = min(group, 256u);
    var lanes: array<f32, 256>;
    for (var t = 0u; t < nl; t = t + 1u) {
        var acc = 0.0;
        for (var j = t; j < group; j = j + 256u) {
            let v = A[base + j];
            acc = acc + nc(v * v);
        }
        lanes[t] = acc;
    }
    // Lanes at or past `group` hold +0 in the workgroup layout: adding them changes nothing.
    for (var s = 16u; s > 0u; s = s >> 1u) {
        for (var t = 0u; t + s < nl; t = t + 1u) {
            if ((t & 31u) < s) { lanes[t] = lanes[t] + lanes[t + s]; }
        }
    }
    for (var s = 4u; s > 0u; s = s >> 1u) {
        for (var t = 0u; t < s; t = t + 1u) {
            if (32u * (t + s) < nl) { lanes[32u * t] = lanes[32u * t] + lanes[32u * (t + s)]; }
        }
    }
    let sc = rms_scale(lanes[0], group, pf(3u));
    var woff = (i % per_row) * group;
    if (pu(4u) == group) { woff = 0u; }
    for (var j = 0u; j < group; j = j + 1u) {
        C[base + j] = nc(A[base + j] * sc) * B[woff + j];
    }
}

@compute @workgroup_size(256)
fn rms_norm_wg(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let i = g.y * pu(5u) + g.x;
    let group = pu(2u);
    let per_row = pu(1u) / group;
    // Every invocation reaches block_sum256's barriers; a group past the end adds nothing.
    let live = i < pu(0u) * per_row;
    let base = i * group;
    var acc = 0.0;
    if (live) {
        for (var j = t; j < group; j = j + 256u) {
            let v = A[base + j];
            acc = acc + nc(v * v);
        }
    }
    let ss = block_sum256(acc, t);
    if (!live) { return; }
    let sc = rms_scale(ss, group, pf(3u));
    var woff = (i % per_row) * group;
    if (pu(4u) == group) { woff = 0u; }
    for (var j = t; j < group; j = j + 256u) {
        C[base + j] = nc(A[base + j] * sc) * B[woff + j];
    }
}

// NeoX rotation in place: p0 rows of p1, heads of p2, p3 rotated pairs, table B (cos, sin per
// position and pair, p4 positions), positions I from p5. A position past the table gives NaN.
@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
        @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let half = pu(3u);
    let heads = pu(1u) / pu(2u);
    if (i >= pu(0u) * heads * half) { return; }
    let p = i % half;
    let rh = i / half;
    let row = rh / heads;
    let base = rh * pu(2u);
    let pos = I[pu(5u) + row];
    var c = f_nan();
    var s = f_nan();
    if (pos < pu(4u)) {
        c = B[(pos * half + p) * 2u];
        s = B[(pos * half + p) * 2u + 1u];
    }
    let x0 = A[base + p];
    let x1 = A[base + p + half];
    A[base + p] = nc(x0 * c) - nc(x1 * s);
    A[base + p + half] = nc(x1 * c) + nc(x0 * s);
}

// ---- attention ----------------------------------------------------------------------------

var<private> qv: array<f32, 256>;
var<private> ov: array<f32, 256>;

// Query qv against key row t of the bound part (head offset off, rows of kvc): the CPU's
// eight interleaved partial sums (attend_causal), or its sequential sum (attend).
fn score(t: u32, kvc: u32, off: u32, d: u32, eight: bool) -> f32 {
    let kb = t * kvc + off;
    if (!eight) {
        var s = 0.0;
        for (var j = 0u; j < d; j = j + 1u) { s = s + nc(qv[j] * B[kb + j]); }
        return s;
    }
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let whole = d / 8u * 8u;
    for (var j = 0u; j < whole; j = j + 8u) {
        for (var u = 0u; u < 8u; u = u + 1u) { acc[u] = acc[u] + nc(qv[j + u] * B[kb + j + u]); }
    }
    for (var j = whole; j < d; j = j + 1u) { acc[j - whole] = acc[j - whole] + nc(qv[j] * B[kb + j]); }
    let s0 = acc[0] + acc[4];
    let s1 = acc[1] + acc[5];
    let s2 = acc[2] + acc[6];
    let s3 = acc[3] + acc[7];
    return (s0 + s2) + (s1 + s3);
}

// Token `idx` a query row attends to: causal (p5 = 0) is idx itself; a selection (p5 = 1)
// reads J[row · p6 + 1 + idx].
fn token(row: u32, idx: u32) -> u32 {
    if (pu(5u) == 0u) { return idx; }
    return J[row * pu(6u) + 1u + idx];
}

// Whether token t is in the bound part of the caches (rows p10..p10 + p11 of p7).
fn in_part(t: u32) -> bool { return t < pu(7u) && t >= pu(10u) && t - pu(10u) < pu(11u); }

// One invocation per (row, head): p0 rows, p1 heads, p2 KV heads, p3 head dim (<= 256),
// p4 F16, p5 selection mode, p6 selection stride, p7 cache rows, p8 positions offset,
// p9 the CPU's attend_causal arithmetic (1) or attend's (0). q A, caches B/C, out D.
// The caches bound are the part holding rows p10..p10 + p11. p12 phase: 0 all in one (one
// part); a split store runs phase 1 (the max), 2 (the sum) and 3 (the weighted values) over
// each part in row order, carrying (m, z, o[d]) per (row, head) in E (rows of d + 2), with
// p13 = 1 on the first part and p14 = 1 on the last: the same sequential sums in the same
// order as phase 0, so the same bits. p15..p16: the range of the row's token list this
// dispatch visits (phase 0: 0..NONE, all of it); the phases also run over consecutive ranges
// of one part (the host's `attention`: a bounded number of loop iterations a dispatch, see
// there), p13/p14 then marking the first and last (part, range) piece, again the same sums in
// the same order. A causal count is at most the cache rows p7 (the tokens past them are not
// in any part), a selection's at most its row's p6 − 1 slots, so the host's bound on the
// iterations holds whatever the positions and counts read.
@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
          @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let nh = pu(1u);
    if (i >= pu(0u) * nh) { return; }
    let row = i / nh;
    let h = i % nh;
    let d = pu(3u);
    let f16 = pu(4u) != 0u;
    let causal_ar = pu(9u) != 0u;
    let kvc = pu(2u) * d;
    let off = (h / (nh / pu(2u))) * d;
    let row0 = pu(10u);
    let phase = pu(12u);
    let first = pu(13u) != 0u;
    let sb = i * (d + 2u);
    var cnt = 0u;
    if (pu(5u) == 0u) {
        cnt = min(I[pu(8u) + row] + 1u, pu(7u));
    } else {
        cnt = min(J[row * pu(6u)], max(pu(6u), 1u) - 1u);
    }
    let xlo = pu(15u);
    let xhi = min(cnt, pu(16u));
    for (var j = 0u; j < d; j = j + 1u) {
        var x = A[i * d + j];
        if (f16) { x = f16r(x); }
        qv[j] = x;
        ov[j] = 0.0;
    }
    let scale = div_rn(1.0, sqrt_rn(f32(d)));
    var m = f_neg_inf();
    if (phase >= 2u || (phase == 1u && !first)) { m = E[sb]; }
    if (phase <= 1u) {
        for (var x = xlo; x < xhi; x = x + 1u) {
            let t = token(row, x);
            if (!in_part(t)) { continue; }
            m = fmax(m, score(t - row0, kvc, off, d, causal_ar) * scale);
        }
        if (phase == 1u) {
            E[sb] = m;
            return;
        }
    }
    var z = 0.0;
    if (phase == 3u || (phase == 2u && !first)) { z = E[sb + 1u]; }
    if (phase == 0u || phase == 2u) {
        for (var x = xlo; x < xhi; x = x + 1u) {
            let t = token(row, x);
            if (!in_part(t)) { continue; }
            z = z + exp(nc(score(t - row0, kvc, off, d, causal_ar) * scale) - m);
        }
        if (phase == 2u) {
            E[sb + 1u] = z;
            return;
        }
    }
    if (phase == 3u && !first) {
        for (var j = 0u; j < d; j = j + 1u) { ov[j] = E[sb + 2u + j]; }
    }
    let inv = div_rn(1.0, z);
    for (var x = xlo; x < xhi; x = x + 1u) {
        let t = token(row, x);
        if (!in_part(t)) { continue; }
        let p = exp(nc(score(t - row0, kvc, off, d, causal_ar) * scale) - m);
        var w = 0.0;
        if (causal_ar) { w = p * inv; } else { w = div_rn(p, z); }
        if (f16) { w = f16r(w); }
        let vb = (t - row0) * kvc + off;
        for (var j = 0u; j < d; j = j + 1u) {
            var v = C[vb + j];
            if (f16 && !causal_ar) { v = f16r(v); }
            ov[j] = ov[j] + nc(w * v);
        }
    }
    if (phase == 3u && pu(14u) == 0u) {
        for (var j = 0u; j < d; j = j + 1u) { E[sb + 2u + j] = ov[j]; }
        return;
    }
    for (var j = 0u; j < d; j = j + 1u) { D[i * d + j] = ov[j]; }
}

// `attend` for an unsplit store (phase 0) by one 256-wide workgroup per (row, head), bit for
// bit: the same per-token arithmetic (score_wg is score on the query in workgroup memory), the
// maximum taken per invocation and then folded (a maximum does not depend on the order; of two
// zeros of either sign, which one is kept changes no exp(s - m) below), the sum of
// exponentials added by one invocation in token order (the exponentials of a tile of 256
// tokens computed in parallel first), and each output element d by its own invocation adding
// the tile's weighted values in token order, as `attend`'s loop does. Same parameters as
// `attend`; one workgroup an item over an (x, y) grid.
var<workgroup> aq: array<f32, 256>;
var<workgroup> aw: array<f32, 256>;
var<workgroup> arow: array<u32, 256>;
var<workgroup> acnt: u32;
var<workgroup> am: f32;
var<workgroup> az: f32;

fn score_wg(t: u32, kvc: u32, off: u32, d: u32, eight: bool) -> f32 {
    let kb = t * kvc + off;
    if (!eight) {
        var s = 0.0;
        for (var j = 0u; j < d; j = j + 1u) { s = s + nc(aq[j] * B[kb + j]); }
        return s;
    }
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let whole = d / 8u * 8u;
    for (var j = 0u; j < whole; j = j + 8u) {
        for (var u = 0u; u < 8u; u = u + 1u) { acc[u] = acc[u] + nc(aq[j + u] * B[kb + j + u]); }
    }
    for (var j = whole; j < d; j = j + 1u) { acc[j - whole] = acc[j - whole] + nc(aq[j] * B[kb + j]); }
    let s0 = acc[0] + acc[4];
    let s1 = acc[1] + acc[5];
    let s2 = acc[2] + acc[6];
    let s3 = acc[3] + acc[7];
    return (s0 + s2) + (s1 + s3);
}

@compute @workgroup_size(256)
fn attend_wg(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
             @builtin(local_invocation_index) l: u32) {
    let i = g.y * n.x + g.x;
    let nh = pu(1u);
    if (i >= pu(0u) * nh) { return; }
    let row = i / nh;
    let h = i % nh;
    let d = pu(3u);
    let f16 = pu(4u) != 0u;
    let causal_ar = pu(9u) != 0u;
    let kvc = pu(2u) * d;
    let off = (h / (nh / pu(2u))) * d;
    let row0 = pu(10u);
    if (l == 0u) {
        // `attend`'s counts, clamped as there.
        if (pu(5u) == 0u) {
            acnt = min(I[pu(8u) + row] + 1u, pu(7u));
        } else {
            acnt = min(J[row * pu(6u)], max(pu(6u), 1u) - 1u);
        }
    }
    if (l < d) {
        var x = A[i * d + l];
        if (f16) { x = f16r(x); }
        aq[l] = x;
    }
    let cnt = workgroupUniformLoad(&acnt);
    let scale = div_rn(1.0, sqrt_rn(f32(d)));
    // The maximum.
    var m = f_neg_inf();
    for (var x = l; x < cnt; x = x + 256u) {
        let t = token(row, x);
        if (!in_part(t)) { continue; }
        m = fmax(m, score_wg(t - row0, kvc, off, d, causal_ar) * scale);
    }
    aw[l] = m;
    workgroupBarrier();
    if (l == 0u) {
        var mm = f_neg_inf();
        for (var u = 0u; u < 256u; u = u + 1u) { mm = fmax(mm, aw[u]); }
        am = mm;
    }
    m = workgroupUniformLoad(&am);
    // The sum of exponentials, in token order.
    for (var x0 = 0u; x0 < cnt; x0 = x0 + 256u) {
        let x = x0 + l;
        arow[l] = NONE;
        if (x < cnt) {
            let t = token(row, x);
            if (in_part(t)) {
                aw[l] = exp(nc(score_wg(t - row0, kvc, off, d, causal_ar) * scale) - m);
                arow[l] = t;
            }
        }
        workgroupBarrier();
        if (l == 0u) {
            var z = 0.0;
            if (x0 > 0u) { z = az; }
            for (var u = 0u; u < min(256u, cnt - x0); u = u + 1u) {
                if (arow[u] != NONE) { z = z + aw[u]; }
            }
            az = z;
        }
        workgroupBarrier();
    }
    var z = 0.0;
    if (cnt > 0u) { z = workgroupUniformLoad(&az); }
    let inv = div_rn(1.0, z);
    // The weighted values: output element l adds the tile's tokens in order.
    var o = 0.0;
    for (var x0 = 0u; x0 < cnt; x0 = x0 + 256u) {
        let x = x0 + l;
        arow[l] = NONE;
        if (x < cnt) {
            let t = token(row, x);
            if (in_part(t)) {
                let p = exp(nc(score_wg(t - row0, kvc, off, d, causal_ar) * scale) - m);
                var w = 0.0;
                if (causal_ar) { w = p * inv; } else { w = div_rn(p, z); }
                if (f16) { w = f16r(w); }
                aw[l] = w;
                arow[l] = (t - row0) * kvc + off;
            }
        }
        workgroupBarrier();
        if (l < d) {
            for (var u = 0u; u < min(256u, cnt - x0); u = u + 1u) {
                let vb = arow[u];
                if (vb == NONE) { continue; }
                var v = C[vb + l];
                if (f16 && !causal_ar) { v = f16r(v); }
                o = o + nc(aw[u] * v);
            }
        }
        workgroupBarrier();
    }
    if (l < d) { D[i * d + l] = o; }
}

// ---- qwen4exp -----------------------------------------------------------------------------

// hc_mix's u: C[r][j] = (Σ_s σ(A[r][s·h + j])·B[r][s·h + j]) · p3, p0 rows, p1 streams, p2 h.
@compute @workgroup_size(64)
fn hc_u(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
        @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let h = pu(2u);
    let st = pu(1u);
    if (i >= pu(0u) * h) { return; }
    let r = i / h;
    let j = i % h;
    var acc = 0.0;
    for (var s = 0u; s < st; s = s + 1u) {
        let o = r * st * h + s * h + j;
        acc = acc + nc(sigm(A[o]) * B[o]);
    }
    C[i] = acc * pf(3u);
}

// hc_combine: A[r][s·h + j] += C[r][s]·B[r][j] (p3 = 1) or B[r][j]; p0 rows, p1 streams, p2 h.
@compute @workgroup_size(64)
fn hc_combine(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
              @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let h = pu(2u);
    let st = pu(1u);
    if (i >= pu(0u) * st * h) { return; }
    let j = i % h;
    let s = (i / h) % st;
    let r = i / (h * st);
    let y = B[r * h + j];
    if (pu(3u) != 0u) {
        A[i] = A[i] + nc(C[r * st + s] * y);
    } else {
        A[i] = A[i] + y;
    }
}

// Causal depthwise conv + silu: x A (p0 rows of p1 channels), kernel B ([c, p2]), history C
// (p4 rows), out D; taps p3 rows apart. Row index q < p4 reads the history.
@compute @workgroup_size(64)
fn conv_silu(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
             @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let c = pu(1u);
    if (i >= pu(0u) * c) { return; }
    let r = i / c;
    let ch = i % c;
    let k = pu(2u);
    let hist = pu(4u);
    var acc = 0.0;
    for (var tap = 0u; tap < k; tap = tap + 1u) {
        let q = hist + r - (k - 1u - tap) * pu(3u);
        var v = 0.0;
        if (q < hist) { v = C[q * c + ch]; } else { v = A[(q - hist) * c + ch]; }
        acc = acc + nc(B[ch * k + tap] * v);
    }
    D[i] = silu(acc);
}

// The conv history's new rows into D: the last p4 rows of [history C; x A] (p0 rows of p1).
@compute @workgroup_size(64)
fn conv_tail(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
             @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let c = pu(1u);
    let hist = pu(4u);
    if (i >= hist * c) { return; }
    let q = pu(0u) + i / c;
    if (q < hist) { D[i] = C[q * c + i % c]; } else { D[i] = A[(q - hist) * c + i % c]; }
}

// GDN gates per (row, value head): E[2i] = σ(b), E[2i+1] = exp(a_h·softplus(a + dt_h)); a A,
// b B, ssm_a C, dt_bias D; p0 rows, p1 value heads.
@compute @workgroup_size(64)
fn gdn_gates(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
             @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    if (i >= pu(0u) * pu(1u)) { return; }
    let h = i % pu(1u);
    E[2u * i] = sigm(B[i]);
    E[2u * i + 1u] = exp(C[h] * softplus(A[i] + D[h]));
}

var<workgroup> gq: array<f32, 256>;
var<workgroup> gk: array<f32, 256>;
var<workgroup> go: array<f32, 256>;
var<workgroup> gsc: vec2<f32>;

// Gated DeltaNet over the rows in order, one workgroup per value head h (invocation j owns the
// state's column j): qkv A, z B, gates C, state D (in place), out E, norm weight I (f32 bits).
// Rows p6..p0 of the step (the host splits a long step's rows over dispatches in order, the
// state carried in D: lavapipe's loop limiter, `gdn_rows`), p1 key heads, p2 value heads,
// p3 head_k (<= 256), p4 head_v (<= 256), p5 eps.
fn gdn_head(h: u32, t: u32, nt: u32) {
    let nk = pu(1u);
    let nv = pu(2u);
    let dk = pu(3u);
    let dv = pu(4u);
    let kg = h % nk;
    let conv = 2u * nk * dk + nv * dv;
    let sb = h * dk * dv;
    let qscale = div_rn(1.0, sqrt_rn(f32(dk)));
    for (var row = pu(6u); row < pu(0u); row = row + 1u) {
        let qb = row * conv + kg * dk;
        let kb = row * conv + nk * dk + kg * dk;
        if (t == 0u) {
            var sq = 0.0;
            var sk = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                sq = sq + nc(A[qb + i] * A[qb + i]);
                sk = sk + nc(A[kb + i] * A[kb + i]);
            }
            gsc = vec2<f32>(div_rn(1.0, sqrt_rn(sq + 1e-6)), div_rn(1.0, sqrt_rn(sk + 1e-6)));
        }
        workgroupBarrier();
        for (var i = t; i < dk; i = i + nt) {
            gq[i] = (A[qb + i] * gsc.x) * qscale;
            gk[i] = A[kb + i] * gsc.y;
        }
        workgroupBarrier();
        let beta = C[2u * (row * nv + h)];
        let decay = C[2u * (row * nv + h) + 1u];
        for (var j = t; j < dv; j = j + nt) {
            var ks = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                let s = D[sb + i * dv + j] * decay;
                D[sb + i * dv + j] = s;
                ks = ks + nc(gk[i] * s);
            }
            let delta = beta * (A[row * conv + 2u * nk * dk + h * dv + j] - ks);
            var o = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                let s = D[sb + i * dv + j] + nc(gk[i] * delta);
                D[sb + i * dv + j] = s;
                o = o + nc(gq[i] * s);
            }
            go[j] = o;
        }
        workgroupBarrier();
        if (t == 0u) {
            var ss = 0.0;
            for (var j = 0u; j < dv; j = j + 1u) { ss = ss + nc(go[j] * go[j]); }
            gsc = vec2<f32>(rms_scale(ss, dv, pf(5u)), 0.0);
        }
        workgroupBarrier();
        for (var j = t; j < dv; j = j + nt) {
            let zi = row * nv * dv + h * dv + j;
            E[zi] = ((go[j] * gsc.x) * bitcast<f32>(I[j])) * sigm(B[zi]);
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn gdn(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    gdn_head(g.x, t, 64u);
}

// `gdn` with a 128-wide workgroup: an invocation per value column (dv ≤ 128) instead of two,
// each column's sums in the same order, so the same bits (the GPUs' default, with the
// attention kernels).
@compute @workgroup_size(128)
fn gdn_wg(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    gdn_head(g.x, t, 128u);
}

// Mean of the p2 raw keys (A, p3 rows of p1) of the block row r's position I[p4 + r] completes;
// zeros for a row that completes none, NaN for a block the store does not hold. Out B. A is
// the store's part holding rows p5..p5 + p6; a split store runs this over each part in row
// order, the sum carried in B (p7 = 1 on the first part starts it, p8 = 1 on the last divides).
@compute @workgroup_size(64)
fn qsa_pool(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
            @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let d = pu(1u);
    if (i >= pu(0u) * d) { return; }
    let r = i / d;
    let c = i % d;
    let ratio = pu(2u);
    let p = I[pu(4u) + r];
    if ((p + 1u) % ratio != 0u) {
        B[i] = 0.0;
        return;
    }
    let b = p / ratio;
    if ((b + 1u) * ratio > pu(3u)) {
        B[i] = f_nan();
        return;
    }
    let row0 = pu(5u);
    var acc = 0.0;
    if (pu(7u) == 0u) { acc = B[i]; }
    let q0 = max(b * ratio, row0);
    let q1 = min((b + 1u) * ratio, row0 + pu(6u));
    for (var q = q0; q < q1; q = q + 1u) { acc = acc + A[(q - row0) * d + c]; }
    if (pu(8u) != 0u) { B[i] = div_rn(acc, f32(ratio)); } else { B[i] = acc; }
}

// Scratch of qsa_select: block scores C (p9 a row), heap indices and flags K (2·p10 a row,
// then the selection's saved state: 2·p10 + 8 words a row).
fn tok_score(row: u32, t: u32, nbr: u32, ratio: u32) -> f32 {
    if (t < nbr) { return C[row * pu(9u) + t / ratio]; }
    return 1e9;
}

fn heap_push(base: u32, hole0: u32, top: u32, value: u32, row: u32, nbr: u32, ratio: u32) {
    var hole = hole0;
    let vv = tok_score(row, value, nbr, ratio);
    loop {
        if (hole <= top) { break; }
        let parent = (hole - 1u) / 2u;
        if (!(tok_score(row, K[base + parent], nbr, ratio) > vv)) { break; }
        K[base + hole] = K[base + parent];
        hole = parent;
    }
    K[base + hole] = value;
}

fn heap_adjust(base: u32, hole0: u32, len: u32, value: u32, row: u32, nbr: u32, ratio: u32) {
    let top = hole0;
    var hole = hole0;
    var second = hole0;
    var lim = 0u;
    if (len > 0u) { lim = (len - 1u) / 2u; }
    loop {
        if (second >= lim) { break; }
        second = 2u * (second + 1u);
        if (tok_score(row, K[base + second], nbr, ratio) > tok_score(row, K[base + second - 1u], nbr, ratio)) {
            second = second - 1u;
        }
        K[base + hole] = K[base + second];
        hole = second;
    }
    if ((len & 1u) == 0u && len >= 2u && second == (len - 2u) / 2u) {
        second = 2u * (second + 1u);
        K[base + hole] = K[base + second - 1u];
        hole = second - 1u;
    }
    heap_push(base, hole, top, value, row, nbr, ratio);
}

// f32 total order as an unsigned key (Rust's total_cmp).
fn tkey(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if ((u & 0x80000000u) != 0u) { return ~u; }
    return u | 0x80000000u;
}

// qsa_select's block scores with a 64-wide workgroup per (row, block of the part), bit for
// bit: invocation h takes head h's dot product in qsa_select's order, then one invocation adds
// the heads' relu(dot) in head order and scales, as qsa_select's loop does. Same parameters as
// qsa_select (p11 the part's first block, p12 its blocks: one workgroup each, p14 the x groups);
// a qsa_select dispatch with p12 = 0 (no scoring) selects afterwards. At most 256 heads.
var<workgroup> qdots: array<f32, 256>;

@compute @workgroup_size(64)
fn qsa_score(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let item = g.y * pu(14u) + g.x;
    let prows = max(pu(12u), 1u);
    let row = item / prows;
    let row0 = pu(11u);
    let b = row0 + item % prows;
    let qc = pu(1u);
    let d = pu(2u);
    let heads = qc / d;
    var live = row < pu(0u);
    if (live) {
        let pos = I[pu(8u) + row];
        live = b < min((pos + 1u) / pu(3u), pu(7u));
    }
    for (var h = l; h < heads; h = h + 64u) {
        var dot = 0.0;
        if (live) {
            for (var j = 0u; j < d; j = j + 1u) { dot = dot + nc(A[row * qc + h * d + j] * B[(b - row0) * d + j]); }
        }
        qdots[h] = dot;
    }
    workgroupBarrier();
    if (l == 0u && live) {
        var s = 0.0;
        for (var h = 0u; h < heads; h = h + 1u) { s = s + fmax(qdots[h], 0.0); }
        C[row * pu(9u) + b] = s * div_rn(1.0, sqrt_rn(f32(d)));
    }
}

// QSA selection, one invocation per query row: queries A (p0 rows of p1, heads of p2), pooled
// blocks B (p7 rows), positions I from p8, block size p3, budget p4, rule p5 (0 reference,
// 1 llama.cpp). Out J: per row [count, tokens ascending] in rows of p6. This dispatch scores
// blocks p11..p11 + p12 of B, the store's part whose first block is p14: a split store scores
// each part's blocks in turn, a long part in ranges a dispatch (lavapipe's loop limiter), and
// selects with the last (p13 = 1: select after scoring).
@compute @workgroup_size(64)
fn qsa_select(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
              @builtin(local_invocation_index) l: u32) {
    let row = lin(g, n, l);
    if (row >= pu(0u)) { return; }
    let qc = pu(1u);
    let d = pu(2u);
    let ratio = pu(3u);
    let budget = pu(4u);
    let pos = I[pu(8u) + row];
    let nb = min((pos + 1u) / ratio, pu(7u));
    let scale = div_rn(1.0, sqrt_rn(f32(d)));
    let sbase = row * pu(9u);
    let row0 = pu(11u);
    let part0 = pu(14u);
    for (var b = row0; b < min(nb, row0 + pu(12u)); b = b + 1u) {
        var s = 0.0;
        for (var h = 0u; h < qc / d; h = h + 1u) {
            var dot = 0.0;
            for (var j = 0u; j < d; j = j + 1u) { dot = dot + nc(A[row * qc + h * d + j] * B[(b - part0) * d + j]); }
            s = s + fmax(dot, 0.0);
        }
        C[sbase + b] = s * scale;
    }
    if (pu(13u) == 0u) { return; }
    // The selection as a resumable loop of small steps: p13 = 1 starts it, 2 resumes it from
    // the row's saved state (phase, index, pick, best, its key, count: 6 words after the
    // flags); p15 > 0 bounds the loop iterations this dispatch spends (lavapipe's loop
    // limiter: the host dispatches until every row is done), 0 runs it to the end. The steps
    // are the baseline's loops' bodies in their order, so the same selection.
    let kb = row * (2u * pu(10u) + 8u);
    let fl = kb + pu(10u);
    let sv = fl + pu(10u);
    let ob = row * pu(6u);
    var ph = 0u;
    var i = 0u;
    var x = 0u;
    var best = NONE;
    var bk = 0u;
    var cnt = 0u;
    if (pu(13u) == 2u) {
        ph = K[sv];
        i = K[sv + 1u];
        x = K[sv + 2u];
        best = K[sv + 3u];
        bk = K[sv + 4u];
        cnt = K[sv + 5u];
    }
    if (ph == NONE) { return; }
    var fuel = pu(15u);
    if (fuel == 0u) { fuel = 0xffffffffu; }
    let total = pos + 1u;
    let nbr = nb * ratio;
    let k = min(total, budget + ratio - 1u);
    let keep = min(budget / ratio, nb);
    // A heap adjustment's most iterations (its descent and its push).
    let step = 2u * (32u - countLeadingZeros(max(k, 1u))) + 4u;
    if (pu(5u) == 0u) {
        // One loop without inner loops: a step is one iteration of the limiter.
        loop {
            if (ph == NONE || fuel < 4u) { break; }
            fuel = fuel - 1u;
            if (ph == 0u) {
                // The flags cleared.
                if (i < nb) {
                    K[fl + i] = 0u;
                    i = i + 1u;
                } else {
                    ph = 1u;
                    i = 0u;
                    x = 0u;
                    best = NONE;
                }
            } else if (ph == 1u) {
                // Pick x: the first unflagged block of the largest score.
                if (x >= keep) {
                    ph = 2u;
                    i = 0u;
                    x = 0u;
                } else if (i < nb) {
                    if (K[fl + i] == 0u) {
                        let kk = tkey(C[sbase + i]);
                        if (best == NONE || kk > bk) {
                            best = i;
                            bk = kk;
                        }
                    }
                    i = i + 1u;
                } else {
                    K[fl + best] = 1u;
                    x = x + 1u;
                    i = 0u;
                    best = NONE;
                }
            } else if (ph == 2u) {
                // The picked blocks' tokens, ascending, one a step (x: the token in block i).
                if (i >= nb) {
                    ph = 3u;
                    i = nb * ratio;
                } else if (K[fl + i] == 0u) {
                    i = i + 1u;
                } else {
                    cnt = cnt + 1u;
                    J[ob + cnt] = i * ratio + x;
                    x = x + 1u;
                    if (x == ratio) {
                        x = 0u;
                        i = i + 1u;
                    }
                }
            } else {
                // The incomplete block's tokens.
                if (i <= pos) {
                    cnt = cnt + 1u;
                    J[ob + cnt] = i;
                    i = i + 1u;
                } else {
                    ph = NONE;
                }
            }
        }
    } else {
        // A step costs 5 (this loop and the two adjustments' two loops each, entered even
        // where no lane adjusts) and an adjustment its own iterations.
        loop {
            if (ph == NONE || fuel < step + 8u) { break; }
            fuel = fuel - 5u;
            if (ph == 0u) {
                if (i < total) {
                    K[kb + i] = i;
                    K[fl + i] = 0u;
                    i = i + 1u;
                } else if (k >= 2u) {
                    ph = 1u;
                    i = (k - 2u) / 2u;
                } else {
                    ph = 2u;
                    i = k;
                }
            } else if (ph == 1u) {
                // The heap built, parents from the last down.
                heap_adjust(kb, i, k, K[kb + i], row, nbr, ratio);
                fuel = fuel - step;
                if (i == 0u) {
                    ph = 2u;
                    i = k;
                } else {
                    i = i - 1u;
                }
            } else if (ph == 2u) {
                // The rest of the tokens against the heap's top.
                if (k == 0u || i >= total) {
                    ph = 3u;
                    i = 0u;
                } else {
                    if (tok_score(row, K[kb + i], nbr, ratio) > tok_score(row, K[kb], nbr, ratio)) {
                        let v = K[kb + i];
                        K[kb + i] = K[kb];
                        heap_adjust(kb, 0u, k, v, row, nbr, ratio);
                        fuel = fuel - step;
                    }
                    i = i + 1u;
                }
            } else if (ph == 3u) {
                if (i < k) {
                    K[fl + K[kb + i]] = 1u;
                    i = i + 1u;
                } else {
                    ph = 4u;
                    i = 0u;
                }
            } else {
                if (i < total) {
                    if (K[fl + i] != 0u) {
                        cnt = cnt + 1u;
                        J[ob + cnt] = i;
                    }
                    i = i + 1u;
                } else {
                    ph = NONE;
                }
            }
        }
    }
    if (ph == NONE) { J[ob] = cnt; }
    K[sv] = ph;
    K[sv + 1u] = i;
    K[sv + 2u] = x;
    K[sv + 3u] = best;
    K[sv + 4u] = bk;
    K[sv + 5u] = cnt;
}

// PLE gate per (row, stream): z = <K_s, Q_s>·p3 (A, B: p0 rows of p1 streams × p2), out D =
// σ(sign(z)·sqrt(max(|z|, 1e-6)))·V (C, p0 rows of p2).
@compute @workgroup_size(64)
fn ple_gate(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
            @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let st = pu(1u);
    let h = pu(2u);
    if (i >= pu(0u) * st) { return; }
    let r = i / st;
    let base = i * h;
    var z = 0.0;
    for (var j = 0u; j < h; j = j + 1u) { z = z + nc(A[base + j] * B[base + j]); }
    z = z * pf(3u);
    var sg = 0.0;
    if (z > 0.0) { sg = sqrt_rn(fmax(abs(z), 1e-6)); }
    if (z < 0.0) { sg = -sqrt_rn(fmax(abs(z), 1e-6)); }
    let gamma = sigm(sg);
    for (var j = 0u; j < h; j = j + 1u) { D[base + j] = gamma * C[r * h + j]; }
}

// MoE combine: A[r][c] = Σ_j C[r·p1 + j]·B[(r·p1 + j)·p2 + c], from 0 in rank order (p0 rows).
@compute @workgroup_size(64)
fn moe_sum(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>,
           @builtin(local_invocation_index) l: u32) {
    let i = lin(g, n, l);
    let k = pu(1u);
    let h = pu(2u);
    if (i >= pu(0u) * h) { return; }
    let r = i / h;
    let c = i % h;
    var acc = 0.0;
    for (var j = 0u; j < k; j = j + 1u) { acc = acc + nc(C[r * k + j] * B[(r * k + j) * h + c]); }
    A[i] = acc;
}
