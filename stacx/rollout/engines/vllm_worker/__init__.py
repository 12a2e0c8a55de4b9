"""Code that runs inside a vLLM server process (its folder goes on the server's PYTHONPATH)."""
