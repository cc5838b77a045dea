"""s3kv: a TensorRT-LLM KV cache connector that shares prompt KV across a fleet through S3."""

__version__ = "0.1.0"
