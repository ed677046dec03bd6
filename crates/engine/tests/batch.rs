//! Batching (issue 15): eight sequences stepped together, one forward pass per step over all
//! their rows (`forward_batch`), each get exactly their solo bits. The oracle is each
//! sequence's own run through the one decoding loop (`decode::run`, whole-prompt prefill then
//! one token per step). In the batch, sequences join at different steps and prefill in chunks
//! beside the others' decode rows (a step with a prefill chunk and decode rows is required to
//! happen); greedy and seeded; one sequence under slop mode 2 with a phrase that makes it
//! rewind (required). Every logits row each sequence was given is compared bit for bit, and the
//! tokens. On the tiny qwen4exp fixture (GDN, QSA with its indexer, PLE, MoE) and on the
//! default qwen2 model when it is cached (else a SKIP message).
//!
//! Speculative (MTP) sequences in the batch: with the tiny fixture's real MTP head, three
//! speculative sequences (windows 4, 3 and 8, one under slop mode 2 with a phrase that makes
//! it rewind, one with drafts forced along its output so that windows keep several rows) and
//! three plain ones join at different steps; every speculative prompt chunk (the decoder's
//! `prompt_item`, the MTP head following its rows after the pass) and verify window runs as
//! rows of the step's one `forward_batch_dev` beside the other sequences' decode rows, windows
//! and prefill chunks (required: windows of several rows shared a step, a step mixed a window
//! with a prefill chunk, every speculative prompt ran in its chunks in the batch — the
//! decoder's own count of prompt passes agrees — and one prompt's chunks shared at least three
//! passes with other sequences' decode rows). The oracle is each sequence alone through `decode::run` (the
//! speculative ones on their own `SpecDecoder`): every verify result (logits bits, or the
//! device's picks), the tokens, the rewinds and the trunk and MTP states after the run equal
//! bit for bit; greedy and seeded.

mod batch_harness;
mod common;

use batch_harness::{batch_equals_solo, speculative_and_plain_in_a_batch_equal_solo, Fam, Q4};
use common::{default_model, tiny_dir, Golden};
use strata_engine::{qwen2, qwen4exp, CpuBackend};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

struct Q2(qwen2::Model<CpuBackend>);

impl Fam for Q2 {
    type St = qwen2::State<CpuBackend>;
    fn fresh(&self) -> Self::St {
        self.0.new_state().unwrap()
    }
    fn tokens<'a>(&self, st: &'a Self::St) -> &'a [u32] {
        st.tokens()
    }
    fn n_ctx(&self) -> usize {
        self.0.config().n_ctx_train
    }
    fn run(&self, st: &mut Self::St, tokens: &[u32], last_only: bool) -> Vec<f32> {
        self.0.forward_with(st, tokens, last_only).unwrap().logits
    }
    fn batch(&self, items: Vec<(&mut Self::St, &[u32], bool)>) -> Vec<Vec<f32>> {
        let mut items: Vec<_> = items
            .into_iter()
            .map(|(state, tokens, last_only)| qwen2::BatchItem {
                state,
                tokens,
                last_only,
            })
            .collect();
        let out = self.0.forward_batch(&mut items).unwrap();
        out.into_iter().map(|o| o.logits).collect()
    }
}

#[test]
fn eight_sequences_in_a_batch_get_their_solo_bits_qwen4exp_tiny() {
    let path = tiny_dir().join("model-f32.gguf");
    let m = qwen4exp::Model::load(&path, CpuBackend::new(2).unwrap(), &Default::default()).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let ids = Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids");
    // Different starts and lengths (3 to 17 tokens), so the sequences sit at different
    // positions and complete QSA blocks at different steps.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| ids[i * 7..i * 7 + 3 + 2 * i].to_vec())
        .collect();
    batch_equals_solo(&Q4(m), &tok, &prompts);
}

#[test]
fn eight_sequences_in_a_batch_get_their_solo_bits_qwen2_default() {
    let Some(path) = default_model() else { return };
    let m = qwen2::Model::load(&path, CpuBackend::new(2).unwrap(), &Default::default()).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let texts = [
        "def fibonacci(n):",
        "The capital of France is",
        "// A linked list in C\nstruct node {",
        "SELECT name, count(*) FROM users",
        "Once upon a time, in a small village by the sea,",
        "import numpy as np\nx = np.",
        "fn main() {\n    let v: Vec<u32> =",
        "Q: What is 17 times 23?\nA:",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false, false).unwrap())
        .collect();
    batch_equals_solo(&Q2(m), &tok, &prompts);
}

/// The tiny fixture with its real MTP head (converted from the checkpoint beside it).
fn tiny_with_head() -> (Q4<CpuBackend>, Tokenizer) {
    let path = tiny_dir().join("model-f32.gguf");
    let m = qwen4exp::Model::load(&path, CpuBackend::new(2).unwrap(), &Default::default()).unwrap();
    let m = common::with_mtp_head(m, &tiny_dir().join("hf"), false);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    (Q4(m), tok)
}

#[test]
fn speculative_and_plain_sequences_in_a_batch_get_their_solo_bits_qwen4exp_tiny() {
    let (m, tok) = tiny_with_head();
    let ids = Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids");
    // The CPU runs a batch as one step: the windows really share the plain rows' pass.
    speculative_and_plain_in_a_batch_equal_solo(&m, &tok, &ids);
}
