//! `strata bench model`: a model's throughput in llama-bench's vocabulary, so the numbers sit
//! beside `llama-bench`'s: `ppN` (a prompt of N tokens, tokens/s), `tgN` (N decode steps of one
//! token, tokens/s), `@ dD` (D tokens already in the context, filled before the timed part and
//! not counted), repetitions with mean ± sd, a markdown table like llama-bench's or JSON with
//! its field names. Both families (qwen2, qwen4exp) through the generation loop's `Session`.
//! Tokens are random ids (as llama-bench's), so the text is noise. Besides the wall clock it
//! records the process's CPU time per repetition, steadier on a shared machine.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata_engine::backend::DevicePick;
use strata_engine::generate::Session;
use strata_gguf::GgufFile;
use strata_quant::synth::SplitMix64;

use crate::args::model::ModelArgs;
use crate::load::{self, Loaded};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to time (pp tests; 0 = none), comma-separated
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_values_t = vec![512])]
    pub n_prompt: Vec<usize>,
    /// Decode lengths to time (tg tests; 0 = none), comma-separated
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_values_t = vec![128])]
    pub n_gen: Vec<usize>,
    /// Context depths: tokens already in the context before the timed part, comma-separated
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_values_t = vec![0])]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// Tokens per forward call in prompts and depth fills (llama-bench's ubatch)
    #[arg(short = 'u', long, default_value_t = 512)]
    pub ubatch: usize,
    /// Per-kernel device time per decode token at each depth, and per token of one prefill of
    /// the first -p size (CUDA backend), on stderr
    #[arg(long)]
    pub profile: bool,
    /// Skip the untimed warm-up run
    #[arg(long)]
    pub no_warmup: bool,
    /// Seed of the random token ids
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print JSON (an array of tests, llama-bench's field names) instead of the table
    #[arg(long)]
    pub json: bool,
    /// An A/B inside this process (CUDA): every test is timed twice, its repetitions
    /// alternating between the switches as the environment sets them (A) and these overrides
    /// (B), e.g. `STRATA_CUDA_QSA_PREP=0`; the weights and buffers stay where they are, so the
    /// spread between processes is out of the comparison. Comma-separated; switches read only at
    /// start are refused
    #[arg(long, value_name = "SWITCH=0|1[,…]")]
    pub ab: Option<String>,
    /// Marginal costs inside the recorded step (CUDA), in this process: every test is timed
    /// once as it is and once per ';'-separated list of kernels made empty launches that only
    /// wait (`*`: every kernel, the launch floor), repetitions rotating over the arms. The
    /// ablated arms compute wrong results; their time lost against the first arm is what those
    /// kernels cost in the graph
    #[arg(long, value_name = "KERNEL[,…][;…]", conflicts_with = "ab")]
    pub ablate: Option<String>,
    /// Decode tests take each step's greedy pick on the device and feed it back, as `strata
    /// run --temp 0` decodes (only the id crosses to the host). Without it every step's
    /// logits come back to the host, as llama-bench's do
    #[arg(long)]
    pub pick: bool,
}

/// One arm of an in-process comparison: switch overrides (`--ab`) or ablated kernels
/// (`--ablate`); the first arm of either is the process as the environment sets it.
enum Arm {
    Switches(Vec<(String, bool)>),
    Ablate(Vec<String>),
}

impl Arm {
    fn label(&self) -> String {
        match self {
            Arm::Switches(ab) => {
                let l: Vec<String> = ab
                    .iter()
                    .map(|(k, on)| format!("{k}={}", u8::from(*on)))
                    .collect();
                format!("B: {}", l.join(","))
            }
            Arm::Ablate(k) => format!("ablated: {}", k.join(",")),
        }
    }

    /// Puts the arm in force (`on`) or back to the environment's settings.
    fn apply(&self, on: bool) -> Result<()> {
        match self {
            Arm::Switches(ab) => apply_ab(ab, on),
            Arm::Ablate(k) => {
                strata_cuda::device::set_ablated(on.then(|| k.clone()));
                Ok(())
            }
        }
    }
}

/// `--ablate`'s lists, checked: each a non-empty list of kernel names.
fn parse_ablate(spec: &str) -> Result<Vec<Vec<String>>> {
    let lists: Vec<Vec<String>> = spec
        .split(';')
        .map(strata_cuda::device::ablate_list)
        .filter(|l| !l.is_empty())
        .collect();
    if lists.is_empty() {
        bail!("--ablate: no kernel named");
    }
    for l in &lists {
        if let Some(bad) = l
            .iter()
            .find(|k| *k != "*" && !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            bail!("--ablate {bad}: not a kernel name (letters, digits and '_', or '*')");
        }
    }
    Ok(lists)
}

/// `--ab`'s overrides, checked: (switch, value) pairs.
fn parse_ab(spec: &str) -> Result<Vec<(String, bool)>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            bail!("--ab {part}: expected SWITCH=0 or SWITCH=1");
        };
        let on = match v.trim() {
            "0" => false,
            "1" => true,
            _ => bail!("--ab {part}: expected SWITCH=0 or SWITCH=1"),
        };
        let k = k.trim().to_string();
        // Checked by setting it (then back to the environment's value).
        strata_cuda::device::set_switch(&k, Some(on)).with_context(|| format!("--ab {part}"))?;
        strata_cuda::device::set_switch(&k, None).with_context(|| format!("--ab {part}"))?;
        out.push((k, on));
    }
    if out.is_empty() {
        bail!("--ab: no switch given");
    }
    Ok(out)
}

/// Sets (`b`) or clears `--ab`'s overrides.
fn apply_ab(ab: &[(String, bool)], b: bool) -> Result<()> {
    for (k, on) in ab {
        strata_cuda::device::set_switch(k, b.then_some(*on))?;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Prompt,
    Gen,
}

#[derive(Clone, Copy, Debug)]
struct Test {
    kind: Kind,
    n: usize,
    depth: usize,
}

impl Test {
    fn name(&self) -> String {
        let base = match self.kind {
            Kind::Prompt => format!("pp{}", self.n),
            Kind::Gen => format!("tg{}", self.n),
        };
        if self.depth > 0 {
            format!("{base} @ d{}", self.depth)
        } else {
            base
        }
    }
}

struct Result1 {
    test: Test,
    /// `--ab`'s arm: None without an A/B, else "A" or "B: overrides".
    arm: Option<String>,
    wall_ns: Vec<u64>,
    cpu_ns: Vec<u64>,
}

impl Result1 {
    fn name(&self) -> String {
        match &self.arm {
            Some(a) => format!("{} [{a}]", self.test.name()),
            None => self.test.name(),
        }
    }
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

impl Result1 {
    fn ts(&self) -> Vec<f64> {
        self.wall_ns
            .iter()
            .map(|&ns| self.test.n as f64 * 1e9 / ns.max(1) as f64)
            .collect()
    }
}

/// The process's CPU time (all threads) in nanoseconds.
fn cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Feeds `n` random tokens in calls of at most `ubatch`.
fn feed(s: &mut dyn Session, rng: &mut SplitMix64, n: usize, ubatch: usize) -> Result<()> {
    let v = s.n_vocab() as u64;
    let mut left = n;
    while left > 0 {
        let k = left.min(ubatch);
        let toks: Vec<u32> = (0..k).map(|_| (rng.next_u64() % v) as u32).collect();
        s.feed(&toks)?;
        left -= k;
    }
    Ok(())
}

/// `n` decode steps that each feed the step before's greedy pick, made on the device (`--pick`);
/// the first feeds a random token.
fn decode_picked(s: &mut dyn Session, rng: &mut SplitMix64, n: usize) -> Result<()> {
    let mut tok = (rng.next_u64() % s.n_vocab() as u64) as u32;
    for _ in 0..n {
        tok = s.feed_picked(&[tok], DevicePick::Greedy)?.ok_or_else(|| {
            anyhow::anyhow!("--pick: this model's session cannot pick on its backend")
        })?;
    }
    Ok(())
}

/// One repetition: a fresh sequence, the depth filled, then the timed part.
fn once(
    loaded: &Loaded,
    t: Test,
    ubatch: usize,
    pick: bool,
    rng: &mut SplitMix64,
) -> Result<(u64, u64)> {
    let mut s = loaded.session(loaded.n_ctx_model())?;
    feed(s.as_mut(), rng, t.depth, ubatch).context("filling the context to the depth")?;
    let (w0, c0) = (Instant::now(), cpu_ns());
    match t.kind {
        Kind::Prompt => feed(s.as_mut(), rng, t.n, ubatch)?,
        Kind::Gen if pick => decode_picked(s.as_mut(), rng, t.n)?,
        Kind::Gen => feed(s.as_mut(), rng, t.n, 1)?,
    }
    Ok((w0.elapsed().as_nanos() as u64, cpu_ns().saturating_sub(c0)))
}

/// `--ablate`'s answer per test: each arm's mean time a token and what it saves against the
/// first (unablated) arm — the marginal cost of its kernels inside the recorded step.
fn ablate_table(rs: &[Result1]) {
    let ms = |r: &Result1| {
        let n = r.wall_ns.len().max(1) as f64;
        r.wall_ns.iter().map(|&w| w as f64).sum::<f64>() / n / 1e6 / r.test.n.max(1) as f64
    };
    let base = ms(&rs[0]);
    eprintln!("| arm | ms/token | saved ms/token | saved % |");
    eprintln!("| --- | ---: | ---: | ---: |");
    for r in rs {
        let m = ms(r);
        eprintln!(
            "| {} | {m:.3} | {:.3} | {:.1} % |",
            r.arm.as_deref().unwrap_or("-"),
            base - m,
            100.0 * (base - m) / base.max(1e-12)
        );
    }
}

/// The 15 kernels with the most device time, per token (`per` tokens profiled, `total` µs of
/// kernel time a token).
fn profile_table(ks: &[strata_cuda::KernelTime], per: f64, total: f64, bw: f64) {
    eprintln!(
        "| kernel | launches/token | µs/token | share | MB/token | floor µs/token | × floor |"
    );
    eprintln!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    // Every kernel of at least 0.5 % (at most 40 rows), then the rest in one row.
    let share = |us: f64| 100.0 * us / per / total.max(1e-9);
    let shown = ks
        .iter()
        .take(40)
        .take_while(|k| share(k.us) >= 0.5)
        .count();
    for k in &ks[..shown] {
        // The floor: the bytes its launches must read over the measured copy bandwidth
        // (kernels whose launchers state no bytes show none).
        let (mb, floor, ratio) = match k.bytes {
            Some(b) if b > 0 => {
                let fl = b as f64 / bw * 1e6 / per;
                (
                    format!("{:.2}", b as f64 / 1e6 / per),
                    format!("{fl:.1}"),
                    format!("{:.1}", k.us / per / fl.max(1e-9)),
                )
            }
            _ => ("-".into(), "-".into(), "-".into()),
        };
        eprintln!(
            "| {} | {:.1} | {:.1} | {:.1} % | {mb} | {floor} | {ratio} |",
            k.name,
            k.launches as f64 / per,
            k.us / per,
            share(k.us)
        );
    }
    if shown < ks.len() {
        let rest = &ks[shown..];
        let (l, us) = rest
            .iter()
            .fold((0usize, 0.0f64), |(a, b), k| (a + k.launches, b + k.us));
        eprintln!(
            "| ({} other kernels) | {:.1} | {:.1} | {:.1} % | | | |",
            rest.len(),
            l as f64 / per,
            us / per,
            share(us)
        );
    }
    let bytes: u64 = ks.iter().filter_map(|k| k.bytes).sum();
    eprintln!(
        "stated bytes {:.1} MB/token: a floor of {:.0} µs/token at the copy bandwidth",
        bytes as f64 / 1e6 / per,
        bytes as f64 / bw * 1e6 / per
    );
}

/// `--profile` on wgpu, decode at depth `d`: (1) the stream as it runs, counted: dispatches
/// and submits per token and the host's time per token split into building launches,
/// recording + submitting and waiting; (2) the same with GPU timestamps between dispatches
/// (nothing serialised beyond what the step does): GPU busy time per token and per kernel
/// (count, total, mean, bytes, GB/s). Without timestamps on the adapter, (2) falls back to each
/// dispatch submitted and waited for on its own (wall times, only to rank kernels).
fn wgpu_profile(
    w: &strata_wgpu::WgpuBackend,
    loaded: &Loaded,
    a: &Args,
    d: usize,
    rng: &mut SplitMix64,
) -> Result<()> {
    let n = a.n_gen.iter().copied().max().unwrap_or(0).max(8);
    let per = |x: u64| x as f64 / n as f64;
    let us = |ns: u64| ns as f64 / 1e3 / n as f64;
    let mut s = loaded.session(loaded.n_ctx_model())?;
    feed(s.as_mut(), rng, d, a.ubatch)?;
    feed(s.as_mut(), rng, 1, 1)?;
    let c0 = w.counters();
    let h0 = w.device().host.get();
    w.profile_start(false)?;
    let w0 = Instant::now();
    feed(s.as_mut(), rng, n, 1)?;
    let counted = w.profile_stop()?;
    let wall = w0.elapsed().as_nanos() as u64;
    let c1 = w.counters();
    let h1 = w.device().host.get();
    let (launch, submit, wait) = (h1.0 - h0.0, h1.1 - h0.1, h1.2 - h0.2);
    eprintln!(
        "profile (wgpu), decode at depth {d} ({n} tokens): {:.1} dispatches and {:.1} submits \
         per token, {:.0} µs wall per token",
        per(c1.dispatches - c0.dispatches),
        per(c1.submits - c0.submits),
        us(wall),
    );
    eprintln!(
        "  host per token: {:.0} µs recording ({:.0} building launches: pipelines, bind \
         groups; {:.0} encoding passes and submitting; {:.0} the model's own host code), {:.0} \
         µs waiting for the GPU",
        us(wall.saturating_sub(wait)),
        us(launch),
        us(submit),
        us(wall.saturating_sub(wait + launch + submit)),
        us(wait),
    );
    w.profile_start(false)?;
    if w.gpu_profile_start()? {
        let w0 = Instant::now();
        feed(s.as_mut(), rng, n, 1)?;
        let wall = w0.elapsed().as_nanos() as u64;
        let g = w.gpu_profile_stop()?;
        w.profile_stop()?;
        let busy = g.busy_ns / 1e3 / n as f64;
        eprintln!(
            "  GPU (timestamps between dispatches, {} passes): {busy:.0} µs busy per token, \
             {:.0} µs wall per token with the stamps on ({:.0} % busy)",
            g.passes,
            us(wall),
            100.0 * busy / us(wall).max(1e-9)
        );
        let mut ks: Vec<_> = g.by.into_iter().collect();
        ks.sort_by(|x, y| y.1 .1.total_cmp(&x.1 .1).then(x.0.cmp(&y.0)));
        eprintln!(
            "| kernel | dispatches/token | GPU µs/token | mean µs | share | MB/token | GB/s |"
        );
        eprintln!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        let total: f64 = ks.iter().map(|k| k.1 .1).sum::<f64>().max(1e-9);
        let shown = ks.len().min(30);
        for (name, (cnt, ns, bytes)) in &ks[..shown] {
            eprintln!(
                "| {name} | {:.1} | {:.1} | {:.2} | {:.1} % | {:.2} | {:.0} |",
                per(*cnt),
                ns / 1e3 / n as f64,
                ns / 1e3 / (*cnt).max(1) as f64,
                100.0 * ns / total,
                *bytes as f64 / 1e6 / n as f64,
                *bytes as f64 / ns.max(1e-9)
            );
        }
        if shown < ks.len() {
            let rest = &ks[shown..];
            let (c, t) = rest
                .iter()
                .fold((0u64, 0.0f64), |(c, t), k| (c + k.1 .0, t + k.1 .1));
            eprintln!(
                "| ({} other kernels) | {:.1} | {:.1} | | {:.1} % | | |",
                rest.len(),
                per(c),
                t / 1e3 / n as f64,
                100.0 * t / total
            );
        }
        eprintln!(
            "(bytes: the products' weight rows read, activations and outputs; other kernels \
             their bound buffers' sizes, an upper bound)"
        );
        return Ok(());
    }
    w.profile_stop()?;
    // No timestamps on this adapter: each dispatch waited for on its own (host time included,
    // so the times only rank kernels).
    w.profile_start(true)?;
    feed(s.as_mut(), rng, n, 1)?;
    let timed = w.profile_stop()?;
    let total: f64 = timed.iter().map(|k| k.secs).sum::<f64>() * 1e6 / n as f64;
    eprintln!("  no GPU timestamps on this adapter: each dispatch waited for on its own, {total:.0} µs per token");
    eprintln!("| kernel | dispatches/token | µs/token (waited singly) | share |");
    eprintln!("| --- | ---: | ---: | ---: |");
    for k in &timed {
        eprintln!(
            "| {} | {:.1} | {:.1} | {:.1} % |",
            k.name,
            per(k.launches),
            k.secs * 1e6 / n as f64,
            100.0 * k.secs * 1e6 / n as f64 / total.max(1e-9)
        );
    }
    eprintln!(
        "({} kernels; {} dispatches in the one-stream run)",
        timed.len(),
        counted.iter().map(|k| k.launches).sum::<u64>()
    );
    Ok(())
}

pub fn run(a: Args) -> Result<ExitCode> {
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if a.ubatch == 0 {
        bail!("--ubatch must be at least 1");
    }
    let mut tests = Vec::new();
    for &d in &a.n_depth {
        tests.extend(a.n_prompt.iter().filter(|&&n| n > 0).map(|&n| Test {
            kind: Kind::Prompt,
            n,
            depth: d,
        }));
        tests.extend(a.n_gen.iter().filter(|&&n| n > 0).map(|&n| Test {
            kind: Kind::Gen,
            n,
            depth: d,
        }));
    }
    if tests.is_empty() {
        bail!("nothing to measure: every -p and -n is 0");
    }

    // The comparisons' specs are checked before anything loads.
    let arms: Vec<Arm> = match (&a.ab, &a.ablate) {
        (Some(spec), _) => vec![Arm::Switches(parse_ab(spec)?)],
        (_, Some(spec)) => parse_ablate(spec)?.into_iter().map(Arm::Ablate).collect(),
        _ => Vec::new(),
    };
    let choice = a.model.resolve()?;
    let path = choice.path()?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let arch = file.architecture()?.to_string();
    let size: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let params: u64 = file.tensors().iter().map(|t| t.n_elements).sum();
    drop(file);
    let t_load = Instant::now();
    let opened = load::open(&path)?;
    let loaded = Loaded::bind(
        &opened,
        &path,
        choice.threads,
        choice.kv_type,
        None,
        choice.ctx_size,
        &choice.backend,
    )?;
    let load_s = t_load.elapsed().as_secs_f64();
    if !a.json {
        eprintln!("backend: {}", loaded.backend_note);
        if a.pick {
            eprintln!(
                "decode tests: each step's greedy pick made on the device and fed back (--pick)"
            );
        }
    }
    let profiler = match &loaded.model {
        load::Bound::Qwen2Cuda(m) => Some(m.backend().gpu()),
        load::Bound::Qwen4expCuda(m) => Some(m.backend().gpu()),
        _ => None,
    };
    let cuda = match &loaded.model {
        load::Bound::Qwen2Cuda(m) => Some(m.backend()),
        load::Bound::Qwen4expCuda(m) => Some(m.backend()),
        _ => None,
    };
    if !arms.is_empty() && profiler.is_none() {
        bail!("--ab and --ablate (comparisons inside the CUDA step) need the CUDA backend");
    }
    let wgpu = match &loaded.model {
        load::Bound::Qwen2Wgpu(m) => Some(m.backend()),
        load::Bound::Qwen4expWgpu(m) => Some(m.backend()),
        _ => None,
    };
    if a.profile && profiler.is_none() && wgpu.is_none() {
        bail!(
            "--profile (per-kernel device times per decode token) needs the CUDA or wgpu \
             backend; the CPU backend reports no per-kernel times"
        );
    }
    let backend = loaded.backend_name().to_uppercase();
    let n_threads = loaded.threads();
    let threads = n_threads.map_or("-".to_string(), |t| t.to_string());
    // Positions a sequence may hold (qwen4exp: the capacity its caches were made with).
    let n_ctx = loaded.n_ctx_model();
    if let Some(t) = tests.iter().find(|t| t.depth + t.n > n_ctx) {
        bail!(
            "{}: depth {} + {} tokens exceeds the model's context of {n_ctx} positions",
            t.name(),
            t.depth,
            t.n,
        );
    }
    let mut rng = SplitMix64(a.seed);
    if !a.no_warmup {
        // Pages the weights in and warms the allocator; not timed. With a prompt test, one
        // whole prefill chunk (a GPU's large-batch kernels and libraries are set up by it).
        let mut s = loaded.session(loaded.n_ctx_model())?;
        let longest = tests
            .iter()
            .filter(|t| t.kind == Kind::Prompt)
            .map(|t| t.n)
            .max()
            .unwrap_or(0);
        feed(
            s.as_mut(),
            &mut rng,
            longest.min(a.ubatch).max(16),
            a.ubatch,
        )?;
        feed(s.as_mut(), &mut rng, 2, 1)?;
    }
    let mut results = Vec::new();
    for &t in &tests {
        if let Some(c) = cuda {
            c.take_host_stats();
        }
        let host_note = |a: &Args| {
            // #10 point 4: the host time of a recorded step (the model code and its launches'
            // recording, the fingerprint, the graph's launch), beside the wall time per token.
            let Some(c) = cuda else { return };
            let h = c.take_host_stats();
            if a.json || h.steps == 0 {
                return;
            }
            let per = |ns: u64| ns as f64 / 1e3 / h.steps as f64;
            eprintln!(
                "{}: host per recorded step: {:.0} ops in {:.1} parts, body + recording (with \
                 the parts handed over on the way) {:.1} µs, signature {:.1} µs, last graph \
                 launch {:.1} µs ({} steps, {} captured)",
                t.name(),
                h.ops as f64 / h.steps as f64,
                h.parts as f64 / h.steps as f64,
                per(h.body_ns),
                per(h.signature_ns),
                per(h.launch_ns),
                h.steps,
                h.captures
            );
            if h.downloads > 0 {
                eprintln!(
                    "{}: {} downloads, {:.1} µs each once the device had finished the step \
                     ({:.1} of them copying out of page-locked memory)",
                    t.name(),
                    h.downloads,
                    h.download_ns as f64 / 1e3 / h.downloads as f64,
                    h.copy_out_ns as f64 / 1e3 / h.downloads as f64
                );
            }
            if h.timed > 0 {
                let med = |v: &[u64]| strata_cuda::backend::median_ns(v) as f64 / 1e3;
                eprintln!(
                    "{}: device per recorded step (timed events, median of {} pairs): {:.1} µs \
                     from the first part's start to the last part's end, then {:.1} µs idle \
                     until the next step starts",
                    t.name(),
                    h.timed,
                    med(&h.device_span_ns),
                    med(&h.device_gap_ns)
                );
            }
        };
        if arms.is_empty() {
            let mut r = Result1 {
                test: t,
                arm: None,
                wall_ns: vec![],
                cpu_ns: vec![],
            };
            for _ in 0..a.repetitions {
                let (w, c) = once(&loaded, t, a.ubatch, a.pick, &mut rng)
                    .with_context(|| format!("running {}", t.name()))?;
                r.wall_ns.push(w);
                r.cpu_ns.push(c);
            }
            if !a.json {
                eprintln!("{}: done", t.name());
            }
            host_note(&a);
            results.push(r);
            continue;
        }
        // Arm 0 is the environment's settings ("A"), then the overrides or ablated lists.
        let n_arms = arms.len() + 1;
        let mut rs: Vec<Result1> = (0..n_arms)
            .map(|i| Result1 {
                test: t,
                arm: Some(match i {
                    0 => "A".into(),
                    _ => arms[i - 1].label(),
                }),
                wall_ns: vec![],
                cpu_ns: vec![],
            })
            .collect();
        // One untimed run of every other arm first: its op lists differ, so its graphs are
        // captured there and not inside its first timed repetition.
        // An ablated arm may fail (a kernel's stale output can be bad input to the next, e.g.
        // an expert id): it is reported and left out, the others go on.
        let mut failed = vec![false; n_arms];
        for (i, arm) in arms.iter().enumerate() {
            arm.apply(true)?;
            let run = once(&loaded, t, a.ubatch, a.pick, &mut rng);
            arm.apply(false)?;
            if let Err(e) = run {
                if matches!(arm, Arm::Switches(_)) {
                    return Err(e.context(format!("warming up {} [{}]", t.name(), arm.label())));
                }
                eprintln!("{} [{}]: failed, left out: {e:#}", t.name(), arm.label());
                failed[i + 1] = true;
            }
        }
        // The arms rotate (A B C, B C A, …): none always runs first.
        for rep in 0..a.repetitions {
            for k in 0..n_arms {
                let i = (k + rep) % n_arms;
                if failed[i] {
                    continue;
                }
                if i > 0 {
                    arms[i - 1].apply(true)?;
                }
                let run = once(&loaded, t, a.ubatch, a.pick, &mut rng);
                if i > 0 {
                    arms[i - 1].apply(false)?;
                }
                match run {
                    Ok((w, c)) => {
                        rs[i].wall_ns.push(w);
                        rs[i].cpu_ns.push(c);
                    }
                    Err(e) if i > 0 && matches!(arms[i - 1], Arm::Ablate(_)) => {
                        eprintln!(
                            "{} [{}]: failed, left out: {e:#}",
                            t.name(),
                            arms[i - 1].label()
                        );
                        failed[i] = true;
                    }
                    Err(e) => return Err(e.context(format!("running {}", t.name()))),
                }
            }
        }
        let rs: Vec<Result1> = rs
            .into_iter()
            .zip(&failed)
            .filter(|(r, f)| !**f && !r.wall_ns.is_empty())
            .map(|(r, _)| r)
            .collect();
        if !a.json {
            eprintln!("{}: done ({} arms)", t.name(), n_arms);
            if matches!(arms[0], Arm::Ablate(_)) {
                ablate_table(&rs);
            }
        }
        results.extend(rs);
    }

    if let (true, Some(gpu)) = (a.profile, profiler) {
        // Decode tokens at each depth with events around every launch: device time per kernel
        // per token. (The events cost host time, so the timed tests above ran without them.)
        let n = a.n_gen.iter().copied().max().unwrap_or(0).max(8);
        let bw = gpu.copy_bandwidth()?;
        eprintln!(
            "copy bandwidth {:.2} TB/s (a device-to-device copy, read + write): each kernel's \
             floor is the bytes it must read over it",
            bw / 1e12
        );
        for &d in &a.n_depth {
            let mut s = loaded.session(n_ctx)?;
            feed(s.as_mut(), &mut rng, d, a.ubatch)?;
            feed(s.as_mut(), &mut rng, 1, 1)?;
            gpu.profile_start();
            let w0 = Instant::now();
            feed(s.as_mut(), &mut rng, n, 1)?;
            let wall = w0.elapsed().as_secs_f64() * 1e6 / n as f64;
            let ks = gpu.profile_stop()?;
            let total: f64 = ks.iter().map(|k| k.us).sum::<f64>() / n as f64;
            let launches: usize = ks.iter().map(|k| k.launches).sum::<usize>() / n;
            eprintln!(
                "profile, decode at depth {d} ({n} tokens): {launches} launches and {total:.0} µs \
                 of kernel time per token; {wall:.0} µs wall per token with the events on (the \
                 rest is host time and launch gaps)"
            );
            profile_table(&ks, n as f64, total, bw);
        }
        // One prefill of the first -p size, the same way: where a prompt's time goes.
        if let Some(&p) = a.n_prompt.iter().find(|&&p| p > 0) {
            let mut s = loaded.session(n_ctx)?;
            gpu.profile_start();
            let w0 = Instant::now();
            feed(s.as_mut(), &mut rng, p, a.ubatch)?;
            let wall = w0.elapsed().as_secs_f64() * 1e6 / p as f64;
            let ks = gpu.profile_stop()?;
            let total: f64 = ks.iter().map(|k| k.us).sum::<f64>() / p as f64;
            let launches: usize = ks.iter().map(|k| k.launches).sum();
            eprintln!(
                "profile, prefill of {p} tokens (ubatch {}): {launches} launches and {total:.0} µs \
                 of kernel time per token; {wall:.0} µs wall per token with the events on",
                a.ubatch
            );
            profile_table(&ks, p as f64, total, bw);
        }
    }

    if let (true, Some(w)) = (a.profile, wgpu) {
        for &d in &a.n_depth {
            wgpu_profile(w, &loaded, &a, d, &mut rng)?;
        }
    }

    let model_type = format!("{arch} {:.2} B", params as f64 / 1e9);
    let filename = path.display().to_string();
    if a.json {
        let rows: Vec<_> = results
            .iter()
            .map(|r| {
                let ts = r.ts();
                let (avg_ts, sd_ts) = mean_sd(&ts);
                let ns: Vec<f64> = r.wall_ns.iter().map(|&x| x as f64).collect();
                let (avg_ns, sd_ns) = mean_sd(&ns);
                let (n_prompt, n_gen) = match r.test.kind {
                    Kind::Prompt => (r.test.n, 0),
                    Kind::Gen => (0, r.test.n),
                };
                json!({
                    "model_filename": filename,
                    "model_type": model_type,
                    "model_size": size,
                    "model_n_params": params,
                    "backends": backend,
                    "n_threads": n_threads,
                    "n_ubatch": a.ubatch,
                    "type_k": format!("{:?}", a.model.kv_type).to_lowercase(),
                    "test": r.test.name(),
                    "ab": r.arm,
                    "n_prompt": n_prompt,
                    "n_gen": n_gen,
                    "n_depth": r.test.depth,
                    "avg_ns": avg_ns as u64,
                    "stddev_ns": sd_ns as u64,
                    "avg_ts": avg_ts,
                    "stddev_ts": sd_ts,
                    "best_ts": ts.iter().copied().fold(0.0, f64::max),
                    "samples_ns": r.wall_ns,
                    "samples_ts": ts,
                    "samples_cpu_ns": r.cpu_ns,
                    "load_s": load_s,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "| model | size | params | backend | threads | test | t/s | best t/s | CPU ms/token |"
        );
        println!("| --- | ---: | ---: | --- | ---: | --: | ---: | ---: | ---: |");
        for r in &results {
            let ts = r.ts();
            let (m, sd) = mean_sd(&ts);
            let best = ts.iter().copied().fold(0.0, f64::max);
            let cpu_min = r.cpu_ns.iter().copied().min().unwrap_or(0);
            println!(
                "| {model_type} | {:.2} GiB | {:.2} B | {backend} | {threads} | {} | {m:.2} ± {sd:.2} | {best:.2} | {:.2} |",
                size as f64 / (1u64 << 30) as f64,
                params as f64 / 1e9,
                r.name(),
                cpu_min as f64 / 1e6 / r.test.n as f64
            );
        }
        println!(
            "\n{} repetitions per test (mean ± sd of tokens/s over the wall clock; best = fastest \
             repetition; CPU ms/token = the least process CPU time of a repetition per token, all \
             threads); load {load_s:.2} s; {filename}",
            a.repetitions
        );
    }
    Ok(ExitCode::SUCCESS)
}
