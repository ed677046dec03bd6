//! `strata inspect`: metadata, tensor table, type histogram, `--dump` to .npy.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file
    pub file: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("{}: inspect is not implemented yet", args.file.display())
}
