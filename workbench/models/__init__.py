"""Small models the course trains: a Llama-style decoder built from workbench.ops, and
Megatron's GPT (``ModelConfig(arch="gpt")``); ``build_model(cfg)`` builds either."""
from .config import ModelConfig, PRESETS, ARCHS, get_config, param_count, ParamCount, build_model
from .llama import Llama, TP_PLAN
from .gpt import GPT, GPT_TP_PLAN
from .data import TOKENIZER, get_batch, batches, load_text

__all__ = ["ModelConfig", "PRESETS", "ARCHS", "get_config", "param_count", "ParamCount",
           "build_model", "Llama", "TP_PLAN", "GPT", "GPT_TP_PLAN", "TOKENIZER", "get_batch",
           "batches", "load_text"]
