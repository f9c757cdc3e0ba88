"""Bring your own model to the conformance suite: ``python -m conformance --model my_models:tiny_llama``.

A factory takes no arguments and returns the model, the submodules to wrap as units, and a batch
function (docs/conformance.md, "Your own model"). The suite seeds torch before each call, so every
rank and every reference builds the same weights. This one builds a tiny Hugging Face Llama from a
config: nothing is downloaded.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

VOCAB, SEQ, BATCH = 97, 12, 2


def tiny_llama():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"  # plain matmuls, the same under every wrapper
    model = LlamaForCausalLM(config)
    units = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]

    def batch(generator: torch.Generator):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]  # integer targets: cross entropy on output.logits

    return model, units, batch
