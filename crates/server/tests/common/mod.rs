//! A server on the tiny qwen4exp fixture (or the default model when cached), and a plain
//! HTTP/1.1 client over a socket, so the tests see exactly the bytes a client would.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use strata_server::{LoadSpec, ModelHandle, Server, ServerConfig};

pub fn tiny_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny/model-f32.gguf")
}

/// The default model when it is in the cache (`strata fetch`), else None.
pub fn default_model() -> Option<PathBuf> {
    let base = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("strata")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))?;
    let p = base.join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    p.exists().then_some(p)
}

/// The tiny fixture's MTP head as a GGUF beside the trunk (written once per test binary).
pub fn mtp_head() -> PathBuf {
    static P: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let hf = tiny_model().with_file_name("hf");
        let opts = strata_convert::ConvertOptions {
            out_type: strata_convert::OutType::F32,
            include_shared: false,
        };
        let (w, _) = strata_convert::convert_mtp(&hf, &opts).expect("converting the tiny MTP head");
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("server-spec-mtp-{}.gguf", std::process::id()));
        std::fs::write(&p, w.to_bytes().expect("serializing the head")).expect("writing it");
        p
    })
    .clone()
}

pub fn start(model: PathBuf, cfg: ServerConfig) -> Server {
    start_with(
        model,
        LoadSpec {
            threads: 2,
            ..Default::default()
        },
        cfg,
    )
}

pub fn start_with(model: PathBuf, spec: LoadSpec, cfg: ServerConfig) -> Server {
    let cfg = ServerConfig { port: 0, ..cfg };
    let loader = Box::new(move || ModelHandle::load(&model, &spec));
    let s = Server::start(cfg, loader).expect("starting the server");
    s.wait_ready(Duration::from_secs(300))
        .expect("loading the model");
    s
}

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent-events body.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }

    /// The `event:` names of a server-sent-events body.
    pub fn sse_events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .map(str::to_string)
            .collect()
    }
}

fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connecting");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("writing the request");
    s
}

/// Undoes `Transfer-Encoding: chunked`.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..i]).unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        let start = i + 2;
        out.extend_from_slice(&b[start..(start + n).min(b.len())]);
        b = &b[(start + n + 2).min(b.len())..];
    }
    out
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut s = send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reading the reply");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    let rest = &raw[split + 4..];
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Reply {
        status,
        headers: head,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Reply {
    request(addr, "POST", path, &[], &body.to_string())
}

/// A request whose reply is read line by line (a stream still running).
pub struct Open {
    pub reader: BufReader<TcpStream>,
}

impl Open {
    pub fn new(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Open {
        let s = send(addr, "POST", path, &[], &body.to_string());
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        Open {
            reader: BufReader::new(s),
        }
    }

    /// Reads lines until one contains `needle`; returns everything read.
    pub fn until(&mut self, needle: &str) -> String {
        let mut all = String::new();
        loop {
            let mut l = String::new();
            match self.reader.read_line(&mut l) {
                Ok(0) | Err(_) => return all,
                Ok(_) => {}
            }
            all.push_str(&l);
            if l.contains(needle) {
                return all;
            }
        }
    }

    pub fn rest(&mut self) -> String {
        let mut s = String::new();
        let _ = self.reader.read_to_string(&mut s);
        s
    }
}

/// Waits until metric `name` reaches `at_least`, for at most two minutes; then fails naming
/// the metric and its value (a test that waits for a state must not hang when it never comes).
pub fn wait_for_metric(addr: SocketAddr, name: &str, at_least: f64) {
    let end = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let v = metric(addr, name);
        if v >= at_least {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "{name} stayed at {v} (waited for {at_least}) for two minutes"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let r = request(addr, "GET", "/metrics", &[], "");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(&format!("strata:{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric strata:{name} in\n{}", r.body))
}
