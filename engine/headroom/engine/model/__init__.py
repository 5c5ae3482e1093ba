"""The torch decoder (Llama 2/3, Mistral, Qwen2), its loaders and tokenizers."""

from headroom.engine.model.batch import ForwardBatch, build_forward_batch
from headroom.engine.model.config import ModelConfig, UnsupportedModel, from_hf_dict
from headroom.engine.model.llama import LlamaForCausalLM
from headroom.engine.model.loader import (
    LoadedModel,
    ModelFilesError,
    UnsupportedDtype,
    load_model,
    resolve_dtype,
)
from headroom.engine.model.tiny import TINY_NAME, build_tiny, tiny_config
from headroom.engine.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)

__all__ = [
    "TINY_NAME",
    "ByteTokenizer",
    "ForwardBatch",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelFilesError",
    "Tokenizer",
    "UnsupportedDtype",
    "UnsupportedModel",
    "build_forward_batch",
    "build_tiny",
    "from_hf_dict",
    "load_model",
    "resolve_dtype",
    "tiny_config",
]
