"""The inference server process (`stacx serve`): the CPU engine, the HTTP server with SGLang's native
API, the OpenAI- and Anthropic-compatible endpoints and their recorded sessions, and the guards
around them. It never imports `stacx.rollout` (the driver): both ends meet in `stacx.wire`.
"""
