// gemv: y[t][r] = W[r] · x_t, weights decoded element by element (quants.wgsl), activations
// in the paired format (Q8_0, Q8_K or BF16). Per (row, token) the order is fixed: lane l adds
// nc(w_i·x_i) for i = l + 256k, k ascending, then block_sum256 — so both variants give the
// same bits on any adapter and subgroup size. The baseline runs one workgroup per (row,
// token); the optimized one a workgroup per row for all tokens (each weight decoded once).
// Parameters: 0 weight format id, 1 rows, 2 k, 3 tokens, 4 weight row bytes, 5 activation
// row bytes, 6 weight block size, 7 weight block bytes, 8 activation format code.

// The block decoders' f16 scales: the integer decoder.
fn f16v(h: u32) -> f32 { return f16_to_f32(h); }

@group(0) @binding(1) var<storage, read_write> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> TAB: array<u32>;

fn xb(o: u32) -> u32 { return (XQ[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu; }
fn xh(o: u32) -> u32 { return xb(o) | (xb(o + 1u) << 8u); }

// Element i of activation row tok.
fn xv(fmt: u32, xrb: u32, tok: u32, i: u32) -> f32 {
    let r = tok * xrb;
    if (fmt == 1u) { return bf16_to_f32(xh(r + 2u * i)); }
    if (fmt == 2u) {
        let b = r + 34u * (i / 32u);
        return f32(sext8(xb(b + 2u + i % 32u))) * f16_to_f32(xh(b));
    }
    // Q8_K: d (f32) at 0, codes at 4.
    let b = r + 292u * (i / 256u);
    return bitcast<f32>(XQ[b >> 2u]) * f32(sext8(xb(b + 4u + i % 256u)));
}

@compute @workgroup_size(256)
fn gemv_base(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let ty = pu(0u);
    let rows = pu(1u);
    let k = pu(2u);
    let wrb = pu(4u);
    let bs = pu(6u);
    let ts = pu(7u);
    let row = g.x;
    let tok = g.y;
    var acc = 0.0;
    for (var i = t; i < k; i = i + 256u) {
        let w = deq(ty, row * wrb + (i / bs) * ts, i % bs);
        acc = acc + nc(w * xv(pu(8u), pu(5u), tok, i));
    }
    let s = block_sum256(acc, t);
    if (t == 0u) { Y[tok * rows + row] = s; }
}

@compute @workgroup_size(256)
fn gemv_opt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(1u);
    let row = g.x;
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (var i = t; i < SPEC_K; i = i + 256u) {
        let w = deq(SPEC_TY, row * SPEC_WRB + (i / SPEC_BS) * SPEC_TS, i % SPEC_BS);
        for (var tok = 0u; tok < SPEC_NT; tok = tok + 1u) {
            acc[tok] = acc[tok] + nc(w * xv(SPEC_XF, SPEC_XRB, tok, i));
        }
    }
    for (var tok = 0u; tok < SPEC_NT; tok = tok + 1u) {
        let s = block_sum256(acc[tok], t);
        if (t == 0u) { Y[tok * rows + row] = s; }
    }
}
