//! `strata parity prompt | verify -m MODEL`: the determinism contract measured on a whole
//! model, on any backend (DESIGN.md §3: prefill equals single steps; a verify window's rows
//! equal single steps). The oracle is the same model fed one token at a time; the candidates
//! are a whole-prompt prefill, an uneven chunked prefill, and windows of 1..8 rows after a
//! prefix. Each row says BITWISE PASS or the first differing (row, logit), with the paired
//! times (single steps as the baseline).

use std::time::Instant;

use anyhow::Result;
use strata_engine::kernels::testdata::Rng;
use strata_engine::qwen4exp::ops::Qwen4expOps;
use strata_engine::{qwen2, qwen4exp, Backend};
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
