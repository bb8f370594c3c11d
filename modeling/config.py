"""Typed model configuration parsed from a Hugging Face ``config.json``.

Supported families: Llama 2 / 3 / 3.1 / 3.2 (``model_type: llama``, including ``llama3`` and ``linear``
RoPE scaling), Mistral (``mistral``, served with full attention) and Qwen2 / 2.5 (``qwen2``, QKV bias).
Both the classic layout (``rope_theta`` + ``rope_scaling``) and the newer ``rope_parameters`` layout are
read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from modeling.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is one of SUPPORTED_ROPE_TYPES other than default."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder. Field names follow the HF config where they exist."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama when attention_bias)
    o_bias: bool  # bias on the output projection (Llama when attention_bias)
    mlp_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def fingerprint(self) -> dict[str, Any]:
        """The fields two workers must agree on to exchange KV caches."""
        return {
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    @staticmethod
    def from_hf_dict(raw: Mapping[str, Any], file: str = _CONFIG_FILE) -> "ModelConfig":
        """Validate and convert a parsed ``config.json``. Raises CheckpointError naming the field."""
        reader = _FieldReader(raw, file)
        model_type = reader.get("model_type", str)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                file,
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
                "model_type",
            )
        act = reader.get("hidden_act", str, default="silu")
        if act != "silu":
            raise CheckpointError(file, f"unsupported activation {act!r}; supported: 'silu'", "hidden_act")
        hidden = reader.positive_int("hidden_size")
        heads = reader.positive_int("num_attention_heads")
        kv_heads = reader.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise CheckpointError(
                file, f"must divide num_attention_heads ({heads}), got {kv_heads}", "num_key_value_heads"
            )
        head_dim = reader.get("head_dim", int, default=None)
        if head_dim is None:
            if hidden % heads:
                raise CheckpointError(file, f"hidden_size {hidden} is not a multiple of {heads}", "hidden_size")
            head_dim = hidden // heads
        if head_dim <= 0 or head_dim % 2:
            raise CheckpointError(file, f"must be a positive even number, got {head_dim}", "head_dim")
        rope_theta, scaling = _read_rope(reader)
        attention_bias = reader.get("attention_bias", bool, default=False)
        qkv_bias = True if model_type == "qwen2" else attention_bias
        o_bias = False if model_type == "qwen2" else attention_bias
        eos = raw.get("eos_token_id")
        return ModelConfig(
            model_type=model_type,
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=reader.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(reader.get("rms_norm_eps", (int, float), default=1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=reader.positive_int("max_position_embeddings", default=2048),
            tie_word_embeddings=reader.get("tie_word_embeddings", bool, default=False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=reader.get("mlp_bias", bool, default=False),
            bos_token_id=reader.get("bos_token_id", int, default=None),
            eos_token_ids=_token_ids(eos, file, "eos_token_id"),
        )


def _token_ids(value: Any, file: str, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise CheckpointError(file, f"expected an int or a list of ints, got {value!r}", field)
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise CheckpointError(file, f"expected an int or a list of ints, got {value!r}", field)


class _FieldReader:
    """Typed access to a JSON mapping with errors that name the file and field."""

    _MISSING = object()

    def __init__(self, raw: Mapping[str, Any], file: str):
        if not isinstance(raw, Mapping):
            raise CheckpointError(file, "expected a JSON object at top level")
        self.raw = raw
        self.file = file

    def get(self, field: str, types: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        value = self.raw.get(field, default)
        if value is self._MISSING:
            raise CheckpointError(self.file, "required field is missing", field)
        if value is None and default is None:
            return None
        types_t = types if isinstance(types, tuple) else (types,)
        # bool is an int subclass in Python: never accept it where a number is expected.
        if not isinstance(value, types_t) or (isinstance(value, bool) and bool not in types_t):
            names = " or ".join(t.__name__ for t in types_t)
            raise CheckpointError(self.file, f"expected {names}, got {value!r}", field)
        return value

    def positive_int(self, field: str, default: Any = _MISSING) -> int:
        value = self.get(field, int, default=default)
        if value <= 0:
            raise CheckpointError(self.file, f"must be > 0, got {value}", field)
        return value


def _read_rope(reader: _FieldReader) -> tuple[float, RopeScaling | None]:
    """Read RoPE theta and scaling from either config layout."""
    params = reader.raw.get("rope_parameters")
    field_prefix = "rope_parameters"
    if params is None:
        theta = reader.raw.get("rope_theta", 10000.0)
        params = reader.raw.get("rope_scaling")
        field_prefix = "rope_scaling"
    else:
        if not isinstance(params, Mapping):
            raise CheckpointError(reader.file, f"expected an object, got {params!r}", "rope_parameters")
        theta = params.get("rope_theta", reader.raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(reader.file, f"must be a positive number, got {theta!r}", "rope_theta")
    if params is None:
        return float(theta), None
    if not isinstance(params, Mapping):
        raise CheckpointError(reader.file, f"expected an object or null, got {params!r}", field_prefix)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            reader.file,
            f"unsupported {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            f"{field_prefix}.rope_type",
        )
    if rope_type == "default":
        return float(theta), None
    sub = _FieldReader(params, reader.file)

    def num(name: str, default: Any = _FieldReader._MISSING) -> float:
        try:
            value = float(sub.get(name, (int, float), default=default))
        except CheckpointError as err:
            raise CheckpointError(reader.file, err.reason, f"{field_prefix}.{name}") from None
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(reader.file, f"must be a positive number, got {value}", f"{field_prefix}.{name}")
        return value

    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=num("factor"))
    low, high = num("low_freq_factor"), num("high_freq_factor")
    if high <= low:
        raise CheckpointError(
            reader.file, f"must be > low_freq_factor ({low}), got {high}", f"{field_prefix}.high_freq_factor"
        )
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=num("factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(num("original_max_position_embeddings")),
    )
