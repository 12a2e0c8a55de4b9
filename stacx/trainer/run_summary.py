"""What `stacx train` tells the user about its outputs: a warning before a run whose trained model
would be discarded, and a summary at the end of where every output went.

    warning = unsaved_model_warning(run_config)      # None when --save or --export-hf keeps the model
    print(describe_run_outputs(run_config, seconds=312.0))

The summary lists what is on disk after the run (a file the run did not write is not listed), so
it is true for any combination of settings.
"""

from __future__ import annotations

import os
from typing import Optional

from stacx.trainer.checkpoint import latest_checkpoint


def unsaved_model_warning(run_config) -> Optional[str]:
    """A warning when neither --save nor --export-hf is set: the trained weights end with the run."""
    if run_config.model.save or run_config.train.export_hf:
        return None
    return ("neither --save nor --export-hf is set, so the trained model is discarded when the run ends; "
            "add --export-hf DIR to keep it as a Hugging Face folder (stacx eval, stacx serve, transformers read "
            "it) or --save DIR for resumable checkpoints")


def _latest_step_folder(save_root: str) -> Optional[str]:
    return latest_checkpoint(save_root) if os.path.isdir(save_root) else None


def describe_run_outputs(run_config, *, seconds: Optional[float] = None) -> str:
    """The end-of-run summary: one line per output that exists, then the model's fate and a next step."""
    out = run_config.logging.out
    steps = run_config.train.num_steps
    lines = [f"stacx train: finished {steps} step(s)" + (f" in {seconds:.0f} s" if seconds is not None else "")
             + f"; outputs in {out}/"]
    rows = []
    if os.path.isfile(os.path.join(out, "metrics.jsonl")):
        rows.append(("metrics", os.path.join(out, "metrics.jsonl"), "one JSON row per step"))
    plots_dir = os.path.join(out, "plots")
    if os.path.isdir(plots_dir):
        pngs = sorted(name for name in os.listdir(plots_dir) if name.endswith(".png"))
        if pngs:
            rows.append(("plots", os.path.join(plots_dir, ""), ", ".join(pngs)))
    if os.path.isdir(os.path.join(out, "tensorboard")):
        rows.append(("tensorboard", os.path.join(out, "tensorboard"), f"tensorboard --logdir {out}/tensorboard"))
    if os.path.isfile(os.path.join(out, "rollouts.jsonl")):
        rows.append(("rollouts", os.path.join(out, "rollouts.jsonl"), "sampled responses with rewards"))
    save = run_config.model.save
    latest = _latest_step_folder(save) if save else None
    if latest:
        rows.append(("checkpoint", latest, f"resume with --load {save}; evaluate with stacx eval --load {latest}"))
    export = run_config.train.export_hf
    if export and os.path.isfile(os.path.join(export, "config.json")):
        rows.append(("model", export, f"Hugging Face folder; evaluate with stacx eval --hf-checkpoint {export}"))
    width = max((len(name) for name, _, _ in rows), default=0)
    lines += [f"  {name:<{width}}  {path}  ({note})" for name, path, note in rows]
    if not latest and not (export and os.path.isdir(export)):
        lines.append("  the trained model was NOT saved (no --save or --export-hf); rerun with --export-hf DIR to keep it")
    return "\n".join(lines)
