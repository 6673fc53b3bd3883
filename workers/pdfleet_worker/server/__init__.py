"""The worker's HTTP server: OpenAI API, health, metrics and PD transfer around one LLMEngine (`pdfleet worker`)."""
