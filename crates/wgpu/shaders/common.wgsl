// strata wgpu kernels: shared helpers, prepended to every module by strata-wgpu.
//
// Exactness across drivers (DESIGN.md §3): WGSL's + and * are correctly rounded, but a driver
// may fuse `a*b + c` into one FMA (NVIDIA's Vulkan driver does, lavapipe does not), and `/`,
// `sqrt`, `exp` are approximate. So every product that feeds an add goes through `nc()` (its
// bits XOR a run-time zero from the parameters: no compiler can see through it, so no fusion),
// and the few divisions and square roots whose bits matter use `div_rn` / `sqrt_rn`, integer
// implementations of IEEE round-to-nearest-even. Float comparisons that must survive NaN use
// the bit patterns (an implementation may assume floats are finite). Reductions use fixed trees
// in workgroup memory, never subgroup operations, so the bits do not depend on the subgroup size.

// Thirty-two parameter words; word 31 is always 0 (the `nc` barrier). `P` itself is declared
// by strata-wgpu before this file: immediates where the device has them, else a uniform buffer
// at binding 0 (shaders.rs, `source_for`).
struct Params { v: array<vec4<u32>, 8> }

fn pu(i: u32) -> u32 { return P.v[i >> 2u][i & 3u]; }
fn pi(i: u32) -> i32 { return bitcast<i32>(pu(i)); }
fn pf(i: u32) -> f32 { return bitcast<f32>(pu(i)); }

// A product (or any value) that no driver may fuse into a following add.
fn nc(x: f32) -> f32 { return bitcast<f32>(bitcast<u32>(x) ^ P.v[7].w); }

// 1 / (1 + exp(-x)): the CPU's sigmoid (only exp is the driver's), and silu; shared by
// model.wgsl's element-wise ops and the products' epilogues (mq.wgsl), so both give one value.
fn sigm(x: f32) -> f32 { return div_rn(1.0, 1.0 + exp(-x)); }
fn silu(x: f32) -> f32 { return x * sigm(x); }

fn f_nan() -> f32 { return bitcast<f32>(0x7fc00000u); }
fn f_neg_inf() -> f32 { return bitcast<f32>(0xff800000u); }
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// ---- half and bfloat ---------------------------------------------------------------------

fn f16_to_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        if (m == 0u) { return bitcast<f32>(s); }
        var mm = m;
        var ee = 113u;
        loop {
            if ((mm & 0x400u) != 0u) { break; }
            mm = mm << 1u;
            ee = ee - 1u;
        }
        return bitcast<f32>(s | (ee << 23u) | ((mm & 0x3ffu) << 13u));
    }
    if (e == 31u) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// Round to nearest even, subnormals kept, NaN quiet (the `half` crate's conversion).
fn f32_to_f16(f: f32) -> u32 {
    let x = bitcast<u32>(f);
    let sign = (x >> 16u) & 0x8000u;
    let ex = x & 0x7f800000u;
    var man = x & 0x007fffffu;
    if (ex == 0x7f800000u) {
        var nan_bit = 0u;
        if (man != 0u) { nan_bit = 0x200u; }
        return sign | 0x7c00u | nan_bit | (man >> 13u);
    }
    let he = i32(ex >> 23u) - 127 + 15;
    if (he >= 31) { return sign | 0x7c00u; }
    if (he <= 0) {
        if (14 - he > 24) { return sign; }
        man = man | 0x00800000u;
        let sh = u32(14 - he);
        var hm = man >> sh;
        let rb = 1u << (sh - 1u);
        if ((man & rb) != 0u && (man & (3u * rb - 1u)) != 0u) { hm = hm + 1u; }
        return sign | hm;
    }
    let v = sign | (u32(he) << 10u) | (man >> 13u);
    if ((man & 0x1000u) != 0u && (man & 0x2fffu) != 0u) { return v + 1u; }
    return v;
}

fn bf16_to_f32(b: u32) -> f32 { return bitcast<f32>((b & 0xffffu) << 16u); }

// ggml_fp32_to_bf16: round to nearest even, NaN kept quiet, subnormals not flushed.
fn f32_to_bf16(f: f32) -> u32 {
    let u = bitcast<u32>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return ((u >> 16u) | 0x40u) & 0xffffu; }
    return ((u + (0x7fffu + ((u >> 16u) & 1u))) >> 16u) & 0xffffu;
}

// ---- correctly rounded division and square root -------------------------------------------

// Rounds a 25-bit quotient/root `q` (value q·2^-24 in [1, 2), times 2^(e-127)) with sticky bit.
fn round_pack(sign: u32, e: i32, q: u32, sticky: bool) -> f32 {
    var sh = 1u;
    if (e < 1) {
        if (2 - e > 25) { return bitcast<f32>(sign); }
        sh = u32(2 - e);
    }
    var keep = q >> sh;
    let rem = q & ((1u << sh) - 1u);
    let half = 1u << (sh - 1u);
    if (rem > half || (rem == half && (sticky || (keep & 1u) != 0u))) { keep = keep + 1u; }
    var base = 0u;
    if (e >= 1) { base = u32(e - 1) << 23u; }
    let bits = base + keep;
    if (bits >= 0x7f800000u) { return bitcast<f32>(sign | 0x7f800000u); }
    return bitcast<f32>(sign | bits);
}

// Unpacks a finite nonzero |x| to (mantissa in [2^23, 2^24), biased exponent, may be <= 0).
fn unpack_norm(u: u32) -> vec2<i32> {
    var e = i32((u >> 23u) & 0xffu);
    var m = u & 0x7fffffu;
    if (e == 0) {
        e = 1;
        loop {
            if ((m & 0x800000u) != 0u) { break; }
            m = m << 1u;
            e = e - 1;
        }
    } else {
        m = m | 0x800000u;
    }
    return vec2<i32>(bitcast<i32>(m), e);
}

// a / b, IEEE round to nearest even (NaN results are the default quiet NaN).
fn div_rn(a: f32, b: f32) -> f32 {
    let ua = bitcast<u32>(a);
    let ub = bitcast<u32>(b);
    let s = (ua ^ ub) & 0x80000000u;
    let aa = ua & 0x7fffffffu;
    let ab = ub & 0x7fffffffu;
    if (aa > 0x7f800000u || ab > 0x7f800000u) { return f_nan(); }
    if ((aa == 0x7f800000u && ab == 0x7f800000u) || (aa == 0u && ab == 0u)) { return f_nan(); }
    if (aa == 0x7f800000u || ab == 0u) { return bitcast<f32>(s | 0x7f800000u); }
    if (ab == 0x7f800000u || aa == 0u) { return bitcast<f32>(s); }
    let na = unpack_norm(aa);
    let nb = unpack_norm(ab);
    var ma = bitcast<u32>(na.x);
    let mb = bitcast<u32>(nb.x);
    var e = na.y - nb.y + 127;
    if (ma < mb) {
        ma = ma << 1u;
        e = e - 1;
    }
    var q = 0u;
    var r = ma;
    for (var i = 0u; i < 25u; i = i + 1u) {
        q = q << 1u;
        if (r >= mb) {
            r = r - mb;
            q = q | 1u;
        }
        r = r << 1u;
    }
    return round_pack(s, e, q, r != 0u);
}

// sqrt(x), IEEE round to nearest (sqrt(-0) = -0, negative x gives NaN).
fn sqrt_rn(x: f32) -> f32 {
    let u = bitcast<u32>(x);
    let a = u & 0x7fffffffu;
    if (a > 0x7f800000u) { return f_nan(); }
    if (a == 0u) { return x; }
    if ((u & 0x80000000u) != 0u) { return f_nan(); }
    if (a == 0x7f800000u) { return x; }
    let n = unpack_norm(a);
    var m = bitcast<u32>(n.x);
    var ee = n.y - 127;
    if ((ee & 1) != 0) {
        m = m << 1u;
        ee = ee - 1;
    }
    // Integer square root of m·2^25 (50 bits), two radicand bits per step: 25 result bits.
    var rem = 0u;
    var root = 0u;
    for (var j = 0u; j < 25u; j = j + 1u) {
        let p1 = 49u - 2u * j;
        var pair = 0u;
        if (p1 >= 25u) { pair = ((m >> (p1 - 25u)) & 1u) << 1u; }
        if (p1 - 1u >= 25u) { pair = pair | ((m >> (p1 - 26u)) & 1u); }
        rem = (rem << 2u) | pair;
        let trial = (root << 2u) | 1u;
        if (rem >= trial) {
            rem = rem - trial;
            root = (root << 1u) | 1u;
        } else {
            root = root << 1u;
        }
    }
    return round_pack(0u, ee / 2 + 127, root, rem != 0u);
}

// 1/sqrt(sum/n + eps), each operation correctly rounded (the CPU kernels' rms_scale).
fn rms_scale(sumsq: f32, n: u32, eps: f32) -> f32 {
    return div_rn(1.0, sqrt_rn(div_rn(sumsq, f32(n)) + eps));
}

// ---- integers ------------------------------------------------------------------------------

// Rust's `f as i8` after rounding: saturating, NaN to 0.
fn sat_i8(f: f32) -> i32 {
    if (is_nan(f)) { return 0; }
    if (f >= 127.0) { return 127; }
    if (f <= -128.0) { return -128; }
    return i32(f);
}

// Round half to even for |v| < 2^22 by adding and removing 1.5·2^23 (the CPU's rne).
fn rne(v: f32) -> f32 {
    if ((bitcast<u32>(v) & 0x7fffffffu) < 0x4a800000u) {
        return nc(v + 12582912.0) - 12582912.0;
    }
    return v;
}

// ggml's nearest_int bit trick.
fn nearest_int(x: f32) -> i32 {
    let v = nc(x + 12582912.0);
    return bitcast<i32>(bitcast<u32>(v) & 0x007fffffu) - 0x00400000;
}

fn sext8(b: u32) -> i32 { return (bitcast<i32>(b << 24u)) >> 24u; }

// An order key for non-NaN floats (−0.0 ties +0.0); NaN gets 0, below every number.
fn fkey(x: f32) -> u32 {
    var u = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return 0u; }
    if ((u & 0x7fffffffu) == 0u) { u = 0u; }
    if ((u & 0x80000000u) != 0u) { return ~u; }
    return u | 0x80000000u;
}

// ---- the canonical 256-lane sum ------------------------------------------------------------

var<workgroup> red: array<f32, 256>;

// strata_engine::kernels::norm::reduce_lanes: each group of 32 lanes halved (16, 8, 4, 2, 1
// apart), then the 8 group sums halved (4, 2, 1). Every invocation returns the total.
fn block_sum256(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s = s >> 1u) {
        if ((t & 31u) < s) { red[t] = red[t] + red[t + s]; }
        workgroupBarrier();
    }
    for (var s = 4u; s > 0u; s = s >> 1u) {
        if (t < s) { red[32u * t] = red[32u * t] + red[32u * (t + s)]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
