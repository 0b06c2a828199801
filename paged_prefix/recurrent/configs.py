"""Small random-weight configs of the hybrid models: Qwen3-Next and LFM2, test-sized.

Same form as `paged_prefix.models.BUILTIN_CONFIGS` (mlx-lm `ModelArgs` fields; vLLM reads the
same dict as config.json) so they can move there as they are.
"""

from __future__ import annotations

HYBRID_CONFIGS: dict[str, dict] = {
    # Layers 0-2 gated delta net, layer 3 gated attention (every 4th); MoE in every layer
    # but layer 1, whose plain MLP keeps both feed-forward kinds in the model. 4 value heads
    # over 2 key heads, as the real model groups them.
    "qwen3-next-test": dict(
        model_type="qwen3_next", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
        moe_intermediate_size=64, shared_expert_intermediate_size=128, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, vocab_size=512,
        tie_word_embeddings=False),
    # Short conv at layers 0, 1 and 3, attention at 2 (LFM2's conv-conv-attention rhythm);
    # embeddings tied as in every LFM2. conv_dim is what vLLM sizes the conv state by.
    "lfm2-test": dict(
        model_type="lfm2", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=False, conv_dim=256,
        layer_types=["conv", "conv", "full_attention", "conv"], block_dim=256,
        block_ff_dim=512, block_multiple_of=64, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=4096, vocab_size=512),
}
