// combine_gnorm: per token and stream, r = h_s + e, then o = (r·scale)·w_s with the stream's
// RMS scale (canonical lane order, correctly rounded scale). Parameters: 0 n, 1 eps bits,
// 2 streams, 3 tokens. The baseline runs one workgroup per token over its streams; the
// optimized one a workgroup per (token, stream).

@group(0) @binding(1) var<storage, read_write> H: array<f32>;
@group(0) @binding(2) var<storage, read_write> E: array<f32>;
@group(0) @binding(3) var<storage, read_write> WS: array<f32>;
@group(0) @binding(4) var<storage, read_write> R: array<f32>;
@group(0) @binding(5) var<storage, read_write> O: array<f32>;

fn combine_one(tok: u32, s: u32, n: u32, streams: u32, eps: f32, t: u32) {
    let base = (tok * streams + s) * n;
    var acc = 0.0;
    for (var i = t; i < n; i = i + 256u) {
        let r = H[base + i] + E[tok * n + i];
        R[base + i] = r;
        acc = acc + nc(r * r);
    }
    let sc = rms_scale(block_sum256(acc, t), n, eps);
    for (var i = t; i < n; i = i + 256u) {
        let r = H[base + i] + E[tok * n + i];
        O[base + i] = (r * sc) * WS[s * n + i];
    }
}

@compute @workgroup_size(256)
fn combine_gnorm_base(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let streams = pu(2u);
    for (var s = 0u; s < streams; s = s + 1u) { combine_one(g.x, s, pu(0u), streams, pf(1u), t); }
}

@compute @workgroup_size(256)
fn combine_gnorm_opt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    combine_one(g.x / SPEC_S, g.x % SPEC_S, SPEC_N, SPEC_S, pf(1u), t);
}
