//! `strata parity prompt | verify -m MODEL`: the determinism contract measured on a whole
//! model, on any backend (DESIGN.md §3: prefill equals single steps; a verify window's rows
//! equal single steps). The oracle is the same model fed one token at a time; the candidates
//! are a whole-prompt prefill, an uneven chunked prefill, and windows of 1..8 rows after a
//! prefix. Each row says BITWISE PASS or the first differing (row, logit), with the paired
//! times (single steps as the baseline).
//!
//! `strata parity ops -m MODEL`: the operations a backend may override, each against the
//! trait's default composition on the same backend ([`OpsSuite`]).

use std::time::Instant;

use anyhow::Result;
use strata_engine::kernels::testdata::Rng;
use strata_engine::qwen4exp::ops::Qwen4expOps;
use strata_engine::{qwen2, qwen4exp, Backend, DeviceBuf};
use strata_parity::{Report, Row};

/// A model whose forward returns every row's logits (both families).
pub trait Rows {
    type St;
    fn fresh(&self) -> Result<Self::St>;
    /// Logits of every token of `tokens`, continuing `st` (`rows × n_vocab`).
    fn rows(&self, st: &mut Self::St, tokens: &[u32]) -> Result<Vec<f32>>;
    fn vocab(&self) -> usize;
}

/// Both families' models have the same state / forward / config shape.
macro_rules! rows_for {
    ($model:ty, $state:ty, $($bound:tt)+) => {
        impl<B: $($bound)+> Rows for $model {
            type St = $state;
            fn fresh(&self) -> Result<Self::St> {
                Ok(self.new_state()?)
            }
            fn rows(&self, st: &mut Self::St, tokens: &[u32]) -> Result<Vec<f32>> {
                Ok(self.forward(st, tokens)?.logits)
            }
            fn vocab(&self) -> usize {
                self.config().n_vocab
            }
        }
    };
}
rows_for!(qwen2::Model<B>, qwen2::State<B>, Backend);
rows_for!(qwen4exp::Model<B>, qwen4exp::State<B>, Qwen4expOps);

/// The first (row, logit) where `got` and `want` differ in their bits, as the report says it.
fn first_diff(got: &[f32], want: &[f32], nv: usize, row0: usize) -> String {
    if got.len() != want.len() {
        return format!("FAIL: {} logits vs {}", got.len(), want.len());
    }
    match (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        None => "BITWISE PASS".to_string(),
        Some(i) => format!(
            "FAIL: row {} logit {}: {:e} vs {:e}",
            row0 + i / nv,
            i % nv,
            got[i],
            want[i]
        ),
    }
}

fn row(kernel: &str, shape: String, base_s: f64, cand_s: f64, parity: String) -> Row {
    Row {
        kernel: kernel.to_string(),
        shape,
        base_us: base_s * 1e6,
        cand_us: cand_s * 1e6,
        failed: parity != "BITWISE PASS",
        vs_cpu: "-".to_string(),
        parity,
        ..Default::default()
    }
}

/// Random token ids below the vocabulary (seeded).
fn prompt(nv: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.u64() % nv as u64) as u32).collect()
}

/// The oracle: `tokens` fed one at a time from a fresh state; every step's logits in order,
/// and the seconds it took.
fn single_steps<M: Rows>(m: &M, tokens: &[u32]) -> Result<(Vec<f32>, f64)> {
    let mut st = m.fresh()?;
    let t = Instant::now();
    let mut out = Vec::with_capacity(tokens.len() * m.vocab());
    for &tok in tokens {
        out.extend(m.rows(&mut st, &[tok])?);
    }
    Ok((out, t.elapsed().as_secs_f64()))
}

/// `prompt`: a prefill of n tokens in one call and in uneven chunks against n single steps.
pub fn prompt_suite<M: Rows>(m: &M, n: usize, seed: u64, report: &mut Report) -> Result<()> {
    let nv = m.vocab();
    let toks = prompt(nv, n, seed);
    let (want, steps_s) = single_steps(m, &toks)?;
    let mut st = m.fresh()?;
    let t = Instant::now();
    let got = m.rows(&mut st, &toks)?;
    let pre_s = t.elapsed().as_secs_f64();
    report.rows.push(row(
        "prefill (one call) vs single steps",
        format!("{n} tokens"),
        steps_s,
        pre_s,
        first_diff(&got, &want, nv, 0),
    ));
    // Chunks of 7, 1, 13, 2, … (uneven on purpose: every chunk boundary is a shape change).
    let sizes = [7usize, 1, 13, 2, 29, 5];
    let mut st = m.fresh()?;
    let mut got = Vec::with_capacity(want.len());
    let (mut at, mut i) = (0usize, 0usize);
    let t = Instant::now();
    while at < n {
        let k = sizes[i % sizes.len()].min(n - at);
        got.extend(m.rows(&mut st, &toks[at..at + k])?);
        at += k;
        i += 1;
    }
    let chunk_s = t.elapsed().as_secs_f64();
    report.rows.push(row(
        "chunked prefill (7, 1, 13, 2, 29, 5, …) vs single steps",
        format!("{n} tokens"),
        steps_s,
        chunk_s,
        first_diff(&got, &want, nv, 0),
    ));
    Ok(())
}

/// `verify`: after a prefix of `prefix` tokens, a window of w = 1..8 rows in one call against
/// the same w tokens as single steps (the speculative verify window's contract).
pub fn verify_suite<M: Rows>(m: &M, prefix: usize, seed: u64, report: &mut Report) -> Result<()> {
    let nv = m.vocab();
    let toks = prompt(nv, prefix + 8, seed);
    let (want, _) = single_steps(m, &toks)?;
    for w in 1..=8usize {
        // The oracle's time for these w rows: w single steps after the prefix.
        let mut st = m.fresh()?;
        m.rows(&mut st, &toks[..prefix])?;
        let t = Instant::now();
        for &tok in &toks[prefix..prefix + w] {
            m.rows(&mut st, &[tok])?;
        }
        let steps_s = t.elapsed().as_secs_f64();
        let mut st = m.fresh()?;
        m.rows(&mut st, &toks[..prefix])?;
        let t = Instant::now();
        let got = m.rows(&mut st, &toks[prefix..prefix + w])?;
        let win_s = t.elapsed().as_secs_f64();
        report.rows.push(row(
            "verify window vs single steps",
            format!("{w} rows after {prefix}"),
            steps_s,
            win_s,
            first_diff(&got, &want[prefix * nv..(prefix + w) * nv], nv, prefix),
        ));
    }
    Ok(())
}

/// `ops`: the operations a backend may override with a fused or reordered version (the family
/// trait's `hc_combine_mix` and `moe_block`, the core's prepared-activation operations), each
/// against the trait's default composition run on the same backend, bitwise, on the model's
/// own weights (its first layer) and seeded rows of 1, 3 and 8 tokens.
pub trait OpsSuite {
    fn ops_suite(&self, seed: u64, report: &mut Report) -> Result<()>;
}

/// Token counts of the `ops` rows (a decode step, an uneven batch, a verify window).
const OPS_ROWS: [usize; 3] = [1, 3, 8];

/// `n` seeded rows of `cols` normal values (times `scale`) on the backend.
fn rand_rows<B: Backend>(b: &B, rng: &mut Rng, n: usize, cols: usize) -> Result<B::Buf> {
    let v: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
    Ok(b.upload(n, cols, &v)?)
}

/// BITWISE PASS when every pair of buffers has the same bits, else the first difference
/// (`names` says which output).
fn same_bufs<B: Backend>(
    b: &B,
    got: &[&B::Buf],
    want: &[&B::Buf],
    names: &[&str],
) -> Result<String> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (b.download(g)?, b.download(w)?);
        let cols = got[i].cols().max(1);
        let v = first_diff(&g, &w, cols, 0);
        if v != "BITWISE PASS" {
            let v = v.replacen("logit", "column", 1);
            return Ok(format!(
                "{}: {v}",
                names.get(i).copied().unwrap_or("output")
            ));
        }
    }
    Ok("BITWISE PASS".to_string())
}

/// Runs `f` once and returns its result and seconds.
fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let t = Instant::now();
    let v = f()?;
    Ok((v, t.elapsed().as_secs_f64()))
}

impl<B: Qwen4expOps> OpsSuite for qwen4exp::Model<B> {
    fn ops_suite(&self, seed: u64, report: &mut Report) -> Result<()> {
        use strata_engine::backend::ExpertWeights;
        use strata_engine::qwen4exp::ops::{hc_combine_mix_composed, moe_block_composed};
        let b = self.backend();
        let c = self.config();
        let lw = self
            .weights()
            .layers
            .first()
            .ok_or_else(|| anyhow::anyhow!("the model has no layers"))?;
        let (h, s) = (c.n_embd, c.hc_streams);
        let hc_attn = self.hc_weights(&lw.hc_attn);
        let hc_ffn = self.hc_weights(&lw.hc_ffn);
        let mw = &lw.moe;
        let mut rng = Rng::new(seed);
        for n in OPS_ROWS {
            let shape = format!("layer 0, {n} rows");
            // hc_combine_mix: the token mixer's combine into the streams, the MoE's mix.
            let x = rand_rows(b, &mut rng, n, s * h)?;
            let y = rand_rows(b, &mut rng, n, h)?;
            let (_, inj) = b.hc_mix(&hc_attn, &x)?;
            let inj = inj.ok_or_else(|| anyhow::anyhow!("layer 0's mix has no inject"))?;
            let (mut xa, mut xb) = (b.copy(&x)?, b.copy(&x)?);
            let ((ua, ia), cand) =
                timed(|| Ok(b.hc_combine_mix(&mut xa, &y, Some(&inj), &hc_ffn)?))?;
            let ((ub, ib), base) = timed(|| {
                Ok(hc_combine_mix_composed(
                    b,
                    &mut xb,
                    &y,
                    Some(&inj),
                    &hc_ffn,
                )?)
            })?;
            let (ia, ib) = (
                ia.ok_or_else(|| anyhow::anyhow!("hc_combine_mix gave no inject"))?,
                ib.ok_or_else(|| anyhow::anyhow!("hc_combine + hc_mix gave no inject"))?,
            );
            let v = same_bufs(
                b,
                &[&xa, &ua, &ia],
                &[&xb, &ub, &ib],
                &["streams", "u", "inject"],
            )?;
            report.rows.push(row(
                "hc_combine_mix vs hc_combine + hc_mix",
                shape.clone(),
                base,
                cand,
                v,
            ));
            // moe_block: router, route, routed experts, gated shared expert.
            let u = rand_rows(b, &mut rng, n, h)?;
            let (ya, cand) = timed(|| Ok(b.moe_block(mw, &u, c.moe.n_used)?))?;
            let (yb, base) = timed(|| Ok(moe_block_composed(b, mw, &u, c.moe.n_used)?))?;
            report.rows.push(row(
                "moe_block vs moe_block_composed",
                shape.clone(),
                base,
                cand,
                same_bufs(b, &[&ya], &[&yb], &["y"])?,
            ));
            // rms_norm_prepared → matmul_prepared (the mix's norm and its two products).
            let inject = hc_attn
                .inject
                .ok_or_else(|| anyhow::anyhow!("layer 0's mix has no inject"))?;
            let ((pa, da, ja), cand) = timed(|| {
                let p = b.rms_norm_prepared(&x, hc_attn.norm, h, c.eps, &[hc_attn.down, inject])?;
                let d = b.matmul_prepared(hc_attn.down, &p)?;
                let j = b.matmul_prepared(inject, &p)?;
                Ok((p, d, j))
            })?;
            let ((nb, db, jb), base) = timed(|| {
                let r = b.rms_norm(&x, hc_attn.norm, h, c.eps)?;
                let d = b.matmul(hc_attn.down, &r)?;
                let j = b.matmul(inject, &r)?;
                Ok((r, d, j))
            })?;
            report.rows.push(row(
                "rms_norm_prepared + matmul_prepared vs rms_norm + matmul",
                format!("{shape}: the attention mix's norm, down and inject"),
                base,
                cand,
                same_bufs(
                    b,
                    &[&pa.rows, &da, &ja],
                    &[&nb, &db, &jb],
                    &["norm", "down", "inject"],
                )?,
            ));
            // prepare → matmuls_prepared and moe_experts_prepared (one image set for every
            // product of the MoE input).
            let ws = [&mw.router, &mw.gate_shexp, &mw.up_shexp, &mw.shexp_gate];
            let experts = ExpertWeights {
                gate: &mw.gate_exps,
                up: &mw.up_exps,
                down: &mw.down_exps,
            };
            let (([ra, ga, ua2, sa], ea), cand) = timed(|| {
                let p = b.prepare(
                    b.copy(&u)?,
                    &[ws[0], ws[1], ws[2], ws[3], &mw.gate_exps, &mw.up_exps],
                )?;
                let ys = b.matmuls_prepared(ws, &p)?;
                let routes = b.route(&ys[0], c.moe.n_used)?;
                let e = b.moe_experts_prepared(&experts, &p, &routes)?;
                Ok((ys, e))
            })?;
            let (([rb, gb, ub2, sb], eb), base) = timed(|| {
                let ys = ws.map(|w| b.matmul(w, &u));
                let [r, g, up, sg] = ys;
                let (r, g, up, sg) = (r?, g?, up?, sg?);
                let routes = b.route(&r, c.moe.n_used)?;
                let e = b.moe_experts(&experts, &u, &routes)?;
                Ok(([r, g, up, sg], e))
            })?;
            report.rows.push(row(
                "prepare + matmuls_prepared + moe_experts_prepared vs matmul + moe_experts",
                format!("{shape}: the MoE's products"),
                base,
                cand,
                same_bufs(
                    b,
                    &[&ra, &ga, &ua2, &sa, &ea],
                    &[&rb, &gb, &ub2, &sb, &eb],
                    &["router", "gate_shexp", "up_shexp", "shexp_gate", "experts"],
                )?,
            ));
            // reshape_prepared: rows of S·H prepared, products of the rows of H they hold
            // (the MTP head's norm over every stream, then fc_hidden per stream).
            let (ra, cand) = timed(|| {
                let p = b.prepare(b.copy(&x)?, &[&mw.router])?;
                let p = b.reshape_prepared(p, n * s, h)?;
                Ok(b.matmul_prepared(&mw.router, &p)?)
            })?;
            let (rb, base) = timed(|| {
                let r = b.reshape(b.copy(&x)?, n * s, h)?;
                Ok(b.matmul(&mw.router, &r)?)
            })?;
            report.rows.push(row(
                "prepare + reshape_prepared + matmul_prepared vs reshape + matmul",
                format!("{shape}: streams as rows, the router"),
                base,
                cand,
                same_bufs(b, &[&ra], &[&rb], &["product"])?,
            ));
        }
        report.notes.push(ops_note(b.name()));
        Ok(())
    }
}

/// A qwen2 norm, its weight and the products of its rows.
type NormCase<'a, B> = (
    &'static str,
    &'a <B as Backend>::Weight,
    Vec<&'a <B as Backend>::Weight>,
);

impl<B: Backend> OpsSuite for qwen2::Model<B> {
    fn ops_suite(&self, seed: u64, report: &mut Report) -> Result<()> {
        let b = self.backend();
        let c = self.config();
        let w = self.weights();
        let lw = w
            .layers
            .first()
            .ok_or_else(|| anyhow::anyhow!("the model has no layers"))?;
        let mut rng = Rng::new(seed);
        for n in OPS_ROWS {
            let x = rand_rows(b, &mut rng, n, c.n_embd)?;
            // The attention's norm and q/k/v, the MLP's norm and gate/up, the head's norm.
            let cases: [NormCase<'_, B>; 3] = [
                (
                    "attn_norm → q, k, v",
                    &lw.attn_norm,
                    vec![&lw.q, &lw.k, &lw.v],
                ),
                ("ffn_norm → gate, up", &lw.ffn_norm, vec![&lw.gate, &lw.up]),
                ("output_norm → output", &w.output_norm, vec![&w.output]),
            ];
            for (what, norm, ws) in cases {
                let (ya, cand) = timed(|| {
                    let p = b.rms_norm_prepared(&x, norm, c.n_embd, c.eps, &ws)?;
                    let mut ys = vec![b.copy(&p.rows)?];
                    for wt in &ws {
                        ys.push(b.matmul_prepared(wt, &p)?);
                    }
                    Ok(ys)
                })?;
                let (yb, base) = timed(|| {
                    let r = b.rms_norm(&x, norm, c.n_embd, c.eps)?;
                    let mut ys = Vec::new();
                    for wt in &ws {
                        ys.push(b.matmul(wt, &r)?);
                    }
                    ys.insert(0, r);
                    Ok(ys)
                })?;
                let ga: Vec<&B::Buf> = ya.iter().collect();
                let gb: Vec<&B::Buf> = yb.iter().collect();
                let mut names = vec!["norm"];
                names.extend(std::iter::repeat_n("product", ws.len()));
                report.rows.push(row(
                    "rms_norm_prepared + matmul_prepared vs rms_norm + matmul",
                    format!("layer 0, {n} rows: {what}"),
                    base,
                    cand,
                    same_bufs(b, &ga, &gb, &names)?,
                ));
            }
            let ws = [&lw.q, &lw.k, &lw.v];
            let (ya, cand) = timed(|| {
                let p = b.prepare(b.copy(&x)?, &ws)?;
                Ok(b.matmuls_prepared(ws, &p)?)
            })?;
            let (yb, base) = timed(|| Ok(b.matmuls(ws, &x)?))?;
            report.rows.push(row(
                "prepare + matmuls_prepared vs matmuls",
                format!("layer 0, {n} rows: q, k, v"),
                base,
                cand,
                same_bufs(
                    b,
                    &[&ya[0], &ya[1], &ya[2]],
                    &[&yb[0], &yb[1], &yb[2]],
                    &["q", "k", "v"],
                )?,
            ));
        }
        report.notes.push(ops_note(b.name()));
        Ok(())
    }
}

/// What the `ops` rows compare on this backend.
fn ops_note(backend: &str) -> String {
    let mut s = "baseline: the trait's default composition on the same backend \
                 (hc_combine + hc_mix, moe_block_composed, rms_norm then plain products); \
                 candidate: the backend's operation; times: one wall-clock run each, the candidate first (it \
                 pays the first touch of the weights), so they are no measurement"
        .to_string();
    if backend == "cpu" {
        s.push_str(
            "; on the CPU hc_combine_mix, moe_block and rms_norm_prepared are the defaults \
             themselves (the rows check the composition against its parts), and prepare / \
             matmul(s)_prepared / moe_experts_prepared / reshape_prepared are the CPU's own \
             (one catalogue xprep image per format, read by every product)",
        );
    }
    s
}
