"""Load a model from local disk: a Hugging Face directory or the built-in `tiny` model.

A directory needs `config.json`, `*.safetensors` weights (one file, or shards listed in
`model.safetensors.index.json`) and `tokenizer.json`. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headroom.contract.budget import DTYPE_NAMES
from headroom.engine.model.config import ModelConfig, from_hf_dict
from headroom.engine.model.llama import LlamaForCausalLM
from headroom.engine.model.tiny import TINY_NAME, build_tiny
from headroom.engine.model.tokenizer import HFTokenizer, Tokenizer

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_INDEX = "model.safetensors.index.json"


class ModelFilesError(FileNotFoundError):
    """A model directory lacks a file the loader needs."""


class UnsupportedDtype(ValueError):
    """The requested weight dtype cannot run on the chosen device."""


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str = "float32"
) -> torch.dtype:
    """The weight dtype to run with; "auto" is float32 on CPU (exact and fast enough there) and
    the checkpoint's dtype (a torch name or the contract's short one) on CUDA."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        short = DTYPE_NAMES.get(checkpoint_dtype)
        name = next((t for t in DTYPES if DTYPE_NAMES[t] == short), "bfloat16")
    if name not in DTYPES:
        raise UnsupportedDtype(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise UnsupportedDtype("float16 is not supported on CPU; use float32 or bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UnsupportedDtype(f"bfloat16 is not supported on {torch.cuda.get_device_name(device)}")
    return dtype


def read_config(path: Path) -> dict[str, Any]:
    """The `config.json` mapping of a model directory."""
    if not path.is_dir():
        raise ModelFilesError(f"model directory {path} does not exist (and is not 'tiny')")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelFilesError(f"no config.json in {path}")
    data: dict[str, Any] = json.loads(cfg_file.read_text())
    return data


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, in shard order."""
    index = path / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelFilesError(f"{_INDEX} in {path} names missing shards: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    legacy = sorted(p.name for p in path.glob("*.bin"))
    hint = f" (found {legacy}: PyTorch .bin checkpoints are not supported)" if legacy else ""
    raise ModelFilesError(f"no *.safetensors weights in {path}{hint}")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in `files`, one shard open at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _special_ids(path: Path, cfg: ModelConfig) -> tuple[int | None, tuple[int, ...]]:
    bos, eos = cfg.bos_token_id, list(cfg.eos_token_ids)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        if bos is None and gen.get("bos_token_id") is not None:
            bos = int(gen["bos_token_id"])
        extra = gen.get("eos_token_id")
        for tid in extra if isinstance(extra, list) else [extra]:
            if tid is not None and int(tid) not in eos:
                eos.append(int(tid))
    return bos, tuple(eos)


def load_tokenizer(path: Path, cfg: ModelConfig) -> HFTokenizer:
    """The fast tokenizer of a model directory with BOS/EOS ids from its configs."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelFilesError(
            f"no tokenizer.json in {path} (only the Hugging Face fast-tokenizer format is read)"
        )
    bos, eos = _special_ids(path, cfg)
    return HFTokenizer(tok_file, bos_token_id=bos, eos_token_ids=eos)


def load_failure(exc: BaseException) -> str:
    """A failed load in one line: the loader's own errors (ValueError, OSError: they name the
    file) by their message, a parser's (KeyError, SafetensorError) with its type."""
    return str(exc) if isinstance(exc, ValueError | OSError) else f"{type(exc).__name__}: {exc}"


def load_model(name: str, dtype: str = "auto", device: str | torch.device = "cpu") -> LoadedModel:
    """Load `name` ("tiny" or a local Hugging Face directory) onto `device`."""
    dev = torch.device(device)
    if name == TINY_NAME:
        dt = resolve_dtype(dtype, dev)
        model, tok = build_tiny(dtype=dt, device=dev)
        return LoadedModel(TINY_NAME, model.config, model, tok, dt)
    path = Path(name).expanduser()
    cfg = from_hf_dict(read_config(path))
    dt = resolve_dtype(dtype, dev, cfg.weight_dtype)
    files = weight_files(path)
    tokenizer = load_tokenizer(path, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=dev).to(dt)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_weights(files))
    return LoadedModel(path.name, cfg, model.eval(), tokenizer, dt)
