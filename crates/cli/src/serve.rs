//! `strata serve`: the HTTP API (crates/server). This module only turns flags into the server's
//! configuration and hands it a loader that resolves the model the way `run` does (the default
//! model, fetched on first use, when no `-m` is given); the server binds first and loads on its
//! worker thread, so `/health` answers 503 while the model is fetched or loaded.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use strata_cuda::CudaBackend;
use strata_engine::CpuBackend;
use strata_server::{ModelHandle, ServerConfig};
use strata_wgpu::WgpuBackend;

use crate::args::backend::BackendKind;
use crate::args::model::ModelArgs;
use crate::load::{self, Bound};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (only this machine by default)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// An accepted API key (repeatable); requests must send it as `Authorization: Bearer KEY`
    /// or `x-api-key: KEY`. Without any key, no authentication
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Vec<String>,
    /// A file of accepted API keys, one per line (`#` comments and blank lines skipped)
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Sequences in flight at once (they take turns token by token)
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free sequence; more get 429
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// MiB of recurrent-state checkpoints kept for prefix reuse across turns (qwen4exp)
    #[arg(long, value_name = "MiB", default_value_t = 1024)]
    pub cache_ram: usize,
    /// Most tokens one batched step runs: every running sequence's decode row plus one
    /// prefill chunk of a joining one
    #[arg(long, default_value_t = strata_server::worker::BATCH_TOKENS)]
    pub batch_tokens: usize,
    /// MiB all sequence states may hold together (default: the memory available once the
    /// model is loaded, less a headroom); a request that does not fit waits, one that never
    /// can gets 429
    #[arg(long, value_name = "MiB")]
    pub state_mem: Option<u64>,
    /// The model id that /v1/models lists (default: the file's name)
    #[arg(long)]
    pub alias: Option<String>,
    /// A Jinja chat template file replacing the model file's
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// The MTP head GGUF for speculative decoding (`strata convert-mtp`); a model file that
    /// carries `mtp.*` needs none
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp: Option<PathBuf>,
    /// Verify window N = 1..8 of requests that set none (their `spec` field): up to N − 1 MTP
    /// drafts per trunk pass; default 4 with a head, 1 (plain decoding) without
    #[arg(long = "spec", value_name = "N")]
    pub spec: Option<usize>,
}

fn read_keys(args: &Args) -> Result<Vec<String>> {
    let mut keys = args.api_key.clone();
    if let Some(p) = &args.api_key_file {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("reading the API key file {}", p.display()))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
        if keys.len() == before {
            bail!("the API key file {} holds no key", p.display());
        }
    }
    if keys.iter().any(|k| k.is_empty()) {
        bail!("--api-key: a key is empty");
    }
    Ok(keys)
}

pub fn run(args: Args) -> Result<ExitCode> {
    if let Some(p) = &args.mtp {
        crate::output::check_input("--mtp", p)?;
    }
    if let Some(n) = args.spec {
        let max = strata_engine::speculative::MAX_WINDOW;
        if !(1..=max).contains(&n) {
            bail!("--spec {n}: out of range; expected a verify window of 1 to {max} rows");
        }
    }
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if args.batch_tokens == 0 {
        bail!("--batch-tokens must be at least 1");
    }
    if args.model.ctx_size == Some(1) {
        bail!("--ctx 1: out of range; a sequence needs at least 2 positions (a prompt token and the next)");
    }
    let chat_template = match &args.chat_template_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading the chat template {}", p.display()))?,
        ),
        None => None,
    };
    let model_id = args.alias.clone().unwrap_or_else(|| {
        let name = match &args.model.model {
            Some(p) => p.clone(),
            None => PathBuf::from(crate::model_cache::DEFAULT_MODEL_FILE),
        };
        name.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "strata".into())
    });
    let cfg = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_keys: read_keys(&args)?,
        n_ctx: args.model.ctx_size,
        parallel: args.parallel,
        queue: args.queue,
        cache_ram: args.cache_ram.saturating_mul(1 << 20),
        model_id,
        chat_template,
        handle_signals: true,
        spec: args.spec,
        draft_oracle: None,
        test_token_delay: None,
        batch_tokens: args.batch_tokens,
        state_memory: args.state_mem.map(|m| m.saturating_mul(1 << 20)),
    };
    let mut choice = args.model.resolve()?;
    let mtp = args.mtp.clone();
    // The server's type carries the backend, so `auto` is settled here: CUDA when it opens.
    match choice.backend.kind {
        BackendKind::Auto => {
            choice.backend.kind = match CudaBackend::new(choice.backend.device) {
                Ok(_) => BackendKind::Cuda,
                Err(_) => BackendKind::Cpu,
            };
        }
        // Refused before the server listens, naming what is missing.
        BackendKind::Cuda => {
            if let Err(e) = CudaBackend::new(choice.backend.device) {
                bail!("--backend cuda: {e}");
            }
        }
        BackendKind::Wgpu => {
            let sel = (choice.backend.device > 0).then(|| choice.backend.device.to_string());
            if let Err(e) = WgpuBackend::new(sel.as_deref()) {
                bail!("--backend wgpu: {e}");
            }
        }
        BackendKind::Cpu => {}
    }
    strata_server::init_logging();
    if choice.backend.kind == BackendKind::Cuda {
        let loader: strata_server::Loader<CudaBackend, CudaBackend> = Box::new(move || {
            let path = choice.path()?;
            let (loaded, tok) = load::model_with_mtp(&path, &choice, mtp.as_deref())?;
            eprintln!("backend: {}", loaded.backend_note);
            let model = match loaded.model {
                Bound::Qwen2Cuda(m) => ModelHandle::Qwen2(m),
                Bound::Qwen4expCuda(m) => ModelHandle::Qwen4exp(m),
                _ => bail!(
                    "strata serve: the GPU cannot run {} ({}); use --backend cpu",
                    path.display(),
                    loaded.backend_note
                ),
            };
            Ok((model, tok))
        });
        strata_server::serve(cfg, loader)?;
    } else if choice.backend.kind == BackendKind::Wgpu {
        let loader: strata_server::Loader<WgpuBackend, WgpuBackend> = Box::new(move || {
            let path = choice.path()?;
            let (loaded, tok) = load::model_with_mtp(&path, &choice, mtp.as_deref())?;
            eprintln!("backend: {}", loaded.backend_note);
            let model = match loaded.model {
                Bound::Qwen2Wgpu(m) => ModelHandle::Qwen2(m),
                Bound::Qwen4expWgpu(m) => ModelHandle::Qwen4exp(m),
                _ => bail!("strata serve: the model was bound on another backend"),
            };
            Ok((model, tok))
        });
        strata_server::serve(cfg, loader)?;
    } else {
        let loader: strata_server::Loader<CpuBackend, CpuBackend> = Box::new(move || {
            let path = choice.path()?;
            let (loaded, tok) = load::model_with_mtp(&path, &choice, mtp.as_deref())?;
            let model = match loaded.model {
                Bound::Qwen2(m) => ModelHandle::Qwen2(m),
                Bound::Qwen4exp(m) => ModelHandle::Qwen4exp(m),
                _ => bail!("strata serve: the model was bound on another backend"),
            };
            Ok((model, tok))
        });
        strata_server::serve(cfg, loader)?;
    }
    Ok(ExitCode::SUCCESS)
}
