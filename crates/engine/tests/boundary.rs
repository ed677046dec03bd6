//! The backend boundary's promises, checked on the CPU (issue "Boundary", DESIGN.md §2.1):
//! - a step is capturable: inside `Backend::step` nothing is read back to the host and only the
//!   step's id inputs are uploaded (first thing, as part of its trace), and the operations a step runs (and the shapes of the buffers they return) depend only on
//!   the step's key — the same key at other positions, with other tokens, crossing a QSA block
//!   boundary or not, gives the same trace, so a GPU backend may capture it once and replay it;
//! - caches are fixed-capacity stores: a step past the capacity is refused before it runs;
//! - the catalogue kernels are the live implementation: `route` runs through the registry, so a
//!   variant selection switches what the model executes, with identical output.
//!
//! The recording backend below wraps the CPU backend and forwards every operation to it.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::tiny_dir;
use strata_convert::{convert_mtp, ConvertOptions, OutType};
use strata_engine::backend::{AttnDims, DevicePick, ExpertWeights, StepKey};
use strata_engine::cpu::{CpuIds, CpuRoutes, CpuSelection};
use strata_engine::kernels::registry;
use strata_engine::qwen4exp::ops::{GdnParams, HcWeights, QsaSelect};
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::sampler::{
    self, Pick as SamplerPick, SampleContext, Sampler, SamplerConfig, Stage,
};
use strata_engine::speculative::{DraftHook, SpecConfig, SpecDecoder};
use strata_engine::{
    Backend, CpuBackend, CpuBuf, CpuWeight, DeviceBuf, EngineError, KvType, Qwen4expOps, Usage,
};
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::GgmlType;

/// One operation of a step: its name and the shape of what it produced (or was given).
type Trace = Vec<(&'static str, usize, usize)>;

#[derive(Default)]
struct Log {
    in_step: bool,
    current: Trace,
    /// Every step's trace, in order, with its key.
    steps: Vec<(StepKey, Trace)>,
    /// Host transfers attempted inside a step.
    violations: Vec<&'static str>,
    /// Downloads anywhere (inside a step or not): of float buffers (logits, hidden rows), and
    /// of id vectors (picked tokens) with the ids they carried.
    float_downloads: usize,
    id_downloads: usize,
    ids_downloaded: usize,
}

struct Recording {
    cpu: CpuBackend,
    log: Mutex<Log>,
    /// Runs a batch of sequences as one step (`Backend::batches_sequences`).
    batch: bool,
}

impl Recording {
    fn new() -> Self {
        Recording {
            cpu: CpuBackend::new(1).unwrap(),
            log: Mutex::new(Log::default()),
            batch: false,
        }
    }

    fn op(&self, name: &'static str, rows: usize, cols: usize) {
        let mut l = self.log.lock().unwrap();
        if l.in_step {
            l.current.push((name, rows, cols));
        }
    }

    fn buf(&self, name: &'static str, b: &CpuBuf) {
        self.op(name, b.rows(), b.cols());
    }

    fn host(&self, name: &'static str) {
        let mut l = self.log.lock().unwrap();
        if l.in_step {
            l.violations.push(name);
        }
    }

    fn take(&self) -> Log {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

type R<T> = strata_engine::Result<T>;

impl Backend for Recording {
    type Buf = CpuBuf;
    type Weight = CpuWeight;
    type Ids = CpuIds;
    type Routes = CpuRoutes;
    type Images = ();

    fn name(&self) -> &'static str {
        "recording-cpu"
    }
    fn supports(&self, ty: GgmlType, usage: Usage) -> bool {
        self.cpu.supports(ty, usage)
    }
    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> R<CpuWeight> {
        self.cpu.load_weight(file, info)
    }
    fn zeros(&self, rows: usize, cols: usize) -> R<CpuBuf> {
        self.op("zeros", rows, cols);
        self.cpu.zeros(rows, cols)
    }
    fn store(&self, cap: usize, cols: usize) -> R<CpuBuf> {
        self.host("store");
        self.cpu.store(cap, cols)
    }
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> R<CpuBuf> {
        self.host("upload");
        self.cpu.upload(rows, cols, data)
    }
    fn upload_ids(&self, ids: &[u32]) -> R<CpuIds> {
        // The step's inputs are uploaded inside it (a replaying backend writes them into its
        // staging): part of the trace, whose length per key must repeat.
        self.op("upload_ids", ids.len(), 1);
        self.cpu.upload_ids(ids)
    }
    fn ids_range(&self, ids: &CpuIds, start: usize, len: usize) -> R<CpuIds> {
        self.op("ids_range", start, len);
        self.cpu.ids_range(ids, start, len)
    }
    fn download(&self, x: &CpuBuf) -> R<Vec<f32>> {
        self.host("download");
        self.log.lock().unwrap().float_downloads += 1;
        self.cpu.download(x)
    }
    fn download_ids(&self, ids: &CpuIds) -> R<Vec<u32>> {
        self.host("download_ids");
        {
            let mut l = self.log.lock().unwrap();
            l.id_downloads += 1;
            l.ids_downloaded += ids.0.len();
        }
        self.cpu.download_ids(ids)
    }
    // The CPU's own picks (the catalogue kernels on its buffers): what a device backend's
    // kernels do, so the log shows what crosses the boundary.
    fn pick_rows(&self, logits: &CpuBuf, pick: DevicePick, first_position: u64) -> R<CpuIds> {
        self.buf("pick_rows", logits);
        self.cpu.pick_rows(logits, pick, first_position)
    }
    fn pick_draft(&self, logits: &CpuBuf) -> R<CpuIds> {
        self.buf("pick_draft", logits);
        self.cpu.pick_draft(logits)
    }
    fn copy(&self, x: &CpuBuf) -> R<CpuBuf> {
        self.buf("copy", x);
        self.cpu.copy(x)
    }
    fn copy_into(&self, dst: &mut CpuBuf, src: &CpuBuf) -> R<()> {
        self.buf("copy_into", src);
        self.cpu.copy_into(dst, src)
    }
    fn reshape(&self, x: CpuBuf, rows: usize, cols: usize) -> R<CpuBuf> {
        self.op("reshape", rows, cols);
        self.cpu.reshape(x, rows, cols)
    }
    fn truncate_rows(&self, dst: &mut CpuBuf, rows: usize) -> R<()> {
        self.op("truncate_rows", rows, dst.cols());
        self.cpu.truncate_rows(dst, rows)
    }
    fn slice_cols(&self, x: &CpuBuf, start: usize, len: usize) -> R<CpuBuf> {
        self.op("slice_cols", start, len);
        self.cpu.slice_cols(x, start, len)
    }
    fn deinterleave(&self, x: &CpuBuf, chunk: usize, parts: usize) -> R<Vec<CpuBuf>> {
        self.op("deinterleave", chunk, parts);
        self.cpu.deinterleave(x, chunk, parts)
    }
    fn write_rows(&self, store: &mut CpuBuf, x: &CpuBuf, at: &CpuIds) -> R<()> {
        self.buf("write_rows", x);
        self.cpu.write_rows(store, x, at)
    }
    fn write_kv(&self, cache: &mut CpuBuf, x: &CpuBuf, at: &CpuIds, kv: KvType) -> R<()> {
        self.buf("write_kv", x);
        self.cpu.write_kv(cache, x, at, kv)
    }
    fn batches_sequences(&self) -> bool {
        self.batch
    }
    fn step<T: Send>(&self, key: StepKey, f: impl FnOnce() -> R<T> + Send) -> R<T> {
        {
            let mut l = self.log.lock().unwrap();
            assert!(!l.in_step, "steps do not nest");
            l.in_step = true;
            l.current.clear();
        }
        let out = self.cpu.step(key, f);
        let mut l = self.log.lock().unwrap();
        l.in_step = false;
        let trace = std::mem::take(&mut l.current);
        l.steps.push((key, trace));
        out
    }
    fn add_assign(&self, x: &mut CpuBuf, y: &CpuBuf) -> R<()> {
        self.buf("add_assign", y);
        self.cpu.add_assign(x, y)
    }
    fn embed_rows(&self, table: &CpuWeight, ids: &CpuIds, copies: usize) -> R<CpuBuf> {
        let y = self.cpu.embed_rows(table, ids, copies)?;
        self.buf("embed_rows", &y);
        Ok(y)
    }
    fn matmul(&self, w: &CpuWeight, x: &CpuBuf) -> R<CpuBuf> {
        let y = self.cpu.matmul(w, x)?;
        self.buf("matmul", &y);
        Ok(y)
    }
    fn matmuls<const N: usize>(&self, ws: [&CpuWeight; N], x: &CpuBuf) -> R<[CpuBuf; N]> {
        let ys = self.cpu.matmuls(ws, x)?;
        for y in &ys {
            self.buf("matmuls", y);
        }
        Ok(ys)
    }
    fn matmul_rows(&self, w: &CpuWeight, rows: &CpuIds, x: &CpuBuf) -> R<CpuBuf> {
        let y = self.cpu.matmul_rows(w, rows, x)?;
        self.buf("matmul_rows", &y);
        Ok(y)
    }
    fn rms_norm(&self, x: &CpuBuf, w: &CpuWeight, group: usize, eps: f32) -> R<CpuBuf> {
        self.buf("rms_norm", x);
        self.cpu.rms_norm(x, w, group, eps)
    }
    fn rope_neox(
        &self,
        x: &mut CpuBuf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &CpuIds,
    ) -> R<()> {
        self.buf("rope_neox", x);
        self.cpu.rope_neox(x, head_dim, rot, theta, positions)
    }
    fn mul_sigmoid(&self, x: &CpuBuf, gate: &CpuBuf) -> R<CpuBuf> {
        self.buf("mul_sigmoid", x);
        self.cpu.mul_sigmoid(x, gate)
    }
    fn route(&self, logits: &CpuBuf, k: usize) -> R<CpuRoutes> {
        self.op("route", logits.rows(), k);
        self.cpu.route(logits, k)
    }
    fn moe_experts(
        &self,
        experts: &ExpertWeights<'_, CpuWeight>,
        x: &CpuBuf,
        routes: &CpuRoutes,
    ) -> R<CpuBuf> {
        self.buf("moe_experts", x);
        self.cpu.moe_experts(experts, x, routes)
    }
    fn swiglu(&self, g: &CpuBuf, u: &CpuBuf) -> R<CpuBuf> {
        self.buf("swiglu", g);
        self.cpu.swiglu(g, u)
    }
    fn add_sigmoid_gated(&self, y: &mut CpuBuf, x: &CpuBuf, gate: &CpuBuf) -> R<()> {
        self.buf("add_sigmoid_gated", x);
        self.cpu.add_sigmoid_gated(y, x, gate)
    }
    fn add_bias(&self, x: &mut CpuBuf, b: &CpuWeight) -> R<()> {
        self.buf("add_bias", x);
        self.cpu.add_bias(x, b)
    }
    fn attend_causal(
        &self,
        q: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        positions: &CpuIds,
        dims: AttnDims,
        kv: KvType,
    ) -> R<CpuBuf> {
        self.buf("attend_causal", q);
        self.cpu
            .attend_causal(q, k_cache, v_cache, positions, dims, kv)
    }
}

impl Qwen4expOps for Recording {
    type Selection = CpuSelection;

    fn hc_mix(&self, hc: &HcWeights<'_, CpuWeight>, x: &CpuBuf) -> R<(CpuBuf, Option<CpuBuf>)> {
        self.buf("hc_mix", x);
        self.cpu.hc_mix(hc, x)
    }
    fn hc_combine(&self, x: &mut CpuBuf, y: &CpuBuf, inj: Option<&CpuBuf>) -> R<()> {
        self.buf("hc_combine", y);
        self.cpu.hc_combine(x, y, inj)
    }
    fn conv1d_silu(
        &self,
        x: &CpuBuf,
        w: &CpuWeight,
        history: &mut CpuBuf,
        dilation: usize,
    ) -> R<CpuBuf> {
        self.buf("conv1d_silu", x);
        self.cpu.conv1d_silu(x, w, history, dilation)
    }
    fn gdn_step(
        &self,
        p: &GdnParams<'_, CpuWeight>,
        qkv: &CpuBuf,
        z: &CpuBuf,
        a: &CpuBuf,
        b: &CpuBuf,
        state: &mut CpuBuf,
    ) -> R<CpuBuf> {
        self.buf("gdn_step", qkv);
        self.cpu.gdn_step(p, qkv, z, a, b, state)
    }
    fn qsa_pool_blocks(&self, kraw: &CpuBuf, positions: &CpuIds, ratio: usize) -> R<CpuBuf> {
        self.op("qsa_pool_blocks", positions.0.len(), ratio);
        self.cpu.qsa_pool_blocks(kraw, positions, ratio)
    }
    fn qsa_select(
        &self,
        qi: &CpuBuf,
        blocks: &CpuBuf,
        positions: &CpuIds,
        sel: QsaSelect,
    ) -> R<CpuSelection> {
        self.buf("qsa_select", qi);
        self.cpu.qsa_select(qi, blocks, positions, sel)
    }
    fn select_causal(&self, positions: &CpuIds) -> R<CpuSelection> {
        self.op("select_causal", positions.0.len(), 0);
        self.cpu.select_causal(positions)
    }
    fn attend(
        &self,
        q: &CpuBuf,
        k_cache: &CpuBuf,
        v_cache: &CpuBuf,
        sel: &CpuSelection,
        dims: AttnDims,
        kv: KvType,
    ) -> R<CpuBuf> {
        self.buf("attend", q);
        self.cpu.attend(q, k_cache, v_cache, sel, dims, kv)
    }
    fn ple_gate(&self, k: &CpuBuf, q: &CpuBuf, v: &CpuBuf, streams: usize) -> R<CpuBuf> {
        self.buf("ple_gate", k);
        self.cpu.ple_gate(k, q, v, streams)
    }
}

fn load<B: Qwen4expOps>(backend: B, opts: &LoadOptions) -> Model<B> {
    let path = tiny_dir().join("model-f32.gguf");
    Model::load(&path, backend, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Decode steps at many positions (some complete a QSA block, most do not) and verify windows
/// of several sizes: every step with the same key runs the same operations on the same shapes,
/// and none reads back or uploads inside the step.
#[test]
fn steps_are_capturable_their_trace_depends_only_on_the_key() {
    let model = load(Recording::new(), &LoadOptions::default());
    let ratios: Vec<usize> = model
        .config()
        .layers
        .iter()
        .filter_map(|k| match k {
            strata_engine::qwen4exp::LayerKind::Attention { ratio } => *ratio,
            _ => None,
        })
        .collect();
    assert!(
        !ratios.is_empty(),
        "the tiny fixture has QSA layers, so block completion is exercised"
    );
    let mut st = model.new_state().unwrap();
    let want = Want {
        last_only: true,
        ..Want::default()
    };
    // A prompt of 5, then single steps over positions 5..21 (crossing several block ends),
    // then windows of 3 and 4 rows twice each at different positions.
    model.forward_with(&mut st, &[1, 2, 3, 4, 5], want).unwrap();
    for t in 0..16u32 {
        model.forward_with(&mut st, &[7 + t], want).unwrap();
    }
    for w in [3usize, 4, 3, 4] {
        let toks: Vec<u32> = (0..w as u32).map(|i| 11 + i).collect();
        model.forward_with(&mut st, &toks, Want::default()).unwrap();
    }
    let log = model.backend().take();
    assert!(
        log.violations.is_empty(),
        "host transfers inside a step: {:?}",
        log.violations
    );
    let mut by_key: HashMap<StepKey, &Trace> = HashMap::new();
    let mut replays = 0;
    for (key, trace) in &log.steps {
        assert!(!trace.is_empty(), "a step ran no operations");
        match by_key.get(key) {
            Some(first) => {
                assert_eq!(
                    *first, trace,
                    "two steps with key {key:?} ran different operations"
                );
                replays += 1;
            }
            None => {
                by_key.insert(*key, trace);
            }
        }
    }
    // 16 decode steps share one key (15 replays), the two windows of 3 and of 4 one each.
    assert_eq!(replays, 15 + 1 + 1, "keys: {:?}", by_key.keys());
}

/// A batch of sequences (`forward_batch`, docs/BATCHING.md) is one step that moves nothing
/// across the boundary inside it: three sequences at different positions (one of them
/// prefilling a chunk the first time) stepped together eight times, then in the same shape at
/// other positions; every step with the same key runs the same operations, and a backend that
/// does not batch gets one step per sequence with the same logits.
#[test]
fn a_batch_of_sequences_is_one_capturable_step() {
    let mut rec = Recording::new();
    rec.batch = true;
    let model = load(rec, &LoadOptions::default());
    let mut sts: Vec<_> = (0..3).map(|_| model.new_state().unwrap()).collect();
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 5, 6, 7, 8, 9, 10], &[11]];
    let step = |sts: &mut Vec<strata_engine::State<Recording>>, toks: &[Vec<u32>]| {
        let mut items: Vec<_> = sts
            .iter_mut()
            .zip(toks)
            .map(|(state, t)| strata_engine::qwen4exp::BatchItem {
                state,
                tokens: t,
                last_only: t.len() > 1,
            })
            .collect();
        model.forward_batch(&mut items).unwrap()
    };
    let first: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut logits = vec![step(&mut sts, &first)];
    for i in 0..8u32 {
        let toks: Vec<Vec<u32>> = (0..3).map(|s| vec![20 + i + s]).collect();
        logits.push(step(&mut sts, &toks));
    }
    let log = model.backend().take();
    assert!(
        log.violations.is_empty(),
        "host transfers inside a batched step: {:?}",
        log.violations
    );
    assert_eq!(log.steps.len(), 9, "one step per batch");
    let mut by_key: HashMap<StepKey, &Trace> = HashMap::new();
    let mut replays = 0;
    for (key, trace) in &log.steps {
        assert!(
            trace.iter().any(|o| o.0 == "write_rows"),
            "the parts were joined"
        );
        match by_key.get(key) {
            Some(first) => {
                assert_eq!(*first, trace, "two batched steps with key {key:?} differ");
                replays += 1;
            }
            None => {
                by_key.insert(*key, trace);
            }
        }
    }
    assert_eq!(replays, 7, "the eight decode batches share one key");
    // The same sequences stepped apart (a backend that does not batch): the same bits.
    let apart = load(Recording::new(), &LoadOptions::default());
    let mut sts: Vec<_> = (0..3).map(|_| apart.new_state().unwrap()).collect();
    let mut items: Vec<_> = sts
        .iter_mut()
        .zip(&first)
        .map(|(state, t)| strata_engine::qwen4exp::BatchItem {
            state,
            tokens: t,
            last_only: t.len() > 1,
        })
        .collect();
    let solo = apart.forward_batch(&mut items).unwrap();
    drop(items);
    assert_eq!(
        apart.backend().take().steps.len(),
        3,
        "one step per sequence"
    );
    for (a, b) in solo.iter().zip(&logits[0]) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.logits), bits(&b.logits));
    }
}

/// The caches are fixed-capacity stores: a step that would run past `--ctx` is refused before
/// anything runs, with the capacity in the message, and the state is still usable.
#[test]
fn a_step_past_the_capacity_is_refused_before_it_runs() {
    let model = load(
        CpuBackend::new(1).unwrap(),
        &LoadOptions {
            ctx: Some(8),
            ..LoadOptions::default()
        },
    );
    let mut st = model.new_state().unwrap();
    model.forward(&mut st, &[1, 2, 3, 4, 5, 6]).unwrap();
    let err = model.forward(&mut st, &[7, 8, 9]).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::ContextFull {
                capacity: 8,
                needed: 9,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--ctx"), "{err}");
    assert_eq!(
        st.position(),
        6,
        "a refused step leaves the state as it was"
    );
    model.forward(&mut st, &[7, 8]).unwrap();
    assert_eq!(st.position(), 8);
}

/// Drafts forced to the true token, or off by one at every third position.
struct Forced {
    truth: Vec<u32>,
}

impl DraftHook for Forced {
    fn draft(&mut self, position: usize, _proposed: u32) -> Option<u32> {
        let right = *self.truth.get(position)?;
        Some(if position.is_multiple_of(3) {
            (right + 1) % 320
        } else {
            right
        })
    }
}

fn with_head<B: Qwen4expOps>(mut m: Model<B>) -> Model<B> {
    let (w, _) = convert_mtp(
        &tiny_dir().join("hf"),
        &ConvertOptions {
            out_type: OutType::F32,
            include_shared: false,
        },
    )
    .unwrap();
    m.attach_mtp(Arc::new(
        GgufFile::from_bytes(w.to_bytes().unwrap(), "mtp.gguf").unwrap(),
    ))
    .unwrap();
    m
}

/// Picking behind the boundary (issue "Boundary", point 4): with a greedy or a seeded-draw
/// chain, a speculative verify window moves only token ids to the host — each draft's pick
/// and the window's picks, never a logits row — and the tokens are those of plain decoding
/// picked on the host from downloaded logits (the oracle: one forward call per token and the
/// sampler's own code).
#[test]
fn a_device_pick_window_moves_only_ids_and_emits_the_plain_tokens() {
    let model = with_head(load(Recording::new(), &LoadOptions::default()));
    // The golden prompt, on which the tiny head's drafts are often right.
    let prompt: Vec<u32> =
        common::Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 24;
    let seeded = || {
        Sampler::new(SamplerConfig {
            stages: vec![Stage::Temperature { t: 0.8 }],
            pick: SamplerPick::Draw { seed: 7 },
        })
        .unwrap()
    };
    for (name, window) in [
        ("greedy", 4usize),
        ("seeded", 4),
        ("greedy", 8),
        ("seeded", 2),
    ] {
        // The oracle: plain steps, logits downloaded, picked by the sampler on the host.
        let mut oracle = seeded();
        let mut host_pick = |logits: &[f32], pos: usize, hist: &[u32]| -> u32 {
            if name == "greedy" {
                sampler::argmax(logits).unwrap()
            } else {
                oracle
                    .sample(
                        logits,
                        &SampleContext {
                            position: pos as u64,
                            history: hist,
                        },
                    )
                    .unwrap()
            }
        };
        let mut st = model.new_state().unwrap();
        let nv = model.config().n_vocab;
        let all = model.forward(&mut st, &prompt).unwrap().logits;
        let mut logits = all[all.len() - nv..].to_vec();
        let mut want = Vec::new();
        while want.len() < NEW {
            let t = host_pick(&logits, st.position(), st.tokens());
            want.push(t);
            logits = model.forward(&mut st, &[t]).unwrap().logits;
        }

        let cfg = SpecConfig {
            window,
            ..SpecConfig::default()
        };
        // The tiny head's own drafts are seldom right: drafts are forced to the plain tokens
        // except at every third position, so windows accept prefixes and roll the rest back
        // (the device pick still runs: the hook sees its proposal).
        let mut truth = prompt.clone();
        truth.extend(&want);
        let mut dec = SpecDecoder::new(&model, cfg)
            .unwrap()
            .with_draft_hook(Forced { truth });
        if name == "seeded" {
            dec = dec.with_picker(seeded());
        }
        let mut got = vec![dec.prefill(&prompt).unwrap()];
        model.backend().take();
        let mut passes = 0;
        while got.len() < NEW {
            let out = dec
                .step(NEW - got.len(), &mut |t| {
                    got.push(t);
                    true
                })
                .unwrap();
            passes += 1;
            let log = model.backend().take();
            assert_eq!(
                log.float_downloads, 0,
                "{name} window {window}: a verify window downloaded floats"
            );
            assert!(
                log.id_downloads >= 1 && log.id_downloads <= window,
                "{name} window {window}: {} id downloads for one window",
                log.id_downloads
            );
            // The drafts' picks (one id each) and the window's (one per row).
            assert!(log.ids_downloaded <= out.offered + (out.offered + 1));
        }
        assert_eq!(got, want, "{name} window {window}: not the plain tokens");
        let s = dec.stats();
        let (acc, off) = (
            s.accepted.iter().sum::<u64>(),
            s.offered.iter().sum::<u64>(),
        );
        assert!(
            acc > 0 && acc < off,
            "{name} window {window}: {acc} of {off} drafts accepted"
        );
        assert!(
            passes < NEW,
            "{name} window {window}: no window held a draft"
        );
    }
}

/// `route` on the CPU is the catalogue's kernel, chosen through the registry when the backend
/// is created: selecting the baseline makes the model run it (the registry counts the calls),
/// with bit-identical logits. (One test in this binary touches the selection, so nothing else
/// races it; `tests/kernel_selection.rs` covers the other CPU catalogue ops.)
#[test]
fn kernel_selection_switches_the_live_route_with_identical_output() {
    let prompt: Vec<u32> = (1..20).collect();
    let run = || {
        let model = load(CpuBackend::new(1).unwrap(), &LoadOptions::default());
        let mut st = model.new_state().unwrap();
        model.forward(&mut st, &prompt).unwrap().logits
    };
    registry::select("route", registry::OPTIMIZED).unwrap();
    let before = registry::use_count("route", registry::OPTIMIZED);
    let optimized = run();
    assert!(registry::use_count("route", registry::OPTIMIZED) > before);

    registry::select("route", registry::BASELINE).unwrap();
    let before = registry::use_count("route", registry::BASELINE);
    let baseline = run();
    let after = registry::use_count("route", registry::BASELINE);
    registry::clear_selection();
    assert!(
        after > before,
        "the baseline route was not called by the model"
    );
    let same = optimized
        .iter()
        .zip(&baseline)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same && optimized.len() == baseline.len());
}

/// The CPU's device picks are the host sampler's choices: greedy rows through the catalogue's
/// `pick` equal `sampler::argmax` (ties to the lower id, −0.0 tying +0.0, a NaN refused), draws
/// equal `sampler::pick_row` keyed by each row's position, and draft picks are the catalogue
/// pick's indices (NaN never chosen).
#[test]
fn cpu_device_picks_equal_the_host_sampler() {
    let cpu = CpuBackend::new(1).unwrap();
    let rows: Vec<Vec<f32>> = vec![
        vec![0.5, 2.0, -1.0, 2.0, 1.0],
        vec![-0.0, 0.0, -3.0, -0.0, -1.0],
        vec![f32::NEG_INFINITY; 5],
        vec![1.0, -2.0, 3.5, 0.25, 3.5],
    ];
    let flat: Vec<f32> = rows.concat();
    let buf = cpu.upload(rows.len(), 5, &flat).unwrap();
    let got = cpu.pick_rows(&buf, DevicePick::Greedy, 10).unwrap().0;
    let want: Vec<u32> = rows.iter().map(|r| sampler::argmax(r).unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(got, vec![1, 0, 0, 2]);
    let draw = DevicePick::Draw {
        seed: 3,
        temperature: 0.7,
    };
    let finite: Vec<f32> = (0..4 * 5).map(|i| ((i * 7) % 11) as f32 * 0.3).collect();
    let buf = cpu.upload(4, 5, &finite).unwrap();
    let got = cpu.pick_rows(&buf, draw, 40).unwrap().0;
    for (r, row) in finite.chunks(5).enumerate() {
        assert_eq!(got[r], sampler::pick_row(draw, row, 40 + r as u64).unwrap());
    }
    let mut nan = flat.clone();
    nan[7] = f32::NAN;
    let buf = cpu.upload(rows.len(), 5, &nan).unwrap();
    let err = cpu.pick_rows(&buf, DevicePick::Greedy, 0).unwrap_err();
    assert!(err.to_string().contains("NaN"), "{err}");
    // Draft picks: NaN never chosen.
    let buf = cpu.upload(rows.len(), 5, &nan).unwrap();
    let got = cpu.pick_draft(&buf).unwrap().0;
    assert_eq!(got, vec![1, 0, 0, 2]);
}
