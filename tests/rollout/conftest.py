import pytest


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Two tiny llama checkpoints (different seeds) with a character tokenizer whose vocab fits."""
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    paths = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny{seed}")
        save_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def single_process_world():
    """A one-rank gloo world with megatron's trivial layout, torn down after the module."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.rollout.engines.cpu import ensure_single_process_layout

    groups = ensure_single_process_layout()
    yield groups
    destroy_parallel_layout()
