//! The web pages (issue 14): the embedded bundle is what `crates/server/web/src` builds to, the
//! pages and `/metrics.json` are served as the page expects (security headers, the key, the
//! JSON twin equal to `/metrics`, `timings` under a chat reply), and the pages themselves in
//! headless Chromium (tests/web/test_pages.py, Playwright for Python): a streamed reply from
//! the tiny fixture, stop, regenerate, edit-and-resend, reload, export/import, settings, the
//! key prompt, the XSS payloads, the monitor's chart. `scripts/test` installs Chromium
//! (Debian's `chromium`) and Playwright into the cache and names them in `STRATA_CHROMIUM` /
//! `STRATA_PLAYWRIGHT`; without them the browser test says so and passes (it cannot run).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{request, start, tiny_model};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use strata_server::ServerConfig;

const KEY: &str = "web-test-key";

fn web_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("web")
}

fn header<'a>(r: &'a common::Reply, name: &str) -> Option<&'a str> {
    r.headers.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The stamp build.mjs writes, recomputed: sha256 of each file under src/ (name order), then
/// package.json and package-lock.json.
fn stamp(dir: &Path) -> String {
    let mut src: Vec<String> = std::fs::read_dir(dir.join("src"))
        .expect("reading web/src")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .map(|n| format!("src/{n}"))
        .collect();
    src.sort();
    src.push("package.json".into());
    src.push("package-lock.json".into());
    src.iter()
        .map(|p| {
            let bytes = std::fs::read(dir.join(p)).unwrap_or_else(|e| panic!("reading {p}: {e}"));
            let h = Sha256::digest(&bytes);
            let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
            format!("{hex}  {p}\n")
        })
        .collect()
}

#[test]
fn web_bundle_is_current() {
    let dir = web_dir();
    let recorded = std::fs::read_to_string(dir.join("dist/SOURCES.sha256"))
        .expect("web/dist/SOURCES.sha256 (run scripts/build-web)");
    assert_eq!(
        recorded,
        stamp(&dir),
        "crates/server/web/src (or its packages) changed since dist/ was built: run scripts/build-web \
         and commit dist/"
    );
}

#[test]
fn pages_assets_and_the_metrics_twin() {
    let s = start(
        tiny_model(),
        ServerConfig {
            model_id: "tiny".into(),
            n_ctx: Some(512),
            api_keys: vec![KEY.into()],
            ..Default::default()
        },
    );
    let a = s.addr();
    let auth = [("Authorization", "Bearer web-test-key")];

    // The pages load without a key (they ask for it); the data behind them needs it.
    for (path, ty, needle) in [
        ("/", "text/html", "/assets/chat.js"),
        ("/monitor", "text/html", "/assets/monitor.js"),
        ("/assets/chat.js", "text/javascript", "DOMPurify"),
        ("/assets/monitor.js", "text/javascript", "/metrics.json"),
        ("/assets/style.css", "text/css", ".uplot"),
    ] {
        let r = request(a, "GET", path, &[], "");
        assert_eq!(r.status, 200, "{path}");
        assert!(
            header(&r, "content-type").is_some_and(|t| t.starts_with(ty)),
            "{path}: {}",
            r.headers
        );
        assert!(r.body.contains(needle), "{path} lacks {needle}");
        let csp = header(&r, "content-security-policy").unwrap_or("");
        assert!(
            csp.contains("script-src 'self'") && csp.contains("connect-src 'self'"),
            "{path}: {csp}"
        );
        assert_eq!(header(&r, "x-content-type-options"), Some("nosniff"));
    }
    // Nothing the pages need comes from elsewhere.
    for path in ["/", "/monitor"] {
        let html = request(a, "GET", path, &[], "").body;
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "{path}"
        );
    }
    assert_eq!(request(a, "GET", "/metrics.json", &[], "").status, 401);

    // One streamed chat reply, then the twin must equal /metrics sample by sample.
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                      "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let r = request(a, "POST", "/v1/chat/completions", &auth, &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let last: Value = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .next_back()
        .expect("chunks");
    let (u, t) = (&last["usage"], &last["timings"]);
    let completion = u["completion_tokens"].as_u64().unwrap();
    assert!(completion >= 1);
    assert_eq!(t["predicted_n"].as_u64(), Some(completion - 1), "{t}");
    assert_eq!(
        t["prompt_n"].as_u64(),
        Some(
            u["prompt_tokens"].as_u64().unwrap()
                - u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
        )
    );
    assert!(t["prompt_ms"].as_f64().unwrap() > 0.0, "{t}");
    // Not streamed: the same object beside usage.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    whole.as_object_mut().unwrap().remove("stream_options");
    let r = request(a, "POST", "/v1/chat/completions", &auth, &whole.to_string()).json();
    assert_eq!(
        r["timings"]["predicted_n"].as_u64(),
        Some(r["usage"]["completion_tokens"].as_u64().unwrap() - 1)
    );

    // Let the sampler take a sample after the generations, and the worker finish its books:
    // compare when two JSON reads around the text one agree.
    std::thread::sleep(Duration::from_millis(1100));
    let (prom, j) = (0..50)
        .find_map(|_| {
            let before = request(a, "GET", "/metrics.json", &auth, "").json();
            let prom = request(a, "GET", "/metrics", &auth, "").body;
            let j = request(a, "GET", "/metrics.json", &auth, "").json();
            if before["metrics"] == j["metrics"] {
                Some((prom, j))
            } else {
                std::thread::sleep(Duration::from_millis(100));
                None
            }
        })
        .expect("the counters settle");
    let mut n = 0;
    for line in prom.lines().filter(|l| !l.starts_with('#')) {
        let (name, v) = line.rsplit_once(' ').unwrap();
        let key = name.strip_prefix("strata:").unwrap();
        let v: f64 = v.parse().unwrap();
        // A labelled sample is the entry of its name's list with the same labels.
        let got = match key.split_once('{') {
            None => j["metrics"][key].as_f64(),
            Some((base, labels)) => j["metrics"][base]
                .as_array()
                .and_then(|a| {
                    a.iter().find(|e| {
                        let l = e["labels"].as_object().unwrap();
                        let text: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        text.join(",") == labels.trim_end_matches('}')
                    })
                })
                .and_then(|e| e["value"].as_f64()),
        }
        .unwrap_or(f64::NAN);
        // serde_json's default float parser may be one ulp off (no `float_roundtrip`).
        assert!((got - v).abs() <= 1e-12 * v.abs(), "{key}: {got} vs {v}");
        n += 1;
    }
    assert!(n >= 18);
    assert_eq!(j["metrics"]["requests_total"], json!(2.0));
    assert_eq!(j["ready"], json!(true));
    let m = &j["model"];
    assert_eq!(m["arch"], "qwen4exp");
    assert_eq!(m["id"], "tiny");
    assert_eq!(m["file"], "model-f32.gguf");
    assert_eq!(m["n_ctx"], 512);
    assert_eq!(
        m["file_bytes"].as_u64(),
        Some(std::fs::metadata(tiny_model()).unwrap().len())
    );
    // The f32 fixture stores its tensors as f32 (norms and all).
    let formats = m["formats"].as_array().unwrap();
    assert_eq!(formats[0]["type"], "F32", "{formats:?}");
    let tensors: u64 = formats.iter().map(|f| f["tensors"].as_u64().unwrap()).sum();
    assert_eq!(Some(tensors), m["n_tensors"].as_u64());
    let h = &j["history"];
    let ts = h["t"].as_array().unwrap();
    assert!(!ts.is_empty());
    let last_pred = h["tokens_predicted_total"]
        .as_array()
        .unwrap()
        .last()
        .cloned();
    assert_eq!(
        last_pred.and_then(|v| v.as_f64()),
        j["metrics"]["tokens_predicted_total"].as_f64()
    );
    if cfg!(target_os = "linux") {
        assert!(j["memory"]["rss_bytes"].as_u64().unwrap() > 1 << 20);
    }
    s.shutdown().unwrap();
}

fn tool(var: &str, fallback: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    fallback.iter().map(PathBuf::from).find(|p| p.exists())
}

#[test]
fn the_pages_in_headless_chromium() {
    let Some(chromium) = tool("STRATA_CHROMIUM", &["/usr/bin/chromium"]) else {
        eprintln!(
            "web: SKIPPED — no chromium (scripts/test installs Debian's chromium and sets \
             STRATA_CHROMIUM)"
        );
        return;
    };
    let py = [
        std::env::var("STRATA_PLAYWRIGHT").unwrap_or_default(),
        std::env::var("STRATA_PYCLIENTS").unwrap_or_default(),
    ]
    .into_iter()
    .filter(|s| !s.is_empty())
    .collect::<Vec<_>>()
    .join(":");
    let ok = Command::new("python3")
        .args(["-c", "import playwright.sync_api, pytest"])
        .env("PYTHONPATH", &py)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "web: SKIPPED — Playwright for Python or pytest is not installed (scripts/test \
             installs them into the cache and sets STRATA_PLAYWRIGHT / STRATA_PYCLIENTS)"
        );
        return;
    }
    let base = ServerConfig {
        model_id: "tiny".into(),
        n_ctx: Some(1024),
        // Slow enough for the page to be stopped mid-stream, fast enough for the test.
        test_token_delay: Some(Duration::from_millis(60)),
        ..Default::default()
    };
    let open = start(tiny_model(), base.clone());
    let keyed = start(
        tiny_model(),
        ServerConfig {
            api_keys: vec![KEY.into()],
            ..base.clone()
        },
    );
    // The same model without the delay, for the test to find a seed that runs long.
    let probe = start(
        tiny_model(),
        ServerConfig {
            test_token_delay: None,
            ..base.clone()
        },
    );
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/web");
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&tests)
        .env("PYTHONPATH", &py)
        .env("STRATA_CHROMIUM", &chromium)
        .env("STRATA_URL", format!("http://{}", open.addr()))
        .env("STRATA_KEYED_URL", format!("http://{}", keyed.addr()))
        .env("STRATA_PROBE_URL", format!("http://{}", probe.addr()))
        .env("STRATA_KEY", KEY)
        .env("NO_PROXY", "127.0.0.1,localhost");
    let out = cmd.output().expect("running pytest");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    open.shutdown().unwrap();
    keyed.shutdown().unwrap();
    probe.shutdown().unwrap();
    assert!(out.status.success(), "the browser tests failed:\n{text}");
    // A sanity check on the runner: it ran the tests it was given.
    assert!(text.contains("passed"), "{text}");
}

#[test]
fn the_pages_and_the_twin_answer_while_the_model_loads() {
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let model = tiny_model();
    // The model loads only when the test says so.
    let loader = Box::new(move || {
        let _ = wait.recv();
        strata_server::ModelHandle::load(&model, &Default::default())
    });
    let s = strata_server::Server::start(
        ServerConfig {
            port: 0,
            ..Default::default()
        },
        loader,
    )
    .unwrap();
    let a = s.addr();
    assert_eq!(request(a, "GET", "/", &[], "").status, 200);
    assert_eq!(request(a, "GET", "/monitor", &[], "").status, 200);
    let j = request(a, "GET", "/metrics.json", &[], "").json();
    assert_eq!(j["ready"], json!(false));
    assert_eq!(j["model"], Value::Null);
    assert_eq!(j["metrics"]["n_tokens_max"], json!(0.0));
    // A chat request meanwhile is refused with the reason, which the page shows.
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[],
        &json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    go.send(()).unwrap();
    s.wait_ready(Duration::from_secs(60)).unwrap();
    let j = request(a, "GET", "/metrics.json", &[], "").json();
    assert_eq!(j["ready"], json!(true));
    assert_eq!(j["model"]["arch"], "qwen4exp");
    s.shutdown().unwrap();
}
