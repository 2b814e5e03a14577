"""The tests' tiny transformers Llama, built from a config (no download)."""


def tiny_llama(**overrides):
    """A 2-layer LlamaForCausalLM: vocabulary 64, width 32, 4 heads (2 key-value), eager
    attention (its two matmuls are plain products abft.checked sees)."""
    import transformers
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              attn_implementation="eager")
    kw.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
