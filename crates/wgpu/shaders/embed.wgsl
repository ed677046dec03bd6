// embed: rows `ids` of a table in one of the 13 report formats, decoded element by element
// (quants.wgsl). An id at or past the table's rows gives a NaN row (no read out of bounds).
// Parameters: 0 format id, 1 row length, 2 row bytes, 3 table rows, 4 block size,
// 5 block bytes. One workgroup per id.

// The block decoders' f16 scales: the integer decoder.
fn f16v(h: u32) -> f32 { return f16_to_f32(h); }

@group(0) @binding(1) var<storage, read_write> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> IDS: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> TAB: array<u32>;

fn embed_row(slot: u32, ty: u32, n: u32, rb: u32, rows: u32, bs: u32, ts: u32, t: u32) {
    let id = IDS[slot];
    for (var i = t; i < n; i = i + 256u) {
        var v = f_nan();
        if (id < rows) {
            v = deq(ty, id * rb + (i / bs) * ts, i % bs);
        }
        Y[slot * n + i] = v;
    }
}

@compute @workgroup_size(256)
fn embed_base(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    embed_row(g.x, pu(0u), pu(1u), pu(2u), pu(3u), pu(4u), pu(5u), t);
}

@compute @workgroup_size(256)
fn embed_opt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    // The format and shape are constants here, so the decoder's switch folds away.
    embed_row(g.x, SPEC_TY, SPEC_N, SPEC_RB, pu(3u), SPEC_BS, SPEC_TS, t);
}
