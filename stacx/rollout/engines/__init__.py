"""The driver's engines: the HTTP and SGLang clients, the engine registry and the server launchers (the
`InferenceEngine` interface is `stacx.wire.engine`; the CPU engine and its server are `stacx.serving`)."""
