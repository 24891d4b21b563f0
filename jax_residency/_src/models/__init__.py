"""Real models and their checkpoints: Llama-family, T5, GPT, BERT, the toy
transformer, Hugging Face loaders and converters.
"""
