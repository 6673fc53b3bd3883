"""The inference engine: sequences, paged KV blocks, the scheduler, the model runner and the sampler."""
