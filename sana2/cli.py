"""What every sana2 command shares: exit codes, dtype names, and the names of the config files.

A leaf module (sana2/config.py and the commands import it; it imports nothing from sana2, and torch
only when a dtype is asked for), so `sana2.launch` can name an exit code without loading a model.
"""

OK = 0
USER_ERROR = 2
"""Bad input: a config key, a flag, a file. The command printed one message naming it and what was expected."""

CONFIG_JSON = "config.json"
"""A Hugging Face / diffusers model folder's config, and the resolved run config in a step folder."""
CONFIG_TOML = "config.toml"
"""The resolved run config as TOML, in the dump folder and each step folder: `sana2-train` reruns it."""

# every spelling a flag or a config key accepts -> torch's name of the dtype
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def dtype_name(text: str) -> str:
    """torch's name of the dtype `text` spells ("bf16" and "bfloat16" -> "bfloat16"); unknown text is
    returned as it is, for the caller's choices to reject with the allowed names."""
    return DTYPE_ALIASES.get(text.strip().lower(), text) if isinstance(text, str) else text


def torch_dtype(text: str):
    """The torch.dtype `text` spells (any alias of DTYPE_ALIASES)."""
    import torch

    name = dtype_name(text)
    if name not in DTYPE_ALIASES.values():
        raise ValueError(f"unknown dtype {text!r}; expected one of {', '.join(sorted(set(DTYPE_ALIASES.values())))}")
    return getattr(torch, name)


DTYPE_HELP = "float32, bfloat16 or float16 (also fp32, bf16, fp16)"
