"""Guide 001's Python config object, as a script: `import my_algorithm` to register, then
`StacxConfig(model_path=..., algorithm={name, adv_estimator, clip_ratio})`, trained with
`run_training` (on Ray, or SPMD when started by torchrun). Tests only.

    python tests/launch/train_python_config.py CHECKPOINT OUT [DATA_PARALLEL_SIZE]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "padded_plugins"))

# Import to register
import my_algorithm  # noqa: E402,F401

from stacx import StacxConfig  # noqa: E402
from stacx.trainer import run_training  # noqa: E402

if __name__ == "__main__":
    checkpoint, out = sys.argv[1], sys.argv[2]
    data_parallel_size = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    config = StacxConfig(
        model_path=checkpoint,
        algorithm={
            "name": "my_loss",
            "adv_estimator": "my_advantage",
            "clip_ratio": 0.2,
        },
        prompt_data="builtin:sorting", rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=6,
        rollout_engine="cpu", num_steps=2, out=out, progress_bar=False, plots=False, data_parallel_size=data_parallel_size,
    )
    run_training(config)
