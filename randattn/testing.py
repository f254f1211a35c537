"""Tiny random-weight models of the supported architectures, built in code (no downloads).

They exercise the same attention code paths as the real checkpoints (GQA with 2 KV heads,
Qwen3's q/k-norm, Phi-3's fused qkv projection) in milliseconds, for unit tests.
"""

from __future__ import annotations

import torch

__all__ = ["TINY_ARCHS", "tiny_config", "tiny_model", "tiny_tokenizer"]

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def tiny_config(arch: str = "llama", **overrides):
    """A 2-layer config: hidden 64, 4 query heads, 2 KV heads of dim 16, vocab 256."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    classes = {
        "llama": (tf.LlamaConfig, dict(head_dim=16)),
        "mistral": (tf.MistralConfig, dict(head_dim=16, sliding_window=None)),
        "qwen2": (tf.Qwen2Config, dict(use_sliding_window=False)),
        "qwen3": (tf.Qwen3Config, dict(head_dim=16, use_sliding_window=False)),
        "phi3": (tf.Phi3Config, dict(sliding_window=None)),
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    cls, extra = classes[arch]
    kwargs = {**common, **extra, **overrides}
    return cls(**kwargs)


def tiny_model(arch: str = "llama", *, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A tiny random-weight causal LM in fp32 eval mode, with the randattn guards installed."""
    from transformers import AutoModelForCausalLM

    from .models import install_guards

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    model.eval()
    install_guards(model)
    return model


def tiny_tokenizer(directory, vocab_size: int = 256):
    """A whitespace word-level tokenizer over ``w0 w1 ...`` saved to ``directory`` and loaded back
    from there (TransformerLens re-reads tokenizers by path, so an in-memory one is not enough).
    Keep it in its own directory: beside a model config, AutoTokenizer picks that family's class."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>")
    tok.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)
