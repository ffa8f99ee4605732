"""The model presets (``--model``): Hugging Face config kwargs plus ``model_type``. Torch-free, so that the CLI
refuses an unknown preset in a fraction of a second, before torch is imported (:mod:`.build` builds them)."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_NO_DROPOUT_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


#: Model presets: Hugging Face config kwargs plus ``model_type``. Dropout is off
#: (pre-training regime; also keeps gradients deterministic). ``vocab_size`` is
#: normally overridden by :func:`build_model` with the tokenizer's. Parameter counts
#: below are at vocab 4096 (the shipped tokenizer's) with tied input/output embeddings
#: (:func:`count_params`).
PRESETS: dict[str, dict[str, Any]] = {
    # 0.94M params (937,472): the model the design's pre-build measurements used. CPU-friendly.
    "tiny": {
        "model_type": "gpt2",
        "vocab_size": 4096,
        "n_layer": 2,
        "n_embd": 128,
        "n_head": 4,
        "n_positions": 128,
        **_NO_DROPOUT_GPT2,
    },
    # 12.3M params (12,318,720).
    "small": {
        "model_type": "gpt2",
        "vocab_size": 4096,
        "n_layer": 6,
        "n_embd": 384,
        "n_head": 6,
        "n_positions": 256,
        **_NO_DROPOUT_GPT2,
    },
    # GPT-2 small shape (124M at the GPT-2 vocab of 50257; 88,988,160 at vocab 4096).
    "gpt2-124m": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "n_positions": 1024,
        **_NO_DROPOUT_GPT2,
    },
    # 0.93M params (926,336), LLaMA architecture (RMSNorm, SwiGLU, RoPE), like the paper's family.
    "llama-tiny": {
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    # The paper's ~150M LLaMA-style model: OpenDiLoCo's "llama-150m" shape (Jaghouar et al.
    # 2024, arXiv 2407.07852; hidden 1024, SwiGLU 2688, 12 layers, 16 heads), at this
    # project's vocabulary with tied embeddings: exactly 153,641,984 params at vocab 4096
    # (12 x 12,453,888 per layer + 4,194,304 embedding + 1,024 final norm).
    "llama-150m": {
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 1024,
        "intermediate_size": 2688,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
}
