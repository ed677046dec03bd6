//! Helpers shared by the CLI's end-to-end tests.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

pub const MODEL_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// Where `strata fetch` caches the default model, or `STRATA_DEFAULT_MODEL`; None (with a
/// message) when it is not there.
pub fn default_model() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = env("STRATA_DEFAULT_MODEL").or_else(|| {
        env("STRATA_CACHE")
            .map(|d| d.join("models"))
            .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("strata/models")))
            .or_else(|| env("HOME").map(|d| d.join(".cache/strata/models")))
            .map(|d| d.join(MODEL_FILE))
    })?;
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "SKIP: {} not found (run `strata fetch` to cache the default model)",
            path.display()
        );
        None
    }
}

/// Runs the `strata` binary with `args`, feeding `stdin` when given.
pub fn strata(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}
