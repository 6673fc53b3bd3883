"""Model code: the Llama/Qwen2/Mistral network, the Hugging Face directory loader, the tokenizer and chat templates, and
`pdfleet model init` / `--train` for the small presets. Imports no engine."""
