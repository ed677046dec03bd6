//! The full-size plan (nothing written) against `../shared/tools/README.md`'s tensor table, typed
//! in here from the README by hand: every row's names, ggml `ne`, types and counts, and the
//! totals it states (1,224 tensors, 125.9 B parameters, 38.0 GB of tensor data). Also the MTP
//! head's plan against docs/MTP-GGUF.md's table at the real geometry.

use std::collections::BTreeMap;

use strata_gguf::GgmlType::{self, *};
use strata_synth::{Options, Plan};

/// (name with the layer number replaced by N, ne) → type → count.
fn census(plan: &Plan) -> BTreeMap<(String, Vec<u64>), BTreeMap<&'static str, usize>> {
    let mut m: BTreeMap<_, BTreeMap<&'static str, usize>> = BTreeMap::new();
    for t in &plan.tensors {
        let name = match t.name.strip_prefix("blk.") {
            Some(rest) => format!("blk.N.{}", rest.split_once('.').unwrap().1),
            None => t.name.clone(),
        };
        *m.entry((name, t.ne.clone()))
            .or_default()
            .entry(t.ty.name())
            .or_default() += 1;
    }
    m
}

fn row(
    name: &str,
    ne: &[u64],
    types: &[(GgmlType, usize)],
) -> ((String, Vec<u64>), BTreeMap<&'static str, usize>) {
    (
        (name.to_string(), ne.to_vec()),
        types.iter().map(|&(t, n)| (t.name(), n)).collect(),
    )
}

#[test]
fn full_size_plan_matches_the_readme_table() {
    let plan = strata_synth::trunk_plan(&Options::default()).unwrap();
    let want: BTreeMap<_, _> = [
        row("token_embd.weight", &[2560, 248320], &[(Q4_K, 1)]),
        row("output.weight", &[2560, 248320], &[(Q6_K, 1)]),
        row("output_hc_norm.weight", &[10240], &[(F32, 1)]),
        row("output_hc_down.weight", &[10240, 320], &[(BF16, 1)]),
        row("output_hc_up.weight", &[320, 10240], &[(BF16, 1)]),
        row(
            "per_layer_token_embd.weight",
            &[160, 1049472],
            &[(IQ4_NL, 1)],
        ),
        row("blk.N.hc_attn_norm.weight", &[10240], &[(F32, 48)]),
        row("blk.N.hc_ffn_norm.weight", &[10240], &[(F32, 48)]),
        row("blk.N.hc_attn_down.weight", &[10240, 320], &[(BF16, 48)]),
        row("blk.N.hc_ffn_down.weight", &[10240, 320], &[(BF16, 48)]),
        row("blk.N.hc_attn_up.weight", &[320, 10240], &[(BF16, 48)]),
        row("blk.N.hc_ffn_up.weight", &[320, 10240], &[(BF16, 48)]),
        row("blk.N.hc_attn_inject.weight", &[10240, 4], &[(BF16, 48)]),
        row("blk.N.hc_ffn_inject.weight", &[10240, 4], &[(BF16, 48)]),
        row("blk.N.ffn_gate_inp.weight", &[2560, 512], &[(BF16, 48)]),
        row(
            "blk.N.ffn_gate_exps.weight",
            &[2560, 640, 512],
            &[(Q2_0, 48)],
        ),
        row("blk.N.ffn_up_exps.weight", &[2560, 640, 512], &[(Q2_0, 48)]),
        row(
            "blk.N.ffn_down_exps.weight",
            &[640, 2560, 512],
            &[(Q2_0, 48)],
        ),
        row("blk.N.ffn_gate_inp_shexp.weight", &[2560], &[(BF16, 48)]),
        row(
            "blk.N.ffn_gate_shexp.weight",
            &[2560, 640],
            &[(Q2_0, 21), (Q4_K, 27)],
        ),
        row(
            "blk.N.ffn_up_shexp.weight",
            &[2560, 640],
            &[(Q2_0, 13), (Q4_K, 35)],
        ),
        row("blk.N.ffn_down_shexp.weight", &[640, 2560], &[(Q8_0, 48)]),
        row(
            "blk.N.attn_qkv.weight",
            &[2560, 10240],
            &[(Q3_K, 18), (IQ4_XS, 13), (Q4_K, 4), (Q2_0, 1)],
        ),
        row("blk.N.attn_gate.weight", &[2560, 6144], &[(Q4_K, 36)]),
        row("blk.N.ssm_out.weight", &[6144, 2560], &[(Q5_K, 36)]),
        row("blk.N.ssm_alpha.weight", &[2560, 48], &[(BF16, 36)]),
        row("blk.N.ssm_beta.weight", &[2560, 48], &[(BF16, 36)]),
        row("blk.N.ssm_conv1d.weight", &[4, 10240], &[(F32, 36)]),
        row("blk.N.ssm_a", &[48], &[(F32, 36)]),
        row("blk.N.ssm_dt.bias", &[48], &[(F32, 36)]),
        row("blk.N.ssm_norm.weight", &[128], &[(F32, 36)]),
        row("blk.N.attn_q.weight", &[2560, 12288], &[(Q2_0, 12)]),
        row("blk.N.attn_k.weight", &[2560, 512], &[(Q5_K, 12)]),
        row("blk.N.attn_v.weight", &[2560, 512], &[(Q6_K, 12)]),
        row("blk.N.attn_output.weight", &[6144, 2560], &[(Q4_K, 12)]),
        row("blk.N.attn_q_norm.weight", &[256], &[(F32, 12)]),
        row("blk.N.attn_k_norm.weight", &[256], &[(F32, 12)]),
        row("blk.N.indexer.q_proj.weight", &[2560, 512], &[(BF16, 12)]),
        row("blk.N.indexer.k_proj.weight", &[2560, 128], &[(BF16, 12)]),
        row("blk.N.indexer.q_norm.weight", &[128], &[(F32, 12)]),
        row("blk.N.indexer.k_norm.weight", &[128], &[(F32, 12)]),
        row("blk.N.ple_key.weight", &[2560, 10240], &[(Q2_0, 1)]),
        row("blk.N.ple_value.weight", &[2560, 2560], &[(BF16, 1)]),
        row("blk.N.ple_norm_key.weight", &[10240], &[(F32, 1)]),
        row("blk.N.ple_norm_query.weight", &[10240], &[(F32, 1)]),
        row("blk.N.ple_norm_conv.weight", &[10240], &[(F32, 1)]),
        row("blk.N.ple_conv1d.weight", &[4, 10240], &[(F16, 1)]),
    ]
    .into_iter()
    .collect();
    let got = census(&plan);
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "{k:?}");
    }
    for k in got.keys() {
        assert!(want.contains_key(k), "not in the README's table: {k:?}");
    }
    // The README's totals.
    assert_eq!(plan.tensors.len(), 1224);
    let params = plan.params() as f64 / 1e9;
    assert!((125.85..125.95).contains(&params), "{params} B params");
    let gb = plan.data_bytes() as f64 / 1e9;
    assert!((37.95..38.05).contains(&gb), "{gb} GB");
    // QSA layers are 3, 7, ..., 47; the PLE block sits on layer 1.
    assert_eq!(
        plan.tensors
            .iter()
            .filter(|t| t.name.ends_with(".attn_q.weight"))
            .map(|t| t.name.clone())
            .collect::<Vec<_>>(),
        (0..12)
            .map(|i| format!("blk.{}.attn_q.weight", 4 * i + 3))
            .collect::<Vec<_>>()
    );
    assert!(plan.tensor("blk.1.ple_key.weight").is_some());
}

#[test]
fn full_size_metadata_has_the_release_keys() {
    use strata_gguf::{Array, Value};
    let plan = strata_synth::trunk_plan(&Options::default()).unwrap();
    let get = |k: &str| {
        plan.kvs
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("missing {k}"))
    };
    assert_eq!(get("qwen4exp.block_count"), Value::U32(48));
    assert_eq!(get("qwen4exp.embedding_length"), Value::U32(2560));
    assert_eq!(get("qwen4exp.attention.head_count"), Value::U32(24));
    assert_eq!(get("qwen4exp.attention.head_count_kv"), Value::U32(2));
    assert_eq!(get("qwen4exp.attention.key_length"), Value::U32(256));
    assert_eq!(get("qwen4exp.rope.freq_base"), Value::F32(1e7));
    assert_eq!(
        get("qwen4exp.rope.dimension_sections"),
        Value::Array(Array::I32(vec![11, 11, 10, 0]))
    );
    assert_eq!(get("qwen4exp.expert_count"), Value::U32(512));
    assert_eq!(get("qwen4exp.expert_used_count"), Value::U32(10));
    assert_eq!(get("qwen4exp.expert_feed_forward_length"), Value::U32(640));
    assert_eq!(get("qwen4exp.hyper_connection.count"), Value::U32(4));
    assert_eq!(get("qwen4exp.hyper_connection.low_rank"), Value::U32(320));
    assert_eq!(get("qwen4exp.attention.indexer.head_count"), Value::U32(4));
    assert_eq!(
        get("qwen4exp.attention.indexer.key_length"),
        Value::U32(128)
    );
    assert_eq!(get("qwen4exp.attention.indexer.top_k"), Value::U32(2048));
    let ratios: Vec<i32> = (0..48).map(|l| if l % 4 == 3 { 4 } else { 0 }).collect();
    assert_eq!(
        get("qwen4exp.attention.compress_ratios"),
        Value::Array(Array::I32(ratios))
    );
    assert_eq!(get("tokenizer.ggml.eos_token_id"), Value::U32(248_046));
    match get("tokenizer.ggml.tokens") {
        Value::Array(Array::String(t)) => {
            assert_eq!(t.len(), 248_320);
            assert_eq!(t[248_044], "<|endoftext|>");
            assert_eq!(t[248_046], "<|im_end|>");
        }
        v => panic!("{v:?}"),
    }
}

#[test]
fn mtp_plan_follows_the_mtp_gguf_layout() {
    let plan = strata_synth::mtp_plan(&Options::default()).unwrap();
    let t = |n: &str| {
        plan.tensor(n)
            .unwrap_or_else(|| panic!("missing {n}"))
            .clone()
    };
    assert_eq!(t("mtp.fc_embedding.weight").ne, [2560, 2560]);
    assert_eq!(t("mtp.fc_hidden.weight").ne, [2560, 2560]);
    assert_eq!(t("mtp.pre_fc_norm_hidden.weight").ne, [10240]);
    assert_eq!(t("mtp.output_hc_down.weight").ne, [10240, 320]);
    assert_eq!(t("mtp.blk.0.attn_q.weight").ne, [2560, 12288]);
    assert_eq!(t("mtp.blk.0.ffn_gate_exps.weight").ne, [2560, 640, 512]);
    assert_eq!(t("mtp.blk.0.ffn_down_exps.weight").ne, [640, 2560, 512]);
    assert_eq!(t("mtp.blk.0.ffn_gate_inp.weight").ty, F32);
    assert_eq!(t("mtp.blk.0.ffn_gate_inp_shexp.weight").ne, [2560, 1]);
    assert_eq!(t("mtp.blk.0.indexer.q_proj.weight").ty, BF16);
    assert_eq!(t("mtp.blk.0.ffn_up_exps.weight").ty, Q8_0);
    assert!(plan.tensor("mtp.token_embd.weight").is_none());
}
