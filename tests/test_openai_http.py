"""The OpenAI-compatible HTTP front end to end: the official ``openai`` client against ``serve_forever``
(the path ``magicserve serve`` runs) on a real local Ray cluster with the bundled model, disaggregated
with KV transfer and self-speculation. Greedy outputs equal the single-process reference engine's;
chat prompts are rendered as transformers' ``apply_chat_template`` renders them; refusals are OpenAI
error objects naming the parameter; ``/metrics`` parses with prometheus_client and its counts match
what was served."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

from controller.config import parse_config
from frontend.server import serving
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")
MODEL = "stdlib-llama-15m"
TOKEN = "test-token-not-secret"
TOKEN_ENV = "MAGICSERVE_TEST_HTTP_TOKEN"
ADMIN_TOKEN = "test-admin-token-not-secret"
ADMIN_TOKEN_ENV = "MAGICSERVE_TEST_ADMIN_TOKEN"
PROMPT = "import os\n\n\ndef walk(top):\n"
MESSAGES = [{"role": "system", "content": "Filesystem helpers."}, {"role": "user", "content": "def walk(top):"}]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    """``(base_url, ports)`` of a served cluster: 1 prefill + 1 decode, float32, 2 requests at once and
    no queue (a third is refused with 429), bearer-token auth on."""
    os.environ[TOKEN_ENV] = TOKEN
    os.environ[ADMIN_TOKEN_ENV] = ADMIN_TOKEN
    cfg = parse_config({
        "model": {"path": MODEL_DIR, "dtype": "float32"},
        "ray": {"num_cpus": 4, "num_gpus": 0},
        "prefill": {"kv_cache_tokens": 4096, "token_budget": 256},
        "decode": {"kv_cache_tokens": 8192,
                   "speculation": {"drafter": "self_sparse", "k_policy": "fixed", "k": 3, "budget": 64, "sink_tokens": 16}},
        "server": {"port": 0, "http_port": 0, "auth_token_env": TOKEN_ENV, "admin_token_env": ADMIN_TOKEN_ENV},
        "limits": {"max_concurrent_requests": 2, "max_queue_length": 0, "max_tokens": 256, "max_prompt_tokens": 1024},
    })
    with serving(cfg) as ports:
        yield f"http://127.0.0.1:{ports.http}", ports


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=http[0] + "/v1", api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine(MODEL_DIR, EngineConfig(kv_cache_tokens=8192, attention_backend="torch"))


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


def greedy(reference, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt], params)[0]


def get(url, token=TOKEN):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read().decode()


def post_raw(url, data: bytes, token=TOKEN):
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_sse(url, body: dict, token=TOKEN) -> list[dict]:
    """The events of a streamed response, parsed as vLLM's benchmark client parses them: ``data: `` (with
    the space) stripped, ``[DONE]`` last."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        messages = [m for m in r.read().decode().split("\n\n") if m]
    assert messages[-1] == "data: [DONE]"
    return [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]


def scrape(base_url) -> dict:
    """``{(family name, sample name, frozenset(labels)): value}`` of one scrape, plus the family types."""
    _, text = get(base_url + "/metrics")
    out = {"types": {}}
    for fam in parser.text_string_to_metric_families(text):
        out["types"][fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(m: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for k, v in m.items() if k != "types" and k[0] == name and set(labels.items()) <= k[1])


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert get(http[0] + "/health", token=None)[0] == 200  # open without a token


def test_completion_is_the_reference_engines_greedy_output(client, reference):
    ref = greedy(reference, PROMPT, 48)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ref.prompt_ids), 48, len(ref.prompt_ids) + 48)
    assert abs(r.created - time.time()) < 120


def test_streamed_completion_and_usage_chunk(client, reference):
    ref = greedy(reference, PROMPT, 40)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert len(text_chunks) > 2  # streamed, not one blob
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_ids)


def test_return_token_ids_streams_every_token(client, reference):
    """vLLM's ``return_token_ids`` extension (the SLO sweep counts tokens by it): the first token goes out
    as soon as prefill samples it, before its text is known."""
    ref = greedy(reference, PROMPT, 30)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == ref.token_ids
    assert chunks[0].choices[0].model_extra["token_ids"] == ref.token_ids[:1]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == ref.token_ids


def test_token_id_prompt_and_stop_string(client, reference):
    ids = greedy(reference, PROMPT, 1).prompt_ids
    ref = greedy(reference, ids, 64)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text
    cut = ref.text.find("\n", 1)
    assert cut > 0, "the reference output has a line break to stop at"
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=64, temperature=0, stop=["\n"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert "\n" not in r.choices[0].text and ref.text.startswith(r.choices[0].text)


def test_chat_applies_the_models_template_as_transformers_does(client, reference, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = greedy(reference, ids, 32)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=32,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text
    assert stream[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in stream)


RECORD_SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["file", "dir", "link"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 1 << 20},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["path", "kind", "size", "tags"], "additionalProperties": False}


def test_response_format_gives_schema_valid_json_through_prefill_and_speculation(client, reference, hf_tokenizer):
    """The official client's ``response_format`` on chat (whole and streamed) and vLLM's ``structured_outputs``
    on completions: the model, which writes Python otherwise, answers with JSON that validates; the first
    token (sampled on the prefill instance) and the speculated rest follow the grammar, token for token as
    the reference engine under the same grammar."""
    jsonschema = pytest.importorskip("jsonschema")
    from modeling.structured_output import StructuredOutput

    fmt = {"type": "json_schema", "json_schema": {"name": "entry", "schema": RECORD_SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0,
                                       response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), RECORD_SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = reference.generate([ids], SamplingParams(max_tokens=120, structured=StructuredOutput.json_schema(RECORD_SCHEMA)))
    assert text == ref[0].text
    stream = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    any_object = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0,
                                                response_format={"type": "json_object"})
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    many = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0.8, seed=3, n=3,
                                     extra_body={"structured_outputs": {"json": RECORD_SCHEMA}})
    for choice in many.choices:
        jsonschema.validate(json.loads(choice.text), RECORD_SCHEMA)
    picked = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert picked.choices[0].text in ("yes", "no", "maybe")


def test_grpc_structured_output(http):
    """The gRPC surface's ``structured_output``: a JSON schema's output validates, a choice picks one of its
    options, and a grammar the engine cannot compile is INVALID_ARGUMENT naming the field."""
    grpc = pytest.importorskip("grpc")
    jsonschema = pytest.importorskip("jsonschema")
    from frontend.client import Client

    with Client(f"127.0.0.1:{http[1].grpc}", token=TOKEN) as c:
        r = c.generate(PROMPT, max_tokens=100, structured_output={"json_schema": RECORD_SCHEMA})
        jsonschema.validate(json.loads(r.text), RECORD_SCHEMA)
        assert r.finish_reason == "stop"
        r = c.generate(PROMPT, max_tokens=8, temperature=1.0, structured_output={"choice": ["os.walk", "os.scandir"]})
        assert r.text in ("os.walk", "os.scandir")
        with pytest.raises(grpc.RpcError) as err:
            c.generate(PROMPT, max_tokens=8, structured_output={"regex": "(unclosed"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("sampling.regex")


TOOLS = [
    {"type": "function", "function": {"name": "stat_file", "description": "Size and kind of a path",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 20},
                                          "follow_links": {"type": "boolean"}},
                                          "required": ["path", "follow_links"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 20}, "depth": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["path", "depth"], "additionalProperties": False}}},
]
TOOL_MESSAGES = [{"role": "user", "content": "How big is setup.py?"}]


def streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """The tool calls a stream's ``delta.tool_calls`` add up to (as the openai client accumulates them),
    the last finish reason and the content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        reason = choice.finish_reason or reason
    return calls, reason, content


def test_forced_tool_calls_parse_whole_and_streamed(client):
    """``tool_choice`` naming a function or ``required``: the call is generated under its schema, so its
    arguments always parse and validate; streamed as OpenAI's ``delta.tool_calls`` pieces that add up to
    the same call; finish reason ``tool_calls``."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "stat_file"}}
    r = client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=named,
                                       max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "stat_file" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas["stat_file"])
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    calls, reason, content = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0,
        stream=True))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("stat_file", call.function.arguments)]
    assert reason == "tool_calls" and content == ""
    for seed in (1, 2):  # one call (parallel_tool_calls false): the array closes after it
        r = client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
        whole = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert whole and r.choices[0].finish_reason == "tool_calls"
        for name, arguments in whole:
            jsonschema.validate(json.loads(arguments), schemas[name])
        calls, reason, _ = streamed_calls(client.chat.completions.create(
            model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
            temperature=1.0, seed=seed, parallel_tool_calls=False, stream=True))
        assert [(c["name"], c["arguments"]) for c in calls.values()] == whole and reason == "tool_calls"


def test_a_conversation_with_tool_results_and_auto_tool_choice(client, reference, hf_tokenizer):
    """The tools and the tool messages reach the chat template as transformers passes them (the prompt is
    the one ``apply_chat_template(tools=...)`` makes); with ``auto`` the model's free answer is content."""
    history = TOOL_MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "stat_file", "arguments": json.dumps({"path": "setup.py", "follow_links": False})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"size\": 5120, \"kind\": \"file\"}"}]
    template_history = [dict(m) for m in history]
    template_history[1] = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "stat_file", "arguments": {"path": "setup.py", "follow_links": False}}}]}
    ids = hf_tokenizer.apply_chat_template(template_history, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = greedy(reference, ids, 24)
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref.text and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "rm_rf"}})
    assert err.value.body["param"] == "tool_choice.function.name"


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_lm_eval_loglikelihood_request_returns_the_prompts_logprobs(http, reference):
    """lm-eval's loglikelihood request (token ids as a batch of one, echo, logprobs 1, one generated token):
    every echoed prompt position but the first carries the target's log-probability, as the reference
    engine computes it, and lm-eval's is_greedy test (the chosen token's value is the top one) holds exactly
    where the prompt token was the argmax."""
    ids = greedy(reference, PROMPT, 1).prompt_ids
    status, body = post_raw(http[0] + "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
         "echo": True}).encode())
    assert status == 200, body
    ref = reference.generate([ids], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [x.logprob for x in ref.prompt_logprobs[1:]] + [ref.logprobs[0].logprob]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected)) < 1e-3
    for value, top, x in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert (value == max(top.values())) == (x.rank == 1)
    assert choice["text"] == reference.tokenizer.decode(ids, skip_special_tokens=False) + ref.text
    assert body["usage"]["completion_tokens"] == 1
    status, body = post_raw(http[0] + "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0}).encode())
    assert status == 200, body
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["finish_reason"] == "length"


def test_lm_eval_generation_requests(http, reference):
    """lm-eval's generate_until bodies: a token-id prompt as a batch of one with the task's stop strings plus
    the tokenizer's EOS text and a seed (completions), and string content with stop and seed (chat)."""
    ids = greedy(reference, PROMPT, 1).prompt_ids
    ref = greedy(reference, ids, 24)
    stops = ["\n", "class ", "<|endoftext|>"]
    assert "\n" in ref.text
    cut = min(ref.text.find(x) for x in stops if x in ref.text)
    status, body = post_raw(http[0] + "/v1/completions", json.dumps(
        {"prompt": [ids], "model": MODEL, "max_tokens": 24, "temperature": 0, "stop": stops, "seed": 1234}).encode())
    assert status == 200, body
    assert body["choices"][0]["text"] == ref.text[:cut] and body["choices"][0]["index"] == 0
    status, body = post_raw(http[0] + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": PROMPT}], "model": MODEL, "max_tokens": 8, "temperature": 0,
         "stop": ["\n\n", "class "], "seed": 1234}).encode())
    assert status == 200 and isinstance(body["choices"][0]["message"]["content"], str), body


def test_a_large_body_does_not_stall_other_streams(client, http):
    """A body of a few MB is parsed and tokenized off the event loop (and without holding the GIL): a stream
    beside it keeps flowing while it is refused for its length."""
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=256, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    arrivals: list[float] = []
    reader = threading.Thread(target=lambda: arrivals.extend(time.perf_counter() for _ in stream))
    reader.start()
    while len(arrivals) < 3:
        time.sleep(0.01)
    big = json.dumps({"model": MODEL, "prompt": "def f(x):\n    return x + 1  # é\n" * 70000}).encode()
    t0 = time.perf_counter()
    status, body = post_raw(http[0] + "/v1/completions", big)
    t1 = time.perf_counter()
    reader.join()
    assert status == 400 and body["error"]["param"] == "prompt"  # over limits.max_prompt_tokens
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t0 and a < t1]
    if t1 - t0 > 1.0:  # tokenizing took long enough to tell a stalled loop from a free one
        # A loop blocked by the parse sends nothing until the 400 goes out, a gap of nearly all of t1 - t0 (the
        # upload and the refusal take milliseconds); a free loop keeps the stream going at whatever pace the
        # tokenizer thread leaves the decode worker on this machine's cores (on 2 cores, a gap of up to 2/3).
        inside = [a for a in arrivals if t0 < a < t1]
        assert inside and max(gaps) < 0.85 * (t1 - t0), (max(gaps), t1 - t0, len(inside))


def test_penalties_bias_and_min_tokens_under_speculation_equal_the_reference(client, reference):
    params = SamplingParams(max_tokens=40, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2,
                            min_tokens=5, logit_bias={10: 5.0}, ignore_eos=True)
    ref = reference.generate([PROMPT], params)[0]
    assert ref.token_ids != greedy(reference, PROMPT, 40).token_ids  # the processors change the output
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, presence_penalty=0.6,
                                  frequency_penalty=0.3, logit_bias={"10": 5},
                                  extra_body={"repetition_penalty": 1.2, "min_tokens": 5, "ignore_eos": True,
                                              "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref.token_ids and r.choices[0].text == ref.text


def test_chat_logprobs_streamed_with_continuous_usage(client, reference, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = reference.generate([ids], SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True))[0]
    stream = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    content = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in content] == [hf_tokenizer.decode([t]) for t in ref.token_ids]
    assert max(abs(e.logprob - x.logprob) for e, x in zip(content, ref.logprobs)) < 1e-3
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    used = [c.usage.completion_tokens for c in stream if c.choices]
    assert used == sorted(used) and used[-1] == 12 and stream[-1].choices == []


def test_the_bodies_vllms_benchmark_client_sends(http, reference):
    """``vllm bench serve``: completions with repetition_penalty 1.0 and logprobs null in every body, chat
    with content parts and max_completion_tokens; streamed, usage in a last chunk without choices."""
    ref = greedy(reference, PROMPT, 8)
    events = post_sse(http[0] + "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref.text
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    events = post_sse(http[0] + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        "temperature": 0.0})
    assert all("delta" in e["choices"][0] for e in events if e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 8
    status, models = get(http[0] + "/v1/models")
    assert json.loads(models)["data"][0]["root"] == MODEL


def test_n_sequences_and_best_of(client, http, reference):
    """n = 3 seeded choices are the single requests seeded seed + i (vLLM's seeding), one prefill forked on
    the decode instance; streamed, each choice comes under its index and ends with its own finish reason;
    best_of = 3, n = 1 returns the one of those three with the highest cumulative log-probability; greedy
    choices all equal the reference engine's output; gRPC returns every sequence."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    singles = [client.completions.create(**{**kw, "seed": 21 + i}, logprobs=0) for i in range(3)]
    r = client.completions.create(**kw, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 36
    assert [c.text for c in r.choices] == [x.choices[0].text for x in singles]
    chunks = list(client.completions.create(**kw, n=3, stream=True))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == r.choices[i].text
        assert [c.finish_reason for c in mine][-1] == "length" and mine[-2].finish_reason is None
    best = max(singles, key=lambda x: sum(x.choices[0].logprobs.token_logprobs))
    r = client.completions.create(**kw, best_of=3)
    assert len(r.choices) == 1 and r.choices[0].text == best.choices[0].text
    ref = greedy(reference, PROMPT, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [ref.text, ref.text]
    from frontend.client import Client

    with Client(f"127.0.0.1:{http[1].grpc}", token=TOKEN) as c:
        res = c.generate(PROMPT, max_tokens=12, temperature=1.0, seed=21, ignore_eos=True, n=3, logprobs=1)
        assert [q["text"] for q in res.sequences] == [x.choices[0].text for x in singles]
        assert res.text == singles[0].choices[0].text and len(res.logprobs) == 12
        chunks = list(c.generate_stream(PROMPT, max_tokens=12, temperature=1.0, seed=21, ignore_eos=True, n=2))
        assert "".join(x.text for x in chunks if x.index == 1) == singles[1].choices[0].text
        assert chunks[-1].final and sum(1 for x in chunks if x.finish_reason and not x.final) == 2


def test_operator_calls_need_the_operator_token(http):
    import grpc

    from frontend.client import Client

    with Client(f"127.0.0.1:{http[1].grpc}", token=TOKEN) as c:
        assert c.generate(PROMPT, max_tokens=2).finish_reason == "length"  # clients' calls take the clients' token
        with pytest.raises(grpc.RpcError) as err:
            c.drain("decode-0", undo=True)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "operator token" in err.value.details()
    with Client(f"127.0.0.1:{http[1].grpc}", token=ADMIN_TOKEN) as c:
        assert c.drain("decode-0", undo=True).instance == "decode-0"
        with pytest.raises(grpc.RpcError) as err:
            c.generate(PROMPT, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"beam_width": 2}}, "beam_width"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, 2, 999999]}, "prompt[2]"),
])
def test_bad_parameters_are_400_naming_the_parameter(client, kwargs, param):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["message"].startswith(param) and body["type"] == "invalid_request_error"


def test_chat_refusals(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f g"}}])
    assert err.value.body["param"] == "tools[0].function.name"


def test_unknown_model_auth_and_bad_json(client, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=http[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, body = post_raw(http[0] + "/v1/completions", b'{"model": "stdlib-llama-15m", "prompt": ')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = post_raw(http[0] + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = post_raw(http[0] + "/v1/nothing", b"{}")
    assert status == 404 and "error" in body


def test_full_server_is_429_and_disconnects_free_kv(client, http):
    """Two long streams fill the server (2 at once, no queue): a third request is refused with 429; closing
    the streams mid-way cancels them and every KV block comes back."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=256, temperature=0, stream=True, extra_body={"ignore_eos": True})
    streams = [client.completions.create(**kw) for _ in range(2)]
    for s in streams:
        next(iter(s))  # both admitted and streaming
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert err.value.status_code == 429
    for s in streams:
        s.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = scrape(http[0])
        if sample(m, "magicserve:num_requests_running") == 0 and sample(m, "magicserve:kv_cache_blocks_used") == 0:
            break
        time.sleep(0.3)
    assert sample(m, "magicserve:num_requests_running") == 0
    assert sample(m, "magicserve:kv_cache_blocks_used") == 0
    assert sample(m, "magicserve:request_errors_total", code="RESOURCE_EXHAUSTED") >= 1


def test_a_client_that_leaves_before_the_response_cancels_its_request(http):
    """A non-streamed request whose client times out is cancelled, not finished: no success is counted
    and its KV comes back."""
    before = scrape(http[0])
    impatient = openai.OpenAI(base_url=http[0] + "/v1", api_key=TOKEN, max_retries=0, timeout=0.3)
    # a long prompt no earlier request sent (nothing of it cached): the client leaves well before the last token
    prompt = PROMPT + "".join(f"    # step {i}: visit node {i * 7919 % 1000}\n" for i in range(50))
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt=prompt, max_tokens=256, temperature=0,
                                     extra_body={"ignore_eos": True})
    deadline = time.time() + 30
    while time.time() < deadline:
        m = scrape(http[0])
        if sample(m, "magicserve:num_requests_running") == 0 and sample(m, "magicserve:kv_cache_blocks_used") == 0:
            break
        time.sleep(0.2)
    assert sample(m, "magicserve:num_requests_running") == 0 and sample(m, "magicserve:kv_cache_blocks_used") == 0
    assert sample(m, "magicserve:request_success_total") == sample(before, "magicserve:request_success_total")


def test_a_repeated_prompt_is_prefilled_from_the_prefix_cache(client, http):
    """The second time, the prompt's full blocks are cached on the decode instance that served the first (its
    prompt and output stay there): the router has that instance prefill the rest itself, with no prefill
    instance involved (seen in the metrics), and the greedy output is the same. The response's usage says how
    many prompt tokens were found cached (``prompt_tokens_details.cached_tokens``, as the OpenAI client reads
    it), and so do the cluster's counters."""
    prompt = "".join(f"def add_{i}(x):\n    return x + {i}\n\n\n" for i in range(6))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 48
    before = scrape(http[0])
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    after = scrape(http[0])

    def grew(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    # every full block but the one holding the last prompt token
    cached = (num_prompt - 1) // 16 * 16
    assert grew("magicserve:prefix_cache_hits_total", instance="decode-0") == cached
    assert grew("magicserve:prefix_cache_queries_total", instance="prefill-0") == 0
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert grew("magicserve:prompt_tokens_cached_total") == cached
    assert grew("magicserve:prompt_tokens_cached_by_source_total", source="pool") == cached
    assert grew("magicserve:prompt_tokens_cached_by_source_total", source="tiers") == 0
    assert grew("magicserve:decode_local_prefills_total") == 1
    assert sample(after, "magicserve:kv_cache_blocks_cached", instance="decode-0") >= (num_prompt - 1) // 16
    assert again.choices[0].text == first.choices[0].text


def test_metrics_parse_and_count_what_was_served(client, http):
    before = scrape(http[0])
    n = 3
    threads = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model=MODEL, prompt=PROMPT + "    " * i, max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True})) for i in range(n)]
    for t in threads[:2]:
        t.start()
    for t in threads[:2]:
        t.join()
    threads[2].start()
    threads[2].join()
    m = scrape(http[0])
    types = m["types"]
    for name, kind in [("magicserve:time_to_first_token_seconds", "histogram"),
                       ("magicserve:inter_token_latency_seconds", "histogram"),
                       ("magicserve:request_time_per_output_token_seconds", "histogram"),
                       ("magicserve:e2e_request_latency_seconds", "histogram"),
                       ("magicserve:request_success", "counter"), ("magicserve:request_errors", "counter"),
                       ("magicserve:prompt_tokens", "counter"), ("magicserve:generation_tokens", "counter"),
                       ("magicserve:prompt_tokens_cached", "counter"),
                       ("magicserve:prompt_tokens_cached_by_source", "counter"),
                       ("magicserve:num_requests_running", "gauge"), ("magicserve:num_requests_waiting", "gauge"),
                       ("magicserve:kv_cache_blocks_used", "gauge"), ("magicserve:kv_cache_blocks_total", "gauge"),
                       ("magicserve:prefill_queue_length", "gauge"), ("magicserve:decode_queue_length", "gauge"),
                       ("magicserve:decode_local_prefills", "gauge"), ("magicserve:requests_handed_back", "counter"),
                       ("magicserve:spec_decode_num_draft_tokens", "counter"),
                       ("magicserve:spec_decode_num_accepted_tokens", "counter"),
                       ("magicserve:spec_decode_acceptance_rate", "gauge"),
                       ("magicserve:spec_decode_mean_accepted_length", "gauge"), ("magicserve:spec_decode_k", "gauge"),
                       ("magicserve:kv_transfer_bytes", "counter"), ("magicserve:kv_transfer_seconds", "counter"),
                       ("magicserve:kv_transfer_failures", "counter"),
                       ("magicserve:prefix_cache_queries", "counter"), ("magicserve:prefix_cache_hits", "counter")]:
        assert types.get(name) == kind, name

    def grew(name, **labels):
        return sample(m, name, **labels) - sample(before, name, **labels)

    assert grew("magicserve:request_success_total", finished_reason="length") == n
    assert grew("magicserve:generation_tokens_total") == n * 20
    assert grew("magicserve:time_to_first_token_seconds_count") == n
    assert grew("magicserve:e2e_request_latency_seconds_count") == n
    assert grew("magicserve:inter_token_latency_seconds_count") == n * 19
    assert grew("magicserve:kv_transfers_total", instance="prefill-0") == n
    # K and V of every layer, 2 KV heads x 64 dims in float32, whole 16-token blocks of each prompt
    assert grew("magicserve:kv_transfer_bytes_total") > 0
    assert grew("magicserve:kv_transfer_bytes_total") % (8 * 2 * 16 * 2 * 64 * 4) == 0
    assert grew("magicserve:spec_decode_num_draft_tokens_total") > 0
    drafts = sample(m, "magicserve:spec_decode_num_draft_tokens_total")
    accepted = sample(m, "magicserve:spec_decode_num_accepted_tokens_total")
    assert sample(m, "magicserve:spec_decode_acceptance_rate", instance="decode-0") == pytest.approx(accepted / drafts)
    assert sample(m, "magicserve:kv_cache_blocks_total", instance="decode-0") == 8192 // 16
    assert sample(m, "magicserve:kv_cache_blocks_total", instance="prefill-0") == 4096 // 16
