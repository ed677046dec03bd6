// slop_pen (strata_engine::kernels::slop): the state advanced by `prev` on one invocation
// (integer bookkeeping), then the penalties applied in the contract's order: listed penalties,
// run caps, phrase matches one after another in match order, banned ids. The baseline does
// everything on invocation 0; the optimized variant spreads the penalty list and the classes
// over the workgroup (distinct ids hit distinct draft slots, checked on the host), and leaves
// at once in mode 0.
//
// INTS holds, at the offsets in the parameters: the inverse map (at 0), penalty ids, newline
// class, blank class, phrase tokens, phrase starts, banned ids. FLTS: penalty values (at 0),
// then phrase penalties. Parameters: 0 nv, 1 mode, 2 prev, 3 n_pen, 4 n_nl, 5 n_bl, 6 n_ph,
// 7 n_banned, 8 cap_nl, 9 cap_bl, 10 off pen ids, 11 off newline, 12 off blank, 13 off phrase
// tokens, 14 off phrase starts, 15 off banned, 16 off phrase penalties (in FLTS), 17 vocab.

@group(0) @binding(1) var<storage, read_write> LG: array<f32>;
@group(0) @binding(2) var<storage, read_write> INTS: array<i32>;
@group(0) @binding(3) var<storage, read_write> FLTS: array<f32>;
@group(0) @binding(4) var<storage, read_write> STIN: array<i32>;
@group(0) @binding(5) var<storage, read_write> STOUT: array<i32>;

const MAX_MATCHES: u32 = 32u;
const STATE_LEN: u32 = 67u;
const RUN_LIMIT: i32 = 1073741824;

fn draft(id: i32) -> i32 {
    let d = INTS[u32(id)];
    if (d >= 0 && u32(d) < pu(0u)) { return d; }
    return -1;
}

fn in_class(off: u32, n: u32, id: i32) -> bool {
    var hit = false;
    for (var i = 0u; i < n; i = i + 1u) { if (INTS[off + i] == id) { hit = true; } }
    return hit;
}

fn bump(run: i32, hit: bool) -> i32 {
    if (hit) { return min(run + 1, RUN_LIMIT); }
    return 0;
}

fn ph_start(p: u32) -> u32 { return u32(INTS[pu(14u) + p]); }
fn ph_tok(p: u32, m: u32) -> i32 { return INTS[pu(13u) + ph_start(p) + m]; }
fn ph_len(p: u32) -> u32 { return ph_start(p + 1u) - ph_start(p); }

// The new state into STOUT (invocation 0 only).
fn advance(mode: u32, prev: i32, is_nl: bool, is_bl: bool) {
    for (var i = 0u; i < STATE_LEN; i = i + 1u) { STOUT[i] = 0; }
    if (prev < 0) {
        STOUT[0] = STIN[0];
        STOUT[1] = STIN[1];
    } else {
        STOUT[0] = bump(STIN[0], is_nl);
        STOUT[1] = bump(STIN[1], is_bl);
    }
    if (mode < 2u) { return; }
    if (prev < 0) {
        for (var i = 2u; i < STATE_LEN; i = i + 1u) { STOUT[i] = STIN[i]; }
        return;
    }
    var n = 0u;
    for (var i = 0u; i < u32(STIN[2]); i = i + 1u) {
        let p = u32(STIN[3u + 2u * i]);
        let m = u32(STIN[4u + 2u * i]);
        if (ph_tok(p, m) == prev && m + 1u < ph_len(p) && n < MAX_MATCHES) {
            STOUT[3u + 2u * n] = i32(p);
            STOUT[4u + 2u * n] = i32(m + 1u);
            n = n + 1u;
        }
    }
    for (var p = 0u; p < pu(6u); p = p + 1u) {
        if (ph_tok(p, 0u) == prev && ph_len(p) > 1u && n < MAX_MATCHES) {
            STOUT[3u + 2u * n] = i32(p);
            STOUT[4u + 2u * n] = 1;
            n = n + 1u;
        }
    }
    STOUT[2] = i32(n);
}

fn pen_one(j: u32) {
    let d = draft(INTS[pu(10u) + j]);
    if (d >= 0) { LG[u32(d)] = LG[u32(d)] - FLTS[j]; }
}

fn cap_one(off: u32, j: u32) {
    let d = draft(INTS[off + j]);
    if (d >= 0) { LG[u32(d)] = f_neg_inf(); }
}

// Phrase matches and banned ids, in order (invocation 0).
fn apply_tail(mode: u32) {
    if (mode < 2u) { return; }
    for (var i = 0u; i < u32(STOUT[2]); i = i + 1u) {
        let p = u32(STOUT[3u + 2u * i]);
        let m = u32(STOUT[4u + 2u * i]);
        let d = draft(ph_tok(p, m));
        if (d >= 0) {
            if (m + 1u == ph_len(p)) {
                LG[u32(d)] = f_neg_inf();
            } else {
                LG[u32(d)] = LG[u32(d)] - FLTS[pu(16u) + p];
            }
        }
    }
    for (var i = 0u; i < pu(7u); i = i + 1u) {
        let d = draft(INTS[pu(15u) + i]);
        if (d >= 0) { LG[u32(d)] = f_neg_inf(); }
    }
}

fn caps_hit(which: u32) -> bool {
    let cap = pi(8u + which);
    return cap > 0 && STOUT[which] >= cap;
}

@compute @workgroup_size(32)
fn slop_pen_base(@builtin(local_invocation_index) t: u32) {
    if (t != 0u) { return; }
    let mode = pu(1u);
    let prev = pi(2u);
    let is_nl = in_class(pu(11u), pu(4u), prev);
    let is_bl = in_class(pu(12u), pu(5u), prev);
    if (mode == 0u) {
        for (var i = 0u; i < STATE_LEN; i = i + 1u) { STOUT[i] = STIN[i]; }
        return;
    }
    advance(mode, prev, is_nl, is_bl);
    for (var j = 0u; j < pu(3u); j = j + 1u) { pen_one(j); }
    if (caps_hit(0u)) { for (var j = 0u; j < pu(4u); j = j + 1u) { cap_one(pu(11u), j); } }
    if (caps_hit(1u)) { for (var j = 0u; j < pu(5u); j = j + 1u) { cap_one(pu(12u), j); } }
    apply_tail(mode);
}

var<workgroup> wg_caps: vec2<u32>;

@compute @workgroup_size(256)
fn slop_pen_opt(@builtin(local_invocation_index) t: u32) {
    let mode = pu(1u);
    let prev = pi(2u);
    if (mode == 0u) {
        if (t < STATE_LEN) { STOUT[t] = STIN[t]; }
        return;
    }
    if (t == 0u) {
        var is_nl = false;
        var is_bl = false;
        if (prev >= 0) {
            is_nl = in_class(pu(11u), pu(4u), prev);
            is_bl = in_class(pu(12u), pu(5u), prev);
        }
        advance(mode, prev, is_nl, is_bl);
        wg_caps = vec2<u32>(select(0u, 1u, caps_hit(0u)), select(0u, 1u, caps_hit(1u)));
    }
    for (var j = t; j < pu(3u); j = j + 256u) { pen_one(j); }
    storageBarrier();
    workgroupBarrier();
    let caps = workgroupUniformLoad(&wg_caps);
    if (caps.x != 0u) { for (var j = t; j < pu(4u); j = j + 256u) { cap_one(pu(11u), j); } }
    if (caps.y != 0u) { for (var j = t; j < pu(5u); j = j + 256u) { cap_one(pu(12u), j); } }
    storageBarrier();
    workgroupBarrier();
    if (t == 0u) { apply_tail(mode); }
}
