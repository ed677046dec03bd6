//! `strata fetch`: download the default model into the cache, or check the cached copy in full
//! (sha256); prints the model's path on stdout. The cache itself is `model_cache`'s.

use std::process::ExitCode;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// Download again even when a verified copy is already cached
    #[arg(long, conflicts_with = "check")]
    pub force: bool,
    /// Only check the cached copy (size and the sha256 of every byte); never download
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = crate::model_cache::fetch_command(args.force, args.check)?;
    crate::outln!("{}", path.display())?;
    Ok(ExitCode::SUCCESS)
}
