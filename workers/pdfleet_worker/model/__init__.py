"""Model code: the Llama/Qwen2/Mistral network, the Hugging Face directory loader and the tokenizer."""
