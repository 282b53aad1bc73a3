from sana2.models.registry import MODELS, ModelConfigError, build_model, model_keywords
from sana2.models.sana import SanaMS
from sana2.models.sana_video import SanaMSVideo

__all__ = ["MODELS", "ModelConfigError", "SanaMS", "SanaMSVideo", "build_model", "model_keywords"]
