"""What a rank imports, checked on a rank forked from the rank forkserver (torch and megatron-core imported,
`transformers` not). Kept apart from the test modules: unpickling a rank's function imports its module, and
the test modules import `transformers`."""

import sys


def build_from_folder_imports_transformers(groups, folder: str) -> bool:
    """Whether building the model from the config.json in `folder` imported `transformers`."""
    if "transformers" in sys.modules:
        raise AssertionError("the rank started with transformers imported: the check would prove nothing")
    from stacx.models import build_model

    build_model(folder, groups)
    return "transformers" in sys.modules
