//! A short soak of the server on the tiny fixture (the full one, 100 clients for 10 minutes
//! through the official SDK, is `scripts/soak`, run by hand; its results are in docs/PERF.md):
//! 16 clients stream chat completions for 20 s against 4 slots; every stream must end with a
//! finish reason and `[DONE]`, none may fail or be refused, and the process's RSS may not keep
//! growing once warmed up. `STRATA_SOAK_CLIENTS` / `STRATA_SOAK_SECONDS` scale it up.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{metric, request, start, tiny_model};
use serde_json::{json, Value};
use strata_server::ServerConfig;

fn rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn many_streaming_clients_all_complete_and_memory_stays_flat() {
    let clients = env_or("STRATA_SOAK_CLIENTS", 16) as usize;
    let seconds = env_or("STRATA_SOAK_SECONDS", 20);
    let s = start(
        tiny_model(),
        ServerConfig {
            model_id: "tiny".into(),
            parallel: 4,
            queue: clients + 8,
            ..Default::default()
        },
    );
    let addr = s.addr();
    let ok = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(seconds);
    let warm = t0 + Duration::from_secs(seconds / 4);
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let ok = Arc::clone(&ok);
            std::thread::spawn(move || -> Result<(), String> {
                let mut n = 0;
                while Instant::now() < deadline {
                    n += 1;
                    let body = json!({"messages": [{"role": "user",
                                       "content": format!("client {i}, request {n}: say something")}],
                                      "max_tokens": 16, "stream": true,
                                      "temperature": 0.8, "seed": n});
                    let r = request(addr, "POST", "/v1/chat/completions", &[], &body.to_string());
                    if r.status != 200 {
                        return Err(format!("client {i}: status {}: {}", r.status, r.body));
                    }
                    let data = r.sse_data();
                    if data.last().map(String::as_str) != Some("[DONE]") {
                        return Err(format!("client {i}: no [DONE]: {}", r.body));
                    }
                    let finished = data.iter().filter(|d| *d != "[DONE]").any(|d| {
                        serde_json::from_str::<Value>(d)
                            .ok()
                            .is_some_and(|v| v["choices"][0]["finish_reason"].is_string())
                    });
                    if !finished || r.body.contains("\"error\"") {
                        return Err(format!("client {i}: stream did not finish: {}", r.body));
                    }
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    // RSS after the warm-up, then its largest value to the end.
    while Instant::now() < warm {
        std::thread::sleep(Duration::from_millis(200));
    }
    let base = rss_mib();
    let mut peak = base;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        peak = peak.max(rss_mib());
    }
    for t in threads {
        t.join().unwrap().unwrap();
    }
    let done = ok.load(Ordering::Relaxed);
    eprintln!(
        "{clients} clients, {seconds} s: {done} streams complete; RSS {base:.1} MiB after \
         warm-up, peak {peak:.1} MiB"
    );
    assert!(done >= clients as u64, "only {done} streams completed");
    assert_eq!(metric(addr, "requests_rejected_total"), 0.0);
    assert_eq!(metric(addr, "requests_processing"), 0.0);
    let h = request(addr, "GET", "/health", &[], "");
    assert_eq!(h.status, 200);
    // Four slots of a 64-wide model hold a few MiB of state at most: a leak of a stream's
    // buffers per request would add that many times over.
    assert!(
        peak - base < 48.0,
        "RSS grew from {base:.1} to {peak:.1} MiB after warm-up"
    );
    s.shutdown().unwrap();
}
