"""The network's building blocks below the model definitions: attention backends (PyTorch, Triton), the sampler and its
logits processors, the C++ CPU kernels and their prebuilt libraries, packed and int8 linears. The model and the engine's
runner use them; they import neither."""
