"""Maps a checkpoint's `architectures` entry to the model class and its variant switches."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.deepseek import DeepseekV3ForCausalLM
from tokenmill.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
    text_config,
)
from tokenmill.models.glm import Glm4ForCausalLM, Glm4MoeForCausalLM, GlmForCausalLM
from tokenmill.models.gpt import PhiForCausalLM, Starcoder2ForCausalLM
from tokenmill.models.gpt_oss import GptOssForCausalLM
from tokenmill.models.granite import (
    GraniteForCausalLM,
    GraniteMoeForCausalLM,
    GraniteMoeHybridForCausalLM,
)
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.llama4 import Llama4ForCausalLM
from tokenmill.models.mamba2 import Mamba2ForCausalLM
from tokenmill.models.moe import MixtralForCausalLM, qwen_moe_mlp
from tokenmill.models.olmo import Olmo2ForCausalLM
from tokenmill.models.qwen3_next import Qwen3NextForCausalLM

# architecture -> (class, extra constructor arguments derived from the HF config)
_MODELS = {
    "LlamaForCausalLM": (LlamaForCausalLM,
                         lambda c: {"qkv_bias": bool(getattr(c, "attention_bias", False))}),
    "MistralForCausalLM": (LlamaForCausalLM, lambda c: {}),
    "Qwen2ForCausalLM": (LlamaForCausalLM, lambda c: {"qkv_bias": True}),
    "Qwen3ForCausalLM": (LlamaForCausalLM,
                         lambda c: {"qkv_bias": bool(getattr(c, "attention_bias", False)),
                                    "qk_norm": True}),
    # fused qkv_proj / gate_up_proj tensors load as they are (our merged layers' names)
    "Phi3ForCausalLM": (LlamaForCausalLM, lambda c: {}),
    "MixtralForCausalLM": (MixtralForCausalLM, lambda c: {}),
    "Gemma2ForCausalLM": (Gemma2ForCausalLM, lambda c: {}),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, lambda c: {}),
    "Qwen2MoeForCausalLM": (LlamaForCausalLM,
                            lambda c: {"qkv_bias": bool(getattr(c, "qkv_bias", True)),
                                       "make_mlp": qwen_moe_mlp}),
    "DeepseekV3ForCausalLM": (DeepseekV3ForCausalLM, lambda c: {}),
    "DeepseekV2ForCausalLM": (DeepseekV3ForCausalLM, lambda c: {}),
    "Qwen3MoeForCausalLM": (LlamaForCausalLM,
                            lambda c: {"qkv_bias": bool(getattr(c, "attention_bias", False)),
                                       "qk_norm": True, "make_mlp": qwen_moe_mlp}),
    "GemmaForCausalLM": (GemmaForCausalLM, lambda c: {}),
    "PhiForCausalLM": (PhiForCausalLM, lambda c: {}),
    "Starcoder2ForCausalLM": (Starcoder2ForCausalLM, lambda c: {}),
    "Olmo2ForCausalLM": (Olmo2ForCausalLM, lambda c: {}),
    "Olmo3ForCausalLM": (Olmo2ForCausalLM, lambda c: {}),
    "GraniteForCausalLM": (GraniteForCausalLM, lambda c: {}),
    "GraniteMoeForCausalLM": (GraniteMoeForCausalLM, lambda c: {}),
    "GraniteMoeSharedForCausalLM": (GraniteMoeForCausalLM, lambda c: {}),
    "GlmForCausalLM": (GlmForCausalLM, lambda c: {}),
    "Glm4ForCausalLM": (Glm4ForCausalLM, lambda c: {}),
    "Glm4MoeForCausalLM": (Glm4MoeForCausalLM, lambda c: {}),
    "Llama4ForCausalLM": (Llama4ForCausalLM, lambda c: {}),
    "GptOssForCausalLM": (GptOssForCausalLM, lambda c: {}),
    "Mamba2ForCausalLM": (Mamba2ForCausalLM, lambda c: {}),
    "Qwen3NextForCausalLM": (Qwen3NextForCausalLM, lambda c: {}),
    "GraniteMoeHybridForCausalLM": (GraniteMoeHybridForCausalLM, lambda c: {}),
}


SUPPORTED_ARCHITECTURES = tuple(_MODELS) + ("LlavaForConditionalGeneration",
                                             "LlavaNextForConditionalGeneration",
                                             "LlavaOnevisionForConditionalGeneration",
                                             "Qwen2VLForConditionalGeneration",
                                             "Qwen2_5_VLForConditionalGeneration",
                                             "Gemma3ForConditionalGeneration",
                                             "Llama4ForConditionalGeneration")


def _llava_text_config(config: Any) -> Any:
    """A LLaVA checkpoint's language model's config (its images: models/vision/)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}.get(config.text_config.model_type)
    if arch is None:
        raise ValueError(f"LLaVA over a {config.text_config.model_type} language model is "
                         "not served.")
    return _inner_text_config(config, arch)


def _qwen_vl_text_config(config: Any) -> Any:
    """A Qwen2-VL / Qwen2.5-VL checkpoint's language model: a Qwen2 whose rotary is M-RoPE
    (its `mrope_section`: layers/rotary.py)."""
    return _inner_text_config(config, "Qwen2ForCausalLM")


def _inner_text_config(config: Any, arch: str) -> Any:
    """`config.text_config` built as `arch`, with the outer config's token ids and tied
    head where the inner one lacks them."""
    text = config.text_config
    text.architectures = [arch]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


# image-text architectures: -> their language model's config (built as a text family)
_TEXT_OF = {"Gemma3ForConditionalGeneration": text_config,
            # (its images are not served: the text model only)
            "Llama4ForConditionalGeneration": lambda c: _inner_text_config(
                c, "Llama4ForCausalLM"),
            "LlavaForConditionalGeneration": _llava_text_config,
            "LlavaNextForConditionalGeneration": _llava_text_config,
            "LlavaOnevisionForConditionalGeneration": _llava_text_config,
            "Qwen2VLForConditionalGeneration": _qwen_vl_text_config,
            "Qwen2_5_VLForConditionalGeneration": _qwen_vl_text_config}


def text_model_config(hf_config: Any) -> Any:
    """The config to build: an image-text checkpoint's language model's, else `hf_config`
    itself."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch not in _TEXT_OF:
        return hf_config
    return _TEXT_OF[arch](hf_config)


def causal_architecture(arch: str) -> str:
    """The causal LM a pooling checkpoint's architecture is the decoder of: a bare decoder
    (`Qwen3Model`, as sentence-transformers saves one) or a sequence classifier
    (`LlamaForSequenceClassification`) is built as its `...ForCausalLM`, its LM head
    unused (the pooler reads the final hidden states)."""
    for suffix in ("ForSequenceClassification", "Model"):
        if arch.endswith(suffix) and arch.removesuffix(suffix) + "ForCausalLM" in _MODELS:
            return arch.removesuffix(suffix) + "ForCausalLM"
    return arch


def build_model(hf_config: Any, max_positions: int, **options) -> nn.Module:
    """`options`: every family's (`head_on_first_stage`, models/llama.py)."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in map(causal_architecture, architectures):
        if arch in _MODELS:
            cls, extra = _MODELS[arch]
            return cls(hf_config, max_positions, **extra(hf_config), **options)
    raise ValueError(f"Unsupported model architecture {architectures}; tokenmill supports "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
