"""Model families, one file each, registered by their GGUF `general.architecture`."""

from __future__ import annotations

from edgeinfer.models.base import Transformer
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.bert import Bert
from edgeinfer.models.gemma3 import Gemma3
from edgeinfer.models.gemma4 import Gemma4
from edgeinfer.models.gptoss import GptOss
from edgeinfer.models.llama import Llama
from edgeinfer.models.nomic_bert import NomicBert
from edgeinfer.models.qwen2 import Qwen2
from edgeinfer.models.qwen3 import Qwen3
from edgeinfer.models.qwen3moe import Qwen3Moe
from edgeinfer.models.qwen35 import Qwen35
from edgeinfer.models.qwen35moe import Qwen35Moe

ARCHITECTURES: dict[str, type[Transformer]] = {
    "llama": Llama,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "qwen3moe": Qwen3Moe,
    "qwen35": Qwen35,
    "qwen35moe": Qwen35Moe,
    "gpt-oss": GptOss,
    "gemma3": Gemma3,
    "gemma4": Gemma4,
    "bert": Bert,
    "nomic-bert": NomicBert,
}
# Architectures that are the same graph under another name (mlx-lm keeps the same remap).
ALIASES = {"mistral": "llama"}


def family_for(arch: str) -> type[Transformer] | None:
    return ARCHITECTURES.get(ALIASES.get(arch, arch))


__all__ = ["ARCHITECTURES", "ModelConfig", "Transformer", "family_for"]
