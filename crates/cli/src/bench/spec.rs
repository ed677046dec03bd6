//! `strata bench spec`: MTP speculative decoding's tokens/s with and without drafts, the cost of
//! a verify window, and the speed-up when drafts are forced right at chosen rates.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::speculative::{
    DraftHook, DraftVocab, SpecConfig, SpecDecoder, SpecStats, MAX_WINDOW,
};
use strata_engine::{CpuBackend, Qwen4expOps};
use strata_tokenizer::Tokenizer;

use crate::load::{self, Loaded};
use crate::outln;

mod synth;

/// A qwen4exp trunk on the chosen backend, its tokenizer and (from `--mtp`, or the trunk file)
/// the MTP head.
fn load_trunk(
    path: &Path,
    mtp: Option<&Path>,
    threads: usize,
    backend: &crate::args::backend::BackendChoice,
) -> Result<(Loaded, Tokenizer)> {
    let opened = load::open(path)?;
    if opened.arch != strata_engine::qwen4exp::config::ARCH {
        bail!(
            "MTP speculation needs a qwen4exp model; {} is {}",
            path.display(),
            opened.arch
        );
    }
    let loaded = Loaded::bind(
        &opened,
        path,
        threads,
        LoadOptions::default().kv_type,
        mtp,
        None,
        backend,
    )?;
    let tok = load::tokenizer(&opened.file, path, loaded.n_vocab())?;
    Ok((loaded, tok))
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// The qwen4exp trunk GGUF
    #[arg(
        short = 'm',
        long,
        value_name = "MODEL.gguf",
        required_unless_present = "synthetic"
    )]
    pub model: Option<PathBuf>,
    /// A synthetic trunk and head built in memory instead (random Q8_0 weights): `medium`
    /// (H 1024, 8 layers, 32 experts of which 8 active) or `flash-mini` (Flash-Next's
    /// proportions, smaller)
    #[arg(long, conflicts_with_all = ["model", "mtp", "prompt"])]
    pub synthetic: Option<String>,
    /// The MTP head GGUF (a model file that carries `mtp.*` needs none)
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp: Option<PathBuf>,
    /// Prompt text (default: a fixed English sentence)
    #[arg(short = 'p', long)]
    pub prompt: Option<String>,
    /// Tokens to generate per run
    #[arg(short = 'n', long, default_value_t = 64)]
    pub n: usize,
    /// Verify windows to measure, comma-separated, each 1..8
    #[arg(long, value_delimiter = ',', default_value = "2,3,4,6,8")]
    pub windows: Vec<usize>,
    /// Force each draft right with these probabilities in [0, 1] (per position, seeded), on
    /// top of the runs with the head's own drafts
    #[arg(long, value_delimiter = ',')]
    pub force_accept: Vec<f64>,
    /// Repetitions of every run (the best is reported: on a shared machine the fastest run is
    /// the one least disturbed)
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Draft floor, in [0, 1] (0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub spec_min_p: f32,
    /// Draft vocabulary file
    #[arg(long)]
    pub draft_vocab: Option<PathBuf>,
    /// Seed of the forced-acceptance draws
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten)]
    pub threads: crate::args::ThreadsArgs,
    #[command(flatten)]
    pub backend: crate::args::backend::BackendArgs,
    /// Print JSON instead of tables
    #[arg(long)]
    pub json: bool,
    /// Time with the wall clock or the process's CPU time (steadier on a shared machine)
    #[arg(long, value_enum, default_value_t = Clock::Wall)]
    pub clock: Clock,
}

/// Forced drafts: right (the plain run's token) with probability `rate`, decided once per
/// position by a hash of (seed, position); wrong otherwise.
struct ForceRate {
    truth: Vec<u32>,
    rate: f64,
    seed: u64,
    n_vocab: u32,
}

fn unit(seed: u64, pos: u64) -> f64 {
    let mut z = seed ^ pos.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

impl DraftHook for ForceRate {
    fn draft(&mut self, position: usize, _proposed: u32) -> Option<u32> {
        let right = *self.truth.get(position)?;
        if unit(self.seed, position as u64) < self.rate {
            Some(right)
        } else {
            Some((right + 1) % self.n_vocab)
        }
    }

    /// The choice depends on the position alone, so the draft chain stays on the device (one
    /// step, its ids read once) as it does with the head's own drafts.
    fn ahead(&mut self, position: usize) -> Option<Option<u32>> {
        Some(self.draft(position, 0))
    }
}

/// One measured generation.
struct Measured {
    tokens: Vec<u32>,
    /// Decode time (the prefill excluded).
    decode: Duration,
    stats: SpecStats,
}

fn measure<B: Qwen4expOps>(
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
    cfg: &SpecConfig,
    hook: Option<&ForceRate>,
    clock: Clock,
) -> Result<Measured> {
    let mut dec = SpecDecoder::new(model, cfg.clone())?;
    if let Some(h) = hook {
        dec = dec.with_draft_hook(ForceRate {
            truth: h.truth.clone(),
            ..*h
        });
    }
    let mut tokens = vec![dec.prefill(prompt)?];
    let c0 = clock.now();
    while tokens.len() < n {
        dec.step(n - tokens.len(), &mut |t| {
            tokens.push(t);
            true
        })?;
    }
    let decode = Duration::from_secs_f64((clock.now() - c0).max(0.0));
    Ok(Measured {
        tokens,
        decode,
        stats: dec.stats().clone(),
    })
}

/// What the benchmark times with: wall time, or the CPU time of the whole process (all its
/// threads, `CLOCK_PROCESS_CPUTIME_ID`), which a busy machine disturbs far less than the wall
/// clock when the run uses fewer threads than there are idle cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Clock {
    Wall,
    Cpu,
}

impl Clock {
    fn now(self) -> f64 {
        match self {
            Clock::Wall => {
                static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
                START.get_or_init(Instant::now).elapsed().as_secs_f64()
            }
            Clock::Cpu => process_cpu_seconds().unwrap_or(f64::NAN),
        }
    }
}

/// The process's CPU time, to the nanosecond (the per-thread `schedstat` counters this used
/// before advance only at scheduler ticks, 4 ms here: too coarse for runs of tens of ms).
fn process_cpu_seconds() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

fn best_min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The benchmark's fixed inputs: model, prompt, run length, repetitions, clock.
struct Runner<'a, B: Qwen4expOps> {
    model: &'a Model<B>,
    prompt: &'a [u32],
    n: usize,
    reps: usize,
    clock: Clock,
}

impl<B: Qwen4expOps> Runner<'_, B> {
    fn once(&self, cfg: &SpecConfig, hook: Option<&ForceRate>) -> Result<Measured> {
        measure(self.model, self.prompt, self.n, cfg, hook, self.clock)
    }

    /// The best of `reps` runs (tokens/s, and the statistics of that run), each checked to
    /// emit exactly `want`.
    fn best(
        &self,
        cfg: &SpecConfig,
        hook: Option<&ForceRate>,
        want: &[u32],
    ) -> Result<(f64, SpecStats)> {
        let mut best: Option<(f64, SpecStats)> = None;
        for _ in 0..self.reps.max(1) {
            let m = self.once(cfg, hook)?;
            if m.tokens != want {
                bail!(
                    "window {}: the speculative run emitted other tokens than plain decoding (first difference at {})",
                    cfg.window,
                    m.tokens.iter().zip(want).position(|(a, b)| a != b).unwrap_or(m.tokens.len())
                );
            }
            let tps = (m.tokens.len() - 1) as f64 / m.decode.as_secs_f64().max(1e-9);
            if best.as_ref().is_none_or(|(b, _)| tps > *b) {
                best = Some((tps, m.stats));
            }
        }
        Ok(best.unwrap_or_default())
    }
}

/// Time of one trunk pass over `rows` window rows at the current position (best of `reps`),
/// with the state rolled back after each.
fn window_cost<B: Qwen4expOps>(
    model: &Model<B>,
    prompt: &[u32],
    cont: &[u32],
    rows: usize,
    reps: usize,
    clock: Clock,
) -> Result<Duration> {
    let mut st = model.new_state()?;
    model.forward_with(
        &mut st,
        prompt,
        Want {
            last_only: true,
            ..Want::default()
        },
    )?;
    let cp = model.checkpoint(&st)?;
    let toks = cont
        .get(..rows)
        .context("the plain run is shorter than the window")?;
    let mut times = Vec::new();
    for _ in 0..reps.max(1) + 1 {
        let t0 = clock.now();
        model.forward_with(
            &mut st,
            toks,
            Want {
                hidden: true,
                ..Want::default()
            },
        )?;
        times.push(clock.now() - t0);
        model.restore(&mut st, &cp)?;
    }
    times.remove(0);
    Ok(Duration::from_secs_f64(best_min(&times)))
}

/// `strata bench spec`.
pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    if a.n < 2 {
        bail!("-n {}: out of range; expected at least 2 tokens", a.n);
    }
    if a.windows.is_empty() {
        bail!("--windows: give at least one window");
    }
    if let Some(&w) = a.windows.iter().find(|&&w| !(1..=MAX_WINDOW).contains(&w)) {
        bail!("--windows {w}: out of range; expected verify windows of 1 to {MAX_WINDOW} rows");
    }
    for &r in &a.force_accept {
        crate::args::check_f32(
            "--force-accept",
            r as f32,
            |r| (0.0..=1.0).contains(&r),
            "probabilities in [0, 1]",
        )?;
    }
    crate::args::check_f32(
        "--spec-min-p",
        a.spec_min_p,
        |p| (0.0..=1.0).contains(&p),
        "a probability in [0, 1] (0: off)",
    )?;
    if let Some(p) = &a.draft_vocab {
        crate::output::check_input("--draft-vocab", p)?;
    }
    if let Some(p) = &a.mtp {
        crate::output::check_input("--mtp", p)?;
    }
    let threads = a.threads.resolve();
    let backend = a.backend.resolve()?;
    match (&a.synthetic, &a.model) {
        (Some(preset), _) => {
            if backend.kind != crate::args::backend::BackendKind::Cpu
                && backend.kind != crate::args::backend::BackendKind::Auto
            {
                bail!(
                    "--synthetic builds its model in host memory for the CPU backend; for a GPU, write a file with `strata synth --mtp` and pass it with -m and --mtp"
                );
            }
            let g = synth::Geometry::preset(preset)?;
            let t0 = Instant::now();
            let (trunk, head) = synth::build(&g, a.seed)?;
            let mut model =
                Model::from_file(trunk, CpuBackend::new(threads)?, &LoadOptions::default())?;
            model.attach_mtp(head)?;
            let bytes = model.file().total_tensor_bytes();
            eprintln!(
                "synthetic '{preset}': {:.0} MiB of trunk weights, built in {:.1} s",
                bytes as f64 / (1u64 << 20) as f64,
                t0.elapsed().as_secs_f64()
            );
            let n_vocab = model.config().n_vocab;
            let prompt: Vec<u32> = (0..32)
                .map(|i| (unit(a.seed, 1_000_000 + i) * n_vocab as f64) as u32)
                .collect();
            let place = format!("{} threads", model.backend().threads());
            run(
                &a,
                &model,
                prompt,
                format!("synthetic {preset} {g:?}"),
                place,
            )
        }
        (None, Some(path)) => {
            let (loaded, tok) = load_trunk(path, a.mtp.as_deref(), threads, &backend)?;
            eprintln!("backend: {}", loaded.backend_note);
            let text = a.prompt.clone().unwrap_or_else(|| {
                "The old lighthouse stands at the edge of the harbour. Every night the keeper"
                    .to_string()
            });
            let prompt = tok
                .encode(&text, true, true)
                .context("tokenizing the prompt")?;
            let place = loaded.backend_name().to_string();
            let name = path.display().to_string();
            match loaded.model {
                load::Bound::Qwen4exp(m) => run(&a, &m, prompt, name, place),
                load::Bound::Qwen4expCuda(m) => run(&a, &m, prompt, name, place),
                load::Bound::Qwen4expWgpu(m) => run(&a, &m, prompt, name, place),
                _ => bail!("{}: not a qwen4exp model", path.display()),
            }
        }
        (None, None) => bail!("give -m MODEL.gguf or --synthetic NAME"),
    }
}

/// The measurements on a loaded trunk with its head.
fn run<B: Qwen4expOps>(
    a: &BenchArgs,
    model: &Model<B>,
    prompt: Vec<u32>,
    name: String,
    place: String,
) -> Result<ExitCode> {
    if !model.has_mtp() {
        bail!(
            "{name} has no MTP head; give one with --mtp (strata convert-mtp makes it, strata synth --mtp writes a synthetic one)"
        );
    }
    let draft_vocab = match &a.draft_vocab {
        Some(p) => Some(DraftVocab::load(p, model.config().n_vocab)?),
        None => None,
    };
    let base_cfg = |window: usize| SpecConfig {
        window,
        min_p: a.spec_min_p,
        draft_vocab: draft_vocab.clone(),
    };

    // Plain decoding: the baseline and the reference sequence.
    let runner = Runner {
        model,
        prompt: &prompt,
        n: a.n,
        reps: a.reps,
        clock: a.clock,
    };
    let plain = runner.once(&base_cfg(1), None)?;
    let want = plain.tokens.clone();
    let (plain_tps, _) = runner.best(&base_cfg(1), None, &want)?;

    // The cost of a window of N rows against one decode step.
    let mut cost = Vec::new();
    let one = window_cost(model, &prompt, &want, 1, a.reps.max(11), a.clock)?;
    for &w in &a.windows {
        let t = window_cost(model, &prompt, &want, w, a.reps.max(11), a.clock)?;
        cost.push((w, t, t.as_secs_f64() / one.as_secs_f64().max(1e-12)));
    }

    // The head's own drafts, then forced acceptance rates.
    let mut rows = Vec::new();
    let mut runs: Vec<(String, Option<f64>)> = vec![("mtp".to_string(), None)];
    runs.extend(
        a.force_accept
            .iter()
            .map(|&r| (format!("forced {r}"), Some(r))),
    );
    let mut truth = prompt.clone();
    truth.extend_from_slice(&want);
    for (label, rate) in &runs {
        for &w in &a.windows {
            let hook = rate.map(|r| ForceRate {
                truth: truth.clone(),
                rate: r,
                seed: a.seed,
                n_vocab: model.config().n_vocab as u32,
            });
            let cfg = base_cfg(w);
            let (tps, s) = runner.best(&cfg, hook.as_ref(), &want)?;
            rows.push((label.clone(), w, tps, s));
        }
    }

    if a.json {
        let j = json!({
            "model": name,
            "place": place,
            "prompt_tokens": prompt.len(),
            "generated": a.n,
            "plain_tokens_per_s": plain_tps,
            "one_row_ms": one.as_secs_f64() * 1e3,
            "window_cost": cost.iter().map(|(w, t, r)| json!({"rows": w, "ms": t.as_secs_f64() * 1e3, "ratio": r})).collect::<Vec<_>>(),
            "runs": rows.iter().map(|(l, w, tps, s)| json!({
                "drafts": l, "window": w, "tokens_per_s": tps, "speedup": tps / plain_tps,
                "tokens_per_pass": s.tokens_per_pass(), "acceptance": s.acceptance_all(),
                "acceptance_per_step": (0..s.offered.len()).map(|j| s.acceptance(j)).collect::<Vec<_>>(),
                "conditional_acceptance_per_step": (0..s.offered.len()).map(|j| s.conditional_acceptance(j)).collect::<Vec<_>>(),
                "ms_catchup_per_pass": s.catchup_time.as_secs_f64() * 1e3 / s.passes.max(1) as f64,
                "ms_rollback_per_pass": s.rollback_time.as_secs_f64() * 1e3 / s.passes.max(1) as f64,
                "ms_per_pass": s.time_per_pass().as_secs_f64() * 1e3,
                "ms_per_draft": s.time_per_draft().as_secs_f64() * 1e3,
            })).collect::<Vec<_>>(),
        });
        outln!("{j:#}")?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "model {} ({}), prompt {} tokens, {} generated, best of {} runs, {:?} clock; every run checked to emit the plain run's tokens\n",
        name,
        place,
        prompt.len(),
        a.n,
        a.reps.max(1),
        a.clock
    )?;
    outln!("plain decoding: {plain_tps:.2} tokens/s\n")?;
    outln!("| rows N | trunk pass | × one decode step |\n|---:|---:|---:|")?;
    outln!("| 1 | {:.3} ms | 1.00 |", one.as_secs_f64() * 1e3)?;
    for (w, t, r) in &cost {
        outln!("| {w} | {:.3} ms | {r:.2} |", t.as_secs_f64() * 1e3)?;
    }
    outln!("\n| drafts | N | tokens/s | speed-up | tokens/pass | accepted/offered | accepted/reached per step | ms verify/pass | ms per chained draft | ms catch-up/pass |\n|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")?;
    let f2 = |r: Option<f64>| r.map(|r| format!("{r:.2}")).unwrap_or_else(|| "-".into());
    for (label, w, tps, s) in &rows {
        let per: Vec<String> = (0..s.offered.len())
            .map(|j| f2(s.conditional_acceptance(j)))
            .collect();
        outln!(
            "| {label} | {w} | {tps:.1} | {:.2} | {:.2} | {} | {} | {:.3} | {:.3} | {:.3} |",
            tps / plain_tps,
            s.tokens_per_pass(),
            f2(s.acceptance_all()),
            per.join(" "),
            s.time_per_pass().as_secs_f64() * 1e3,
            s.time_per_draft().as_secs_f64() * 1e3,
            s.catchup_time.as_secs_f64() * 1e3 / s.passes.max(1) as f64
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
