"""The server as the official `openai` and `anthropic` SDKs see it.

Run by crates/server/tests/clients.rs, which starts the servers and sets:
  STRATA_URL      a server on the tiny qwen4exp fixture with its MTP head (speculative decoding
                  by default, window 4), key STRATA_KEY, context STRATA_CTX
  STRATA_DEFAULT  a server on the default model (Qwen2.5-Coder-0.5B), when it is cached
"""

import json
import os
import urllib.request

import anthropic
import openai
import pytest

URL = os.environ["STRATA_URL"]
KEY = os.environ["STRATA_KEY"]
CTX = int(os.environ["STRATA_CTX"])
DEFAULT = os.environ.get("STRATA_DEFAULT")

oa = openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0)
an = anthropic.Anthropic(base_url=URL, api_key=KEY, max_retries=0)

needs_default = pytest.mark.skipif(not DEFAULT, reason="the default model is not cached (strata fetch)")


def metrics(url=URL):
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer " + KEY})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("strata:"):
            name, value = line.split(" ", 1)
            out[name[len("strata:"):]] = float(value)
    return out


def user(text):
    return [{"role": "user", "content": text}]


# ---- OpenAI ----

def test_models_list_the_served_model():
    ids = [m.id for m in oa.models.list().data]
    assert ids == ["tiny"]


def test_chat_stream_equals_whole_response():
    kw = dict(model="tiny", messages=user("Tell me about rivers"), max_tokens=20, temperature=0)
    whole = oa.chat.completions.create(**kw)
    chunks = list(oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stream_equals_whole_response():
    kw = dict(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0)
    whole = oa.completions.create(**kw)
    text = "".join(c.choices[0].text for c in oa.completions.create(**kw, stream=True) if c.choices)
    assert text == whole.choices[0].text
    assert whole.usage.completion_tokens <= 12


def test_logprobs_follow_the_greedy_choice():
    r = oa.chat.completions.create(model="tiny", messages=user("logprobs"), max_tokens=8, temperature=0,
                                   logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == t.logprob


def test_seeded_sampling_repeats_and_extras_pass_through():
    kw = dict(model="tiny", messages=user("seeded"), max_tokens=16, temperature=1.0, seed=42,
              extra_body={"top_k": 20, "min_p": 0.01, "repeat_penalty": 1.1, "dry_multiplier": 0.5})
    a = oa.chat.completions.create(**kw).choices[0].message.content
    b = oa.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_a_slop_phrase_is_never_written():
    kw = dict(model="tiny", messages=user("slop"), max_tokens=24, temperature=0)
    text = oa.chat.completions.create(**kw).choices[0].message.content
    phrase = text[:3]
    assert phrase.strip(), text
    banned = oa.chat.completions.create(**kw, extra_body={"slop_phrases": [phrase], "slop_list": "none"})
    assert not banned.choices[0].message.content.startswith(phrase)


def test_speculation_equals_plain_decoding_through_both_sdks():
    kw = dict(model="tiny", messages=user("Speculate about rivers"), max_tokens=24, temperature=0.7, seed=9)
    plain = oa.chat.completions.create(**kw, extra_body={"spec": 1})
    for w in (2, 4, 8):
        spec = oa.chat.completions.create(**kw, extra_body={"spec": w})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        extra = spec.usage.model_extra["speculative"]
        assert extra["window"] == w and len(extra["drafted"]) == w - 1
        assert sum(extra["drafted"]) > 0
    assert "speculative" not in (plain.usage.model_extra or {})
    m = dict(model="tiny", max_tokens=24, messages=user("Speculate about rivers"))
    a1 = an.messages.create(**m, extra_body={"spec": 1, "temperature": 0})
    a4 = an.messages.create(**m, extra_body={"spec": 4, "temperature": 0})
    assert a4.content[0].text == a1.content[0].text
    assert a4.usage.model_extra["speculative"]["window"] == 4
    assert metrics()["spec_drafted_total"] > 0


def test_wrong_key_is_401():
    bad = openai.OpenAI(base_url=URL + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=user("x"), max_tokens=2)


def test_bad_fields_are_400_with_the_field_named():
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=user("x"), max_tokens=2, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=[{"role": "narrator", "content": "x"}], max_tokens=2)
    assert e.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=user("x"), max_tokens=2, n=3)
    assert e.value.param == "n"


def test_context_overflow_is_context_length_exceeded():
    long = "word " * (CTX * 2)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=user(long), max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="tiny", max_tokens=2, messages=user(long))
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_turn_two_does_not_rerun_turn_one():
    turn1 = [{"role": "system", "content": "A unique system prompt for the cache test."},
             {"role": "user", "content": "First question about caches"}]
    r1 = oa.chat.completions.create(model="tiny", messages=turn1, max_tokens=10, temperature=0)
    before = metrics()
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "A follow-up"}]
    r2 = oa.chat.completions.create(model="tiny", messages=turn2, max_tokens=10, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 1
    after = metrics()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == r2.usage.prompt_tokens - cached
    assert after["prefix_cache_hits_total"] > before["prefix_cache_hits_total"]


def test_metrics_use_llama_server_names():
    m = metrics()
    for name in ["prompt_tokens_total", "tokens_predicted_total", "requests_processing",
                 "requests_deferred", "n_decode_total", "prompt_seconds_total"]:
        assert name in m
    assert m["tokens_predicted_total"] > 0


# ---- Anthropic ----
# The anthropic 2.x SDK has no sampling arguments (the API chooses); greedy goes in the body.
GREEDY = {"temperature": 0}


def test_messages_stream_equals_whole_response():
    kw = dict(model="tiny", max_tokens=20, extra_body=GREEDY, system="Be brief.", messages=user("Tell me about rivers"))
    whole = an.messages.create(**kw)
    assert whole.stop_reason == "max_tokens"
    with an.messages.stream(**kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types and "message_delta" in types


def test_raw_event_sequence():
    events = [e.type for e in an.messages.create(model="tiny", max_tokens=5, extra_body=GREEDY,
                                                 messages=user("events"), stream=True)]
    # The SDK drops `ping` (tests/http.rs sees it on the wire).
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) <= {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_keys_in_either_header_and_401():
    bearer = anthropic.Anthropic(base_url=URL, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=user("x")).type == "message"
    bad = anthropic.Anthropic(base_url=URL, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=2, messages=user("x"))
    assert e.value.body["error"]["type"] == "authentication_error"


def test_anthropic_errors_have_its_shape():
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="tiny", max_tokens=0, messages=user("x"))
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["message"].startswith("max_tokens")


def test_count_tokens_matches_the_prompt_a_message_uses():
    kw = dict(model="tiny", system="Count me.", messages=user("How many tokens is this?"))
    n = an.messages.count_tokens(**kw).input_tokens
    m = an.messages.create(**kw, max_tokens=1, extra_body=GREEDY)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stop_sequences_end_with_stop_sequence():
    kw = dict(model="tiny", max_tokens=16, extra_body=GREEDY, messages=user("stop here"))
    text = an.messages.create(**kw).content[0].text
    stop = text[4:6]
    assert stop, text
    m = an.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


# ---- the default model: tool calls ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@needs_default
def test_openai_tool_call_whole_and_streamed():
    c = openai.OpenAI(base_url=DEFAULT + "/v1", api_key=KEY, max_retries=0)
    kw = dict(model="m", messages=user("What is the weather in Paris right now?"), tools=[WEATHER],
              temperature=0, max_tokens=64)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    name, args, finish = "", "", None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    # The result goes back; the second turn reuses the first.
    turn2 = kw["messages"] + [r.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r2 = c.chat.completions.create(**{**kw, "messages": turn2})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.choices[0].finish_reason in ("stop", "tool_calls", "length")


@needs_default
def test_anthropic_tool_use():
    c = anthropic.Anthropic(base_url=DEFAULT, api_key=KEY, max_retries=0)
    tool = {"name": "get_weather", "description": "Get the current weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    kw = dict(model="m", max_tokens=64, extra_body=GREEDY, tools=[tool],
              messages=user("What is the weather in Paris right now?"))
    m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    use2 = [b for b in final.content if b.type == "tool_use"][0]
    assert (use2.name, use2.input, final.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")


# ---- structured output ----

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}


def test_openai_json_schema_is_followed():
    r = oa.chat.completions.create(model="tiny", messages=user("json"), max_tokens=60, temperature=0,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}})
    v = json.loads(r.choices[0].message.content)
    assert isinstance(v["ok"], bool) and v["size"] in ("S", "M", "L") and len(v) == 2


def test_anthropic_output_format_is_followed():
    m = an.messages.create(model="tiny", max_tokens=60, messages=user("json"), extra_body=GREEDY,
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    v = json.loads(m.content[0].text)
    assert isinstance(v["ok"], bool) and v["size"] in ("S", "M", "L")


def test_forced_tool_calls_through_both_sdks():
    r = oa.chat.completions.create(model="tiny", messages=user("call it"), max_tokens=200, temperature=0,
                                   tools=[{"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}],
                                   tool_choice={"type": "function", "function": {"name": "pick"}})
    assert r.choices[0].finish_reason == "tool_calls", (r.choices[0].message, r.usage)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["size"] in ("S", "M", "L")
    m = an.messages.create(model="tiny", max_tokens=200, messages=user("call it"), extra_body=GREEDY,
                           tools=[{"name": "pick", "input_schema": SCHEMA}], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert use.name == "pick" and use.input["size"] in ("S", "M", "L")


def test_openai_parse_helper_with_a_pydantic_model():
    from typing import Literal

    import pydantic

    class Answer(pydantic.BaseModel):
        ok: bool
        size: Literal["S", "M", "L"]

    r = oa.chat.completions.parse(model="tiny", messages=user("parse"), max_tokens=60, temperature=0,
                                  response_format=Answer)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer)
    assert parsed.size in ("S", "M", "L")
