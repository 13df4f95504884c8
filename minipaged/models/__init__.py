"""Model classes, and the registry from ``config.architectures[0]`` to them."""

from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .opt import OPTForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def model_class(architecture: str | None):
    """The class serving ``architecture``; a ``ValueError`` names the supported ones."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]


__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "OPTForCausalLM", "Qwen2ForCausalLM",
           "MODEL_REGISTRY", "model_class"]
