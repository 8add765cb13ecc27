"""Embeddings and reranking (Qwen3-VL-Embedding, Qwen3-VL-Reranker) on the engine's scheduler:
prompts prefilled like generation's, answered with the last token's hidden state."""
