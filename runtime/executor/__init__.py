"""weft.runtime.executor: runs batches on the device: model runner, CUDA graphs, sampler, KV memory, attention backends."""
