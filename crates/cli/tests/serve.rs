//! `strata serve` as a process: it binds (port 0: any free port, printed on stderr), answers
//! `/health` once the tiny fixture is loaded, a chat request, and stops cleanly on SIGTERM;
//! flags it cannot honour are refused before anything starts.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny/model-f32.gguf")
}

fn get(addr: &str, req: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn serves_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "-m"])
        .arg(tiny())
        .args(["--port", "0", "--api-key", "k"])
        .env("STRATA_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut addr = None;
    let mut seen = String::new();
    // The first lines say where it listens and that the model loaded, in either order (the
    // model loads on the worker thread while the listener starts).
    let mut loaded = false;
    for _ in 0..10 {
        let mut l = String::new();
        if err.read_line(&mut l).unwrap() == 0 {
            break;
        }
        seen.push_str(&l);
        if let Some(rest) = l.split("listening on http://").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_string);
        }
        loaded |= l.contains("model loaded");
        if loaded && addr.is_some() {
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("no address in {seen}"));
    let health = get(
        &addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"temperature":0}"#;
    let chat = get(
        &addr,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(chat.starts_with("HTTP/1.1 200"), "{chat}");
    assert!(chat.contains("\"completion_tokens\":3"), "{chat}");
    // SAFETY: sending a signal to the child this test spawned, by its own pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "exit {status:?}: {rest}");
    assert!(rest.contains("stopping"), "{rest}");
}

#[test]
fn refuses_what_it_cannot_do() {
    for (args, says) in [
        (vec!["--mtp", "x.gguf"], "--mtp"),
        (vec!["--spec", "9"], "--spec 9: out of range"),
        // A window above 1 needs a head, which the tiny trunk file does not carry.
        (vec!["--spec", "2"], "needs an MTP head"),
        (vec!["--ctx", "0"], "--ctx 0: out of range"),
        (vec!["--ctx", "1"], "--ctx 1: out of range"),
        (vec!["--backend", "cuda"], "--backend"),
        (vec!["--parallel", "0"], "--parallel"),
        (
            vec!["--api-key-file", "/nonexistent/keys"],
            "/nonexistent/keys",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "-m"])
            .arg(tiny())
            .args(["--port", "0"])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A greedy completion through `strata serve --backend wgpu` (lavapipe here) is the text
/// `strata run --backend wgpu` prints for the same prompt: the server's wgpu wiring runs the
/// same model on the same loop. Skipped, saying so, where no wgpu adapter exists.
#[test]
fn a_greedy_completion_on_wgpu_equals_run_on_wgpu() {
    let m = tiny();
    let run = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["run", "-m"])
        .arg(&m)
        .args(["-p", "hello", "-n", "8", "--temp", "0", "--no-echo"])
        .args(["--backend", "wgpu"])
        .output()
        .unwrap();
    let run_err = String::from_utf8_lossy(&run.stderr);
    if !run.status.success()
        && run_err.contains("--backend wgpu")
        && run_err.to_lowercase().contains("adapter")
    {
        eprintln!("SKIP: no wgpu adapter here ({run_err})");
        return;
    }
    assert!(run.status.success(), "{run_err}");
    let want = String::from_utf8(run.stdout).unwrap();
    let want = want.strip_suffix('\n').unwrap_or(&want);
    assert!(!want.is_empty(), "run printed nothing");

    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "-m"])
        .arg(&m)
        .args(["--port", "0", "--backend", "wgpu"])
        .env("STRATA_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let (mut addr, mut loaded, mut seen) = (None, false, String::new());
    for _ in 0..10 {
        let mut l = String::new();
        if err.read_line(&mut l).unwrap() == 0 {
            break;
        }
        seen.push_str(&l);
        if let Some(rest) = l.split("listening on http://").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_string);
        }
        loaded |= l.contains("model loaded");
        if loaded && addr.is_some() {
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("no address in {seen}"));
    assert!(seen.contains("wgpu"), "the backend is not named: {seen}");
    let body = r#"{"prompt":"hello","max_tokens":8,"temperature":0}"#;
    let resp = get(
        &addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    // SAFETY: sending a signal to the child this test spawned, by its own pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let json = resp.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {resp}"));
    let got = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(got, want, "serve --backend wgpu vs run --backend wgpu");
    assert!(status.success(), "exit {status:?}");
}
