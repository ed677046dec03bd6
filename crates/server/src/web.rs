//! The web pages `strata serve` ships (issue 14): the chat page at `/`, the monitor at
//! `/monitor`, their bundled assets under `/assets/`, and `/metrics.json`, the JSON twin of
//! `/metrics` that the monitor reads (the same counters, plus the loaded model's description,
//! memory, and one-second samples of the counters for the tokens/s chart).
//!
//! The pages are built from `crates/server/web/src` by `scripts/build-web` into
//! `crates/server/web/dist`, which is committed and embedded here with `include_str!`, so
//! neither building nor running strata needs Node. Model output is untrusted: the page
//! sanitizes it (DOMPurify), and every page response carries a Content-Security-Policy that
//! allows no script but the page's own bundle and no connection or image from elsewhere, so a
//! sanitizer miss still runs nothing and leaks nothing.
//!
//! Also here: the llama.cpp-style `timings` object of a chat response, which the page shows
//! under each reply (prompt and generation tokens/s).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Serialize;
use serde_json::{json, Map, Value};
use strata_gguf::GgufFile;

use crate::run::Driver;
use crate::{AppState, Shared};

const INDEX_HTML: &str = include_str!("../web/dist/index.html");
const MONITOR_HTML: &str = include_str!("../web/dist/monitor.html");
const CHAT_JS: &str = include_str!("../web/dist/chat.js");
const MONITOR_JS: &str = include_str!("../web/dist/monitor.js");
const STYLE_CSS: &str = include_str!("../web/dist/style.css");

/// Script only from this server (the bundles: no inline script, no eval), connections only to
/// it, images only `data:` ones (a remote image in model output could carry the conversation
/// away in its URL), no plugins, no framing.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

/// Samples of the counters kept for the chart: one a second, ten minutes.
const HISTORY_LEN: usize = 600;
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { page(INDEX_HTML) }))
        .route("/monitor", get(|| async { page(MONITOR_HTML) }))
        .route(
            "/assets/chat.js",
            get(|| async { asset(CHAT_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/assets/monitor.js",
            get(|| async { asset(MONITOR_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/assets/style.css",
            get(|| async { asset(STYLE_CSS, "text/css; charset=utf-8") }),
        )
        .route("/metrics.json", get(metrics_json))
}

fn secured(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The bundle changes with the binary; revalidate rather than run a stale one.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

fn page(html: &'static str) -> Response {
    secured(([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response())
}

fn asset(body: &'static str, ty: &'static str) -> Response {
    secured(([(header::CONTENT_TYPE, ty)], body).into_response())
}

/// What the monitor shows about the loaded model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub id: String,
    /// The file's name as it was opened.
    pub file: String,
    pub arch: &'static str,
    pub file_bytes: u64,
    pub n_params: u64,
    pub n_tensors: usize,
    /// Tensors and bytes per storage type, most bytes first.
    pub formats: Vec<Format>,
    pub backend: &'static str,
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub parallel: usize,
    /// Whether an MTP head drafts tokens.
    pub mtp: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Format {
    #[serde(rename = "type")]
    pub ty: String,
    pub tensors: usize,
    pub bytes: u64,
}

impl ModelInfo {
    /// `file` is the model's GGUF; the rest comes from the loaded model (the caller matches on
    /// its architecture, so this needs no backend type).
    pub fn new(
        file: &GgufFile,
        arch: &'static str,
        n_vocab: usize,
        backend: &'static str,
        mtp: bool,
        shared: &Shared,
        n_ctx: usize,
    ) -> ModelInfo {
        let mut by_type: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        let mut n_params = 0u64;
        for t in file.tensors() {
            let e = by_type.entry(t.ty.to_string()).or_default();
            e.0 += 1;
            e.1 += t.n_bytes;
            n_params = n_params.saturating_add(t.n_elements);
        }
        let mut formats: Vec<Format> = by_type
            .into_iter()
            .map(|(ty, (tensors, bytes))| Format { ty, tensors, bytes })
            .collect();
        formats.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.ty.cmp(&b.ty)));
        ModelInfo {
            id: shared.cfg.model_id.clone(),
            file: std::path::Path::new(file.name())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| file.name().to_string()),
            arch,
            file_bytes: file.file_size(),
            n_params,
            n_tensors: file.tensors().len(),
            formats,
            backend,
            n_ctx,
            n_vocab,
            parallel: shared.cfg.parallel,
            mtp,
        }
    }
}

/// One sample of the counters the chart needs.
#[derive(Clone, Copy, Debug)]
struct Sample {
    /// Unix seconds.
    t: f64,
    prompt_tokens: u64,
    predicted_tokens: u64,
    processing: u64,
    deferred: u64,
}

/// The web side's share of the server state: the model's description (set once loaded) and
/// the counters' recent samples.
#[derive(Default)]
pub struct WebState {
    model: OnceLock<ModelInfo>,
    history: Mutex<VecDeque<Sample>>,
    /// Device memory in use, +1 (0: no device), set by the worker, which owns the backend.
    vram: std::sync::atomic::AtomicU64,
}

impl WebState {
    /// Records the backend's device memory in use (the worker calls it after each turn).
    pub fn set_vram(&self, bytes: Option<u64>) {
        let v = bytes.map_or(0, |b| b.saturating_add(1));
        self.vram.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    fn vram(&self) -> Option<u64> {
        match self.vram.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            v => Some(v - 1),
        }
    }

    pub fn set_model(&self, info: ModelInfo) {
        let _ = self.model.set(info);
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn take_sample(shared: &Shared) {
    use std::sync::atomic::Ordering::Relaxed;
    let m = &shared.metrics;
    let s = Sample {
        t: unix_now(),
        prompt_tokens: m.prompt_tokens.load(Relaxed),
        predicted_tokens: m.predicted_tokens.load(Relaxed),
        processing: m.processing.load(Relaxed),
        deferred: m.deferred.load(Relaxed),
    };
    if let Ok(mut h) = shared.web.history.lock() {
        if h.len() == HISTORY_LEN {
            h.pop_front();
        }
        h.push_back(s);
    }
}

/// Samples the counters once a second until the server stops (spawned by the HTTP runtime).
pub async fn sample_history(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !shared.shutting_down() {
        tick.tick().await;
        take_sample(&shared);
    }
}

/// `/metrics`' Prometheus text as JSON: `{"name": value}` for a plain sample (the `strata:`
/// prefix dropped), `{"name": [{"labels": {...}, "value": v}, ...]}` for labelled ones. Parsing
/// the rendered text rather than reading the counters keeps the twin exact as metrics are added.
pub fn prometheus_to_json(text: &str) -> Map<String, Value> {
    let mut out = Map::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (head, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let v = match value.parse::<f64>() {
            Ok(v) if v.is_finite() => json!(v),
            _ => Value::Null,
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, Some(parse_labels(rest.trim_end_matches('}')))),
            None => (head, None),
        };
        let name = name.strip_prefix("strata:").unwrap_or(name).to_string();
        match labels {
            None => {
                out.insert(name, v);
            }
            Some(l) => {
                let e = out.entry(name).or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(a) = e {
                    a.push(json!({"labels": l, "value": v}));
                }
            }
        }
    }
    out
}

/// `a="x",b="y\"z"` → {"a": "x", "b": "y\"z"}.
fn parse_labels(s: &str) -> Map<String, Value> {
    let mut out = Map::new();
    let mut rest = s;
    while let Some((k, after)) = rest.split_once("=\"") {
        let mut val = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => val.push('\n'),
                    Some((_, c)) => val.push(c),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.insert(
            k.trim().trim_start_matches(',').trim().to_string(),
            json!(val),
        );
        rest = &after[end.min(after.len())..];
    }
    out
}

/// Resident and peak resident memory of this process (Linux; None elsewhere).
fn rss() -> (Option<u64>, Option<u64>) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

async fn metrics_json(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = s.check_key(&headers) {
        return e.openai();
    }
    let n_ctx = s.ready().map_or(0, |r| r.n_ctx);
    let metrics = prometheus_to_json(&s.metrics.render(n_ctx));
    let history = {
        let h = s.web.history.lock().map(|h| h.clone()).unwrap_or_default();
        json!({
            "interval_s": SAMPLE_EVERY.as_secs_f64(),
            "t": h.iter().map(|x| x.t).collect::<Vec<_>>(),
            "prompt_tokens_total": h.iter().map(|x| x.prompt_tokens).collect::<Vec<_>>(),
            "tokens_predicted_total": h.iter().map(|x| x.predicted_tokens).collect::<Vec<_>>(),
            "requests_processing": h.iter().map(|x| x.processing).collect::<Vec<_>>(),
            "requests_deferred": h.iter().map(|x| x.deferred).collect::<Vec<_>>(),
        })
    };
    let (rss, peak) = rss();
    let body = json!({
        "ready": s.ready().is_some() && !s.shutting_down(),
        "uptime_s": s.started.elapsed().as_secs_f64(),
        "model": s.web.model.get(),
        "memory": {
            "rss_bytes": rss,
            "rss_peak_bytes": peak,
            "vram_bytes": s.web.vram(),
            "checkpoint_budget_bytes": s.cfg.cache_ram,
        },
        "metrics": metrics,
        "history": history,
    });
    (
        StatusCode::OK,
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(body),
    )
        .into_response()
}

/// llama-server's `timings` object for a finished generation: prompt tokens run (cached ones
/// excluded) over the time from the job's start to its first token (prefill, and the first
/// sampling), generated tokens after the first over the time between first and last.
pub fn timings(d: &Driver) -> Value {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let prompt_n = d.prompt_tokens.saturating_sub(d.cached_tokens);
    let (prompt_ms, predicted_ms) = match (d.t_first, d.t_last) {
        (Some(f), Some(l)) => (ms(d.t0, f), ms(f, l)),
        _ => (ms(d.t0, Instant::now()), 0.0),
    };
    let predicted_n = d.completion_tokens.saturating_sub(1);
    let per_s = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    json!({
        "cache_n": d.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_second": per_s(prompt_n, prompt_ms),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_second": per_s(predicted_n, predicted_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_becomes_the_same_numbers_in_json() {
        let text = "# HELP strata:a_total A.\n# TYPE strata:a_total counter\nstrata:a_total 12\n\
                    strata:rate 2.5\nstrata:spec_accepted_total{pos=\"1\",kind=\"a\\\"b\"} 7\n\
                    strata:spec_accepted_total{pos=\"2\"} 3\nstrata:bad NaN\n";
        let j = Value::Object(prometheus_to_json(text));
        assert_eq!(
            j,
            json!({
                "a_total": 12.0,
                "rate": 2.5,
                "spec_accepted_total": [
                    {"labels": {"pos": "1", "kind": "a\"b"}, "value": 7.0},
                    {"labels": {"pos": "2"}, "value": 3.0},
                ],
                "bad": null,
            })
        );
    }

    #[test]
    fn every_metric_of_the_server_is_in_the_twin() {
        let m = crate::metrics::Metrics::default();
        m.prompt_tokens
            .store(41, std::sync::atomic::Ordering::Relaxed);
        let text = m.render(512);
        let j = prometheus_to_json(&text);
        let names: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split([' ', '{']).next())
            .collect();
        assert!(names.len() >= 18, "{names:?}");
        for n in names {
            let k = n.strip_prefix("strata:").unwrap();
            assert!(j.contains_key(k), "{k} missing from the JSON twin");
        }
        assert_eq!(j["prompt_tokens_total"], json!(41.0));
        assert_eq!(j["n_tokens_max"], json!(512.0));
    }
}
