"""Load a local Hugging Face checkpoint directory (never the network).

A directory holds ``config.json``, weights as ``model.safetensors`` or a sharded
``model.safetensors.index.json``, ``tokenizer.json`` and optionally ``generation_config.json``.
Every failure raises :class:`CheckpointError` naming the file (and field or tensor) at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from modeling.config import ModelConfig, _token_ids
from modeling.dtypes import parse_dtype
from modeling.errors import CheckpointError
from modeling.heads import HeadRange
from modeling.model import CausalLM
from modeling.rope import RotaryEmbedding
from modeling.tp import DROP, TensorSlice, TPShard, shard_layout, slice_plan

SINGLE_WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the checkpoint says about generation."""

    path: str
    config: ModelConfig
    model: CausalLM
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]
    shard: TPShard = TPShard()  # which tensor-parallel slice of the model this is

    @property
    def kv_heads(self) -> HeadRange:
        """The global KV heads this (possibly sharded) model computes and caches."""
        return self.shard.kv_heads(self.config)


def read_json(directory: str, name: str, required: bool = True) -> dict[str, Any] | None:
    """Parse ``directory/name`` as a JSON object; CheckpointError if missing (when required) or corrupt."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            raise CheckpointError(path, "file not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(path, f"not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "expected a JSON object at top level")
    return data


def load_config(directory: str) -> ModelConfig:
    """Read and validate ``config.json``."""
    _check_directory(directory)
    raw = read_json(directory, "config.json")
    return ModelConfig.from_hf_dict(raw, file=os.path.join(directory, "config.json"))


def read_eos_token_ids(directory: str, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present, else from config.json."""
    gen_path = os.path.join(directory, "generation_config.json")
    gen = read_json(directory, "generation_config.json", required=False)
    if gen is not None and gen.get("eos_token_id") is not None:
        return _token_ids(gen["eos_token_id"], gen_path, "eos_token_id")
    return config.eos_token_ids


def load_model(directory: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               shard: TPShard = TPShard()) -> LoadedModel:
    """Build a :class:`CausalLM` from a local HF directory, weights cast to ``dtype`` on ``device``.
    With a sharded ``shard``, only that tensor-parallel rank's slices are read (see :mod:`modeling.tp`);
    the caller installs the all-reduces (:func:`modeling.tp.install_all_reduce`)."""
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but CUDA is not available; allowed here: cpu")
    config = load_config(directory)
    with torch.device("meta"):
        model = CausalLM(config)
    full_shapes = {name: tuple(t.shape) for name, t in model.hf_state_dict().items()}
    shard_layout(model, shard)
    tensors = _read_weights(directory, full_shapes, slice_plan(config, shard), torch_dtype, device)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryEmbedding(config).to(device)
    model.eval().requires_grad_(False)
    return LoadedModel(
        path=directory,
        config=config,
        model=model,
        dtype=torch_dtype,
        device=device,
        eos_token_ids=read_eos_token_ids(directory, config),
        shard=shard,
    )


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise CheckpointError(directory, "checkpoint directory not found (only local paths are supported)")


def _weight_files(directory: str) -> dict[str, list[str]]:
    """Map each weight file to the tensor names it should provide (None = whatever it holds)."""
    index = read_json(directory, SHARD_INDEX, required=False)
    if index is None:
        single = os.path.join(directory, SINGLE_WEIGHTS)
        if not os.path.isfile(single):
            raise CheckpointError(single, f"file not found (nor {SHARD_INDEX})")
        return {single: []}
    weight_map = index.get("weight_map")
    index_path = os.path.join(directory, SHARD_INDEX)
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index_path, "expected a non-empty object", "weight_map")
    files: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.sep in shard or shard.startswith("."):
            raise CheckpointError(index_path, f"invalid shard file name {shard!r}", f"weight_map.{name}")
        files.setdefault(os.path.join(directory, shard), []).append(name)
    return files


def _read_weights(
    directory: str, full_shapes: dict[str, tuple[int, ...]], plan: dict[str, TensorSlice | None],
    dtype: torch.dtype, device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``full_shapes`` (checked against it), or the slice ``plan`` names; none it drops."""
    expected = {name for name in full_shapes if not (name in plan and plan[name] is DROP)}
    tensors: dict[str, torch.Tensor] = {}
    for path, names in _weight_files(directory).items():
        if not os.path.isfile(path):
            raise CheckpointError(path, "weight shard listed in the index is missing")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                available = set(f.keys())
                for name in names:
                    if name not in available:
                        raise CheckpointError(path, "tensor listed in the index is missing", name)
                for name in sorted(available):
                    if name not in full_shapes:
                        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise CheckpointError(path, "unexpected tensor for this architecture", name)
                    lazy = f.get_slice(name)
                    shape, want = tuple(lazy.get_shape()), full_shapes[name]
                    if shape != want:
                        raise CheckpointError(path, f"shape {list(shape)} does not match config.json {list(want)}", name)
                    if name in plan and plan[name] is DROP:
                        continue
                    part = plan.get(name)
                    if part is None:
                        tensor = lazy[:]
                    elif part.dim == 0:
                        tensor = lazy[part.start : part.stop]
                    else:
                        tensor = lazy[:, part.start : part.stop]
                    tensors[name] = tensor.to(device=device, dtype=dtype)
        except SafetensorError as err:
            raise CheckpointError(path, f"corrupt safetensors file ({err})") from None
        except OSError as err:
            raise CheckpointError(path, f"cannot read ({err})") from None
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(directory, f"weights missing from the checkpoint: {shown}")
    return tensors
