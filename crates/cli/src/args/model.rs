//! Which model to load and how: `-m` (or the default model, fetched on first use), threads,
//! the K/V precision, the context size and the backend.

use std::path::PathBuf;

use anyhow::Result;
use strata_engine::KvType;

/// Which model to load and how.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The model GGUF (qwen2 or qwen4exp); without it, the default model (fetched if absent)
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub threads: super::ThreadsArgs,
    /// Precision attention reads K/V at: `f16` (llama.cpp's default cache type) or `f32`
    #[arg(long, default_value = "f16")]
    pub kv_type: KvType,
    /// Context size in tokens (prompt and reply); default and upper bound: the model's own
    /// (`serve`: its trained context up to 8192)
    #[arg(short = 'c', long = "ctx", value_name = "N")]
    pub ctx_size: Option<usize>,
    #[command(flatten)]
    pub backend: super::backend::BackendArgs,
}

/// A validated [`ModelArgs`].
#[derive(Clone, Debug)]
pub struct ModelChoice {
    /// None: the default model (resolved by [`ModelChoice::path`], which may fetch it).
    pub model: Option<PathBuf>,
    pub threads: usize,
    pub kv_type: KvType,
    pub ctx_size: Option<usize>,
    pub backend: super::backend::BackendChoice,
}

impl ModelArgs {
    pub fn resolve(&self) -> Result<ModelChoice> {
        if let Some(p) = &self.model {
            crate::output::check_input("-m", p)?;
        }
        if self.ctx_size == Some(0) {
            anyhow::bail!("--ctx 0: out of range; expected at least 1 token");
        }
        Ok(ModelChoice {
            model: self.model.clone(),
            threads: self.threads.resolve(),
            kv_type: self.kv_type,
            ctx_size: self.ctx_size,
            backend: self.backend.resolve()?,
        })
    }
}

impl ModelChoice {
    /// The model file: `-m`, or the default model (downloaded with a progress bar when missing).
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => crate::model_cache::default_model_path(true),
        }
    }
}
