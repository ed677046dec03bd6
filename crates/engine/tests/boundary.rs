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
use strata_engine::backend::{
    AttnDims, DevicePick, DraftMap, DraftPick, DraftSlop, ExpertWeights, StepKey, StepKind,
};
use strata_engine::cpu::{CpuIds, CpuRoutes, CpuSelection};
use strata_engine::generate::{GenOptions, Qwen4expSession};
use strata_engine::kernels::registry;
use strata_engine::qwen4exp::ops::{GdnParams, HcWeights, QsaSelect};
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::sampler::guard::{self, GuardStop};
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::vocab::SamplerVocab;
use strata_engine::sampler::{
    self, Pick as SamplerPick, SampleContext, Sampler, SamplerConfig, Stage,
};
use strata_engine::speculative::guarded;
use strata_engine::speculative::{DraftHook, SpecConfig, SpecDecoder};
use strata_engine::speculative::{DraftVocab, CHAIN_STEP};
use strata_engine::{
    Backend, CpuBackend, CpuBuf, CpuWeight, DeviceBuf, EngineError, KvType, Qwen4expOps, Usage,
};
use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::GgmlType;
use strata_tokenizer::Tokenizer;

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
    /// Draft rows the device's slop operation edited.
    slop_pens: usize,
    /// Steps and downloads in order (the draft chain test reads what crossed between steps).
    events: Vec<Ev>,
}

/// A step (its key) or a download (of a float buffer, or of an id vector with its ids).
#[derive(Clone, Debug)]
enum Ev {
    Step(StepKey),
    Floats,
    Ids(Vec<u32>),
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
        {
            let mut l = self.log.lock().unwrap();
            l.float_downloads += 1;
            l.events.push(Ev::Floats);
        }
        self.cpu.download(x)
    }
    fn download_ids(&self, ids: &CpuIds) -> R<Vec<u32>> {
        self.host("download_ids");
        {
            let mut l = self.log.lock().unwrap();
            l.id_downloads += 1;
            l.ids_downloaded += ids.0.len();
            l.events.push(Ev::Ids(ids.0.clone()));
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
    fn pick_draft_mapped(
        &self,
        logits: &CpuBuf,
        map: Option<&DraftMap<CpuIds>>,
    ) -> R<DraftPick<CpuIds>> {
        self.buf("pick_draft_mapped", logits);
        self.cpu.pick_draft_mapped(logits, map)
    }
    fn slop_pen_draft(
        &self,
        logits: &mut CpuBuf,
        slop: &DraftSlop<CpuIds, CpuBuf>,
        prev: Option<&CpuIds>,
        state: &CpuIds,
    ) -> R<CpuIds> {
        self.buf("slop_pen_draft", logits);
        self.log.lock().unwrap().slop_pens += 1;
        self.cpu.slop_pen_draft(logits, slop, prev, state)
    }
    fn write_ids(&self, dst: &mut CpuIds, at: usize, src: &CpuIds) -> R<()> {
        self.op("write_ids", at, src.0.len());
        self.cpu.write_ids(dst, at, src)
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
            if l.in_step {
                // A step inside a step (a draft chain's head steps): part of the outer one,
                // as a capturing backend records it; the event says where it ran.
                assert_eq!(key.kind, StepKind::Draft, "only draft steps nest");
                l.current.push(("step", key.rows, key.outputs as usize));
                drop(l);
                let out = f();
                self.log.lock().unwrap().events.push(Ev::Step(key));
                return out;
            }
            l.in_step = true;
            l.current.clear();
        }
        let out = self.cpu.step(key, f);
        let mut l = self.log.lock().unwrap();
        l.in_step = false;
        let trace = std::mem::take(&mut l.current);
        l.steps.push((key, trace));
        l.events.push(Ev::Step(key));
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
            .map(|(state, t)| strata_engine::qwen4exp::BatchItem::rows(state, t, t.len() > 1))
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
        .map(|(state, t)| strata_engine::qwen4exp::BatchItem::rows(state, t, t.len() > 1))
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

/// A speculative verify window in a batch (docs/BATCHING.md): the window's rows, with its
/// replay log and hidden rows, run in the same ONE step as another sequence's decode row —
/// no step of their own, nothing crossing the boundary inside — and every batched step of the
/// same key runs the same operations. The tokens are the solo decoder's (same window, same
/// greedy picks).
#[test]
fn a_verify_window_in_a_batch_runs_in_its_one_step() {
    use strata_engine::decode::{ByPicker, Lent, Progress};
    use strata_engine::qwen4exp::BatchItem;
    use strata_engine::speculative::Greedy;
    const NEW: usize = 16;
    let mut rec = Recording::new();
    rec.batch = true;
    let model = with_head(load(rec, &LoadOptions::default()));
    let prompt: Vec<u32> =
        common::Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..12].to_vec();
    let cfg = || SpecConfig {
        window: 4,
        ..SpecConfig::default()
    };
    // The oracle: the decoder alone.
    let mut alone = SpecDecoder::new(&model, cfg()).unwrap();
    let want = strata_engine::speculative::run(&mut alone, &prompt, NEW, &mut |_| true).unwrap();

    let mut dec = SpecDecoder::new(&model, cfg()).unwrap();
    let mut plain = model.new_state().unwrap();
    model.forward(&mut plain, &prompt[..5]).unwrap();
    let mut greedy = Greedy;
    let mut pick = ByPicker(&mut greedy);
    let mut got = Vec::new();
    let mut p = Progress::new(&mut dec, None, 4, NEW, prompt.len());
    let mut sink = |t: u32| {
        got.push(t);
        true
    };
    let no_eog = |_: u32| false;
    let first = p.prefill(
        Lent {
            stepper: &mut dec,
            pick: &mut pick,
            is_eog: &no_eog,
            on_token: &mut sink,
        },
        &prompt,
        &GenOptions::default(),
    );
    assert!(first.unwrap().is_none());
    let mut by_key: HashMap<StepKey, Trace> = HashMap::new();
    let (mut windows, mut replays) = (0, 0);
    for i in 0.. {
        let window = p
            .begin_window(Lent {
                stepper: &mut dec,
                pick: &mut pick,
                is_eog: &no_eog,
                on_token: &mut |_| true,
            })
            .unwrap()
            .to_vec();
        let device = p.device_pick(&pick);
        model.backend().take();
        let token = [30 + i as u32];
        let mut outs = {
            let mut items = vec![
                BatchItem::rows(&mut plain, &token, false),
                dec.window_item(&window).unwrap(),
            ];
            model.forward_batch_dev(&mut items).unwrap()
        };
        let log = model.backend().take();
        assert!(
            log.violations.is_empty(),
            "host transfers inside a batched step: {:?}",
            log.violations
        );
        assert_eq!(log.steps.len(), 1, "the window ran in a step of its own");
        let (key, trace) = &log.steps[0];
        assert_eq!(
            (key.kind, key.rows),
            (StepKind::Forward, 1 + window.len()),
            "the batch's step holds the decode row and the window"
        );
        match by_key.get(key) {
            Some(t) => {
                assert_eq!(t, trace, "two batched steps with key {key:?} differ");
                replays += 1;
            }
            None => {
                by_key.insert(*key, trace.clone());
            }
        }
        windows += usize::from(window.len() > 1);
        let out = outs.pop().unwrap();
        assert_eq!(out.hidden.as_ref().map(|h| h.rows()), Some(window.len()));
        let rows = dec.window_ran(out, device).unwrap();
        let (_, end) = p
            .end_window(
                Lent {
                    stepper: &mut dec,
                    pick: &mut pick,
                    is_eog: &no_eog,
                    on_token: &mut sink,
                },
                rows,
            )
            .unwrap();
        if end.is_some() {
            break;
        }
    }
    assert_eq!(
        got, want,
        "the batched decoder's tokens differ from the solo decoder's"
    );
    assert!(windows > 0, "no window of several rows ran in the batch");
    assert!(replays > 0, "no two batched steps shared a key");
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

fn with_head<B: Qwen4expOps>(m: Model<B>) -> Model<B> {
    common::with_mtp_head(m, &tiny_dir().join("hf"), false)
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
            // The drafts' picks (the id and its logit's bits each) and the window's (one per
            // row).
            assert!(log.ids_downloaded <= 2 * out.offered + (out.offered + 1));
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

/// The draft chain behind the boundary (issue "Boundary", point 4; issue "CUDA MTP", point 1,
/// host side): per draft chain, what happened between the head's catch-up (a draft step with
/// host tokens) and the next verify pass: the chain's step (`CHAIN_STEP`), the head steps
/// inside it (their tokens on the device, key bit 2) and every download.
#[derive(Debug, Default)]
struct Chain {
    device_steps: usize,
    /// The chain steps (the whole chain as one step) and their rows (drafts).
    chain_steps: Vec<usize>,
    downloads: Vec<Ev>,
}

fn chains(events: &[Ev]) -> Vec<Chain> {
    let mut out = Vec::new();
    let mut cur: Option<Chain> = None;
    for e in events {
        match e {
            Ev::Step(k) if k.kind == StepKind::Draft && k.outputs & CHAIN_STEP != 0 => cur
                .as_mut()
                .expect("a chain after a catch-up")
                .chain_steps
                .push(k.rows),
            Ev::Step(k) if k.kind == StepKind::Draft && k.outputs & 4 == 0 => {
                cur = Some(Chain::default())
            }
            Ev::Step(k) if k.kind == StepKind::Draft => {
                cur.as_mut()
                    .expect("a chained draft step after a catch-up")
                    .device_steps += 1
            }
            Ev::Step(k) if k.kind == StepKind::Forward => out.extend(cur.take()),
            Ev::Step(_) => {}
            d => {
                if let Some(c) = cur.as_mut() {
                    c.downloads.push(d.clone())
                }
            }
        }
    }
    out
}

fn tokenizer_of(path: &std::path::Path) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
}

/// Greedy with slop mode 1 alone (so the drafts' edits are a device operation): the entries
/// penalize (and one bans) tokens of the model's own free output, and the run caps are low.
fn slop_mode_1(entries: &[(String, f32)]) -> SamplerConfig {
    SamplerConfig {
        stages: vec![Stage::Slop(SlopConfig {
            mode: 1,
            list: ListChoice::None,
            entries: entries
                .iter()
                .map(|(p, v)| SlopEntry {
                    phrase: p.clone(),
                    penalty: *v,
                })
                .collect(),
            newline_run_cap: 1,
            blank_run_cap: 2,
            ..SlopConfig::default()
        })],
        pick: SamplerPick::Greedy,
    }
}

/// Plain decoding under `cfg` (the oracle: one token per step, picked by the host sampler
/// with the sequence's slop state): tokens and stop.
fn plain_guarded<B: Qwen4expOps>(
    m: &Model<B>,
    tok: &Tokenizer,
    cfg: &SamplerConfig,
    prompt: &[u32],
    new: usize,
) -> (Vec<u32>, GuardStop) {
    let mut sampler = Sampler::with_vocab(cfg.clone(), tok).unwrap();
    let g = guard::generate(
        &mut Qwen4expSession::new(m).unwrap(),
        prompt,
        &mut sampler,
        // No end-of-generation token: the runs are long enough to hold many windows.
        &|_| false,
        &GenOptions {
            max_tokens: new,
            prefill_chunk: 512,
        },
        &mut |_| true,
    )
    .unwrap();
    (g.generation.tokens, g.stop)
}

/// Records the head's proposals and keeps them (the chain then reads each draft).
struct Proposals(Arc<Mutex<Vec<u32>>>);

impl DraftHook for Proposals {
    fn draft(&mut self, _position: usize, proposed: u32) -> Option<u32> {
        self.0.lock().unwrap().push(proposed);
        Some(proposed)
    }
}

/// How a speculative run's draft chain is driven.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ChainMode {
    /// On the device, nothing read between drafts.
    Device,
    /// Edited and picked on the device, each draft read by a hook.
    DeviceHooked,
    /// Logits downloaded and edited on the host (a draft floor too small to cut anything).
    Host,
    /// Read draft by draft with the sampler's edits of the drafts off (what they change).
    Unpenalized,
}

struct SpecRun {
    tokens: Vec<u32>,
    stop: GuardStop,
    /// The drafts in the order they were proposed.
    drafts: Vec<u32>,
    offered: u64,
    chains: Vec<Chain>,
    slop_pens: usize,
}

#[allow(clippy::too_many_arguments)]
fn spec_guarded(
    m: &Model<Recording>,
    tok: &Tokenizer,
    cfg: &SamplerConfig,
    prompt: &[u32],
    new: usize,
    window: usize,
    mode: ChainMode,
    draft_vocab: Option<DraftVocab>,
) -> SpecRun {
    let mut sampler = Sampler::with_vocab(cfg.clone(), tok).unwrap();
    let proposals = Arc::new(Mutex::new(Vec::new()));
    let spec = SpecConfig {
        window,
        min_p: if mode == ChainMode::Host { 1e-30 } else { 0.0 },
        draft_vocab,
    };
    let mut dec = SpecDecoder::new(m, spec)
        .unwrap()
        .with_draft_penalties(mode != ChainMode::Unpenalized);
    if mode != ChainMode::Device {
        dec = dec.with_draft_hook(Proposals(Arc::clone(&proposals)));
    }
    m.backend().take();
    let g = guarded::generate(
        &mut dec,
        prompt,
        &mut sampler,
        // No end-of-generation token: the runs are long enough to hold many windows.
        &|_| false,
        new,
        &mut |_| true,
    )
    .unwrap();
    let log = m.backend().take();
    // Capturable: nothing crossed inside a step, and every chain step of one key ran the same
    // operations on the same shapes (so a capturing backend replays one graph per N).
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    let mut traces: HashMap<StepKey, &Trace> = HashMap::new();
    for (k, t) in log
        .steps
        .iter()
        .filter(|(k, _)| k.outputs & CHAIN_STEP != 0)
    {
        assert_eq!(
            *traces.entry(*k).or_insert(t),
            t,
            "chain step {k:?}: another trace"
        );
    }
    let chains = chains(&log.events);
    let drafts = match mode {
        ChainMode::Device => chains
            .iter()
            .filter_map(|c| match c.downloads.first() {
                // The chain's ids, as long as its picked logits are above −∞.
                Some(Ev::Ids(ids)) => Some(
                    (0..c.device_steps + 1)
                        .take_while(|&j| strata_engine::backend::draft_alive(ids[8 + j]))
                        .map(|j| ids[j])
                        .collect::<Vec<u32>>(),
                ),
                _ => None,
            })
            .flatten()
            .collect(),
        _ => proposals.lock().unwrap().clone(),
    };
    SpecRun {
        tokens: g.tokens,
        stop: g.stop,
        drafts,
        offered: dec.stats().offered.iter().sum(),
        chains,
        slop_pens: log.slop_pens,
    }
}

/// Entries for [`slop_mode_1`] from the free greedy output: three of its tokens (trimmed text),
/// penalized by 4 and 8 and banned.
fn entries_from(tok: &Tokenizer, free: &[u32]) -> Vec<(String, f32)> {
    let mut out: Vec<(String, f32)> = Vec::new();
    for &t in free {
        let Ok(s) = String::from_utf8(tok.piece(t)) else {
            continue;
        };
        let s = s.trim().to_string();
        if s.is_empty() || out.iter().any(|(p, _)| *p == s) {
            continue;
        }
        let pen = [4.0, 8.0, f32::INFINITY][out.len()];
        out.push((s, pen));
        if out.len() == 3 {
            break;
        }
    }
    assert_eq!(out.len(), 3, "three tokens to penalize in {free:?}");
    out
}

/// The draft chain moves only ids (issue "Boundary", point 4; "CUDA MTP", point 1): greedy,
/// slop mode 1, seeded draws and seeded draws under slop mode 1, windows 2..8, with the head's
/// own drafts. Every chain
/// downloads exactly one id vector — after its last draft step, so nothing between drafts —
/// and no float buffer; its drafts' slop edits ran as the device operation; the emitted
/// tokens and the stop are plain decoding's (the oracle: the host sampler one token per step).
#[test]
fn a_device_draft_chain_downloads_its_ids_once_and_emits_the_plain_tokens() {
    let model = with_head(load(Recording::new(), &LoadOptions::default()));
    let tok = tokenizer_of(&tiny_dir().join("model-f32.gguf"));
    let prompt: Vec<u32> =
        common::Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 32;
    let greedy = SamplerConfig::greedy();
    let (free, _) = plain_guarded(&model, &tok, &greedy, &prompt, NEW);
    let slop = slop_mode_1(&entries_from(&tok, &free));
    // Seeded draws (a temperature, then Philox keyed by position), without and with slop.
    let seeded = |mut c: SamplerConfig| {
        c.stages.push(Stage::Temperature { t: 0.8 });
        c.pick = SamplerPick::Draw { seed: 7 };
        c
    };
    let (seeded_plain, seeded_slop) = (seeded(greedy.clone()), seeded(slop.clone()));
    for (name, cfg) in [
        ("greedy", &greedy),
        ("slop mode 1", &slop),
        ("seeded", &seeded_plain),
        ("seeded, slop mode 1", &seeded_slop),
    ] {
        let want = plain_guarded(&model, &tok, cfg, &prompt, NEW);
        if name == "slop mode 1" {
            assert_ne!(want.0, free, "{name}: the penalties changed nothing");
        }
        for window in 2usize..=8 {
            let what = format!("{name} window {window}");
            let run = spec_guarded(
                &model,
                &tok,
                cfg,
                &prompt,
                NEW,
                window,
                ChainMode::Device,
                None,
            );
            assert_eq!(
                (&run.tokens, &run.stop),
                (&want.0, &want.1),
                "{what}: not plain"
            );
            let with_drafts: Vec<&Chain> = run
                .chains
                .iter()
                .filter(|c| !c.downloads.is_empty())
                .collect();
            assert!(
                with_drafts.len() >= 3,
                "{what}: {} chains",
                with_drafts.len()
            );
            for c in &run.chains {
                assert!(
                    c.downloads.len() <= 1 && c.downloads.iter().all(|d| matches!(d, Ev::Ids(_))),
                    "{what}: a chain downloaded {:?}",
                    c.downloads
                );
                assert!(c.device_steps + 1 < window, "{what}: {c:?}");
                // The whole chain ran as one step of its drafts' rows, the head steps inside.
                if !c.downloads.is_empty() {
                    assert_eq!(c.chain_steps, vec![c.device_steps + 1], "{what}: {c:?}");
                }
            }
            let drafted: usize = with_drafts.iter().map(|c| c.device_steps + 1).sum();
            assert_eq!(drafted as u64, run.offered, "{what}: drafts offered");
            if window > 2 {
                assert!(
                    with_drafts.iter().any(|c| c.device_steps > 0),
                    "{what}: no chain fed a pick to the next draft step"
                );
            }
            let pens = if name.contains("slop") { drafted } else { 0 };
            assert_eq!(run.slop_pens, pens, "{what}: slop edits on the device");
        }
    }
}

/// Slop mode 1 on the device chain is the host's (issue "Boundary", point 4): on the tiny
/// fixture (full vocabulary) and, when present, the small one (a draft vocabulary of 400
/// ids), greedy windows 3 and 6: the drafts of the device chain (nothing read between them),
/// of the device chain read draft by draft, and of the host chain (logits downloaded, edited by
/// `Sampler::penalize_draft`) are the same tokens, and every run emits plain decoding's.
#[test]
fn slop_mode_1_drafts_on_the_device_equal_the_host_chain() {
    let mut cases = vec![(
        with_head(load(Recording::new(), &LoadOptions::default())),
        tiny_dir().join("model-f32.gguf"),
        None,
    )];
    if let Some(dir) = common::small_dir() {
        let path = dir.join("q8_0.gguf");
        let m = Model::load(&path, Recording::new(), &LoadOptions::default()).unwrap();
        let m = common::with_mtp_head(m, &dir.join("hf"), true);
        let n = m.config().n_vocab as u32;
        // Every id the prompt region and the low ids use, and every other one above.
        let ids: Vec<u32> = (0..n)
            .filter(|&t| t < 200 || t % 3 == 0)
            .take(400)
            .collect();
        cases.push((
            m,
            path,
            Some(DraftVocab::new(ids, n as usize, "test").unwrap()),
        ));
    }
    for (model, path, vocab) in cases {
        let tok = tokenizer_of(&path);
        let g = path.with_file_name("golden.safetensors");
        let prompt: Vec<u32> = common::Golden::open(g).ids("input_ids")[..24].to_vec();
        const NEW: usize = 28;
        let (free, _) = plain_guarded(&model, &tok, &SamplerConfig::greedy(), &prompt, NEW);
        // Penalize tokens the head drafts, too (its drafts are seldom the trunk's tokens): the
        // first three the unedited chain proposes.
        let probe = slop_mode_1(&entries_from(&tok, &free));
        let drafted = spec_guarded(
            &model,
            &tok,
            &probe,
            &prompt,
            NEW,
            4,
            ChainMode::Unpenalized,
            vocab.clone(),
        )
        .drafts;
        let mut entries = entries_from(&tok, &free);
        for (p, v) in entries_from(&tok, &drafted) {
            if !entries.iter().any(|(q, _)| *q == p) {
                entries.push((p, v));
            }
        }
        let cfg = slop_mode_1(&entries);
        let want = plain_guarded(&model, &tok, &cfg, &prompt, NEW);
        for window in [3usize, 6] {
            let what = format!("{} window {window}", path.display());
            let run = |mode| {
                spec_guarded(
                    &model,
                    &tok,
                    &cfg,
                    &prompt,
                    NEW,
                    window,
                    mode,
                    vocab.clone(),
                )
            };
            let device = run(ChainMode::Device);
            let hooked = run(ChainMode::DeviceHooked);
            let host = run(ChainMode::Host);
            for r in [&device, &hooked, &host] {
                assert_eq!(
                    (&r.tokens, &r.stop),
                    (&want.0, &want.1),
                    "{what}: not plain"
                );
            }
            assert!(
                device.drafts.len() >= 8,
                "{what}: {} drafts",
                device.drafts.len()
            );
            assert_eq!(
                device.drafts, host.drafts,
                "{what}: device chain vs host chain"
            );
            assert_eq!(
                hooked.drafts, host.drafts,
                "{what}: hooked chain vs host chain"
            );
            assert!(device.slop_pens > 0 && host.slop_pens == 0, "{what}");
            // The edits changed drafts, so the equality says something.
            let free = run(ChainMode::Unpenalized);
            assert_eq!(
                (&free.tokens, &free.stop),
                (&want.0, &want.1),
                "{what}: not plain"
            );
            assert_ne!(
                free.drafts, host.drafts,
                "{what}: the slop edits changed no draft"
            );
        }
    }
}

/// A small deterministic generator for the op tests below.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn logit(&mut self) -> f32 {
        (self.next() % 2000) as f32 / 100.0 - 10.0
    }
}

/// `slop_pen_draft` (issue "Boundary", point 4): the CPU's operation (the catalogue kernel
/// `kernels::slop`; its two variants agree bitwise by the kernel's own tests) gives bit for bit the draft logits and the state of the
/// trait's default (the sampler's host code) and of `Sampler::penalize_draft` on a host copy
/// with the sequence's slop state after the same tokens — the oracle the drafter used before.
/// The built-in list compiled against the tiny vocabulary, caps 1 and 2, a walk through
/// newline, blank, penalized and other tokens; the full vocabulary and a draft vocabulary of
/// every other id. The walk must remove tokens (caps) and lower others (penalties), or the
/// test could not fail.
#[test]
fn slop_pen_draft_is_the_samplers_host_code_bit_for_bit() {
    let tok = tokenizer_of(&tiny_dir().join("model-f32.gguf"));
    let n = tok.n_vocab();
    let cfg = SamplerConfig {
        stages: vec![Stage::Slop(SlopConfig {
            mode: 1,
            list: ListChoice::Default,
            entries: [(40u32, f32::INFINITY), (41, 2.5), (45, 0.75), (50, 3.0)]
                .iter()
                .map(|&(t, penalty)| SlopEntry {
                    phrase: String::from_utf8_lossy(&tok.piece(t)).trim().to_string(),
                    penalty,
                })
                .collect(),
            newline_run_cap: 1,
            blank_run_cap: 2,
            ..SlopConfig::default()
        })],
        pick: SamplerPick::Greedy,
    };
    let sampler = Sampler::with_vocab(cfg, &tok).unwrap();
    let compiled = Arc::clone(sampler.slop().unwrap());
    let (newline, blank) = compiled.classes();
    let pens: Vec<u32> = compiled.token_penalties().iter().map(|e| e.0).collect();
    assert!(!newline.is_empty() && !blank.is_empty() && !pens.is_empty());
    let mut rng = Lcg(99);
    let mut walk: Vec<u32> = Vec::new();
    for i in 0..60 {
        walk.push(match i % 6 {
            0 | 1 => newline[rng.next() as usize % newline.len()],
            2 => blank[rng.next() as usize % blank.len()],
            3 => pens[rng.next() as usize % pens.len()],
            _ => rng.next() % n as u32,
        });
    }
    let full: Vec<i32> = (0..n as i32).collect();
    let mut every_other = vec![-1i32; n];
    for (d, t) in (0..n).step_by(2).enumerate() {
        every_other[t] = d as i32;
    }
    let variant = "the selected variant";
    {
        let cpu = CpuBackend::new(1).unwrap();
        for inverse in [&full, &every_other] {
            let nv = inverse.iter().filter(|&&d| d >= 0).count();
            let ds = DraftSlop::new(&cpu, Arc::clone(&compiled), inverse.clone(), nv).unwrap();
            let prompt = [1u32, 2, 3];
            let mut history = prompt.to_vec();
            let mut seq = sampler.new_slop_state(prompt.len()).unwrap();
            let st0 = DraftSlop::<CpuIds, CpuBuf>::state_ids(seq.token_state());
            let (mut st_dev, mut st_host) =
                (cpu.upload_ids(&st0).unwrap(), cpu.upload_ids(&st0).unwrap());
            let (mut removed, mut lowered) = (0, 0);
            for (k, t) in std::iter::once(None)
                .chain(walk.iter().copied().map(Some))
                .enumerate()
            {
                let prev = t.map(|t| cpu.upload_ids(&[t]).unwrap());
                if let Some(t) = t {
                    assert_eq!(seq.accept(t), strata_engine::sampler::slop::Accepted::Kept);
                    history.push(t);
                }
                let raw: Vec<f32> = (0..nv).map(|_| rng.logit()).collect();
                let mut dev = cpu.upload(1, nv, &raw).unwrap();
                let mut host = cpu.upload(1, nv, &raw).unwrap();
                st_dev = cpu
                    .slop_pen_draft(&mut dev, &ds, prev.as_ref(), &st_dev)
                    .unwrap();
                st_host = strata_engine::backend::slop_pen_draft_on_host(
                    &cpu,
                    &mut host,
                    &ds,
                    prev.as_ref(),
                    &st_host,
                )
                .unwrap();
                let mut oracle = raw.clone();
                sampler.penalize_draft(
                    &mut oracle,
                    inverse,
                    &SampleContext {
                        position: history.len() as u64,
                        history: &history,
                    },
                    Some(&seq),
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                let what = format!("{variant}, {nv} draft ids, step {k}");
                assert_eq!(
                    bits(dev.as_slice()),
                    bits(&oracle),
                    "{what}: kernel vs sampler"
                );
                assert_eq!(
                    bits(host.as_slice()),
                    bits(&oracle),
                    "{what}: default vs sampler"
                );
                assert_eq!(st_dev, st_host, "{what}: states");
                assert_eq!(
                    st_dev.0,
                    DraftSlop::<CpuIds, CpuBuf>::state_ids(seq.token_state()),
                    "{what}: state vs the sequence's"
                );
                removed += oracle.iter().filter(|x| **x == f32::NEG_INFINITY).count();
                lowered += oracle
                    .iter()
                    .zip(&raw)
                    .filter(|(a, b)| a.is_finite() && a < b)
                    .count();
            }
            assert!(
                removed > 0 && lowered > 0,
                "{removed} removed, {lowered} lowered"
            );
        }
    }
}

/// `pick_draft_mapped` (issue "Boundary", point 4): the CPU's (the catalogue `pick` mapping
/// through the draft ids) and the trait's default (the host) give, per row, the token of the
/// first largest logit (ties to the lower index, NaN never chosen, index 0 when nothing is
/// above −∞: the oracle written out below) and that logit's bits, on rows with ties, −∞ rows
/// and NaN; every id is a token of the draft vocabulary (the full vocabulary: the index), so
/// ids that never reach the host are valid by construction; a map with an id outside the
/// vocabulary is refused when it is made.
#[test]
fn pick_draft_mapped_gives_valid_token_ids() {
    let cpu = CpuBackend::new(1).unwrap();
    let n_vocab = 1000usize;
    let ids: Vec<u32> = (0..n_vocab as u32).filter(|t| t % 7 == 3).collect();
    let map = DraftMap::new(&cpu, &ids, n_vocab).unwrap();
    let nv = ids.len();
    let oracle = |row: &[f32]| -> usize {
        let mut best: Option<usize> = None;
        for (i, &v) in row.iter().enumerate() {
            if v > f32::NEG_INFINITY && best.is_none_or(|b| v > row[b]) {
                best = Some(i);
            }
        }
        best.unwrap_or(0)
    };
    let mut rng = Lcg(5);
    for case in 0..6 {
        let mut rows: Vec<f32> = (0..3 * nv).map(|_| rng.logit()).collect();
        match case {
            1 => rows.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
            2 => {
                rows[nv + 5] = f32::NAN;
                rows[..nv].iter_mut().for_each(|x| *x = f32::NAN);
            }
            3 => rows.iter_mut().for_each(|x| *x = 1.0),
            _ => {}
        }
        let logits = cpu.upload(3, nv, &rows).unwrap();
        let want: Vec<usize> = rows.chunks(nv).map(oracle).collect();
        let bits: Vec<u32> = want
            .iter()
            .enumerate()
            .map(|(r, &i)| rows[r * nv + i].to_bits())
            .collect();
        for (what, map, tokens) in [
            (
                "draft vocabulary",
                Some(&map),
                want.iter().map(|&i| ids[i]).collect::<Vec<_>>(),
            ),
            (
                "full vocabulary",
                None,
                want.iter().map(|&i| i as u32).collect(),
            ),
        ] {
            let got = cpu.pick_draft_mapped(&logits, map).unwrap();
            let dflt =
                strata_engine::backend::pick_draft_mapped_on_host(&cpu, &logits, map).unwrap();
            for (who, p) in [("cpu", &got), ("default", &dflt)] {
                assert_eq!(p.ids.0, tokens, "case {case}, {what}, {who}");
                assert_eq!(p.values.0, bits, "case {case}, {what}, {who}: values");
            }
            assert!(got.ids.0.iter().all(|t| (*t as usize) < n_vocab));
        }
    }
    let err = DraftMap::new(&cpu, &[3, n_vocab as u32], n_vocab)
        .err()
        .unwrap();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

/// [`Forced`] decided ahead: the same drafts, which the chain can ask for before it runs.
struct ForcedAhead(Forced);

impl DraftHook for ForcedAhead {
    fn draft(&mut self, position: usize, proposed: u32) -> Option<u32> {
        self.0.draft(position, proposed)
    }
    fn ahead(&mut self, position: usize) -> Option<Option<u32>> {
        Some(self.0.draft(position, 0))
    }
}

/// Forced drafts decided ahead keep the chain on the device (what `strata bench spec
/// --force-accept` measures): greedy and slop mode 1, windows 2, 4 and 8, drafts forced to the
/// plain tokens but every third: the chain fed the forced tokens runs as one step and downloads
/// one id vector, and the run equals the same hook asked draft by draft — tokens, stop,
/// drafts offered and accepted per step — and plain decoding.
#[test]
fn forced_drafts_decided_ahead_stay_on_the_device() {
    let model = with_head(load(Recording::new(), &LoadOptions::default()));
    let tok = tokenizer_of(&tiny_dir().join("model-f32.gguf"));
    let prompt: Vec<u32> =
        common::Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 32;
    let greedy = SamplerConfig::greedy();
    let (free, _) = plain_guarded(&model, &tok, &greedy, &prompt, NEW);
    let slop = slop_mode_1(&entries_from(&tok, &free));
    for (name, cfg) in [("greedy", &greedy), ("slop mode 1", &slop)] {
        let want = plain_guarded(&model, &tok, cfg, &prompt, NEW);
        let mut truth = prompt.clone();
        truth.extend(&want.0);
        for window in [2usize, 4, 8] {
            let what = format!("{name} window {window}");
            let run = |ahead: bool| {
                let mut sampler = Sampler::with_vocab(cfg.clone(), &tok).unwrap();
                let spec = SpecConfig {
                    window,
                    ..SpecConfig::default()
                };
                let forced = Forced {
                    truth: truth.clone(),
                };
                let dec = SpecDecoder::new(&model, spec).unwrap();
                let mut dec = if ahead {
                    dec.with_draft_hook(ForcedAhead(forced))
                } else {
                    dec.with_draft_hook(forced)
                };
                model.backend().take();
                let g = guarded::generate(
                    &mut dec,
                    &prompt,
                    &mut sampler,
                    &|_| false,
                    NEW,
                    &mut |_| true,
                )
                .unwrap();
                let s = dec.stats();
                let counts = (s.offered.clone(), s.accepted.clone());
                (g.tokens, g.stop, counts, model.backend().take())
            };
            let (t1, s1, c1, _) = run(false);
            let (t2, s2, c2, log) = run(true);
            assert_eq!(
                (&t1, &s1),
                (&want.0, &want.1),
                "{what}: per draft, not plain"
            );
            assert_eq!((&t2, &s2), (&want.0, &want.1), "{what}: ahead, not plain");
            assert_eq!(c1, c2, "{what}: drafts offered and accepted");
            let accepted: u64 = c2.1.iter().sum();
            assert!(accepted > 0, "{what}: no forced draft accepted");
            let chains = chains(&log.events);
            let with_drafts: Vec<&Chain> =
                chains.iter().filter(|c| !c.downloads.is_empty()).collect();
            assert!(
                with_drafts.len() >= 3,
                "{what}: {} chains",
                with_drafts.len()
            );
            for c in &with_drafts {
                assert!(
                    c.downloads.len() == 1 && matches!(c.downloads[0], Ev::Ids(_)),
                    "{what}: a chain downloaded {:?}",
                    c.downloads
                );
                assert_eq!(c.chain_steps, vec![c.device_steps + 1], "{what}: {c:?}");
            }
        }
    }
}
