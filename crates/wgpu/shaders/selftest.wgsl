// The arithmetic helpers of common.wgsl, element by element, for the tests that hold them
// against the CPU's IEEE operations: OUT[4i..4i+4] = div_rn(a, b), sqrt_rn(|a|),
// f32_to_f16(a) | f32_to_bf16(a) << 16, f16_to_f32(low half of b's bits).

@group(0) @binding(1) var<storage, read_write> A: array<f32>;
@group(0) @binding(2) var<storage, read_write> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<u32>;

@compute @workgroup_size(64)
fn arith(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= pu(0u)) { return; }
    let a = A[i];
    let b = B[i];
    OUT[4u * i] = bitcast<u32>(div_rn(a, b));
    OUT[4u * i + 1u] = bitcast<u32>(sqrt_rn(bitcast<f32>(bitcast<u32>(a) & 0x7fffffffu)));
    OUT[4u * i + 2u] = f32_to_f16(a) | (f32_to_bf16(a) << 16u);
    OUT[4u * i + 3u] = bitcast<u32>(f16_to_f32(bitcast<u32>(b) & 0xffffu));
}
