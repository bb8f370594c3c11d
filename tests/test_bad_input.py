"""Bad checkpoints and bad requests fail with messages that name the file/field at fault."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from modeling.checkpoint import load_model
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import CheckpointError, InvalidRequestError
from modeling.sampling import SamplingParams


@pytest.fixture
def broken(tmp_path, llama_dir):
    """A fresh copy of a good checkpoint to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_model(str(tmp_path / "nope"))


def test_missing_config(broken):
    os.remove(broken / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(str(broken))


def test_corrupt_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_model(str(broken))


def test_missing_weights(broken):
    os.remove(broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: file not found"):
        load_model(str(broken))


def test_corrupt_weights(broken):
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors file"):
        load_model(str(broken))


def test_unsupported_model_type(broken):
    edit_config(broken, model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"config\.json: model_type: unsupported model_type 'gpt2'; supported: llama"):
        load_model(str(broken))


def test_bad_field_types(broken):
    edit_config(broken, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match=r"num_key_value_heads: must divide num_attention_heads \(4\), got 3"):
        load_model(str(broken))
    edit_config(broken, num_key_value_heads=2, hidden_size="64")
    with pytest.raises(CheckpointError, match=r"hidden_size: expected int, got '64'"):
        load_model(str(broken))
    edit_config(broken, hidden_size=64, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(CheckpointError, match=r"rope_parameters.rope_type: unsupported 'yarn'"):
        load_model(str(broken))


def test_shape_mismatch_names_tensor(broken):
    edit_config(broken, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.0\.mlp\.\w+_proj\.weight: shape \[\d+, \d+\] does not match"):
        load_model(str(broken))


def test_sharded_index_missing_shard(broken):
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: weight shard listed in the index is missing"):
        load_model(str(broken))


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    """Split the single file into two shards with an index; the model must load identically."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded"
    shutil.copytree(llama_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    os.remove(d / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    a = load_model(str(d)).model.state_dict()
    b = load_model(llama_dir).model.state_dict()
    assert all((a[k] == b[k]).all() for k in b)


def test_bad_dtype(llama_dir):
    with pytest.raises(ValueError, match="dtype: unsupported 'float64'; allowed: float32, bfloat16, float16"):
        load_model(llama_dir, dtype="float64")


@pytest.fixture(scope="module")
def engine(llama_dir):
    return ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequestError, match=r"prompt: 1024 tokens leave no room to generate within the context of 1024"):
        engine.add_request([5] * 1024)


def test_bad_prompt_tokens(engine):
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[1\]: must be an integer in \[0, 384\), got 999"):
        engine.add_request([5, 999])
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        engine.add_request([])


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=-1), r"max_tokens: must be >= 0, got -1"),
    (dict(repetition_penalty=0.0), r"repetition_penalty: must be > 0.0, got 0.0"),
    (dict(presence_penalty=2.5), r"presence_penalty: must be <= 2.0, got 2.5"),
    (dict(min_p=-0.1), r"min_p: must be >= 0.0, got -0.1"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens: must be <= 4, got 5"),
    (dict(logit_bias={400: 1.0}), r"logit_bias: must be <= 383, got 400"),
    (dict(logit_bias={3: 101.0}), r"logit_bias\[3\]: must be <= 100.0, got 101.0"),
    (dict(logprobs=21), r"logprobs: must be <= 20, got 21"),
    (dict(n=2, best_of=1), r"best_of: must be >= 2, got 1"),
    (dict(temperature=-1.0), r"temperature: must be >= 0.0, got -1.0"),
    (dict(temperature=float("nan")), r"temperature: must be a finite number"),
    (dict(top_p=0.0), r"top_p: must be > 0.0, got 0.0"),
    (dict(top_p=1.5), r"top_p: must be <= 1.0, got 1.5"),
    (dict(top_k=-2), r"top_k: must be >= 0, got -2"),
    (dict(seed=-1), r"seed: must be >= 0, got -1"),
    (dict(seed="7"), r"seed: must be an integer, got '7'"),
    (dict(stop_token_ids=[400]), r"stop_token_ids\[0\]: must be <= 383, got 400"),
    (dict(stop=[""]), r"stop\[0\]: must be a non-empty string"),
    (dict(max_tokens=True), r"max_tokens: must be an integer, got True"),
])
def test_invalid_sampling_params(engine, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request([5, 6, 7], SamplingParams(**kwargs))
    assert not engine.has_unfinished()


def test_bad_engine_config():
    with pytest.raises(ValueError, match="token_budget: must be >= 1, got 0"):
        EngineConfig(token_budget=0)
