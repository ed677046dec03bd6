// Block decoders of the 13 report formats, one element at a time, transcribed from
// strata_engine::kernels::embed::dequant_block (products `(d·s)·q`, then `− m` after an `nc`
// barrier: never fused). The module that includes this declares `W` (the quantized bytes as
// little-endian u32 words) and `TAB` (the grids: IQ3_S at 0, IQ3_XXS at 512, the IQ2_XS sign
// table at 768, the IQ4_NL values at 896, IQ2_XS's grid at 912, IQ2_S's at 1936, two words an
// entry, IQ2_XXS's at 3984, IQ1_S's (shared by IQ1_M) at 4496). The format ids `T_*` are
// prepended by strata-wgpu. IQ2_S, MXFP4, NVFP4 and the formats added in session 6 (Q4_1,
// Q5_1, Q2_K, IQ2_XXS, IQ1_S, IQ1_M, TQ1_0, TQ2_0, Q1_0) follow strata_quant's decoders
// (legacy.rs, kquants.rs, iquants.rs, lowbit.rs) the same way.

fn wb(o: u32) -> u32 { return (W[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu; }
// Two and four little-endian bytes at any offset: one word load when they lie in one word
// (every BF16 element, the f16 scales of even-sized blocks), else two; the same value as
// assembling them byte by byte.
fn wh(o: u32) -> u32 {
    let s = (o & 3u) * 8u;
    let lo = W[o >> 2u];
    if (s <= 16u) { return (lo >> s) & 0xffffu; }
    return (lo >> 24u) | ((W[(o >> 2u) + 1u] & 0xffu) << 8u);
}
fn ww(o: u32) -> u32 {
    let s = (o & 3u) * 8u;
    let lo = W[o >> 2u];
    if (s == 0u) { return lo; }
    return (lo >> s) | (W[(o >> 2u) + 1u] << (32u - s));
}
// `f16v` is the including module's f16 decoder: the integer one (common.wgsl), or in mq.wgsl's
// optimized variant the hardware's.
fn wf16(o: u32) -> f32 { return f16v(wh(o)); }

fn kv4(q: u32) -> f32 { return f32(bitcast<i32>(TAB[896u + (q & 15u)])); }

fn scale_q3_k(j: u32, s: u32) -> i32 {
    var lo = 0u;
    if (j < 8u) { lo = wb(s + j) & 15u; } else { lo = wb(s + j - 8u) >> 4u; }
    let hi = (wb(s + 8u + j % 4u) >> (2u * (j / 4u))) & 3u;
    return i32(lo | (hi << 4u)) - 32;
}

fn scale_min_k4(j: u32, q: u32) -> vec2<u32> {
    if (j < 4u) { return vec2<u32>(wb(q + j) & 63u, wb(q + j + 4u) & 63u); }
    return vec2<u32>((wb(q + j + 4u) & 15u) | ((wb(q + j - 4u) >> 6u) << 4u),
                     (wb(q + j + 4u) >> 4u) | ((wb(q + j) >> 6u) << 4u));
}

// 2^k as f32 for k >= -149 (subnormal below -126), exactly: strata_quant's pow2.
fn pow2f(k: i32) -> f32 {
    if (k >= -126) { return bitcast<f32>(u32(k + 127) << 23u); }
    return bitcast<f32>(1u << u32(k + 149));
}

// The FP4 (E2M1) values, doubled: strata_quant's KVALUES_FP4.
fn kv_fp4(q: u32) -> f32 {
    let m = q & 7u;
    var v = f32(m);
    if (m == 5u) { v = 6.0; }
    if (m == 6u) { v = 8.0; }
    if (m == 7u) { v = 12.0; }
    if (q >= 8u && m != 0u) { v = -v; }
    return v;
}

// A UE4M3 sub-scale, halved (ggml_ue4m3_to_fp32): 0 and 0x7F read as 0, the top bit ignored.
fn ue4m3(x: u32) -> f32 {
    if (x == 0u || x == 0x7fu) { return 0.0; }
    let e = (x >> 3u) & 15u;
    let man = f32(x & 7u);
    var raw = 0.0;
    if (e == 0u) { raw = man * pow2f(-9); } else { raw = (1.0 + man * 0.125) * pow2f(i32(e) - 7); }
    return raw * 0.5;
}

fn signed_grid(g: u32, signs: u32, k: u32, jj: u32) -> f32 {
    let m = i32((g >> (8u * jj)) & 255u);
    if ((signs & (1u << (4u * k + jj))) != 0u) { return f32(-m); }
    return f32(m);
}

// Element `j` of the block of format `ty` at byte offset `b` of W.
fn deq(ty: u32, b: u32, j: u32) -> f32 {
    switch ty {
        case T_BF16: { return bf16_to_f32(wh(b)); }
        case T_F32: { return bitcast<f32>(W[b >> 2u]); }
        case T_F16: { return wf16(b); }
        case T_Q8_0: { return f32(sext8(wb(b + 2u + j))) * wf16(b); }
        case T_Q4_0: {
            var q = 0u;
            if (j < 16u) { q = wb(b + 2u + j) & 15u; } else { q = wb(b + 2u + j - 16u) >> 4u; }
            return f32(i32(q) - 8) * wf16(b);
        }
        case T_Q5_0: {
            let qh = ww(b + 2u);
            var lo = 0u;
            if (j < 16u) { lo = wb(b + 6u + j) & 15u; } else { lo = wb(b + 6u + j - 16u) >> 4u; }
            let h = ((qh >> j) & 1u) << 4u;
            return f32(i32(lo | h) - 16) * wf16(b);
        }
        case T_IQ4_NL: {
            var q = 0u;
            if (j < 16u) { q = wb(b + 2u + j) & 15u; } else { q = wb(b + 2u + j - 16u) >> 4u; }
            return wf16(b) * kv4(q);
        }
        case T_Q2_0: {
            let c = (wb(b + 2u + j / 4u) >> (2u * (j % 4u))) & 3u;
            return f32(i32(c) - 1) * wf16(b);
        }
        case T_IQ4_XS: {
            let d = wf16(b);
            let sh = wh(b + 2u);
            let ib = j / 32u;
            let jj = j % 32u;
            let lo = (wb(b + 4u + ib / 2u) >> (4u * (ib % 2u))) & 15u;
            let ls = i32(lo | (((sh >> (2u * ib)) & 3u) << 4u)) - 32;
            let dl = d * f32(ls);
            let q = wb(b + 8u + 16u * ib + jj % 16u);
            var nib = q & 15u;
            if (jj >= 16u) { nib = q >> 4u; }
            return dl * kv4(nib);
        }
        case T_IQ3_S: {
            let d = wf16(b);
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let k = (r % 8u) / 4u;
            let jj = r % 4u;
            let s = (wb(b + 106u + ib / 2u) >> (4u * (ib % 2u))) & 15u;
            let db = d * f32(1 + 2 * i32(s));
            let h = wb(b + 66u + ib);
            var idx = 0u;
            if (k == 0u) {
                idx = wb(b + 2u + 8u * ib + 2u * l) | ((h << (8u - 2u * l)) & 256u);
            } else {
                idx = wb(b + 2u + 8u * ib + 2u * l + 1u) | ((h << (7u - 2u * l)) & 256u);
            }
            let signs = wb(b + 74u + 4u * ib + l);
            return db * signed_grid(TAB[idx], signs, k, jj);
        }
        case T_IQ2_XS: {
            // strata_quant's decode_iq2_xs: grid magnitudes (TAB[912..], two words an entry),
            // signs from KSIGNS, sub-block scale (d·(0.5 + s))·0.25.
            let d = wf16(b);
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let jj = r % 8u;
            let sc = wb(b + 66u + ib);
            var s = sc & 15u;
            if (r >= 16u) { s = sc >> 4u; }
            let db = (d * (0.5 + f32(s))) * 0.25;
            let q = wh(b + 2u + 2u * (4u * ib + l));
            let gi = 912u + 2u * (q & 511u);
            var g = TAB[gi];
            if (jj >= 4u) { g = TAB[gi + 1u]; }
            var v = f32(i32((g >> (8u * (jj % 4u))) & 255u));
            if ((TAB[768u + (q >> 9u)] & (1u << jj)) != 0u) { v = -v; }
            return db * v;
        }
        case T_IQ2_S: {
            // decode_iq2_s: a 10-bit grid index (qs and two bits of qh), an explicit sign
            // byte per 8 values, sub-block scale (d·(0.5 + s))·0.25.
            let d = wf16(b);
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let jj = r % 8u;
            let sc = wb(b + 74u + ib);
            var s = sc & 15u;
            if (r >= 16u) { s = sc >> 4u; }
            let db = (d * (0.5 + f32(s))) * 0.25;
            let idx = wb(b + 2u + 4u * ib + l) | ((wb(b + 66u + ib) << (8u - 2u * l)) & 0x300u);
            let gi = 1936u + 2u * idx;
            var g = TAB[gi];
            if (jj >= 4u) { g = TAB[gi + 1u]; }
            var v = f32(i32((g >> (8u * (jj % 4u))) & 255u));
            if ((wb(b + 34u + 4u * ib + l) & (1u << jj)) != 0u) { v = -v; }
            return db * v;
        }
        case T_MXFP4: {
            // 32 values: an E8M0 exponent, then nibbles split (low: 0..15, high: 16..31).
            let q = wb(b + 1u + j % 16u);
            var nib = q & 15u;
            if (j >= 16u) { nib = q >> 4u; }
            return kv_fp4(nib) * pow2f(i32(wb(b)) - 128);
        }
        case T_NVFP4: {
            // 64 values: four UE4M3 sub-scales, then per 16 values 8 bytes, nibbles split.
            let s = j / 16u;
            let r = j % 16u;
            let q = wb(b + 4u + 8u * s + r % 8u);
            var nib = q & 15u;
            if (r >= 8u) { nib = q >> 4u; }
            return kv_fp4(nib) * ue4m3(wb(b + s));
        }
        case T_Q4_1: {
            var q = 0u;
            if (j < 16u) { q = wb(b + 4u + j) & 15u; } else { q = wb(b + 4u + j - 16u) >> 4u; }
            return nc(f32(q) * wf16(b)) + wf16(b + 2u);
        }
        case T_Q5_1: {
            let qh = ww(b + 4u);
            var lo = 0u;
            if (j < 16u) { lo = wb(b + 8u + j) & 15u; } else { lo = wb(b + 8u + j - 16u) >> 4u; }
            let h = ((qh >> j) & 1u) << 4u;
            return nc(f32(lo | h) * wf16(b)) + wf16(b + 2u);
        }
        case T_Q2_K: {
            let s = j / 16u;
            let sc = wb(b + s);
            let dl = wf16(b + 80u) * f32(sc & 15u);
            // Both products behind nc(): neither may fuse into the subtraction.
            let ml = nc(wf16(b + 82u) * f32(sc >> 4u));
            let q = wb(b + 16u + 32u * (s / 8u) + 16u * (s % 2u) + j % 16u);
            return nc(dl * f32((q >> (2u * ((s / 2u) % 4u))) & 3u)) - ml;
        }
        case T_IQ2_XXS: {
            // decode_iq2_xxs: 8-byte grid entries (TAB[3984..]), KSIGNS signs, sub-block scale
            // (d·(0.5 + s))·0.25 with s the top nibble of the second word.
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let jj = r % 8u;
            let a0 = ww(b + 2u + 8u * ib);
            let a1 = ww(b + 6u + 8u * ib);
            let db = (wf16(b) * (0.5 + f32(a1 >> 28u))) * 0.25;
            let gi = 3984u + 2u * ((a0 >> (8u * l)) & 255u);
            var g = TAB[gi];
            if (jj >= 4u) { g = TAB[gi + 1u]; }
            var v = f32(i32((g >> (8u * (jj % 4u))) & 255u));
            if ((TAB[768u + ((a1 >> (7u * l)) & 127u)] & (1u << jj)) != 0u) { v = -v; }
            return db * v;
        }
        case T_IQ1_S, T_IQ1_M: {
            // decode_iq1_s / decode_iq1_m: an 11-bit index into IQ1S_GRID (TAB[4496..], signed
            // bytes), the value 8·g ± 1 times 0.125, times the sub-block scale d·(2s + 1).
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let jj = r % 8u;
            var d = 0.0;
            var ls = 0u;
            var idx = 0u;
            var neg = false;
            if (ty == T_IQ1_S) {
                d = wf16(b);
                let qh = wh(b + 34u + 2u * ib);
                ls = 2u * ((qh >> 12u) & 7u) + 1u;
                neg = (qh & 0x8000u) != 0u;
                idx = wb(b + 2u + 4u * ib + l) | (((qh >> (3u * l)) & 7u) << 8u);
            } else {
                let bits = (wh(b + 48u) >> 12u) | ((wh(b + 50u) >> 8u) & 0xf0u)
                    | ((wh(b + 52u) >> 4u) & 0xf00u) | (wh(b + 54u) & 0xf000u);
                d = f16v(bits);
                let sc = wh(b + 48u + 2u * (ib / 2u));
                ls = 2u * ((sc >> (6u * (ib % 2u) + 3u * (r / 16u))) & 7u) + 1u;
                let hb = wb(b + 32u + 2u * ib + l / 2u);
                idx = wb(b + 4u * ib + l) | ((hb << (8u - 4u * (l % 2u))) & 0x700u);
                neg = (hb & (0x08u << (4u * (l % 2u)))) != 0u;
            }
            let gi = 4496u + 2u * idx;
            var g = TAB[gi];
            if (jj >= 4u) { g = TAB[gi + 1u]; }
            var w = 8 * sext8((g >> (8u * (jj % 4u))) & 255u) + 1;
            if (neg) { w = w - 2; }
            return (d * f32(ls)) * (f32(w) * 0.125);
        }
        case T_TQ1_0: {
            // Trits in element order: qs[0..32] five rows of 32, qs[32..48] five rows of 16,
            // qh four rows of 4; trit n of byte q is ((q·3^n mod 256)·3) >> 8.
            var q = 0u;
            var n = 0u;
            if (j < 160u) {
                q = wb(b + j % 32u);
                n = j / 32u;
            } else if (j < 240u) {
                q = wb(b + 32u + (j - 160u) % 16u);
                n = (j - 160u) / 16u;
            } else {
                q = wb(b + 48u + (j - 240u) % 4u);
                n = (j - 240u) / 4u;
            }
            var p = 1u;
            for (var k = 0u; k < n; k = k + 1u) { p = p * 3u; }
            let t = (((q * p) & 255u) * 3u) >> 8u;
            return f32(i32(t) - 1) * wf16(b + 52u);
        }
        case T_TQ2_0: {
            let c = (wb(b + 32u * (j / 128u) + j % 32u) >> (2u * ((j % 128u) / 32u))) & 3u;
            return f32(i32(c) - 1) * wf16(b + 64u);
        }
        case T_Q1_0: {
            let d = wf16(b);
            if (((wb(b + 2u + j / 8u) >> (j % 8u)) & 1u) != 0u) { return d; }
            return -d;
        }
        case T_IQ3_XXS: {
            let d = wf16(b);
            let ib = j / 32u;
            let r = j % 32u;
            let l = r / 8u;
            let k = (r % 8u) / 4u;
            let jj = r % 4u;
            let a = ww(b + 66u + 4u * ib);
            let db = (d * (0.5 + f32(a >> 28u))) * 0.5;
            let signs = TAB[768u + ((a >> (7u * l)) & 127u)];
            let g = TAB[512u + wb(b + 2u + 8u * ib + 2u * l + k)];
            return db * signed_grid(g, signs, k, jj);
        }
        case T_Q3_K: {
            let d = wf16(b + 108u);
            let s = j / 16u;
            let l = j % 16u;
            let dl = d * f32(scale_q3_k(s, b + 96u));
            let half = s / 8u;
            let jq = (s / 2u) % 4u;
            let h = s % 2u;
            let bit = 1u << (4u * half + jq);
            let q = wb(b + 32u + 32u * half + 16u * h + l);
            let hm = wb(b + 16u * h + l);
            var sub = 4;
            if ((hm & bit) != 0u) { sub = 0; }
            let v = i32((q >> (2u * jq)) & 3u) - sub;
            return dl * f32(v);
        }
        case T_Q4_K, T_Q5_K: {
            let d = wf16(b);
            let dmin = wf16(b + 2u);
            let q5 = ty == T_Q5_K;
            var qs0 = 16u;
            if (q5) { qs0 = 48u; }
            let s = j / 32u;
            let l = j % 32u;
            let sm = scale_min_k4(s, b + 4u);
            let dl = d * f32(sm.x);
            let ml = dmin * f32(sm.y);
            var v = (wb(b + qs0 + 32u * (s / 2u) + l) >> (4u * (s % 2u))) & 15u;
            if (q5) { v = v | (((wb(b + 16u + l) >> s) & 1u) << 4u); }
            return nc(dl * f32(v)) - ml;
        }
        case T_Q6_K: {
            let d = wf16(b + 208u);
            let half = j / 128u;
            let r = j % 128u;
            let quarter = r / 32u;
            let l = r % 32u;
            let ql = wb(b + 64u * half + 32u * (quarter % 2u) + l);
            var lo = ql & 15u;
            if (quarter >= 2u) { lo = ql >> 4u; }
            let hi = (wb(b + 128u + 32u * half + l) >> (2u * quarter)) & 3u;
            let sc = sext8(wb(b + 192u + j / 16u));
            return (d * f32(sc)) * f32(i32(lo | (hi << 4u)) - 32);
        }
        default: { return f_nan(); }
    }
}
