//! The official `openai` and `anthropic` Python SDKs against the server (tests/py): a server on
//! the tiny fixture, and one on the default model when it is cached. `scripts/test` installs
//! the pinned SDKs and pytest into the cache and names the folder in `STRATA_PYCLIENTS`; without
//! them this test says so and passes (it cannot run, it did not fail).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{default_model, mtp_head, start, start_with, tiny_model};
use strata_server::{LoadSpec, ServerConfig};

const KEY: &str = "test-key";
const CTX: usize = 2048;

fn pyclients() -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_PYCLIENTS").map(PathBuf::from)?;
    let ok = Command::new("python3")
        .args(["-c", "import openai, anthropic, pytest"])
        .env("PYTHONPATH", &dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok.then_some(dir)
}

#[test]
fn official_clients_against_the_server() {
    let Some(dir) = pyclients() else {
        eprintln!(
            "clients: SKIPPED — the openai/anthropic SDKs are not installed \
             (scripts/test installs them into the cache and sets STRATA_PYCLIENTS)"
        );
        return;
    };
    let cfg = ServerConfig {
        api_keys: vec![KEY.into()],
        model_id: "tiny".into(),
        n_ctx: Some(CTX),
        ..Default::default()
    };
    // The tiny server carries the fixture's MTP head and decodes speculatively by default
    // (window 4), so every SDK test below also checks speculation against its oracle; the
    // default model (qwen2, no head) decodes plainly.
    let tiny = start_with(
        tiny_model(),
        LoadSpec {
            threads: 2,
            mtp: Some(mtp_head()),
            ..Default::default()
        },
        cfg.clone(),
    );
    let default = default_model().map(|m| {
        start(
            m,
            ServerConfig {
                model_id: "default".into(),
                n_ctx: Some(4096),
                ..cfg.clone()
            },
        )
    });
    if default.is_none() {
        eprintln!("clients: the default model is not cached; its tool-call tests skip");
    }
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py");
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&tests)
        .env("PYTHONPATH", &dir)
        .env("STRATA_URL", format!("http://{}", tiny.addr()))
        .env("STRATA_KEY", KEY)
        .env("STRATA_CTX", CTX.to_string())
        // The SDKs must not pick up a proxy or a real key from the environment.
        .env_remove("OPENAI_API_KEY")
        .env_remove("ANTHROPIC_API_KEY")
        .env("NO_PROXY", "127.0.0.1,localhost");
    if let Some(d) = &default {
        cmd.env("STRATA_DEFAULT", format!("http://{}", d.addr()));
    }
    let out = cmd.output().expect("running pytest");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    tiny.shutdown().unwrap();
    if let Some(d) = default {
        d.shutdown().unwrap();
    }
    assert!(out.status.success(), "pytest failed:\n{text}");
}
