"""What the training driver and the inference server both speak: generation requests and outputs,
the `InferenceEngine` interface, the HTTP client, weight buckets on the wire and their versions,
the SGLang protocol, tool calls, chat-template ids, samples and recorded turns.

Under both ends: it imports the standard library, torch and `stacx.parallel` only (docs/architecture.md).
"""
