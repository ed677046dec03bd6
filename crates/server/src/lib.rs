//! strata-server: `strata serve`, an HTTP API in the shapes of OpenAI's and Anthropic's, so that
//! their official clients and the tools built on them work unchanged. Owns the process layout:
//! the listener is bound first (so `/health` answers 503 while the model loads), one worker
//! thread loads and then owns the model and its sequences ([`worker`]), and the async handlers
//! ([`openai`], [`anthropic`]) talk to it through channels. Everything that calls the engine is
//! in [`engine`].

pub mod anthropic;
pub mod chat;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod memory;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod run;
pub mod web;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use strata_engine::backend::Backend;
use strata_engine::{CpuBackend, Qwen4expOps};
use strata_tokenizer::{ChatTemplate, Tokenizer};
use tokio::sync::Notify;

pub use engine::{LoadSpec, ModelHandle};
use error::ApiError;

/// A plain ChatML template for files that carry none (the CLI's `chat` uses the same).
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// What `strata serve` was told.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Accepted keys; empty: no authentication.
    pub api_keys: Vec<String>,
    /// Positions per sequence (None: the model's trained context, capped at 8192; 4096 when
    /// the file states none).
    pub n_ctx: Option<usize>,
    /// Sequences in flight at once.
    pub parallel: usize,
    /// Requests that may wait for a slot; one more gets 429.
    pub queue: usize,
    /// Bytes of recurrent-state checkpoints kept for prefix reuse.
    pub cache_ram: usize,
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    /// Overrides the file's chat template.
    pub chat_template: Option<String>,
    /// Stop on SIGINT/SIGTERM (the CLI); tests stop the server themselves.
    pub handle_signals: bool,
    /// Verify window of requests that set none (`--spec N`); None: 4 when the model has an
    /// MTP head, else 1 (plain decoding).
    pub spec: Option<usize>,
    /// Replaces the MTP head's drafts (tests and benchmarks only: forced acceptance patterns).
    pub draft_oracle: Option<engine::DraftOracle>,
    /// Test-only: the worker sleeps this long after each decode step, so that a browser test
    /// can stop a generation of the (fast) tiny fixture mid-stream. No flag sets it.
    pub test_token_delay: Option<Duration>,
    /// Most tokens one batched step runs: every running sequence's decode row plus one prefill
    /// chunk (`worker::BATCH_TOKENS`).
    pub batch_tokens: usize,
    /// Bytes all sequence states may hold together (None: the memory available once the model
    /// is loaded, less a headroom: `memory::Budget`).
    pub state_memory: Option<u64>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            n_ctx: None,
            parallel: 1,
            queue: 64,
            cache_ram: 1 << 30,
            model_id: "strata".into(),
            chat_template: None,
            handle_signals: false,
            spec: None,
            draft_oracle: None,
            test_token_delay: None,
            batch_tokens: worker::BATCH_TOKENS,
            state_memory: None,
        }
    }
}

/// Loads the model; runs on the worker thread, which then owns what it returns (so the
/// backends need not be `Send`: a device backend is made on the thread that uses it).
pub type Loader<Q2 = CpuBackend, Q4 = CpuBackend> =
    Box<dyn FnOnce() -> Result<(ModelHandle<Q2, Q4>, Tokenizer)> + Send>;

/// What the handlers need once the model is loaded.
pub struct Ready {
    pub tok: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub n_ctx: usize,
    pub arch: &'static str,
    pub n_vocab: usize,
    /// The model has an MTP head, and the verify window of requests that ask for none.
    pub has_mtp: bool,
    pub spec_window: usize,
    /// Control tokens printed anyway ([`output::preserved_ids`]).
    pub preserved: Arc<Vec<u32>>,
    /// llguidance's view of the vocabulary, built on the first constrained request.
    constrainer: OnceLock<Result<Arc<grammar::Constrainer>, String>>,
}

impl Ready {
    pub fn constrainer(&self) -> Result<Arc<grammar::Constrainer>, ApiError> {
        self.constrainer
            .get_or_init(|| {
                grammar::Constrainer::new(Arc::clone(&self.tok))
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
            .map_err(|e| ApiError::internal(format!("constrained decoding is unavailable: {e}")))
    }
}

/// State shared by the handlers and the worker.
pub struct Shared {
    pub cfg: ServerConfig,
    ready: OnceLock<Ready>,
    failed: Mutex<Option<String>>,
    shutdown: AtomicBool,
    notify: Notify,
    pub metrics: metrics::Metrics,
    /// The web pages' model description and counter samples ([`web`]).
    pub web: web::WebState,
    jobs: SyncSender<worker::Job>,
    pub started: Instant,
    /// The sequence states' memory, once the model is loaded.
    budget: OnceLock<memory::Budget>,
}

impl Shared {
    pub fn ready(&self) -> Option<&Ready> {
        self.ready.get()
    }

    pub fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    pub fn begin_shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    /// Records a fatal error (the model did not load) and stops the server.
    pub fn fail(&self, msg: String) {
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert(msg);
        }
        self.begin_shutdown();
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }

    /// Queues a job; a full queue is a 429.
    pub fn submit(&self, job: worker::Job) -> Result<(), ApiError> {
        if self.shutting_down() {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        if let Some(why) = self
            .budget
            .get()
            .and_then(|b| b.refuse(job.prompt.len(), job.max_tokens))
        {
            self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::busy(why));
        }
        self.metrics.deferred.fetch_add(1, Ordering::Relaxed);
        match self.jobs.try_send(job) {
            Ok(()) => {
                self.metrics.requests.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.metrics.deferred.fetch_sub(1, Ordering::Relaxed);
                match e {
                    TrySendError::Full(_) => {
                        self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                        Err(ApiError::busy(format!(
                            "every slot is busy and the queue of {} is full; retry later",
                            self.cfg.queue
                        )))
                    }
                    TrySendError::Disconnected(_) => {
                        Err(ApiError::unavailable("the model worker has stopped"))
                    }
                }
            }
        }
    }

    /// The loaded model's handles, or 503 while loading.
    pub fn need_ready(&self) -> Result<&Ready, ApiError> {
        self.ready()
            .ok_or_else(|| ApiError::unavailable("the model is loading"))
    }

    /// Accepts `Authorization: Bearer KEY` or `x-api-key: KEY` when keys are configured.
    pub fn check_key(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.cfg.api_keys.is_empty() {
            return Ok(());
        }
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let xkey = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        let ok = [bearer, xkey]
            .into_iter()
            .flatten()
            .any(|k| self.cfg.api_keys.iter().any(|a| a == k));
        if ok {
            Ok(())
        } else if bearer.is_none() && xkey.is_none() {
            Err(ApiError::auth(
                "no API key given (Authorization: Bearer KEY or x-api-key: KEY)",
            ))
        } else {
            Err(ApiError::auth("invalid API key"))
        }
    }
}

pub type AppState = Arc<Shared>;

/// A running server: bound, its worker loading or serving.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: std::thread::JoinHandle<Result<()>>,
    worker: std::thread::JoinHandle<()>,
}

impl Server {
    /// Binds `cfg.host:cfg.port` (port 0: any free port), starts loading the model on the
    /// worker thread and serving on a runtime thread; returns at once.
    pub fn start<Q2: Backend + 'static, Q4: Qwen4expOps + 'static>(
        cfg: ServerConfig,
        loader: Loader<Q2, Q4>,
    ) -> Result<Server> {
        let listener = std::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
            .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue);
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            ready: OnceLock::new(),
            failed: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            notify: Notify::new(),
            metrics: metrics::Metrics::default(),
            web: web::WebState::default(),
            jobs: tx,
            started: Instant::now(),
            budget: OnceLock::new(),
        });
        let ws = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("strata-worker".into())
            .spawn(move || load_and_run(loader, rx, ws))?;
        let rs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("strata-http".into())
            .spawn(move || -> Result<()> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .context("starting the async runtime")?;
                rt.block_on(run_http(listener, rs))
            })?;
        Ok(Server {
            addr,
            shared,
            thread,
            worker,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Waits until the model is loaded (or failed to load).
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if self.shared.ready().is_some() {
                return Ok(());
            }
            if let Some(e) = self.shared.failure() {
                anyhow::bail!("{e}");
            }
            if t0.elapsed() > timeout {
                anyhow::bail!("the model did not load within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops serving: in-flight generations end with an error event.
    pub fn shutdown(self) -> Result<()> {
        self.shared.begin_shutdown();
        self.wait()
    }

    /// Runs until the server stops (a signal, or a model that failed to load).
    pub fn wait(self) -> Result<()> {
        let http = self
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?;
        let _ = self.worker.join();
        if let Some(e) = self.shared.failure() {
            anyhow::bail!("{e}");
        }
        http
    }
}

/// Serves until SIGINT/SIGTERM.
pub fn serve<Q2: Backend + 'static, Q4: Qwen4expOps + 'static>(
    cfg: ServerConfig,
    loader: Loader<Q2, Q4>,
) -> Result<()> {
    let cfg = ServerConfig {
        handle_signals: true,
        ..cfg
    };
    let s = Server::start(cfg, loader)?;
    tracing::info!("listening on http://{}", s.addr());
    eprintln!(
        "strata serve: listening on http://{} (loading the model)",
        s.addr()
    );
    s.wait()
}

fn load_and_run<Q2: Backend, Q4: Qwen4expOps>(
    loader: Loader<Q2, Q4>,
    rx: std::sync::mpsc::Receiver<worker::Job>,
    shared: Arc<Shared>,
) {
    let t0 = Instant::now();
    let (model, tok) = match loader() {
        Ok(x) => x,
        Err(e) => {
            tracing::error!("loading the model: {e:#}");
            shared.fail(format!("{e:#}"));
            return;
        }
    };
    let template = match make_template(&shared.cfg, &tok) {
        Ok(t) => t,
        Err(e) => {
            shared.fail(format!("{e:#}"));
            return;
        }
    };
    // `--ctx` is checked against what the model can hold: its trained context (qwen2) or its
    // caches' capacity (qwen4exp, sized at load).
    let limit = model.trained_ctx().unwrap_or(model.capacity());
    let n_ctx = match shared.cfg.n_ctx {
        Some(n) if n > limit => {
            let msg =
                format!("--ctx {n}: out of range; the model's context holds {limit} positions");
            tracing::error!("{msg}");
            shared.fail(msg);
            return;
        }
        Some(n) => n,
        None => model.trained_ctx().map_or(4096, |t| t.min(8192)).min(limit),
    };
    let has_mtp = model.has_mtp();
    let spec_window = match shared.cfg.spec {
        Some(n) if n > 1 && !has_mtp => {
            let msg = format!(
                "--spec {n}: speculative decoding needs an MTP head; the model has none (give \
                 one with --mtp MTP.gguf)"
            );
            tracing::error!("{msg}");
            shared.fail(msg);
            return;
        }
        Some(n) => n,
        None if has_mtp => 4,
        None => 1,
    };
    let (file, backend) = match &model {
        ModelHandle::Qwen2(m) => (m.file(), strata_engine::backend::Backend::name(m.backend())),
        ModelHandle::Qwen4exp(m) => (m.file(), strata_engine::backend::Backend::name(m.backend())),
    };
    let (arch, n_vocab) = (model.arch(), model.n_vocab());
    let info = web::ModelInfo::new(file, arch, n_vocab, backend, has_mtp, &shared, n_ctx);
    shared.web.set_model(info);
    shared.web.set_vram(match &model {
        ModelHandle::Qwen2(m) => m.backend().device_memory_used(),
        ModelHandle::Qwen4exp(m) => m.backend().device_memory_used(),
    });
    let tok = Arc::new(tok);
    let _ = shared.ready.set(Ready {
        tok: Arc::clone(&tok),
        template,
        n_ctx,
        arch: model.arch(),
        n_vocab: model.n_vocab(),
        has_mtp,
        spec_window,
        preserved: Arc::new(output::preserved_ids(&tok)),
        constrainer: OnceLock::new(),
    });
    let secs = t0.elapsed().as_secs_f64();
    tracing::info!(
        arch = model.arch(),
        n_ctx,
        spec_window,
        secs,
        "model loaded"
    );
    eprintln!(
        "strata serve: model loaded ({}, context {n_ctx}, {} slots{}) in {secs:.1} s",
        model.arch(),
        shared.cfg.parallel,
        if spec_window > 1 {
            format!(", MTP speculation with windows of {spec_window}")
        } else {
            String::new()
        }
    );
    // What one sequence's state costs, and how many fit at the context (printed, enforced).
    let (weights, on_device) = match &model {
        ModelHandle::Qwen2(m) => (m.file().file_size(), m.backend().device_memory_used()),
        ModelHandle::Qwen4exp(m) => (m.file().file_size(), m.backend().device_memory_used()),
    };
    let size = memory::StateSize::of(&model);
    let limit = match (shared.cfg.state_memory, on_device) {
        (Some(l), _) => Some(l),
        // A device backend's states are device memory, reserved when the slots are made.
        (None, Some(_)) => Some(u64::MAX),
        (None, None) => None,
    };
    let budget = memory::Budget::new(size, n_ctx, limit, weights);
    let _ = shared.budget.set(budget);
    let line = budget.describe(shared.cfg.parallel);
    tracing::info!("{line}");
    eprintln!("strata serve: {line}");
    let cfg = worker::WorkerConfig {
        parallel: shared.cfg.parallel,
        n_ctx,
        cache_ram: shared.cfg.cache_ram,
        draft_oracle: shared.cfg.draft_oracle.clone(),
        batch_tokens: shared.cfg.batch_tokens.max(1),
        memory: budget,
    };
    worker::run(model, tok, cfg, rx, shared);
}

fn make_template(cfg: &ServerConfig, tok: &Tokenizer) -> Result<ChatTemplate> {
    let text = |id: Option<u32>| {
        id.and_then(|i| tok.token_text(i).ok())
            .unwrap_or("")
            .to_string()
    };
    if let Some(src) = &cfg.chat_template {
        return ChatTemplate::new(src, &text(tok.bos()), &text(tok.eos()))
            .context("compiling --chat-template");
    }
    match ChatTemplate::from_tokenizer(tok).context("compiling the file's chat template")? {
        Some(t) => Ok(t),
        None => {
            tracing::warn!("the model file has no chat template; using ChatML");
            Ok(ChatTemplate::new(
                CHATML,
                &text(tok.bos()),
                &text(tok.eos()),
            )?)
        }
    }
}

async fn run_http(listener: std::net::TcpListener, shared: Arc<Shared>) -> Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    if shared.cfg.handle_signals {
        let s = Arc::clone(&shared);
        tokio::spawn(async move {
            wait_signal().await;
            eprintln!("strata serve: stopping");
            s.begin_shutdown();
        });
    }
    tokio::spawn(web::sample_history(Arc::clone(&shared)));
    let app = router(Arc::clone(&shared));
    let s = Arc::clone(&shared);
    let stop = async move {
        while !s.shutting_down() {
            let _ = tokio::time::timeout(Duration::from_millis(200), s.notify.notified()).await;
        }
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(stop);
    // Streams end once the worker has sent their error events; give them a moment, no more.
    let s = Arc::clone(&shared);
    let deadline = async move {
        while !s.shutting_down() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        r = server => r.context("serving HTTP")?,
        _ = deadline => tracing::warn!("connections still open 5 s after shutdown; closing"),
    }
    Ok(())
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics_handler))
        .route("/v1/models", get(openai::models))
        .route("/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/completions", post(openai::completions))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .merge(web::routes())
        .fallback(not_found)
        .layer(axum::middleware::from_fn(log_request))
        // Long agent conversations exceed axum's 2 MiB default; 64 MiB is ~16M tokens of text.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(shared)
}

/// The log line of a request the generation path does not log itself: every refusal (4xx, 5xx
/// before any output) at info, other endpoints at debug. Generations log their own line, with
/// token counts, when they end (run.rs's callers).
async fn log_request(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let t0 = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let ms = t0.elapsed().as_millis() as u64;
    let generating = matches!(
        path.as_str(),
        "/v1/chat/completions"
            | "/chat/completions"
            | "/v1/completions"
            | "/completions"
            | "/v1/messages"
    );
    if status >= 400 {
        tracing::info!(target: "strata::request", %method, path, status, ms, "request refused");
    } else if !generating {
        tracing::debug!(target: "strata::request", %method, path, status, ms, "request done");
    }
    resp
}

async fn health(State(s): State<AppState>) -> Response {
    match s.ready() {
        Some(_) if !s.shutting_down() => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"status": "ok"})),
        )
            .into_response(),
        _ => ApiError::unavailable("Loading model").openai(),
    }
}

async fn metrics_handler(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = s.check_key(&headers) {
        return e.openai();
    }
    let n_ctx = s.ready().map_or(0, |r| r.n_ctx);
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(n_ctx),
    )
        .into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no such endpoint: {}", uri.path()),
    )
    .openai()
}

/// Logs to stderr: one line per request (target `strata::request`) and the server's events;
/// `STRATA_LOG` sets the filter (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
