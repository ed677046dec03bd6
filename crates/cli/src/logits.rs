//! `strata logits`: every position's logits for a prompt (token ids or text), written as a
//! safetensors file with `logits` (f32, `[positions, vocab]`) and `input_ids` (i64, `[positions]`).
//! The whole prompt runs as one prefill, which gives the same bits as token-by-token decode.
//! The outputs never replace an input and appear only complete (`output`); the prompt obeys
//! the same context rule as `run` (`load::check_context`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use strata_engine::qwen4exp::{LoadOptions, Model};
use strata_engine::{qwen2, FloatActivations, KvType, QsaRule, Qwen4expOps};

use crate::load;
use crate::output::{check_outputs, OutputFile};

#[derive(clap::Args)]
pub struct Args {
    /// The model GGUF file (architecture qwen4exp or qwen2)
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: PathBuf,
    /// Token ids, comma-separated
    #[arg(long, value_delimiter = ',', num_args = 1.., conflicts_with = "text", required_unless_present = "text")]
    pub tokens: Option<Vec<u32>>,
    /// Text to tokenize with the file's tokenizer (special tokens are parsed)
    #[arg(long)]
    pub text: Option<String>,
    /// Output safetensors file
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// QSA token selection: `reference` (transformers/vLLM) or `llamacpp` (llama.cpp 0c1e570)
    #[arg(long, default_value = "reference")]
    pub qsa_rule: QsaRule,
    /// QSA block size for layers whose file ratio is 0 (or, when given, for every QSA layer)
    #[arg(long)]
    pub qsa_ratio: Option<usize>,
    /// Precision attention reads K/V at: `f32`, or `f16` (llama.cpp's default cache type)
    #[arg(long, default_value = "f32")]
    pub kv_type: KvType,
    #[command(flatten)]
    pub threads: crate::args::ThreadsArgs,
    /// Keep activations in f32 for F16/BF16 weights instead of rounding them to the weight's
    /// format (an exact mode for comparisons; block-quantized weights are unaffected)
    #[arg(long)]
    pub f32_activations: bool,
    /// MTP head GGUF for --mtp-out (a model file that carries `mtp.*` needs none)
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp: Option<PathBuf>,
    /// Also write the MTP head's logits (`mtp_logits` [positions − 1, vocab]: row p from the
    /// trunk's state at p and token p + 1) to this safetensors file
    #[arg(long, value_name = "OUT.safetensors")]
    pub mtp_out: Option<PathBuf>,
    #[command(flatten)]
    pub backend: crate::args::backend::BackendArgs,
}

pub fn run(args: Args) -> Result<ExitCode> {
    // Every check before the model is bound.
    let mut outputs: Vec<(&str, &Path)> = vec![("--out", &args.out)];
    if let Some(p) = &args.mtp_out {
        outputs.push(("--mtp-out", p));
    }
    let mut inputs: Vec<(&str, &Path)> = vec![("-m", &args.model)];
    if let Some(p) = &args.mtp {
        crate::output::check_input("--mtp", p)?;
        inputs.push(("--mtp", p));
    }
    check_outputs(&outputs, &inputs)?;
    let threads = args.threads.resolve();
    let opened = load::open(&args.model)?;
    let is_qwen2 = opened.arch == qwen2::ARCH;
    if is_qwen2 && (args.mtp.is_some() || args.mtp_out.is_some()) {
        bail!(
            "--mtp and --mtp-out need a qwen4exp model; {} is qwen2",
            args.model.display()
        );
    }
    let tokens = match (&args.tokens, &args.text) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => {
            let tok = strata_tokenizer::Tokenizer::from_gguf(&opened.file)
                .with_context(|| format!("reading the tokenizer of {}", args.model.display()))?;
            tok.encode(text, true, true).context("tokenizing --text")?
        }
        (None, None) => bail!("give --tokens or --text"),
    };
    let mode = if args.f32_activations {
        FloatActivations::F32
    } else {
        FloatActivations::Paired
    };
    let (chosen, note) = load::open_backend(&args.backend.resolve()?, threads)?;
    let t0 = Instant::now();
    // (logits, n_vocab, time to load, time of the forward pass)
    let (out_logits, n_vocab, loaded, ran) = match chosen {
        load::Chosen::Cpu(b) => forward_file(
            &args,
            opened,
            &tokens,
            is_qwen2,
            b.with_float_activations(mode),
            t0,
        )?,
        _ if args.f32_activations => {
            bail!("--f32-activations is a CPU mode; use --backend cpu with it")
        }
        load::Chosen::Cuda(b) => forward_file(&args, opened, &tokens, is_qwen2, *b, t0)?,
        load::Chosen::Wgpu(b) => forward_file(&args, opened, &tokens, is_qwen2, *b, t0)?,
    };
    let rows = out_logits.len() / n_vocab.max(1);

    let logits: Vec<u8> = out_logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let ids: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| i64::from(t).to_le_bytes())
        .collect();
    let views = [
        (
            "logits",
            TensorView::new(Dtype::F32, vec![rows, n_vocab], &logits)?,
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![tokens.len()], &ids)?,
        ),
    ];
    write_safetensors(views, &args.out)?;
    eprintln!(
        "wrote {}: logits [{}, {}] (load {:.2?}, forward {:.2?} on {note}, {:.1} tokens/s)",
        args.out.display(),
        rows,
        n_vocab,
        loaded,
        ran,
        tokens.len() as f64 / ran.as_secs_f64().max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}

/// Loads the file on backend `b` and runs the prompt: (logits, n_vocab, load time, forward
/// time); writes `--mtp-out` on the way.
fn forward_file<B: Qwen4expOps>(
    args: &Args,
    opened: load::Opened,
    tokens: &[u32],
    is_qwen2: bool,
    backend: B,
    t0: Instant,
) -> Result<(Vec<f32>, usize, Duration, Duration)> {
    if is_qwen2 {
        let opts = qwen2::LoadOptions {
            kv_type: args.kv_type,
        };
        let model = qwen2::Model::from_file(opened.file, backend, &opts)
            .with_context(|| format!("loading {}", args.model.display()))?;
        check_tokens(tokens, model.config().n_vocab, model.config().n_ctx_train)?;
        let loaded = t0.elapsed();
        let mut state = model.new_state()?;
        let t1 = Instant::now();
        let out = model.forward(&mut state, tokens)?;
        return Ok((out.logits, out.n_vocab, loaded, t1.elapsed()));
    }
    let opts = LoadOptions {
        qsa_rule: args.qsa_rule,
        qsa_ratio: args.qsa_ratio,
        kv_type: args.kv_type,
        ..LoadOptions::default()
    };
    let mut model = Model::from_file(opened.file, backend, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    for w in model.warnings() {
        eprintln!("warning: {w}");
    }
    if let Some(p) = &args.mtp {
        model
            .load_mtp(p)
            .with_context(|| format!("loading the MTP head {}", p.display()))?;
    }
    check_tokens(tokens, model.config().n_vocab, u32::MAX as usize)?;
    if args.mtp_out.is_some() && tokens.len() < 2 {
        bail!("--mtp-out needs at least two tokens (row p pairs position p with token p + 1)");
    }
    if args.mtp_out.is_some() && !model.has_mtp() {
        bail!(
            "--mtp-out needs an MTP head: {} carries no mtp.* tensors; give one with --mtp",
            args.model.display()
        );
    }
    let loaded = t0.elapsed();
    let mut state = model.new_state()?;
    let t1 = Instant::now();
    let want = strata_engine::qwen4exp::Want {
        hidden: args.mtp_out.is_some(),
        ..Default::default()
    };
    let out = model.forward_with(&mut state, tokens, want)?;
    let ran = t1.elapsed();
    if let (Some(path), Some(hidden)) = (&args.mtp_out, &out.hidden) {
        write_mtp_logits(&model, tokens, hidden, path)?;
    }
    Ok((out.logits, out.n_vocab, loaded, ran))
}

/// Token ids inside the vocabulary, and as many as `run` would take (`load::check_context`).
fn check_tokens(tokens: &[u32], n_vocab: usize, n_ctx: usize) -> Result<()> {
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        bail!("--tokens: token {bad} is outside the vocabulary of {n_vocab}");
    }
    load::check_context("the prompt", tokens.len(), n_ctx)
}

/// A safetensors file through a temporary beside `dest`, renamed when complete.
fn write_safetensors<'a>(
    views: impl IntoIterator<Item = (&'a str, TensorView<'a>)>,
    dest: &Path,
) -> Result<()> {
    let f = OutputFile::reserve(dest)?;
    safetensors::tensor::serialize_to_file(views, None, f.tmp_path())
        .with_context(|| format!("writing {}", dest.display()))?;
    f.commit()
}

/// `--mtp-out`: the MTP head's logits for every position but the last, in the goldens'
/// convention: row `p` from the trunk's pre-mixer state at `p` and token `p + 1`.
fn write_mtp_logits<B: Qwen4expOps>(
    model: &Model<B>,
    tokens: &[u32],
    hidden: &[f32],
    out: &Path,
) -> Result<()> {
    let t = tokens.len();
    let sh = model.config().residual_dim();
    let mut st = model.new_mtp_state()?;
    let m = model.mtp_forward(
        &mut st,
        hidden.get(..(t - 1) * sh).context("trunk states")?,
        &tokens[1..],
        false,
        None,
    )?;
    let logits: Vec<u8> = m.logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let hid: Vec<u8> = m.hidden.iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = [
        (
            "mtp_logits",
            TensorView::new(Dtype::F32, vec![t - 1, m.cols], &logits)?,
        ),
        (
            "mtp_hidden",
            TensorView::new(Dtype::F32, vec![t - 1, sh], &hid)?,
        ),
    ];
    write_safetensors(views, out)?;
    eprintln!(
        "wrote {}: mtp_logits [{}, {}], mtp_hidden [{}, {sh}]",
        out.display(),
        t - 1,
        m.cols,
        t - 1
    );
    Ok(())
}
