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

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The tiny qwen4exp fixture (f32).
pub fn tiny() -> PathBuf {
    fixtures().join("qwen4exp/tiny/model-f32.gguf")
}

/// A fresh, empty folder for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `strata` with extra environment and raw stdin bytes.
pub fn strata_with(args: &[&str], env: &[(&str, &std::ffi::OsStr)], stdin: &[u8]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A metadata edit: the new value of a key, or None to keep it.
pub type KvEdit<'a> = &'a dyn Fn(&str) -> Option<strata_gguf::Value>;
/// A tensor edit: the new bytes of a tensor, or None to keep them.
pub type DataEdit<'a> = &'a dyn Fn(&str, &[u8]) -> Option<Vec<u8>>;

/// A copy of the GGUF `src` at `dst` with metadata values and tensor bytes changed by `kv` and
/// `data` (each returns None to keep the original).
pub fn rewrite_gguf(
    src: &std::path::Path,
    dst: &std::path::Path,
    kv: KvEdit<'_>,
    data: DataEdit<'_>,
) {
    let f = strata_gguf::GgufFile::open(src).unwrap();
    let mut w = strata_gguf::GgufWriter::new();
    w.version(f.version());
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), kv(k).unwrap_or_else(|| v.clone()));
    }
    for t in f.tensors() {
        let bytes = f.tensor_data(t).unwrap();
        let bytes = data(&t.name, bytes).unwrap_or_else(|| bytes.to_vec());
        w.add_tensor_owned(&t.name, &t.dims, f.tensor_type(t).unwrap(), bytes)
            .unwrap();
    }
    w.write_file(dst).unwrap();
}
