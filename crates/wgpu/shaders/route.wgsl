// route: softmax over each row's expert logits (max, exp(l − max), the sum in expert order,
// p = e / s correctly rounded), top-k by p with ties to the lower expert, weights p / Σ p in
// rank order. Both variants compute the same p with the same operations (the sum is always
// sequential, in expert order), so they agree bitwise; against the CPU only `exp` differs.
// Parameters: 0 experts (≤ 512), 1 k (≤ 16), 2 rows.

@group(0) @binding(1) var<storage, read_write> L: array<f32>;
@group(0) @binding(2) var<storage, read_write> IDS: array<i32>;
@group(0) @binding(3) var<storage, read_write> WT: array<f32>;

var<workgroup> sh_p: array<f32, 512>;
var<workgroup> sh_key: array<u32, 256>;
var<workgroup> sh_idx: array<u32, 256>;
var<workgroup> sh_taken: array<u32, 512>;
var<workgroup> sh_s: f32;

fn renorm(row: u32, k: u32) {
    var s = 0.0;
    for (var r = 0u; r < k; r = r + 1u) { s = s + WT[row * k + r]; }
    for (var r = 0u; r < k; r = r + 1u) { WT[row * k + r] = div_rn(WT[row * k + r], s); }
}

// One invocation per row, everything in order (the report's repeated argmax).
@compute @workgroup_size(1)
fn route_base(@builtin(workgroup_id) g: vec3<u32>) {
    let ne = pu(0u);
    let k = pu(1u);
    let row = g.x;
    var m = f_neg_inf();
    for (var e = 0u; e < ne; e = e + 1u) {
        let v = L[row * ne + e];
        if (v > m) { m = v; }
    }
    var p: array<f32, 512>;
    var s = 0.0;
    for (var e = 0u; e < ne; e = e + 1u) {
        p[e] = exp(L[row * ne + e] - m);
        s = s + p[e];
    }
    for (var e = 0u; e < ne; e = e + 1u) { p[e] = div_rn(p[e], s); }
    var taken: array<u32, 16>;
    for (var r = 0u; r < k; r = r + 1u) {
        var best = 0xffffffffu;
        for (var e = 0u; e < ne; e = e + 1u) {
            var t = false;
            for (var q = 0u; q < r; q = q + 1u) { if (taken[q] == e) { t = true; } }
            if (t) { continue; }
            if (best == 0xffffffffu || fkey(p[e]) > fkey(p[best])) { best = e; }
        }
        if (best == 0xffffffffu) { best = 0u; }
        taken[r] = best;
        IDS[row * k + r] = i32(best);
        WT[row * k + r] = p[best];
    }
    renorm(row, k);
}

// A workgroup per row: parallel exponentials, divisions and arg-max trees.
@compute @workgroup_size(256)
fn route_opt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = g.x;
    // Maximum: a tree over keys (exact in any order).
    var mk = 0u;
    for (var e = t; e < SPEC_E; e = e + 256u) { mk = max(mk, fkey(L[row * SPEC_E + e])); }
    sh_key[t] = mk;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { sh_key[t] = max(sh_key[t], sh_key[t + s]); }
        workgroupBarrier();
    }
    // Back from the key to the value: keys of numbers are invertible.
    let kk = sh_key[0];
    var m = 0.0;
    if ((kk & 0x80000000u) != 0u) { m = bitcast<f32>(kk & 0x7fffffffu); } else { m = bitcast<f32>(~kk); }
    workgroupBarrier();
    for (var e = t; e < SPEC_E; e = e + 256u) {
        sh_p[e] = exp(L[row * SPEC_E + e] - m);
        sh_taken[e] = 0u;
    }
    workgroupBarrier();
    if (t == 0u) {
        var s = 0.0;
        for (var e = 0u; e < SPEC_E; e = e + 1u) { s = s + sh_p[e]; }
        sh_s = s;
    }
    workgroupBarrier();
    let s = sh_s;
    for (var e = t; e < SPEC_E; e = e + 256u) { sh_p[e] = div_rn(sh_p[e], s); }
    workgroupBarrier();
    for (var r = 0u; r < SPEC_K; r = r + 1u) {
        var bk = 0u;
        var bi = 0xffffffffu;
        for (var e = t; e < SPEC_E; e = e + 256u) {
            if (sh_taken[e] == 0u) {
                let ke = fkey(sh_p[e]) + 1u;
                if (ke > bk) { bk = ke; bi = e; }
            }
        }
        sh_key[t] = bk;
        sh_idx[t] = bi;
        workgroupBarrier();
        for (var h = 128u; h > 0u; h = h >> 1u) {
            if (t < h) {
                let ok = sh_key[t + h];
                let oi = sh_idx[t + h];
                if (ok > sh_key[t] || (ok == sh_key[t] && oi < sh_idx[t])) {
                    sh_key[t] = ok;
                    sh_idx[t] = oi;
                }
            }
            workgroupBarrier();
        }
        var b = sh_idx[0];
        if (b == 0xffffffffu) { b = 0u; }
        if (t == 0u) {
            sh_taken[b] = 1u;
            IDS[row * SPEC_K + r] = i32(b);
            WT[row * SPEC_K + r] = sh_p[b];
        }
        workgroupBarrier();
    }
    if (t == 0u) { renorm(row, SPEC_K); }
}
