from sana2.models.config import SanaConfig, SanaVideoConfig
from sana2.models.registry import MODELS, ModelConfigError, build_model, model_config
from sana2.models.sana import SanaMS
from sana2.models.sana_video import SanaMSVideo

__all__ = [
    "MODELS",
    "ModelConfigError",
    "SanaConfig",
    "SanaMS",
    "SanaMSVideo",
    "SanaVideoConfig",
    "build_model",
    "model_config",
]
