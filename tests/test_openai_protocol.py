"""The HTTP front's parts on plain objects: OpenAI request validation and response shapes, chat templates
rendered exactly as transformers renders them, metrics that never go backwards across restarts, and the
config fields of the HTTP front."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from controller.config import ConfigError, parse_config
from controller.metrics import MonotonicTotals, ServingMetrics
from frontend.chat_template import ChatTemplate, ChatTemplateError
from frontend.openai_output import ChoiceResult, ResponseBuilder
from frontend.openai_protocol import OpenAIError, OpenAIProtocol
from modeling.tokenizer import TextTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")

# a Llama-3-style template: bos, headers, raise_exception, loop controls, tojson
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if loop.index0 > 8 %}{% break %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{% if tools is defined %}{{ tools | tojson }}{% endif %}"
)
CONVERSATION = [{"role": "system", "content": "Be brief. é ✓"}, {"role": "user", "content": "  hi  "},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]


@pytest.fixture(scope="module")
def protocol():
    tok = TextTokenizer(MODEL_DIR)
    return OpenAIProtocol("m", tok, ChatTemplate.from_checkpoint(MODEL_DIR), vocab_size=4096, max_prompt_tokens=64,
                          max_tokens=100, max_model_len=128)


# -- chat templates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["bundled", LLAMA3_STYLE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(tmp_path, template, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    directory = MODEL_DIR
    if template != "bundled":
        directory = str(tmp_path)
        for name in ("tokenizer.json", "special_tokens_map.json"):
            with open(os.path.join(MODEL_DIR, name)) as f, open(os.path.join(directory, name), "w") as g:
                g.write(f.read())
        with open(os.path.join(MODEL_DIR, "tokenizer_config.json")) as f:
            cfg = json.load(f)
        cfg["chat_template"] = template
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    ours = ChatTemplate.from_checkpoint(directory)
    expected = hf.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.render(CONVERSATION, add_generation_prompt) == expected
    ids = hf.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert TextTokenizer(directory).encode(expected, add_special_tokens=False) == ids


def test_chat_template_file_wins_and_named_lists(tmp_path):
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "T"},
                                                           {"name": "default", "template": "D{{ eos_token }}"}]}, f)
    assert ChatTemplate.from_checkpoint(str(tmp_path)).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert ChatTemplate.from_checkpoint(str(tmp_path)).render([{"role": "user", "content": "x"}]) == "F1"


def test_chat_template_errors_and_sandbox(tmp_path):
    t = ChatTemplate(LLAMA3_STYLE, {"bos_token": "<s>"})
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        t.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="chat_template: not a valid jinja2 template"):
        ChatTemplate("{% for %}", {})
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        evil.render([])
    assert ChatTemplate.from_checkpoint(str(tmp_path)) is None


# -- requests ---------------------------------------------------------------------------------------


def refused(fn, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        fn(body)
    return err.value


def test_completion_parsing(protocol):
    r = protocol.completion({"model": "m", "prompt": "def f():", "max_tokens": 7, "temperature": 0, "stop": "\n",
                             "seed": 3, "top_k": -1, "ignore_eos": True, "user": "u"})
    assert r.kind == "completion" and r.prompt_ids == protocol.tokenizer.encode("def f():")
    p = r.params
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.top_k, p.ignore_eos) == (7, 0.0, ("\n",), 3, 0, True)
    assert protocol.completion({"model": "m", "prompt": [5, 6]}).params.max_tokens == 16  # OpenAI's default
    assert protocol.completion({"model": "m", "prompt": [[5, 6]]}).prompt_ids == [5, 6]
    assert protocol.completion({"model": "m", "prompt": ["ab"]}).prompt_ids == protocol.tokenizer.encode("ab")
    # vLLM's priority (lower first) becomes the router's (higher first)
    assert protocol.completion({"model": "m", "prompt": "x", "priority": -3}).priority == 3
    assert protocol.completion({"model": "m", "prompt": "x"}).priority == 0


def test_chat_parsing_defaults_to_the_room_left(protocol):
    r = protocol.chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}]})
    text = protocol.chat_template.render([{"role": "user", "content": "ab"}], True)
    assert r.prompt_ids == protocol.tokenizer.encode(text, add_special_tokens=False)
    assert r.params.max_tokens == min(100, 128 - len(r.prompt_ids))
    r = protocol.chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5,
                       "max_completion_tokens": 9})
    assert r.params.max_tokens == 9


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "m"}, 400, "prompt"),
    ({"model": "m", "prompt": ""}, 400, "prompt"),
    ({"model": "m", "prompt": "x" * 400}, 400, "prompt"),
    ({"model": "m", "prompt": [1, True]}, 400, "prompt"),
    ({"model": "m", "prompt": [4096]}, 400, "prompt[0]"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "m", "prompt": "x", "seed": "1"}, 400, "seed"),
    ({"model": "m", "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "m", "prompt": "x", "n": 17}, 400, "n"),
    ({"model": "m", "prompt": "x", "priority": 1.5}, 400, "priority"),
    ({"model": "m", "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ({"model": "m", "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "m", "prompt": "x", "logit_bias": {"x": 5}}, 400, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias[1]"),
    ({"model": "m", "prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ({"model": "m", "prompt": "x", "stop_token_ids": [4096]}, 400, "stop_token_ids[0]"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ({"model": "m", "prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
    ({"model": "m", "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "guided_regex"),
    ({"model": "m", "prompt": "x", "guided_decoding_backend": "xgrammar"}, 400, "guided_decoding_backend"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options"),
    ({"model": "m", "prompt": "x", "messages": []}, 400, "messages"),
])
def test_completion_refusals_name_the_parameter(protocol, body, status, param):
    err = refused(protocol.completion, body)
    assert (err.status, err.param) == (status, param)
    assert err.body()["error"]["param"] == param and err.message.startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
])
def test_chat_refusals_name_the_parameter(protocol, body, param):
    assert refused(protocol.chat, body).param == param


def test_chat_without_a_template_is_refused(protocol):
    bare = OpenAIProtocol("m", protocol.tokenizer, None, 4096, 64, 100, 128)
    err = refused(bare.chat, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert err.param == "messages" and "no chat template" in err.message


def test_response_shapes(protocol):
    c = protocol.completion({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    out = ResponseBuilder(c, protocol.tokenizer, "cmpl-1", 5)
    assert out.response([ChoiceResult(0, "hi", [1, 2], finish_reason="length")], 3, 2) == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert out.chunk(0, "h")["usage"] is None  # include_usage: every chunk has the key
    assert out.usage_chunk(3, 2)["choices"] == []
    chat = protocol.chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    out = ResponseBuilder(chat, protocol.tokenizer, "chatcmpl-1", 5)
    first = out.chunk(0, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first
    assert out.chunk(0, None, reason="stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                              "finish_reason": "stop"}


def test_sampling_surface_parsing(protocol):
    r = protocol.completion({"model": "m", "prompt": "x", "repetition_penalty": 1.0, "logprobs": None,
                             "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.1, "min_tokens": 2,
                             "stop_token_ids": [7], "include_stop_str_in_output": True, "logit_bias": {"5": -100},
                             "n": 2, "best_of": 3, "seed": 4, "use_beam_search": False, "echo": False})
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (0.5, -0.5, 1.0, 0.1, 2)
    assert p.stop_token_ids == (7,) and p.include_stop_str_in_output and p.logit_bias == ((5, -100.0),)
    assert (p.n, p.best_of, p.logprobs) == (2, 3, 0)  # best_of ranks by log-probabilities: computed, not shown
    assert r.logprobs is None
    # lm-eval's loglikelihood request: echo, logprobs, one generated token, a batch of one token-id prompt
    r = protocol.completion({"model": "m", "prompt": [[5, 6, 7]], "echo": True, "logprobs": 1, "max_tokens": 1,
                             "temperature": 0, "seed": 1234})
    assert r.echo and r.prompt_ids == [5, 6, 7] and r.params.prompt_logprobs == 1 and r.params.logprobs == 1
    assert protocol.completion({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0}).params.max_tokens == 0
    chat = protocol.chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert chat.params.logprobs == 3 and chat.continuous_usage and not chat.include_usage


def test_echo_and_logprob_shapes(protocol):
    from modeling.logprobs import TokenLogprob

    r = protocol.completion({"model": "m", "prompt": [5, 6], "echo": True, "logprobs": 1, "max_tokens": 1})
    out = ResponseBuilder(r, protocol.tokenizer, "cmpl-1", 5)
    prompt_lps = [None, TokenLogprob(6, -1.5, 2, ((9, -0.5),))]
    choice = ChoiceResult(0, "z", [7], [TokenLogprob(7, -0.25, 1, ((7, -0.25),))], "length")
    body = out.response([choice], 2, 1, prompt_lps)
    lp = body["choices"][0]["logprobs"]
    texts = protocol.tokenizer.token_texts([5, 6, 7, 9])
    assert body["choices"][0]["text"] == protocol.tokenizer.decode([5, 6], skip_special_tokens=False) + "z"
    assert lp["tokens"] == texts[:3] and lp["token_logprobs"] == [None, -1.5, -0.25]
    assert lp["top_logprobs"] == [None, {texts[3]: -0.5, texts[1]: -1.5}, {texts[2]: -0.25}]
    assert lp["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    chat = protocol.chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 1})
    body = ResponseBuilder(chat, protocol.tokenizer, "c", 5).response([choice], 2, 1)
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": texts[2], "logprob": -0.25, "bytes": list(texts[2].encode()),
                     "top_logprobs": [{"token": texts[2], "logprob": -0.25, "bytes": list(texts[2].encode())}]}


# -- metrics ----------------------------------------------------------------------------------------


def test_monotonic_totals_survive_restarts():
    t = MonotonicTotals()
    t.update("d0", 0, {"x": 5})
    t.update("d0", 0, {"x": 9})
    assert t.total("d0", "x") == 9
    t.update("d0", 1, {"x": 12})  # replaced, and already counted 12 more before this scrape
    assert t.total("d0", "x") == 21
    t.update("d0", 1, {"x": 2})  # a drop without a generation change is a restart too
    assert t.total("d0", "x") == 23
    t.update("d0", 1, {"x": 4})
    assert t.total("d0", "x") == 25


def _sample(metrics: ServingMetrics, name: str, **labels):
    """The value of the first sample ``name`` whose labels include ``labels`` (None: none)."""
    parser = pytest.importorskip("prometheus_client.parser")
    for fam in parser.text_string_to_metric_families(metrics.exposition().decode()):
        for s in fam.samples:
            if s.name == name and set(labels.items()) <= set(s.labels.items()):
                return s.value
    return None


def test_instance_counters_never_go_backwards():
    m = ServingMetrics("m")

    def value(name, **labels):
        return _sample(m, name, **labels)

    st = {"name": "decode-0", "role": "decode", "device": "cpu", "alive": True, "generation": 0, "draft_tokens": 40,
          "accepted_tokens": 30, "k_counts": {3: 10}, "total_kv_blocks": 8, "free_kv_blocks": 6}
    m.observe_instances([st])
    assert value("magicserve:spec_decode_num_draft_tokens_total") == 40
    assert value("magicserve:spec_decode_steps_total", k="3") == 10
    assert value("magicserve:kv_cache_usage_perc") == 0.25
    m.observe_instances([{**st, "device": "", "draft_tokens": 0}])  # not answering: keeps the counts
    assert value("magicserve:spec_decode_num_draft_tokens_total") == 40
    m.observe_instances([{**st, "generation": 1, "draft_tokens": 4, "accepted_tokens": 1, "k_counts": {3: 1}}])
    assert value("magicserve:spec_decode_num_draft_tokens_total") == 44
    assert value("magicserve:spec_decode_num_accepted_tokens_total") == 31
    assert value("magicserve:spec_decode_steps_total", k="3") == 11
    assert value("magicserve:instance_generation") == 1


def test_kv_tier_series_carry_the_tier_and_never_go_backwards():
    from modeling.kv_tiers.stats import TierStats

    m = ServingMetrics("m")

    def value(name, **labels):
        return _sample(m, name, **labels)

    disk = TierStats(hits=5, bytes_in=500, load_s=0.25, stored=9, blocks=9, bytes=900, capacity_bytes=4096)
    st = {"name": "prefill-0", "role": "prefill", "device": "cpu", "generation": 0, "prefix_cache_tier_hits": 80,
          "kv_tiers": {"disk": disk.as_dict(), "host": TierStats(capacity_bytes=1024).as_dict()}}
    m.observe_instances([st])
    assert value("magicserve:kv_tier_hits_total", tier="disk", instance="prefill-0") == 5
    assert value("magicserve:kv_tier_load_seconds_total", tier="disk") == 0.25
    assert value("magicserve:kv_tier_bytes", tier="disk") == 900
    assert value("magicserve:kv_tier_capacity_bytes", tier="host") == 1024
    assert value("magicserve:prefix_cache_tier_hits_total") == 80
    restarted = {**disk.as_dict(), "hits": 2, "blocks": 1}
    m.observe_instances([{**st, "generation": 1, "kv_tiers": {"disk": restarted}}])
    assert value("magicserve:kv_tier_hits_total", tier="disk") == 7  # banked across the restart
    assert value("magicserve:kv_tier_blocks", tier="disk") == 1



MASTER_METRICS = """# HELP master_key_count keys
master_key_count 42
master_total_capacity_bytes 402653184
segment_allocated_bytes{segment="10.0.0.1:13544"} 1048576
segment_total_capacity_bytes{segment="10.0.0.1:13544"} 268435456
segment_total_capacity_bytes{segment="10.0.0.2:12001"} 134217728
"""


def test_the_stores_segments_come_from_its_masters_metrics_and_reach_metrics():
    from controller.kv_store import parse_master_metrics

    occupancy = parse_master_metrics(MASTER_METRICS, {"10.0.0.1:13544": "node-a"})
    assert occupancy.objects == 42 and occupancy.capacity_bytes == 402653184 and occupancy.used_bytes == 1048576
    assert [(g.name, g.node, g.used_bytes) for g in occupancy.segments] == [("10.0.0.1:13544", "node-a", 1048576),
                                                                            ("10.0.0.2:12001", "", 0)]
    m = ServingMetrics("m")
    m.observe_store(occupancy)
    m.observe_store(None)  # the master did not answer: the last figures stay
    assert _sample(m, "magicserve:kv_store_capacity_bytes", segment="10.0.0.2:12001") == 134217728
    assert _sample(m, "magicserve:kv_store_used_bytes", segment="10.0.0.1:13544", node="node-a") == 1048576
    assert _sample(m, "magicserve:kv_store_objects") == 42

# -- config -----------------------------------------------------------------------------------------


def test_kv_tiers_config_names_the_field():
    base = {"model": {"path": "x"}}
    cfg = parse_config(base)
    assert cfg.kv_tiers.active and cfg.decode.kv_tiers == cfg.prefill.kv_tiers == cfg.kv_tiers  # on by default
    assert cfg.kv_tiers.loads_layer_by_layer("cuda:0") and not cfg.kv_tiers.loads_layer_by_layer("cpu")  # auto
    assert parse_config({**base, "kv_tiers": {"layered_loads": True}}).prefill.kv_tiers.loads_layer_by_layer("cpu")
    assert parse_config({**base, "kv_tiers": {"store": {"replicas": 2}}}).decode.kv_tiers.store.replicas == 2
    off = parse_config({**base, "kv_tiers": {"enabled": False}})
    assert not off.colocated.kv_tiers.active
    for bad, why in [({"disk_mb": -1}, "kv_tiers.disk_mb: must be >= 0, got -1"),
                     ({"host_memory_mb": "1G"}, "kv_tiers.host_memory_mb: must be an integer"),
                     ({"write_queue_blocks": 0}, "kv_tiers.write_queue_blocks: must be >= 1"),
                     ({"layered_loads": "sometimes"}, "kv_tiers.layered_loads: must be true, false or auto, got 'some"),
                     ({"layered_loads": 1}, "kv_tiers.layered_loads: must be true, false or auto, got 1"),
                     ({"store": {"replicas": 0}}, "kv_tiers.store.replicas: must be >= 1, got 0"),
                     ({"disk": 1}, "kv_tiers.disk: unknown field")]:
        with pytest.raises(ConfigError, match=why):
            parse_config({**base, "kv_tiers": bad})
    with pytest.raises(ConfigError, match="decode.kv_tiers: not set here; it follows kv_tiers"):
        parse_config({**base, "decode": {"kv_tiers": {}}})


def test_http_port_config():
    base = {"model": {"path": "x"}}
    assert parse_config(base).server.http_port == 8000
    assert parse_config({**base, "server": {"http_port": None}}).server.http_port is None
    for bad, why in [(70000, "must be in"), (50051, "must differ from port"), ("80", "must be an integer")]:
        with pytest.raises(ConfigError, match=f"server.http_port: {why}"):
            parse_config({**base, "server": {"http_port": bad}})


def test_output_constraints_from_each_surface(protocol):
    """response_format, vLLM's structured_outputs and the guided_* parameters give the same constraints; a
    grammar the engine cannot compile is refused naming where it was given."""
    from modeling.structured_output import StructuredOutput

    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    by_format = protocol.chat({**chat, "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "s", "schema": schema}}})
    by_vllm = protocol.chat({**chat, "structured_outputs": {"json": schema}})
    by_guided = protocol.completion({"model": "m", "prompt": "x", "guided_json": json.dumps(schema)})
    assert by_format.params.structured.spec == by_vllm.params.structured.spec == by_guided.params.structured.spec
    assert list(json.loads(by_format.params.structured.spec)["properties"]) == ["b", "a"]  # order kept
    assert protocol.chat({**chat, "response_format": {"type": "text"}}).params.structured is None
    assert protocol.chat({**chat, "response_format": {"type": "json_object"}}).params.structured.kind == "json_object"
    choice = protocol.completion({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.params.structured == StructuredOutput.choice(["yes", "no"])
    pytest.importorskip("llguidance")
    from frontend.server import grammar_check
    from modeling.checkpoint import load_config

    checked = dataclasses.replace(protocol, grammar_check=grammar_check(MODEL_DIR, load_config(MODEL_DIR)))
    for body, param in [({"guided_regex": "(unclosed"}, "guided_regex"),
                        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
                        ({"response_format": {"type": "json_schema", "json_schema": {
                            "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
                         "response_format.json_schema.schema")]:
        err = refused(checked.completion, {"model": "m", "prompt": "x", **body})
        assert err.param == param and err.status == 400, (err.param, err.message)
    assert checked.completion({"model": "m", "prompt": "x", "guided_regex": "[0-9]+"}).params.structured.kind == "regex"
