//! `strata run`: stream a completion of a prompt. Owns what `run` and `chat` share: choosing the
//! model file (the default model, fetched on first use, when no `-m` is given), loading it by
//! architecture, the sampling options, and the `--verbose` timing report.
//!
//! stdout carries the text and nothing else, as llama.cpp's `simple` example prints it: the
//! prompt, then each token as it is chosen, then a newline. Everything else goes to stderr.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use strata_engine::generate::{
    GenOptions, Generation, Qwen2Session, Qwen4expSession, Session, StopReason,
};
use strata_engine::sampler::Sampler;
use strata_engine::{qwen2, qwen4exp, CpuBackend, KvType};
use strata_gguf::GgufFile;
use strata_tokenizer::{StreamDecoder, Tokenizer};

use crate::fetch;

/// Which model to load and how.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The model GGUF (qwen2 or qwen4exp); without it, the default model (fetched if absent)
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: Option<PathBuf>,
    /// Worker threads (0: one per core)
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Precision attention reads K/V at: `f16` (llama.cpp's default cache type) or `f32`
    #[arg(long, default_value = "f16")]
    pub kv_type: KvType,
}

/// The sampling chain's knobs (llama.cpp's names and defaults).
#[derive(clap::Args, Clone, Debug)]
pub struct SampleArgs {
    /// Temperature; 0 is greedy (ties to the lower token id)
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep the k most likely tokens (0: off)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off)
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Keep tokens at least this fraction as likely as the best one (0: off)
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Seed of the draws (default: from the clock; printed with --verbose)
    #[arg(long)]
    pub seed: Option<u64>,
    /// A whole sampler chain as JSON (replaces the options above), e.g.
    /// '{"stages":[{"type":"top_k","k":20},{"type":"temperature","t":0.7}],"pick":{"type":"draw","seed":1}}'
    #[arg(long, value_name = "JSON")]
    pub sampler: Option<String>,
    /// Penalties, DRY, slop and the chain's order (sampling_args.rs).
    #[command(flatten)]
    pub extra: crate::sampling_args::PenaltyArgs,
}

pub(crate) fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (special tokens such as <|im_start|> are parsed)
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Most tokens to generate
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Do not print the prompt before the completion
    #[arg(long)]
    pub no_echo: bool,
    /// Load and speed report on stderr
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// MTP speculative decoding (qwen4exp): --mtp, --spec N, --spec-min-p, --draft-vocab
    #[command(flatten)]
    pub spec: crate::spec_run::SpecArgs,
}

/// A loaded model of any supported architecture, on the CPU backend.
pub enum Loaded {
    Qwen2(Box<qwen2::Model<CpuBackend>>),
    Qwen4exp(Box<qwen4exp::Model<CpuBackend>>),
}

impl Loaded {
    pub fn session(&self) -> Result<Box<dyn Session + '_>> {
        Ok(match self {
            Loaded::Qwen2(m) => Box::new(Qwen2Session::new(m)?),
            Loaded::Qwen4exp(m) => Box::new(Qwen4expSession::new(m)?),
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Loaded::Qwen2(m) => {
                let c = m.config();
                format!(
                    "qwen2, {} layers, {} embd, {} heads / {} kv heads, vocab {}{}",
                    c.n_layer,
                    c.n_embd,
                    c.attn.n_head,
                    c.attn.n_head_kv,
                    c.n_vocab,
                    if m.tied_output() { ", tied head" } else { "" }
                )
            }
            Loaded::Qwen4exp(m) => {
                let c = m.config();
                format!(
                    "qwen4exp, {} layers, {} embd, vocab {}",
                    c.n_layer, c.n_embd, c.n_vocab
                )
            }
        }
    }

    pub fn threads(&self) -> usize {
        match self {
            Loaded::Qwen2(m) => m.backend().threads(),
            Loaded::Qwen4exp(m) => m.backend().threads(),
        }
    }
}

/// The model file: `-m`, or the default model (downloaded with a progress bar when missing).
pub fn model_path(m: &ModelArgs) -> Result<PathBuf> {
    match &m.model {
        Some(p) => Ok(p.clone()),
        None => fetch::default_model_path(true),
    }
}

/// Opens `path`, reads its tokenizer and binds the model for its architecture.
pub fn load(path: &Path, m: &ModelArgs) -> Result<(Loaded, Tokenizer)> {
    let file =
        Arc::new(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?);
    let tok = Tokenizer::from_gguf(&file)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let backend = CpuBackend::new(m.threads)?;
    let arch = file.architecture()?.to_string();
    let loaded = match arch.as_str() {
        qwen2::ARCH => Loaded::Qwen2(Box::new(
            qwen2::Model::from_file(file, backend, &qwen2::LoadOptions { kv_type: m.kv_type })
                .with_context(|| format!("loading {}", path.display()))?,
        )),
        qwen4exp::config::ARCH => {
            let opts = qwen4exp::LoadOptions {
                kv_type: m.kv_type,
                ..Default::default()
            };
            let model = qwen4exp::Model::from_file(file, backend, &opts)
                .with_context(|| format!("loading {}", path.display()))?;
            for w in model.warnings() {
                eprintln!("warning: {w}");
            }
            Loaded::Qwen4exp(Box::new(model))
        }
        other => bail!(
            "{}: architecture '{other}' is not supported; expected qwen2 or qwen4exp",
            path.display()
        ),
    };
    Ok((loaded, tok))
}

/// Writes text to stdout as it comes; remembers a write failure (a closed pipe) so the
/// generation loop can stop instead of computing tokens nobody reads.
pub struct Out {
    out: std::io::Stdout,
    pub failed: Option<std::io::Error>,
}

impl Out {
    pub fn new() -> Out {
        Out {
            out: std::io::stdout(),
            failed: None,
        }
    }

    /// False once stdout is gone.
    pub fn write(&mut self, s: &str) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let mut lock = self.out.lock();
        if let Err(e) = lock.write_all(s.as_bytes()).and_then(|_| lock.flush()) {
            self.failed = Some(e);
            return false;
        }
        true
    }

    pub fn finish(self) -> Result<()> {
        match self.failed {
            // A reader that went away early (`| head`) is not an error of ours.
            Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            Some(e) => Err(e).context("writing to stdout"),
            None => Ok(()),
        }
    }
}

/// The `--verbose` report.
pub fn report(load: Duration, g: &Generation, threads: usize, sampler: &Sampler) {
    let t = &g.timings;
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.2} tokens/s){}",
        t.prompt_tokens,
        t.prompt.as_secs_f64(),
        t.prompt_tps(),
        if t.reused_tokens > 0 {
            format!(", {} reused from the cache", t.reused_tokens)
        } else {
            String::new()
        }
    );
    eprintln!(
        "decode: {} tokens in {:.3} s ({:.2} tokens/s, {:.2} ms/token); sampling {:.3} s for {} tokens",
        t.decoded_tokens,
        t.decode.as_secs_f64(),
        t.decode_tps(),
        1e3 * t.decode.as_secs_f64() / t.decoded_tokens.max(1) as f64,
        t.sample.as_secs_f64(),
        t.sampled_tokens
    );
    let stop = match g.stop {
        StopReason::Eog(id) => format!("end of generation (token {id})"),
        StopReason::MaxTokens => "token budget".to_string(),
        StopReason::ContextFull => "context full".to_string(),
        StopReason::Stopped => "output closed".to_string(),
    };
    eprintln!(
        "load {:.2} s, {threads} threads; stop: {stop}; sampler {}",
        load.as_secs_f64(),
        sampler.config().to_json()
    );
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.spec.wanted() {
        return crate::spec_run::run(crate::spec_run::RunArgs {
            model: args.model,
            spec: args.spec,
            prompt: args.prompt,
            n_predict: args.n_predict,
            sample: args.sample,
            no_echo: args.no_echo,
            verbose: args.verbose,
        });
    }
    let path = model_path(&args.model)?;
    let t0 = Instant::now();
    let (model, tok) = load(&path, &args.model)?;
    let load_time = t0.elapsed();
    if args.verbose {
        eprintln!("model: {} ({})", path.display(), model.describe());
    }
    let mut sampler = args.sample.build_for(&tok)?;
    let prompt = tok
        .encode(&args.prompt, true, true)
        .context("tokenizing the prompt")?;
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let mut session = model.session()?;
    let mut out = Out::new();
    // llama.cpp prints special tokens' text too, in the prompt and in the completion.
    let mut dec = StreamDecoder::new(true);
    if !args.no_echo {
        let mut text = String::new();
        for &id in &prompt {
            text.push_str(&dec.push(&tok, id)?);
        }
        text.push_str(&dec.flush());
        out.write(&text);
    }
    let mut tok_err = None;
    let opts = GenOptions {
        max_tokens: args.n_predict,
        ..Default::default()
    };
    // The guarded loop: slop's phrase level may rewind; text is streamed once final.
    let gg = strata_engine::sampler::guard::generate(
        session.as_mut(),
        &prompt,
        &mut sampler,
        &|id| tok.is_eog(id),
        &opts,
        &mut |id| match dec.push(&tok, id) {
            Ok(s) => out.write(&s),
            Err(e) => {
                tok_err = Some(e);
                false
            }
        },
    )?;
    let g = &gg.generation;
    if let Some(e) = tok_err {
        return Err(e).context("detokenizing");
    }
    let rest = dec.flush();
    out.write(&format!("{rest}\n"));
    out.finish()?;
    if args.verbose {
        report(load_time, g, model.threads(), &sampler);
        crate::sampling_args::report_slop(&gg);
    }
    Ok(ExitCode::SUCCESS)
}
