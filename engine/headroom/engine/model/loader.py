"""Load a model from local disk: a Hugging Face directory or the built-in `tiny` model.

A directory needs `config.json`, `*.safetensors` weights (one file, or shards listed in
`model.safetensors.index.json`) and `tokenizer.json`. Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from headroom.contract.budget import DTYPE_NAMES
from headroom.contract.jsonfile import fields_line, read_json_object
from headroom.engine.model.config import ModelConfig, from_hf_dict
from headroom.engine.model.llama import LlamaForCausalLM
from headroom.engine.model.tiny import TINY_NAME, build_tiny
from headroom.engine.model.tokenizer import HFTokenizer, Tokenizer
from headroom.engine.sampling import SamplingParams

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
# transformers' GenerationConfig defaults (4.x, which vLLM 0.11 reads the file with) of the
# sampling fields vLLM takes from generation_config.json; a value equal to its default is no
# setting of the model's (`GenerationConfig.to_diff_dict`).
_HF_SAMPLING_DEFAULTS: dict[str, float | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}
# The ones the sampler does not implement, with their neutral value (no warning for that).
_UNSUPPORTED_SAMPLING: dict[str, float] = {"min_p": 0.0, "repetition_penalty": 1.0}
log = logging.getLogger(__name__)


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
    return read_json_object(cfg_file)


def parse_config(path: Path) -> ModelConfig:
    """The decoder config of a model directory; a field out of bounds is one line naming the
    file and the field (not pydantic's multi-line report)."""
    cfg_file = path / "config.json"
    try:
        return from_hf_dict(read_config(path))
    except ValidationError as e:
        raise ValueError(f"{cfg_file}: {fields_line(e)}") from None
    except (KeyError, TypeError, ZeroDivisionError, OverflowError, AttributeError) as e:
        # A field missing, null, zero or of the wrong kind: say which file, and what broke.
        raise ValueError(
            f"{cfg_file}: not a model config this reads ({type(e).__name__}: {e})"
        ) from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, in shard order."""
    index = path / _INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
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


def _read_generation_config(path: Path) -> dict[str, Any]:
    """The `generation_config.json` mapping of a model directory, {} without one (the file is
    optional, as in transformers); raises OSError or ValueError naming a file it cannot read."""
    gen_file = path / GENERATION_CONFIG
    return read_json_object(gen_file) if gen_file.is_file() else {}


def _special_ids(path: Path, cfg: ModelConfig) -> tuple[int | None, tuple[int, ...]]:
    bos, eos = cfg.bos_token_id, list(cfg.eos_token_ids)
    gen: dict[str, Any] = {}
    try:
        gen = _read_generation_config(path)
    except (OSError, ValueError) as e:
        # Optional, as in transformers: the model loads with config.json's ids.
        log.warning("%s; ignoring it (the file is optional)", e)
    if gen:
        if bos is None and gen.get("bos_token_id") is not None:
            bos = int(gen["bos_token_id"])
        extra = gen.get("eos_token_id")
        for tid in extra if isinstance(extra, list) else [extra]:
            if tid is not None and int(tid) not in eos:
                eos.append(int(tid))
    return bos, tuple(eos)


def _sampling_value(name: str, value: object) -> float | int | None:
    """`value` as the engine's `SamplingParams` takes `name`, None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number: float | int = value
    if name == "top_k" and isinstance(value, float):
        if not value.is_integer():  # also inf and nan
            return None
        number = int(value)
    try:
        SamplingParams.model_validate({name: number})
    except ValidationError:
        return None
    return number


def generation_sampling_defaults(path: str | Path) -> dict[str, float | int]:
    """The model's own sampling defaults, as vLLM's `--generation-config auto` takes them from
    `generation_config.json` (`ModelConfig.get_diff_sampling_param`): `temperature`, `top_p`
    and `top_k` where they differ from transformers' GenerationConfig defaults (1.0, 1.0, 50;
    vLLM reads `to_diff_dict`, so a file's `top_k` 50 sets nothing), whatever `do_sample` says
    (vLLM does not look at it). A value the engine cannot sample with is left out with a
    warning, and so are `min_p` and `repetition_penalty`, which its sampler does not
    implement. {} for a directory without the file, or with one that cannot be read (the load
    warns about that one)."""
    path = Path(path).expanduser()
    gen_file = path / GENERATION_CONFIG
    try:
        gen = _read_generation_config(path)
    except (OSError, ValueError) as e:
        log.debug("no sampling defaults: %s", e)
        return {}
    defaults: dict[str, float | int] = {}
    for name, hf_default in _HF_SAMPLING_DEFAULTS.items():
        value = gen.get(name)
        if value is None or value == hf_default:
            continue
        if name in _UNSUPPORTED_SAMPLING:
            if value != _UNSUPPORTED_SAMPLING[name]:
                log.warning(
                    "%s: %s %r is not supported by this engine; requests sample without it",
                    gen_file, name, value,
                )  # fmt: skip
            continue
        usable = _sampling_value(name, value)
        if usable is None:
            log.warning("%s: ignoring %s %r (not a value the engine samples with)",
                        gen_file, name, value)  # fmt: skip
            continue
        defaults[name] = usable
    return defaults


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
    cfg = parse_config(path)
    dt = resolve_dtype(dtype, dev, cfg.weight_dtype)
    files = weight_files(path)
    tokenizer = load_tokenizer(path, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # Cast while still on meta, then allocate: materializing fp32 first and casting after
    # would hold the whole model in fp32 on the device (2x a bf16 model's weights) at the
    # peak. The rotary frequencies are a plain fp32 attribute, untouched by either.
    model = model.to(dt).to_empty(device=dev)
    if cfg.tie_word_embeddings:  # to_empty gives each parameter new storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_weights(files))
    return LoadedModel(path.name, cfg, model.eval(), tokenizer, dt)
