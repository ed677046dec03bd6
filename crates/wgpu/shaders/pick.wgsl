// pick: the index of the largest draft logit, ties to the lower index (−0.0 ties +0.0), NaN
// never chosen unless every value is NaN (then index 0): the largest order key (fkey) with
// the lowest index, an exact choice in any reduction order. OUT gets (index, token, value
// bits). The baseline is one workgroup; the optimized variant a first pass of many workgroups
// writing (key, index) partials to PART and a second pass of one workgroup. Parameters: 0 nv,
// 1 number of partials.

@group(0) @binding(1) var<storage, read_write> L: array<f32>;
@group(0) @binding(2) var<storage, read_write> DIDS: array<i32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<i32>;
@group(0) @binding(4) var<storage, read_write> PART: array<u32>;

var<workgroup> pk: array<u32, 256>;
var<workgroup> px: array<u32, 256>;

fn better(k: u32, i: u32, bk: u32, bi: u32) -> bool { return k > bk || (k == bk && i < bi); }

// Tree over the workgroup; returns (key, index) of the winner to every invocation.
fn tree(k: u32, i: u32, t: u32) -> vec2<u32> {
    pk[t] = k;
    px[t] = i;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h = h >> 1u) {
        if (t < h && better(pk[t + h], px[t + h], pk[t], px[t])) {
            pk[t] = pk[t + h];
            px[t] = px[t + h];
        }
        workgroupBarrier();
    }
    let r = vec2<u32>(pk[0], px[0]);
    workgroupBarrier();
    return r;
}

fn finish(i: u32) {
    var idx = i;
    if (idx == 0xffffffffu) { idx = 0u; }
    OUT[0] = i32(idx);
    OUT[1] = DIDS[idx];
    OUT[2] = bitcast<i32>(L[idx]);
}

@compute @workgroup_size(256)
fn pick_base(@builtin(local_invocation_index) t: u32) {
    let nv = pu(0u);
    var bk = 0u;
    var bi = 0xffffffffu;
    for (var i = t; i < nv; i = i + 256u) {
        let k = fkey(L[i]);
        if (better(k, i, bk, bi)) { bk = k; bi = i; }
    }
    let r = tree(bk, bi, t);
    if (t == 0u) { finish(r.y); }
    if (nv == 0xffffffffu) { PART[0] = 0u; }
}

// Pass 1: workgroup g covers values [1024·g, 1024·(g+1)), four consecutive ones a thread.
@compute @workgroup_size(256)
fn pick_opt1(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let nv = pu(0u);
    var bk = 0u;
    var bi = 0xffffffffu;
    for (var c = g.x * 1024u + 4u * t; c < nv; c = c + 1024u * pu(1u)) {
        for (var j = 0u; j < 4u; j = j + 1u) {
            let i = c + j;
            if (i < nv) {
                let k = fkey(L[i]);
                if (better(k, i, bk, bi)) { bk = k; bi = i; }
            }
        }
    }
    let r = tree(bk, bi, t);
    if (t == 0u) {
        PART[2u * g.x] = r.x;
        PART[2u * g.x + 1u] = r.y;
    }
}

// Pass 2: the partials.
@compute @workgroup_size(256)
fn pick_opt2(@builtin(local_invocation_index) t: u32) {
    var bk = 0u;
    var bi = 0xffffffffu;
    for (var g = t; g < pu(1u); g = g + 256u) {
        if (better(PART[2u * g], PART[2u * g + 1u], bk, bi)) { bk = PART[2u * g]; bi = PART[2u * g + 1u]; }
    }
    let r = tree(bk, bi, t);
    if (t == 0u) { finish(r.y); }
}
