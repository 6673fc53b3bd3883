"""The inference engine: sequences, the scheduler and the paged KV block manager (no torch), the model runner, and
LLMEngine that drives them one step at a time."""
