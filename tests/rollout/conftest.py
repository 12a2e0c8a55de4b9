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


@pytest.fixture(scope="module")
def cpu_engine(tiny_checkpoints, single_process_world):
    """The CPU engine serving the first tiny checkpoint (one per test module)."""
    from stacx.rollout.engines.cpu import CpuEngine

    return CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])


def second_checkpoint_buckets(tiny_checkpoints, world, *, bucket_bytes: int) -> list[list]:
    """The second tiny checkpoint's weights as buckets of Hugging Face names (a weight update)."""
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    source = build_model(tiny_checkpoints[1], world)
    load_hf_checkpoint(source, tiny_checkpoints[1], world)
    return [list(b) for b in iter_hf_weight_buckets(source, world, bucket_bytes=bucket_bytes)]
