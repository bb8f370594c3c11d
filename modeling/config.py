"""Typed model configuration parsed from a Hugging Face ``config.json``.

Supported families: Llama 2 / 3 / 3.1 / 3.2 (``model_type: llama``, including ``llama3`` and ``linear``
RoPE scaling), Mistral (``mistral``) and Qwen2 / 2.5 (``qwen2``, QKV bias). Both the classic layout
(``rope_theta`` + ``rope_scaling``) and the newer ``rope_parameters`` layout are read; as in transformers,
a non-empty ``rope_scaling`` takes precedence over ``rope_parameters``.

Sliding-window attention follows transformers 5.24 (:attr:`ModelConfig.layer_windows`). A query at
position ``p`` of a layer with window ``W`` sees keys ``p - W + 1 .. p`` (``W`` keys, itself included;
masking_utils.sliding_window_overlay: ``kv_idx > q_idx - W``). Which layers slide:

* Mistral: every layer when ``sliding_window`` is an integer, none when it is null. A missing field means
  4096 (MistralConfig's default). MistralForCausalLM ignores ``layer_types``: one that disagrees with
  ``sliding_window`` is refused.
* Qwen2: the window is ``sliding_window`` when ``use_sliding_window`` is true (default false), else there
  is none; the layers are ``layer_types`` when given, else layer ``i`` slides iff a window exists and
  ``i >= max_window_layers`` (default 28).
* Llama: no window; a non-null ``sliding_window`` or a sliding ``layer_types`` is refused.

``layer_types`` entries must be ``full_attention`` or ``sliding_attention`` (the legacy ``attention``
reads as ``full_attention``, as transformers remaps it), one per layer.

Fields that would change the math and are not implemented are refused with a CheckpointError naming the
file and field:

* ``layer_types`` values other than the two above;
* non-null ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2 fields, which transformers'
  Llama / Mistral / Qwen2 classes would silently drop: a checkpoint that sets them expects other math) and
  ``attention_chunk_size`` (Llama 4 chunked attention; transformers would give such a checkpoint a chunked
  KV cache in ``generate``);
* ``partial_rotary_factor`` other than 1, at top level or in the RoPE object (transformers' linear and
  llama3 RoPE read it), and RoPE parameters nested per layer type;
* RoPE types other than SUPPORTED_ROPE_TYPES, activations other than SiLU;
* ``attention_bias`` / ``mlp_bias`` true on Mistral or Qwen2, whose transformers classes have fixed biases
  (none; Qwen2: q/k/v only).

``pretraining_tp`` (read by no transformers 5.24 model code) and ``attention_dropout`` (training only) do
not change inference and are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from modeling.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
SUPPORTED_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION}  # transformers' remap of old names
_DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig / Qwen2Config default when the field is absent
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config default
# Fields of other architectures that would change the math; refused when set to anything but null.
_UNIMPLEMENTED_WHEN_SET = ("attn_logit_softcapping", "final_logit_softcapping", "attention_chunk_size")

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
    # Sliding window of each layer (None: full attention), or None when no layer slides. A query at
    # position p of a layer with window W sees keys p - W + 1 .. p.
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_windows is None:
            return
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"layer_windows: expected {self.num_hidden_layers} entries, got {len(self.layer_windows)}")
        for w in self.layer_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"layer_windows: entries must be None or integers >= 1, got {w!r}")

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None: full attention)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

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
        _refuse_unimplemented(reader)
        attention_bias = reader.get("attention_bias", bool, default=False)
        mlp_bias = reader.get("mlp_bias", bool, default=False)
        if model_type != "llama":
            # MistralForCausalLM / Qwen2ForCausalLM build fixed biases (Qwen2: q/k/v only) whatever these say
            for field, value in (("attention_bias", attention_bias), ("mlp_bias", mlp_bias)):
                if value:
                    raise CheckpointError(file, f"not supported for model_type {model_type!r} (its projections "
                                                f"have fixed biases in transformers)", field)
        qkv_bias = True if model_type == "qwen2" else attention_bias
        o_bias = False if model_type == "qwen2" else attention_bias
        num_layers = reader.positive_int("num_hidden_layers")
        eos = raw.get("eos_token_id")
        return ModelConfig(
            model_type=model_type,
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=num_layers,
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
            mlp_bias=mlp_bias,
            bos_token_id=reader.get("bos_token_id", int, default=None),
            eos_token_ids=_token_ids(eos, file, "eos_token_id"),
            layer_windows=_read_layer_windows(reader, model_type, num_layers),
        )


def _read_layer_windows(reader: "_FieldReader", model_type: str, num_layers: int) -> tuple[int | None, ...] | None:
    """Per-layer sliding windows as transformers 5.24 computes them (see the module docstring)."""
    file = reader.file
    if model_type == "qwen2":
        use = reader.get("use_sliding_window", bool, default=False)
        window = _window_value(reader) if use else None
        max_window_layers = reader.get("max_window_layers", int, default=_DEFAULT_MAX_WINDOW_LAYERS)
        types = _layer_types(reader, num_layers)
        if types is None:
            types = [SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION
                     for i in range(num_layers)]
        elif SLIDING_ATTENTION in types and window is None:
            raise CheckpointError(file, "sliding_attention layers need use_sliding_window: true and an integer "
                                        "sliding_window", "layer_types")
    else:
        window = _window_value(reader) if model_type == "mistral" else None
        if model_type == "llama" and reader.raw.get("sliding_window") is not None:
            raise CheckpointError(file, "model_type 'llama' has no sliding-window attention; must be null "
                                        "(a sliding-window checkpoint is model_type 'mistral' or 'qwen2')",
                                  "sliding_window")
        # Mistral/Llama attention ignores layer_types: the window (if any) applies to every layer.
        implied = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
        types = _layer_types(reader, num_layers)
        if types is not None and any(t != implied for t in types):
            raise CheckpointError(
                file, f"model_type {model_type!r} applies "
                      f"{'full attention' if window is None else f'sliding_window {window}'}"
                      f" to every layer (transformers ignores layer_types for it); this list disagrees", "layer_types")
        types = [implied] * num_layers
    windows = tuple(window if t == SLIDING_ATTENTION else None for t in types)
    return windows if any(w is not None for w in windows) else None


def _window_value(reader: "_FieldReader") -> int | None:
    """``sliding_window``: a positive integer, null for none; absent means transformers' default 4096."""
    if "sliding_window" not in reader.raw:
        return _DEFAULT_SLIDING_WINDOW
    window = reader.get("sliding_window", int, default=None)
    if window is not None and window < 1:
        raise CheckpointError(reader.file, f"must be a positive integer or null, got {window}", "sliding_window")
    return window


def _layer_types(reader: "_FieldReader", num_layers: int) -> list[str] | None:
    """Validated ``layer_types`` (legacy names remapped), or None when absent or null."""
    raw = reader.raw.get("layer_types")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise CheckpointError(reader.file, f"expected a list of strings, got {raw!r}", "layer_types")
    if len(raw) != num_layers:
        raise CheckpointError(reader.file, f"expected one entry per layer ({num_layers}), got {len(raw)}",
                              "layer_types")
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in raw]
    for i, t in enumerate(types):
        if t not in SUPPORTED_LAYER_TYPES:
            raise CheckpointError(reader.file, f"unsupported {t!r}; supported: {', '.join(SUPPORTED_LAYER_TYPES)}",
                                  f"layer_types[{i}]")
    return types


def _refuse_unimplemented(reader: "_FieldReader") -> None:
    """Refuse set fields that ask for math this model does not compute (see the module docstring)."""
    for field in _UNIMPLEMENTED_WHEN_SET:
        if reader.raw.get(field) is not None:
            raise CheckpointError(reader.file, f"not supported (must be null or absent), got {reader.raw[field]!r}",
                                  field)


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
    """Read RoPE theta and scaling from either config layout (``rope_scaling`` wins when non-empty, as in
    transformers' ``convert_rope_params_to_dict``)."""
    scaling_raw = reader.raw.get("rope_scaling")
    if scaling_raw:
        params, field_prefix = scaling_raw, "rope_scaling"
    else:
        params, field_prefix = reader.raw.get("rope_parameters"), "rope_parameters"
    if params is not None and not isinstance(params, Mapping):
        raise CheckpointError(reader.file, f"expected an object or null, got {params!r}", field_prefix)
    params = params or None
    theta = reader.raw.get("rope_theta", 10000.0) if params is None else params.get(
        "rope_theta", reader.raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(reader.file, f"must be a positive number, got {theta!r}", "rope_theta")
    sources = ((reader.raw, "partial_rotary_factor"), (params or {}, f"{field_prefix}.partial_rotary_factor"))
    for where, field in sources:
        factor = where.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            raise CheckpointError(reader.file, f"partial rotary embeddings are not supported (must be 1), "
                                               f"got {factor!r}", field)
    if params is None:
        return float(theta), None
    nested = [key for key in params if key in SUPPORTED_LAYER_TYPES or key in _LEGACY_LAYER_TYPES]
    if nested:
        raise CheckpointError(reader.file, f"RoPE parameters per layer type are not supported (keys {nested})",
                              field_prefix)
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
