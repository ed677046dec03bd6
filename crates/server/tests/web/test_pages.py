"""The chat page (/) and the monitor (/monitor) in headless Chromium, against `strata serve` on
the tiny fixture (started by crates/server/tests/web.rs, which names the servers in STRATA_URL
and STRATA_KEYED_URL). Oracles: the server's own API (a greedy reply asked for directly),
its counters, the page's localStorage, and the DOM. Replies with HTML in them come from a
fake /v1/chat/completions (Playwright's request routing), since the tiny model writes noise.
"""

import json
import os
import urllib.request

import pytest
from playwright.sync_api import expect, sync_playwright

URL = os.environ["STRATA_URL"]
KEYED = os.environ["STRATA_KEYED_URL"]
PROBE = os.environ["STRATA_PROBE_URL"]
KEY = os.environ["STRATA_KEY"]
SHOTS = os.environ.get("STRATA_WEB_SHOTS")
GEN_TIMEOUT = 60_000
# A loaded 2-core CI machine can be slow to lay out a page; nothing here waits on purpose.
expect.set_options(timeout=20_000)


def api(base, path, body=None, key=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metric(name, base=URL, key=None):
    return api(base, "/metrics.json", key=key)["metrics"][name]


def greedy_reply(text, max_tokens):
    """What the server answers to one user message, asked for directly (not streamed)."""
    r = api(URL, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}],
        "temperature": 0.0, "top_p": 0.95, "max_tokens": max_tokens,
    })
    return r["choices"][0]["message"]["content"]


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=os.environ["STRATA_CHROMIUM"], args=["--no-sandbox"])
        yield b
        b.close()


def new_page(browser, base=URL, **ctx_opts):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800}, **ctx_opts)
    page = ctx.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: page.errors.append(f"console: {m.text}") if m.type == "error" else None)
    # Everything the page loads must come from the server itself (no CDN).
    page.on("request", lambda r: None if r.url.startswith((base + "/", "data:", "blob:"))
            else page.errors.append(f"request elsewhere: {r.url}"))
    page.goto(base + "/")
    return page


@pytest.fixture
def page(browser):
    p = new_page(browser)
    yield p
    assert p.errors == [], p.errors
    p.context.close()


def settings(page, **values):
    page.click("#open-settings")
    for k, v in values.items():
        el = page.locator(f"#settings-form [name={k}]")
        if el.evaluate("e => e.tagName") == "SELECT":
            el.select_option(str(v))
        else:
            el.fill(str(v))
    page.click("#settings-form button[type=submit]")


def send(page, text):
    page.fill("#prompt", text)
    page.click("#send")


def wait_done(page):
    expect(page.locator("#send")).to_be_visible(timeout=GEN_TIMEOUT)


def stored(page):
    return page.evaluate("JSON.parse(localStorage.getItem('strata.conversations') || '[]')")


def test_a_reply_streams_in_and_survives_a_reload(page):
    settings(page, temperature=0, max_tokens=24)
    # Every state of the reply's text while it streams.
    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const el = document.querySelector('.msg.assistant .content');
            if (el) window.__seen.push(el.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    send(page, "hello there")
    expect(page.locator("#stop")).to_be_visible()
    wait_done(page)
    seen = [n for n in page.evaluate("window.__seen") if n > 0]
    final = seen[-1]
    assert any(0 < n < final for n in seen), f"the reply did not arrive in pieces: {seen}"
    convs = stored(page)
    assert len(convs) == 1
    msgs = convs[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[0]["content"] == "hello there"
    # The streamed text is what the server answers when asked directly.
    assert msgs[1]["content"] == greedy_reply("hello there", 24)
    stats = page.locator(".msg.assistant .stats").inner_text()
    assert f"{msgs[1]['usage']['completion_tokens']} tokens" in stats, stats
    assert "generation" in stats and "tok/s" in stats and "cached" in stats and "MTP off" in stats, stats

    page.reload()
    item = page.locator("#conv-list li")
    expect(item).to_have_count(1)
    expect(item.locator(".conv-open")).to_have_text("hello there")
    item.locator(".conv-open").click()
    expect(page.locator(".msg.user .content")).to_have_text("hello there")
    assert stored(page)[0]["messages"][1]["content"] == msgs[1]["content"]
    expect(page.locator(".msg.assistant .stats")).to_have_text(stats)


def long_seed(n):
    """A seed for which the tiny model's sampled reply to the stop test's message runs to n
    tokens or more, found on the server without the token delay (same model, same sampler)."""
    for seed in range(200):
        r = api(PROBE, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "temperature": 1.5, "top_p": 1.0, "max_tokens": n, "seed": seed,
        })
        if r["choices"][0]["finish_reason"] == "length":
            return seed
    raise AssertionError(f"no seed below 200 gives {n} tokens")


def test_stop_ends_the_generation_on_the_server(page):
    # Sampled with a seed that runs for 200+ tokens, 60 ms each: long enough to be stopped.
    settings(page, temperature=1.5, top_p=1, max_tokens=900, seed=long_seed(200))
    before = metric("requests_cancelled_total")
    send(page, "tell me a long story")
    expect(page.locator(".msg.assistant .content")).not_to_be_empty(timeout=GEN_TIMEOUT)
    page.click("#stop")
    wait_done(page)
    m = stored(page)[0]["messages"][1]
    assert m.get("stopped") is True, m
    assert 0 < len(m["content"]), m
    expect(page.locator(".msg.assistant .stats")).to_contain_text("stopped")
    # The server saw the client go and dropped the job.
    page.wait_for_function(
        f"fetch('/metrics.json').then(r => r.json()).then(j => j.metrics.requests_cancelled_total > {before})",
        timeout=10_000,
    )
    # The page is usable again at once.
    settings(page, temperature=0, max_tokens=8, seed="")
    send(page, "again")
    wait_done(page)
    assert stored(page)[0]["messages"][3]["content"] == greedy_reply_after(stored(page)[0], 8)


def greedy_reply_after(conv, max_tokens):
    msgs = [{"role": m["role"], "content": m["content"]} for m in conv["messages"][:-1] if m["content"]]
    r = api(URL, "/v1/chat/completions", {
        "messages": msgs, "temperature": 0.0, "top_p": 0.95, "max_tokens": max_tokens,
    })
    return r["choices"][0]["message"]["content"]


def test_regenerate_and_edit_and_resend(page):
    settings(page, temperature=0, max_tokens=12)
    send(page, "abc")
    wait_done(page)
    first = stored(page)[0]["messages"][1]["content"]
    n = metric("requests_total")
    page.click(".msg.assistant .regen")
    wait_done(page)
    msgs = stored(page)[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["content"] == first  # greedy: the same reply, asked again
    assert metric("requests_total") == n + 1

    page.click(".msg.user .edit")
    page.fill(".msg.user .edit-box", "xyz")
    page.click(".msg.user .edit-send")
    wait_done(page)
    msgs = stored(page)[0]["messages"]
    assert [(m["role"], m["content"]) for m in msgs][0] == ("user", "xyz")
    assert len(msgs) == 2
    assert msgs[1]["content"] == greedy_reply("xyz", 12)


def test_export_and_import(page, tmp_path):
    settings(page, temperature=0, max_tokens=6)
    send(page, "keep this")
    wait_done(page)
    with page.expect_download() as d:
        page.click("#export")
    path = tmp_path / "export.json"
    d.value.save_as(path)
    exported = json.loads(path.read_text())
    assert exported["format"] == "strata-conversations"
    assert [c["id"] for c in exported["conversations"]] == [c["id"] for c in stored(page)]
    assert exported["conversations"][0]["messages"][0]["content"] == "keep this"

    page.evaluate("localStorage.clear()")
    page.reload()
    expect(page.locator("#conv-list li")).to_have_count(0)
    page.set_input_files("#import", str(path))
    expect(page.locator("#conv-list li")).to_have_count(1)
    expect(page.locator("#notice")).to_contain_text("Imported 1 conversation")
    # Importing it again adds a copy under a new id; nothing is overwritten.
    page.set_input_files("#import", str(path))
    expect(page.locator("#conv-list li")).to_have_count(2)
    ids = [c["id"] for c in stored(page)]
    assert len(set(ids)) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": [{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}]}))
    page.set_input_files("#import", str(bad))
    expect(page.locator("#notice")).to_contain_text("nothing imported")
    expect(page.locator("#notice")).to_contain_text("messages[0].role")
    expect(page.locator("#conv-list li")).to_have_count(2)


def test_settings_are_checked_sent_and_kept(page):
    page.click("#open-settings")
    page.fill("#settings-form [name=temperature]", "warm")
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-error")).to_contain_text("temperature")
    expect(page.locator("#settings-dialog")).to_have_attribute("open", "")
    page.fill("#settings-form [name=temperature]", "0.5")
    page.fill("#settings-form [name=seed]", "-3")
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-error")).to_contain_text("seed")
    page.click("#settings-cancel")
    settings(page, system="Be brief.", temperature=0.5, top_p=0.9, max_tokens=8, slop_mode=2,
             slop_phrases="foo bar\nbaz", seed=7)
    with page.expect_request("**/v1/chat/completions") as req:
        send(page, "hi")
    body = req.value.post_data_json
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][1] == {"role": "user", "content": "hi"}
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.5, 0.9, 8)
    assert body["slop_mode"] == 2 and body["slop_phrases"] == ["foo bar", "baz"]
    assert body["seed"] == 7
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "spec" not in body  # MTP window 0: left to the server's --spec
    wait_done(page)
    assert "error" not in stored(page)[0]["messages"][1]  # the server took every field
    page.reload()
    page.click("#open-settings")
    expect(page.locator("#settings-form [name=slop_phrases]")).to_have_value("foo bar\nbaz")
    expect(page.locator("#settings-form [name=max_tokens]")).to_have_value("8")


def fake_stream(reasoning, content):
    """A /v1/chat/completions stream as the server writes one."""
    def chunk(delta, fr=None):
        return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}],
                "usage": None}
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"reasoning_content": r}) for r in reasoning]
    events += [chunk({"content": c}) for c in content]
    events.append(chunk({}, "stop"))
    events.append({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "tiny", "choices": [],
                   "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                             "prompt_tokens_details": {"cached_tokens": 4},
                             "speculative": {"window": 4, "passes": 3, "drafted": [3, 3, 2],
                                             "accepted": [3, 2, 1]}},
                   "timings": {"cache_n": 4, "prompt_n": 5, "prompt_ms": 10.0, "predicted_n": 6,
                               "predicted_ms": 20.0}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def route_reply(page, reasoning, content):
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=fake_stream(reasoning, content)))


XSS_REASONING = ['<svg onload="window.__xss=\'svg\'"></svg>', "thinking <b onmouseover=\"window.__xss='b'\">x</b>"]
XSS_CONTENT = [
    "Look: <img src=x onerror=\"window.__xss='img'\"> and ",
    "<script>window.__xss='script'</script>",
    " [click](javascript:window.__xss='md-link') ",
    "<a href=\"javascript:window.__xss='a'\" id=\"evil\">a</a> ",
    "<iframe src=\"javascript:window.__xss='iframe'\"></iframe>",
    "<details open ontoggle=\"window.__xss='toggle'\">d</details>",
    "![remote](https://example.invalid/leak?q=secret)\n\n",
    "```html\n<script>alert(1)</script>\n```\n",
]


def check_nothing_ran(page):
    page.wait_for_timeout(300)
    assert page.evaluate("window.__xss") is None
    box = page.locator("#messages")
    assert box.locator("script, iframe, object, embed").count() == 0
    assert box.locator("[onerror], [onload], [onmouseover], [ontoggle]").count() == 0
    assert box.locator("a[href^='javascript' i]").count() == 0
    for img in box.locator("img").all():
        src = img.get_attribute("src")
        assert src is None or src.startswith("data:"), src


def test_model_output_cannot_run_script(browser):
    # bypass_csp: the sanitizer alone must stop these; the CSP is checked on its own below.
    page = new_page(browser, bypass_csp=True)
    route_reply(page, XSS_REASONING, XSS_CONTENT)
    send(page, "show me html")
    wait_done(page)
    expect(page.locator(".msg.assistant .content")).to_contain_text("Look:")
    # The code block shows the tag as text.
    expect(page.locator(".msg.assistant pre code")).to_contain_text("<script>alert(1)</script>")
    page.locator(".msg.assistant details.reasoning summary").click()
    for a in page.locator("#messages a").all():
        a.click(modifiers=["Alt"])  # no navigation wanted; a javascript: href would run on click
    page.locator(".msg.assistant .content").hover()
    check_nothing_ran(page)
    # Rendered again from storage.
    page.reload()
    check_nothing_ran(page)
    assert page.errors == [], page.errors
    page.context.close()

    # The served policy stops a script that got into the DOM anyway.
    page = new_page(browser)
    page.evaluate("""() => {
        const s = document.createElement('script');
        s.textContent = "window.__csp = 1";
        document.body.append(s);
        const i = document.createElement('img');
        i.setAttribute('onerror', "window.__csp = 2");
        i.src = 'x';
        document.body.append(i);
    }""")
    page.wait_for_timeout(300)
    assert page.evaluate("window.__csp") is None
    assert any("Content Security Policy" in e for e in page.errors), page.errors
    page.context.close()


def test_markdown_code_copy_and_reasoning(browser):
    page = new_page(browser)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    route_reply(page, ["thinking ", "**hard**"], ["# Title\n\nSome `code` and a block:\n\n",
                                                  "```python\nprint('hi')\n```\n"])
    settings(page, mtp_window=3)
    with page.expect_request("**/v1/chat/completions") as req:
        send(page, "code please")
    assert req.value.post_data_json["spec"] == 3
    wait_done(page)
    msg = page.locator(".msg.assistant")
    expect(msg.locator("h1")).to_have_text("Title")
    expect(msg.locator("pre code [class^=hljs-]").first).to_be_visible()
    expect(msg.locator(".code-bar span")).to_have_text("python")
    msg.locator(".code-bar .copy").click()
    expect(msg.locator(".code-bar .copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi')\n"
    det = msg.locator("details.reasoning")
    expect(det).not_to_have_attribute("open", "")
    det.locator("summary").click()
    expect(det.locator("strong")).to_have_text("hard")
    stats = msg.locator(".stats").inner_text()
    assert "7 tokens" in stats and "prompt 9 (4 cached)" in stats, stats
    assert "prompt 500.0 tok/s" in stats and "generation 300.0 tok/s" in stats, stats
    assert "MTP 6/8 accepted (75%; by position 3/3 2/3 1/2)" in stats, stats
    assert page.errors == [], page.errors
    page.context.close()


def test_the_page_asks_for_the_key(browser):
    page = new_page(browser, base=KEYED)
    dlg = page.locator("#key-dialog")
    expect(dlg).to_have_attribute("open", "")
    # Dismissed: the page says why it has no model, and the Key button asks again.
    page.keyboard.press("Escape")
    expect(page.locator("#notice")).to_contain_text("no API key given")
    page.click("#change-key")
    expect(dlg).to_have_attribute("open", "")
    page.fill("#key-input", "wrong")
    page.click("#key-dialog button[type=submit]")
    expect(page.locator("#key-reason")).to_contain_text("invalid API key")
    expect(dlg).to_have_attribute("open", "")
    page.fill("#key-input", KEY)
    page.click("#key-dialog button[type=submit]")
    expect(page.locator("#model-name")).to_have_text("tiny")
    settings(page, temperature=0, max_tokens=5)
    send(page, "hi")
    wait_done(page)
    assert "error" not in stored(page)[0]["messages"][1]
    page.goto(KEYED + "/monitor")
    expect(page.locator("#status")).to_have_text("serving")
    # Only the 401s of the wrong and the missing key were logged.
    assert all("401" in e for e in page.errors), page.errors
    page.context.close()


def test_the_monitor_shows_the_model_and_a_live_chart(page):
    settings(page, temperature=0, max_tokens=30)
    send(page, "something to measure")
    wait_done(page)
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "chat-tiny.png"))
    page.goto(URL + "/monitor")
    expect(page.locator("#status")).to_have_text("serving")
    expect(page.locator("dd[data-key=architecture]")).to_have_text("qwen4exp")
    expect(page.locator("dd[data-key=backend]")).to_have_text("cpu")
    expect(page.locator("#formats tbody tr").first).to_contain_text("F32")
    assert int(page.locator("dd[data-key='accepted (total)']").inner_text()) >= 1
    page.wait_for_function(
        "Number(document.getElementById('chart').dataset.points) > 0 && "
        "Number(document.getElementById('chart').dataset.max) > 0", timeout=10_000)
    # The generation line is drawn: pixels of its colour (#2f6fed) on the canvas.
    blue = page.evaluate("""() => {
        const c = document.querySelector('#chart canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) {
            if (Math.abs(d[i] - 0x2f) < 12 && Math.abs(d[i+1] - 0x6f) < 12 && Math.abs(d[i+2] - 0xed) < 12 && d[i+3] > 200) n++;
        }
        return n;
    }""")
    assert blue > 20, blue
    expect(page.locator("#spec")).to_contain_text("No MTP head loaded")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "monitor-tiny.png"), full_page=True)


def test_the_monitor_shows_acceptance_per_draft_position(browser):
    # /metrics.json as a server with an MTP head writes it (names of docs/SERVER.md), faked:
    # the tiny fixture has no head.
    real = api(URL, "/metrics.json")
    real["model"]["mtp"] = True
    pos = lambda vals: [{"labels": {"position": str(i + 1)}, "value": v} for i, v in enumerate(vals)]
    real["metrics"]["spec_drafted_position_total"] = pos([10.0, 8.0, 5.0])
    real["metrics"]["spec_accepted_position_total"] = pos([9.0, 4.0, 1.0])
    ctx = browser.new_context()
    page = ctx.new_page()
    page.route("**/metrics.json", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "application/json"}, body=json.dumps(real)))
    page.goto(URL + "/monitor")
    rows = page.locator("#spec-table tr")
    expect(rows).to_have_count(4)
    assert [c.strip() for c in rows.nth(1).locator("td").all_inner_texts()][:4] == ["1", "10", "9", "90%"]
    assert [c.strip() for c in rows.nth(2).locator("td").all_inner_texts()][:4] == ["2", "8", "4", "50%"]
    assert [c.strip() for c in rows.nth(3).locator("td").all_inner_texts()][:4] == ["3", "5", "1", "20%"]
    expect(page.locator("dd[data-key='MTP head']")).to_have_text("loaded")
    ctx.close()
