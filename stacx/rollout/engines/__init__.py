"""Inference engines and their clients: the `InferenceEngine` protocol, the CPU engine and its server, HTTP and SGLang clients."""
