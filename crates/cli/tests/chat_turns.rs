//! `strata chat` keeps the conversation through a failed turn (issue 17, point 2): a line that
//! is not UTF-8, a turn that does not fit the context, an unknown `/command` are reported on
//! stderr and the conversation goes on; `/reset` confirms; `--ctx-policy drop-oldest` drops
//! whole turns; a reply cut by the context says so. On the tiny qwen4exp fixture, greedy.

mod common;
use common::{stderr, strata_with, tiny};

fn chat(extra: &[&str], stdin: &[u8]) -> (bool, String, String) {
    let t = tiny();
    let mut args = vec!["chat", "-m", t.to_str().unwrap(), "--temp", "0", "-n", "6"];
    args.extend_from_slice(extra);
    let out = strata_with(&args, &[], stdin);
    (
        out.status.success(),
        String::from_utf8(out.stdout.clone()).unwrap(),
        stderr(&out),
    )
}

#[test]
fn failed_turns_are_reported_and_the_conversation_goes_on() {
    // The oracle: each turn that is answered, asked alone in a fresh chat (every failed turn
    // must leave the history untouched, and /reset must clear it).
    let (ok, hello, _) = chat(&["-c", "64"], b"hello\n");
    assert!(ok);
    let (ok, again, _) = chat(&["-c", "64"], b"again\n");
    assert!(ok);
    let long = "the river keeps its own time ".repeat(4);
    let mut input = b"hello\n\xff\xfe not text\n/nope\n".to_vec();
    input.extend_from_slice(format!("{long}\n/reset\nagain\n").as_bytes());
    let (ok, out, err) = chat(&["-c", "64"], &input);
    assert!(ok, "{err}");
    assert_eq!(out, format!("{hello}{again}"), "{err}");
    for want in [
        "input line 2 is not UTF-8 text; it was not sent",
        "unknown command /nope: /reset clears the history",
        "It was not sent: /reset clears the history, or start chat with --ctx-policy drop-oldest",
        "history cleared",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
    // The refusal says how many tokens were left.
    assert!(err.contains("are left"), "{err}");
    // `//` sends a line that begins with `/`: the same reply as the message itself.
    let (ok, slash, err) = chat(&["-c", "64"], b"//nope\n");
    assert!(ok && !err.contains("unknown command"), "{err}");
    let (_, direct, _) = chat(&["-c", "64"], b"/nope\n");
    assert!(
        direct.is_empty(),
        "an unknown command went to the model: {direct:?}"
    );
    assert!(!slash.is_empty());
}

#[test]
fn drop_oldest_drops_whole_turns_to_fit() {
    // Each turn renders to about 20 tokens with its reply; a context of 48 holds two.
    let input = b"one river\ntwo rivers\nthree rivers\n";
    let (ok, out, err) = chat(&["-c", "48", "--ctx-policy", "drop-oldest"], input);
    assert!(ok, "{err}");
    assert!(
        err.contains("oldest turn(s) to fit the context of 48 tokens"),
        "{err}"
    );
    assert!(!err.contains("error:"), "{err}");
    // Under `stop`, the same conversation refuses a turn instead.
    let (ok, out_stop, err_stop) = chat(&["-c", "48"], input);
    assert!(ok, "{err_stop}");
    assert!(err_stop.contains("It was not sent"), "{err_stop}");
    assert!(
        out.len() > out_stop.len(),
        "drop-oldest answered no more turns than stop"
    );
}

#[test]
fn a_reply_cut_by_the_context_says_so() {
    let t = tiny();
    let out = strata_with(
        &[
            "chat",
            "-m",
            t.to_str().unwrap(),
            "--temp",
            "0",
            "-n",
            "200",
            "-c",
            "24",
        ],
        &[],
        b"hi\n",
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("tokens are left in the context of 24; the reply may be cut"),
        "{err}"
    );
    assert!(
        err.contains("the reply was cut at the context limit (24 tokens)"),
        "{err}"
    );
}
