"""`stacx train` flags, generated from the `RunConfig` fields, and `--config run.yaml` merging.

Every run-config field has exactly one flag: the field name with dashes
(`tensor_model_parallel_size` -> `--tensor-model-parallel-size`). Booleans are
`--flag/--no-flag`; tuple fields (`--custom-module`, `--rollout-urls`) are repeatable. The
known `algorithm:` hyperparameters get flags too (`--advantage-estimator`, `--use-kl-loss`,
`--kl-loss-type low_var_kl`, `--kl-loss-coef 0.01`, `--clip-ratio`, ...); any custom one is
passed as `--algorithm-param NAME=VALUE` (repeatable) or in the YAML `algorithm:` section.

Precedence: defaults < `--config` file < flags. Only flags given on the command line override
the file (argparse defaults are suppressed), so `--config run.yaml --lr 1e-4` changes one field.
`--load runs/x` without `--config` takes the run config saved with the checkpoint it resumes
(`run_config.json`) as the file, so `stacx train --load runs/x` resumes the run as it was.

    parser = argparse.ArgumentParser(); add_run_config_arguments(parser)
    run_config = run_config_from_args(parser.parse_args(argv))
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

from stacx.trainer.config.run import (
    ALGORITHM_FIELD_TYPES,
    ALGORITHM_FIELDS,
    FIELD_CHOICES,
    FIELDS,
    SECTIONS,
    ConfigError,
    RunConfig,
)
from stacx.trainer.config.resolve import current_run_config_keys

CONFIG_DEST = "config"
ALGORITHM_PARAM_DEST = "algorithm_param"

# Algorithm fields whose default is None: their value type, for argparse conversion.
_UNTYPED_ALGORITHM_FIELDS = {**ALGORITHM_FIELD_TYPES, "off_policy_corrections": str}  # comma-separated names

_SECTION_TITLES = {
    "model": "model and checkpoints",
    "parallel": "parallelism and cluster",
    "rollout": "rollout and data",
    "teacher": "teacher (distillation)",
    "optim": "optimizer",
    "train": "training",
    "logging": "logging",
}


def flag_name(field_name: str) -> str:
    """`tensor_model_parallel_size` -> `--tensor-model-parallel-size`."""
    return "--" + field_name.replace("_", "-")


def _field_base_type(f: dataclasses.Field) -> Any:
    """The declared type without `| None` (`str | None` -> str, `tuple[str, ...]` -> tuple)."""
    hint = typing.get_type_hints(_section_class_of(f.name))[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return tuple
    if args and type(None) in typing.get_args(hint):
        return args[0]
    return hint


def _section_class_of(field_name: str) -> type:
    return SECTIONS[FIELDS[field_name][0]]


def _first_docstring_sentence(field_name: str) -> str:
    """Field docstrings are not kept by dataclasses; read them from the section's source once."""
    return _FIELD_HELP.get(field_name, "")


def _collect_field_help() -> dict[str, str]:
    """field name -> the docstring under it in its section's module (stacx/trainer/config/run.py;
    the rollout's sections in stacx/rollout/sections.py)."""
    import ast
    import inspect
    import sys

    modules = {sys.modules[section.__module__] for section in SECTIONS.values()}
    found: dict[str, str] = {}
    for node in (node for module in modules for node in ast.walk(ast.parse(inspect.getsource(module)))):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for current, following in zip(body, body[1:]):
            if (isinstance(current, ast.AnnAssign) and isinstance(current.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                found[current.target.id] = " ".join(following.value.value.split())
    return found


_FIELD_HELP = _collect_field_help()


def _engine_kinds_shown() -> list[str]:
    """--rollout-engine's choices as its help shows them: 'auto' and the registered kinds, plus '...'
    for the kinds a --custom-module file registers (checked once it is loaded, by the preflight)."""
    # Imported here: the engine clients import the HTTP stack, which only this flag's help needs.
    from stacx.rollout.engines.registry import AUTO, engine_kind_names

    return [AUTO, *engine_kind_names(discover=False), "..."]


_REGISTERED_CHOICES = {"rollout_engine": _engine_kinds_shown}
"""Fields whose values are registry names: shown as choices, checked against the registry later."""


def _add_flag(group, name: str, base: Any, default: Any, help_text: str) -> None:
    flag = flag_name(name)
    shown_default = f" (default: {default})" if default not in (None, (), "") else ""
    help_text = (help_text + shown_default).replace("%", "%%")
    if base is bool:
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_text)
    elif base is tuple:
        group.add_argument(flag, dest=name, action="append", default=argparse.SUPPRESS, metavar="VALUE",
                           help=help_text + " (repeatable)")
    else:
        choices = FIELD_CHOICES.get(name)
        shown = choices or _REGISTERED_CHOICES.get(name, lambda: None)()
        metavar = "{" + ",".join(shown) + "}" if shown else {int: "N", float: "X"}.get(base, "VALUE")
        group.add_argument(flag, dest=name, type=base, default=argparse.SUPPRESS, metavar=metavar, help=help_text,
                           choices=choices)


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per run-config field and known algorithm hyperparameter, plus --config and
    --algorithm-param. Defaults are suppressed: the namespace holds only what was given."""
    parser.add_argument("--config", dest=CONFIG_DEST, default=None, metavar="RUN_YAML",
                        help="YAML run config whose keys mirror the flags (flags override it)")
    groups = {name: parser.add_argument_group(title) for name, title in _SECTION_TITLES.items()}
    for name, (section_name, f) in FIELDS.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        _add_flag(groups[section_name], name, _field_base_type(f), default, _first_docstring_sentence(name))
    algorithm_group = parser.add_argument_group("algorithm hyperparameters (the `algorithm:` section)")
    for name, default in ALGORITHM_FIELDS.items():
        if name in FIELDS:
            continue
        base = type(default) if default is not None else _UNTYPED_ALGORITHM_FIELDS[name]
        _add_flag(algorithm_group, name, base, default, f"algorithm.{name}")
    algorithm_group.add_argument(
        "--algorithm-param", dest=ALGORITHM_PARAM_DEST, action="append", default=[], metavar="NAME=VALUE",
        help="a custom algorithm hyperparameter read by the loss kernels as config.NAME; VALUE is parsed "
             "as YAML (0.3 -> float, true -> bool); repeatable")


def load_yaml_config(path: str) -> dict[str, Any]:
    """The mapping in a YAML run config; errors name the file."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as handle:
        try:
            values = yaml.safe_load(handle)
        except yaml.YAMLError as err:
            raise ConfigError(f"--config {path}: not valid YAML: {err}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of keys, got {type(values).__name__}")
    return values


def _nested_overrides(values: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Flat or nested keys -> {section: {field: value}, 'algorithm': {...}} without defaults.

    Validation (unknown keys, types) is RunConfig.from_dict's job; this only files each key
    under its section so that a later layer overrides an earlier one key by key.
    """
    nested: dict[str, dict[str, Any]] = {name: {} for name in [*SECTIONS, "algorithm"]}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key == "algorithm" and isinstance(value, dict):
            nested["algorithm"].update({str(k).replace("-", "_"): v for k, v in value.items()})
        elif key in SECTIONS and isinstance(value, dict):
            nested[key].update({str(k).replace("-", "_"): v for k, v in value.items()})
        elif key in FIELDS:
            nested[FIELDS[key][0]][key] = value
        elif key in ALGORITHM_FIELDS:
            nested["algorithm"][key] = value
        else:  # let from_dict produce its message (it names the key and suggests close ones)
            RunConfig.from_dict({raw_key: value}, source=source)
    return nested


def parse_algorithm_params(items: list[str]) -> dict[str, Any]:
    """`["my_temp=0.3", "use_x=true"]` -> {"my_temp": 0.3, "use_x": True} (values parsed as YAML)."""
    import yaml

    params: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name.isidentifier():
            raise ConfigError(f"--algorithm-param {item!r}: expected NAME=VALUE with NAME a Python identifier")
        if name in FIELDS:
            raise ConfigError(f"--algorithm-param {item!r}: {name!r} has its own flag {flag_name(name)}")
        if name == "name":
            raise ConfigError(f"--algorithm-param {item!r}: the recipe is train.algorithm; pass --algorithm "
                              f"{text.strip() or 'NAME'}")
        params[name] = yaml.safe_load(text) if text.strip() else None
    return params


def merge_run_config(file_values: dict[str, Any] | None, flag_values: dict[str, Any], *,
                     file_source: str = "config", flag_source: str = "command line") -> RunConfig:
    """Defaults < file < flags, key by key. Both layers may be flat or nested."""
    if file_values:
        RunConfig.from_dict(file_values, source=file_source)  # the file's own errors name the file
    merged = _nested_overrides(file_values or {}, file_source)
    flags = _nested_overrides(flag_values, flag_source)
    for section, values in flags.items():
        merged[section].update(values)
    source = f"{file_source} + {flag_source}" if file_values else flag_source
    return RunConfig.from_dict({name: values for name, values in merged.items() if values}, source=source)


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of a parsed `stacx train` namespace (reads `--config` when given)."""
    given = vars(args)
    flag_values: dict[str, Any] = {name: value for name, value in given.items() if name in FIELDS and name != "algorithm"}
    # `algorithm` is both the recipe flag (train.algorithm) and the hyperparameter section's key.
    if "algorithm" in given:
        flag_values["train"] = {"algorithm": given["algorithm"]}
    algorithm_section = {name: value for name, value in given.items() if name in ALGORITHM_FIELDS and name not in FIELDS}
    algorithm_section.update(parse_algorithm_params(given.get(ALGORITHM_PARAM_DEST) or []))
    if algorithm_section:
        flag_values["algorithm"] = algorithm_section
    config_path = given.get(CONFIG_DEST)
    file_values = load_yaml_config(config_path) if config_path else None
    file_source = config_path or "config"
    if file_values is None and given.get("load"):
        saved = saved_run_config(given["load"])
        if saved is not None:  # `stacx train --load runs/x`: the saved run, flags given with it override it
            file_values, file_source = saved
    return merge_run_config(file_values, flag_values, file_source=file_source)


def saved_run_config(load: str) -> tuple[dict[str, Any], str] | None:
    """(the resolved run config saved with the checkpoint `load` resumes, its run_config.json path), or None
    when `load` holds no complete Stacx training checkpoint (the run then reports that itself)."""
    import json
    import os

    from stacx.trainer.checkpoint import RUN_CONFIG_NAME, CheckpointError, resolve_checkpoint_folder

    try:
        path = os.path.join(resolve_checkpoint_folder(load), RUN_CONFIG_NAME)
        with open(path) as f:
            values = json.load(f)
    except (CheckpointError, OSError, ValueError):
        return None
    return (current_run_config_keys(values), path) if isinstance(values, dict) else None


def resume_overrides(args: argparse.Namespace, run_config: RunConfig) -> list[str]:
    """One line per flag given next to `--load` (without `--config`) whose value differs from the saved run
    config's: `--lr 0.001 (saved: 0.0003)`. Empty when the run does not resume with its saved config."""
    given = vars(args)
    if given.get(CONFIG_DEST) or not given.get("load"):
        return []
    saved = saved_run_config(given["load"])
    if saved is None:
        return []
    values, _ = saved
    lines = []
    for name in sorted(name for name in given if name in FIELDS and name not in ("load", "algorithm", "dry_run")):
        section = FIELDS[name][0]
        before = (values.get(section) or {}).get(name)
        now = getattr(getattr(run_config, section), name)
        if before != now and not (isinstance(now, tuple) and list(now) == before):
            lines.append(f"{flag_name(name)} {now} (saved: {before})")
    for name in sorted(name for name in given if name in ALGORITHM_FIELDS and name not in FIELDS):
        before = (values.get("algorithm") or {}).get(name)
        if before != given[name]:
            lines.append(f"{flag_name(name)} {given[name]} (saved: {before})")
    return lines
