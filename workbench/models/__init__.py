"""Small models the course trains: a Llama-style decoder built from workbench.ops."""
from .config import ModelConfig, PRESETS, get_config, param_count, ParamCount
from .llama import Llama, TP_PLAN
from .data import TOKENIZER, get_batch, batches, load_text

__all__ = ["ModelConfig", "PRESETS", "get_config", "param_count", "ParamCount", "Llama",
           "TP_PLAN", "TOKENIZER", "get_batch", "batches", "load_text"]
