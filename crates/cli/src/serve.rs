//! `strata serve`: the HTTP API (crates/server). This module only turns flags into the server's
//! configuration and hands it a loader that resolves the model the way `run` does (the default
//! model, fetched on first use, when no `-m` is given); the server binds first and loads on its
//! worker thread, so `/health` answers 503 while the model is fetched or loaded.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use strata_server::{ModelHandle, ServerConfig};

use crate::args::model::ModelArgs;
use crate::load::{self, Loaded};

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
    /// Positions per sequence (default: the model's trained context up to 8192; 4096 when the
    /// file states none)
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Sequences in flight at once (they take turns token by token)
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free sequence; more get 429
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// MiB of recurrent-state checkpoints kept for prefix reuse across turns (qwen4exp)
    #[arg(long, value_name = "MiB", default_value_t = 1024)]
    pub cache_ram: usize,
    /// The model id that /v1/models lists (default: the file's name)
    #[arg(long)]
    pub alias: Option<String>,
    /// A Jinja chat template file replacing the model file's
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// The MTP head GGUF (not wired into the server yet: refused)
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp: Option<PathBuf>,
    /// Compute backend (only `cpu` for now)
    #[arg(long, default_value = "cpu")]
    pub backend: String,
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
    if args.mtp.is_some() {
        bail!("--mtp: speculative decoding is not wired into `strata serve` yet");
    }
    if args.backend != "cpu" {
        bail!(
            "--backend {}: `strata serve` runs on the cpu backend only for now",
            args.backend
        );
    }
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if args.ctx == Some(0) || args.ctx == Some(1) {
        bail!("--ctx must be at least 2");
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
        n_ctx: args.ctx,
        parallel: args.parallel,
        queue: args.queue,
        cache_ram: args.cache_ram.saturating_mul(1 << 20),
        model_id,
        chat_template,
        handle_signals: true,
        test_token_delay: None,
    };
    let choice = args.model.resolve()?;
    let loader = Box::new(move || {
        let path = choice.path()?;
        let (loaded, tok) = load::model(&path, &choice)?;
        let model = match loaded {
            Loaded::Qwen2(m) => ModelHandle::Qwen2(m),
            Loaded::Qwen4exp(m) => ModelHandle::Qwen4exp(m),
        };
        Ok((model, tok))
    });
    strata_server::init_logging();
    strata_server::serve(cfg, loader)?;
    Ok(ExitCode::SUCCESS)
}
