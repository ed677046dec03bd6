// mq: the model's reads of weights in their file formats, one storage binding per weight part
// (a weight larger than the adapter's binding limit is split by rows, one dispatch a part).
// `mm` is gemv.wgsl's baseline product (lane l adds nc(w_i·x_i) for i = l + 256k, then
// block_sum256), so an output's bits depend only on its weight row and activation row, never on
// the batch, the part or the dispatch: prefill rows equal single-token rows. `gather` is
// embed.wgsl's decoder with a part's row range and repeated copies.
//
// The weight format is a specialization constant (SPEC_TY): one pipeline per format, so the
// decoder's switch folds to one case (lavapipe pays per dispatch for the whole switch).
//
// Bindings: 1 W (the part's bytes), 2 XQ (activation images), 3 Y (f32 out), 4 TAB (grids),
// 5 IDS (u32: the rows or experts to read).

@group(0) @binding(1) var<storage, read_write> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> TAB: array<u32>;
@group(0) @binding(5) var<storage, read_write> IDS: array<u32>;

// The f16 scales of weight blocks and Q8_0 images: the integer decoder (baseline), or with
// SPEC_HWF16 the hardware's unpack2x16float, the same value for every finite f16 (exact
// widening), so the same bits (tests/model.rs checks every format both ways).
fn f16v(h: u32) -> f32 {
    if (SPEC_HWF16) { return unpack2x16float(h).x; }
    return f16_to_f32(h);
}

fn xb(o: u32) -> u32 { return (XQ[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu; }
// Two bytes of an image: one word load when they lie in one word (every BF16 element, the
// Q8_0 scales of even rows), the same value as two byte loads.
fn xh(o: u32) -> u32 {
    let s = (o & 3u) * 8u;
    let lo = XQ[o >> 2u];
    if (s <= 16u) { return (lo >> s) & 0xffffu; }
    return (lo >> 24u) | ((XQ[(o >> 2u) + 1u] & 0xffu) << 8u);
}

// Element i of activation row tok (images of kernels::actq; F32 rows as they are).
fn xv(fmt: u32, xrb: u32, tok: u32, i: u32) -> f32 {
    let r = tok * xrb;
    if (fmt == 0u) { return bitcast<f32>(XQ[(r >> 2u) + i]); }
    if (fmt == 1u) { return bf16_to_f32(xh(r + 2u * i)); }
    if (fmt == 2u) {
        let b = r + 34u * (i / 32u);
        return f32(sext8(xb(b + 2u + i % 32u))) * f16v(xh(b));
    }
    let b = r + 292u * (i / 256u);
    return bitcast<f32>(XQ[b >> 2u]) * f32(sext8(xb(b + 4u + i % 256u)));
}

// A product's epilogue, p18: 0 none; 5 silu(y·p19) and 6 2σ(y·p19), model.wgsl's eltwise ops
// 5 and 6 on the same value (the same expression through the same helpers), so the same bits
// with the element-wise dispatch folded away.
fn epi(y: f32) -> f32 {
    switch pu(18u) {
        case 5u: { return silu(nc(y * pf(19u))); }
        case 6u: { return 2.0 * sigm(nc(y * pf(19u))); }
        default: { return y; }
    }
}

// Y[t·p12 + col] = W[row] · x_{t / p15} for output item o of token t (groups: x·y items, z
// tokens). p0 format, p1 items, p2 k, p4 weight row bytes, p5 image row bytes, p6 block size,
// p7 block bytes, p8 image format, p9 mode, p10 the part's first row, p11 its rows, p13 IDS
// offset, p14 rows per expert, p16 groups in x, p18/p19 the epilogue. Mode 0: row p10 + o into column p10 + o;
// 1: row IDS[p13 + o] into column o; 2: row IDS[p13 + t]·p14 + o (an expert's slab) into o.
@compute @workgroup_size(256)
fn mm(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let o = g.y * pu(16u) + g.x;
    let tok = g.z;
    // Every invocation reaches the barriers of block_sum256 (whether an item is this part's
    // depends on IDS, which uniformity analysis cannot see as uniform).
    let mode = pu(9u);
    let row0 = pu(10u);
    var grow = row0 + o;
    var col = grow;
    if (mode == 1u && o < pu(1u)) {
        grow = IDS[pu(13u) + o];
        col = o;
    } else if (mode == 2u) {
        grow = IDS[pu(13u) + tok] * pu(14u) + o;
        col = o;
    }
    let live = o < pu(1u) && grow >= row0 && grow - row0 < pu(11u);
    let lr = grow - row0;
    let ty = pu(0u);
    let k = pu(2u);
    let wrb = pu(4u);
    let bs = pu(6u);
    let ts = pu(7u);
    let xt = tok / pu(15u);
    var acc = 0.0;
    if (live) {
        for (var i = t; i < k; i = i + 256u) {
            let w = deq(SPEC_TY, lr * wrb + (i / bs) * ts, i % bs);
            acc = acc + nc(w * xv(pu(8u), pu(5u), xt, i));
        }
    }
    let s = block_sum256(acc, t);
    if (t == 0u && live) { Y[tok * pu(12u) + col] = epi(s); }
}

// The weight row (in the part), the output column and whether output item o of token tok is
// this part's: `mm`'s item rule, shared by `mmr`.
fn mm_item(o: u32, tok: u32) -> vec3<u32> {
    let mode = pu(9u);
    let row0 = pu(10u);
    var grow = row0 + o;
    var col = grow;
    if (mode == 1u && o < pu(1u)) {
        grow = IDS[pu(13u) + o];
        col = o;
    } else if (mode == 2u) {
        grow = IDS[pu(13u) + tok] * pu(14u) + o;
        col = o;
    }
    let live = o < pu(1u) && grow >= row0 && grow - row0 < pu(11u);
    return vec3<u32>(grow - row0, col, u32(live));
}

var<workgroup> redr: array<f32, 256u * SPEC_R>;

// `mm` for SPEC_R consecutive output items per workgroup, bit for bit: lane l keeps one sum per
// item, each adding nc(w_i·x_i) for i = l + 256k in `mm`'s order, the activation element read
// once for all of them; then block_sum256's tree on every item's 256 lane sums at once (the
// barriers shared). Block sizes as constants (SPEC_BS, SPEC_TS), so the element → block
// arithmetic folds. Same parameters as `mm`; p16 counts groups of SPEC_R items.
@compute @workgroup_size(256)
fn mmr(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let o0 = (g.y * pu(16u) + g.x) * SPEC_R;
    let tok = g.z;
    let k = pu(2u);
    let wrb = pu(4u);
    let xf = pu(8u);
    let xrb = pu(5u);
    let xt = tok / pu(15u);
    var acc: array<f32, SPEC_R>;
    var wrow: array<u32, SPEC_R>;
    var some = false;
    for (var r = 0u; r < SPEC_R; r = r + 1u) {
        let it = mm_item(o0 + r, tok);
        acc[r] = 0.0;
        wrow[r] = 0xffffffffu;
        if (it.z != 0u) {
            wrow[r] = it.x * wrb;
            some = true;
        }
    }
    // Every block size divides 256, so lane t reads the same element of every block it
    // visits: j is loop-invariant (the decoders' index arithmetic on it can be hoisted).
    let j = t % SPEC_BS;
    if (some) {
        for (var i = t; i < k; i = i + 256u) {
            let xval = xv(xf, xrb, xt, i);
            let boff = (i / SPEC_BS) * SPEC_TS;
            for (var r = 0u; r < SPEC_R; r = r + 1u) {
                if (wrow[r] != 0xffffffffu) {
                    acc[r] = acc[r] + nc(deq(SPEC_TY, wrow[r] + boff, j) * xval);
                }
            }
        }
    }
    for (var r = 0u; r < SPEC_R; r = r + 1u) { redr[256u * r + t] = acc[r]; }
    workgroupBarrier();
    for (var s = 16u; s > 0u; s = s >> 1u) {
        if ((t & 31u) < s) {
            for (var r = 0u; r < SPEC_R; r = r + 1u) {
                redr[256u * r + t] = redr[256u * r + t] + redr[256u * r + t + s];
            }
        }
        workgroupBarrier();
    }
    for (var s = 4u; s > 0u; s = s >> 1u) {
        if (t < s) {
            for (var r = 0u; r < SPEC_R; r = r + 1u) {
                redr[256u * r + 32u * t] = redr[256u * r + 32u * t] + redr[256u * r + 32u * (t + s)];
            }
        }
        workgroupBarrier();
    }
    if (t < SPEC_R) {
        let it = mm_item(o0 + t, tok);
        if (it.z != 0u) { Y[tok * pu(12u) + it.y] = epi(redr[256u * t]); }
    }
}

// `mm` block-wise, bit for bit: a 64-wide workgroup for SPEC_R outputs, invocation u keeping
// the lane sums of lanes 4u..4u+3 of every output. Lane l still adds nc(w_i·x_i) for
// i = l + 256k in k order, so each lane sum is `mm`'s; but the four elements an invocation
// takes are adjacent, in one block (every block size is 1 or a multiple of 4), so their
// decoders share the block's scale and word loads (the same expressions on the same bytes, left
// to the compiler to share), and each activation element is read once for all outputs. The
// 256·SPEC_R lane sums then go through block_sum256's tree in workgroup memory. Same parameters
// as `mm`; p16 counts groups of SPEC_R items.
@compute @workgroup_size(64)
fn mmb(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) u: u32) {
    let o0 = (g.y * pu(16u) + g.x) * SPEC_R;
    let tok = g.z;
    let k = pu(2u);
    let wrb = pu(4u);
    let xf = pu(8u);
    let xrb = pu(5u);
    let xt = tok / pu(15u);
    var acc: array<f32, 4u * SPEC_R>;
    var wrow: array<u32, SPEC_R>;
    var some = false;
    for (var r = 0u; r < SPEC_R; r = r + 1u) {
        let it = mm_item(o0 + r, tok);
        wrow[r] = 0xffffffffu;
        if (it.z != 0u) {
            wrow[r] = it.x * wrb;
            some = true;
        }
    }
    for (var a = 0u; a < 4u * SPEC_R; a = a + 1u) { acc[a] = 0.0; }
    let l0 = 4u * u;
    if (some) {
        for (var i0 = l0; i0 < k; i0 = i0 + 256u) {
            for (var q = 0u; q < 4u; q = q + 1u) {
                let i = i0 + q;
                if (i < k) {
                    let xval = xv(xf, xrb, xt, i);
                    let boff = (i / SPEC_BS) * SPEC_TS;
                    let j = i % SPEC_BS;
                    for (var r = 0u; r < SPEC_R; r = r + 1u) {
                        if (wrow[r] != 0xffffffffu) {
                            acc[4u * r + q] = acc[4u * r + q] + nc(deq(SPEC_TY, wrow[r] + boff, j) * xval);
                        }
                    }
                }
            }
        }
    }
    for (var r = 0u; r < SPEC_R; r = r + 1u) {
        for (var q = 0u; q < 4u; q = q + 1u) { redr[256u * r + l0 + q] = acc[4u * r + q]; }
    }
    workgroupBarrier();
    // block_sum256's tree on every output's 256 lanes: at each level lane t < s of a group of
    // 32 adds lane t + s, which no one writes at that level.
    for (var s = 16u; s > 0u; s = s >> 1u) {
        for (var e = u; e < 256u * SPEC_R; e = e + 64u) {
            if ((e & 31u) < s) { redr[e] = redr[e] + redr[e + s]; }
        }
        workgroupBarrier();
    }
    for (var s = 4u; s > 0u; s = s >> 1u) {
        for (var e = u; e < s * SPEC_R; e = e + 64u) {
            let b = 256u * (e / s) + 32u * (e % s);
            redr[b] = redr[b] + redr[b + 32u * s];
        }
        workgroupBarrier();
    }
    if (u < SPEC_R) {
        let it = mm_item(o0 + u, tok);
        if (it.z != 0u) { Y[tok * pu(12u) + it.y] = epi(redr[256u * u]); }
    }
}

// `mm` with 8 invocations an output, bit for bit: invocation g of an output keeps the lane
// sums of lanes 32g..32g+31 in registers, lane l adding nc(w_i·x_i) for i = l + 256k in k order
// as in `mm` (its 32 elements a step are adjacent: one block of every block-quantized format, so
// the decoders' scale and word loads are shared), then runs block_sum256's first five levels on
// its 32 lanes itself (level s: lane j < s adds lane j + s, as the tree does) and the last three
// over the 8 group sums in the tree's order (a0+a4, a1+a5, a2+a6, a3+a7; a0+a2, a1+a3; a0+a1).
// No barrier in the loop, one at the end; a 64-wide workgroup for 8 outputs. Same parameters as
// `mm`; p16 counts groups of 8 items.
var<workgroup> redt: array<f32, 64>;

@compute @workgroup_size(64)
fn mmt(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) u: u32) {
    let r = u / 8u;
    let gq = u % 8u;
    let o = (g.y * pu(16u) + g.x) * 8u + r;
    let tok = g.z;
    let k = pu(2u);
    let wrb = pu(4u);
    let xf = pu(8u);
    let xrb = pu(5u);
    let xt = tok / pu(15u);
    let it = mm_item(o, tok);
    var acc: array<f32, 32>;
    for (var j = 0u; j < 32u; j = j + 1u) { acc[j] = 0.0; }
    if (it.z != 0u) {
        let wr = it.x * wrb;
        for (var i0 = 32u * gq; i0 < k; i0 = i0 + 256u) {
            for (var j = 0u; j < 32u; j = j + 1u) {
                let i = i0 + j;
                if (i < k) {
                    let w = deq(SPEC_TY, wr + (i / SPEC_BS) * SPEC_TS, i % SPEC_BS);
                    acc[j] = acc[j] + nc(w * xv(xf, xrb, xt, i));
                }
            }
        }
    }
    for (var s = 16u; s > 0u; s = s >> 1u) {
        for (var j = 0u; j < s; j = j + 1u) { acc[j] = acc[j] + acc[j + s]; }
    }
    redt[u] = acc[0];
    workgroupBarrier();
    if (gq == 0u && it.z != 0u) {
        let b = 8u * r;
        let a0 = redt[b] + redt[b + 4u];
        let a1 = redt[b + 1u] + redt[b + 5u];
        let a2 = redt[b + 2u] + redt[b + 6u];
        let a3 = redt[b + 3u] + redt[b + 7u];
        let c0 = a0 + a2;
        let c1 = a1 + a3;
        Y[tok * pu(12u) + it.y] = epi(c0 + c1);
    }
}

// Rows IDS[p7 + slot] of the table, each written p8 times along the output row: p0 format,
// p1 row length, p2 row bytes, p3 the part's first row, p4 its rows, p5 block size, p6 block
// bytes, p9 the table's rows (an id past them gives a NaN row, written by part 0).
@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let slot = g.x;
    let id = IDS[pu(7u) + slot];
    let n = pu(1u);
    let copies = pu(8u);
    let row0 = pu(3u);
    let inside = id >= row0 && id - row0 < pu(4u);
    let bad = id >= pu(9u) && row0 == 0u;
    if (!inside && !bad) { return; }
    for (var i = t; i < n; i = i + 256u) {
        var v = f_nan();
        if (inside) { v = deq(SPEC_TY, (id - row0) * pu(2u) + (i / pu(5u)) * pu(6u), i % pu(5u)); }
        for (var c = 0u; c < copies; c = c + 1u) { Y[(slot * copies + c) * n + i] = v; }
    }
}


// `mm` with one invocation per (item, token), bit for bit: the invocation keeps the 256 lane
// sums itself and reduces them in block_sum256's tree (a CPU adapter such as lavapipe runs a
// 256-wide workgroup's barriers as coroutine switches; this version has none). Same parameters;
// invocations over a 2-D grid of 64-wide groups, p17 items × tokens.
@compute @workgroup_size(64)
fn mm1(@builtin(workgroup_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
       @builtin(local_invocation_index) l: u32) {
    let gi = (g.y * nw.x + g.x) * 64u + l;
    if (gi >= pu(17u)) { return; }
    let o = gi % pu(1u);
    let tok = gi / pu(1u);
    let mode = pu(9u);
    let row0 = pu(10u);
    var grow = row0 + o;
    var col = grow;
    if (mode == 1u) {
        grow = IDS[pu(13u) + o];
        col = o;
    } else if (mode == 2u) {
        grow = IDS[pu(13u) + tok] * pu(14u) + o;
        col = o;
    }
    if (grow < row0 || grow - row0 >= pu(11u)) { return; }
    let lr = grow - row0;
    let ty = pu(0u);
    let k = pu(2u);
    let wrb = pu(4u);
    let bs = pu(6u);
    let ts = pu(7u);
    let xt = tok / pu(15u);
    // Lanes at or past k hold +0 in `mm` and a lane sum is never −0 (acc starts at +0), so
    // adding them changes nothing: only the first nl lanes are summed and reduced.
    let nl = min(k, 256u);
    var lanes: array<f32, 256>;
    for (var t = 0u; t < nl; t = t + 1u) {
        var acc = 0.0;
        for (var i = t; i < k; i = i + 256u) {
            let w = deq(SPEC_TY, lr * wrb + (i / bs) * ts, i % bs);
            acc = acc + nc(w * xv(pu(8u), pu(5u), xt, i));
        }
        lanes[t] = acc;
    }
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
    Y[tok * pu(12u) + col] = epi(lanes[0]);
}
