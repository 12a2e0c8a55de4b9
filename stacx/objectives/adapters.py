"""Run plugins written against padded (batch, seq_len) tensors under Stacx's per-trajectory API.

Other frameworks write losses as `fn(old_log_prob, log_prob, advantages, response_mask,
**hyperparameters) -> (loss, metrics)` on padded tensors, and advantages as
`fn(token_level_rewards, response_mask, **hyperparameters) -> (advantages, returns)`.
Wrap them, unchanged, with an explicit adapter:

    from stacx.objectives.adapters import register_padded_policy_loss, register_padded_advantage

    @register_padded_policy_loss("my_loss", aggregation="token-mean")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2, **kwargs): ...

What the adapters do:
- Pad the per-trajectory inputs (right padding, response_mask = the loss mask, 0 on padding).
- Pass hyperparameters: a named parameter of the plugin is passed from the config
  (`clip_ratio` <- `config.clip_ratio`) when the user SET that key (`config.given_keys`) or the
  parameter has no default; otherwise the plugin's own default holds (`entropy_coef=0.01` stays
  0.01 unless the run sets it). The config must be an `AlgorithmConfig` (None: its defaults).
  Padded `rollout_log_prob`, `ref_log_prob`, `entropy` are passed when given and the plugin
  accepts them (by name or **kwargs); advantage plugins get `index` (the prompt ids) and padded
  `values` the same way.
- A plugin taking `entropy_coef` applies its own entropy bonus: it is registered with
  `applies_entropy_bonus`, and the actor adds no second one. A plugin taking
  `importance_weights` gets the off-policy correction weights (shape (batch,) when they are
  constant over each response, as sequence-level corrections give, else (batch, seq_len); None
  without corrections) and the actor does not apply them again (`applies_importance_weights`).
- An advantage plugin's `returns`, when it returns `(advantages, returns)`, are kept: the
  adapted estimator's result carries them as `.returns` (per trajectory) for critic targets.
- A (batch, seq_len) loss is unpadded to per-token losses (exact).
- A scalar loss L (the plugin aggregated itself, e.g. with `agg_loss(..., mode)`) is turned into
  the per-token contract by spreading it as a constant c_i over each trajectory's tokens, chosen
  so that `aggregate_sum(c, masks, mode) = L * count_normalizer(masks, mode)`: the framework's
  sum and its gradient equal the plugin's own un-normalized sum. This is exact only when the
  plugin's aggregation is the run's `loss_agg_mode` (checked), and per-token importance weights
  applied downstream act on the spread constant, not on the plugin's token losses; prefer
  plugins that return per-token losses.
- Metrics: plugin metrics are taken as token means over the response mask (masked_mean, as is
  usual) and converted to sums by multiplying by this micro-batch's token count.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from stacx.objectives.advantages_returns import token_level_rewards
from stacx.objectives.aggregation import aggregate_sum, count_normalizer, get_aggregation_mode
from stacx.objectives.algorithm_config import AlgorithmConfig, as_algorithm_config
from stacx.objectives.padding import pad_trajectories, unpad_trajectories
from stacx.objectives.registry import KernelTraits, register_advantage, register_policy_loss
from stacx.objectives.validation import check_trajectory_lists, rollout_field

_POLICY_TENSOR_KWARGS = ("rollout_log_prob", "ref_log_prob", "entropy")


def _accepted(fn: Callable) -> tuple[set[str], bool, list[str]]:
    """(named parameters, accepts **kwargs, positional parameter names in order)."""
    parameters = inspect.signature(fn).parameters
    names = {n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    positional = [n for n, p in parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    return names, var_kw, positional


def _declared_knobs(fn: Callable, skip: set[str]) -> tuple[str, ...]:
    """The plugin's named parameters with a default, but for the tensors the adapter passes: the
    knobs it reads from the config (`KernelTraits.hyperparameters`)."""
    parameters = inspect.signature(fn).parameters
    return tuple(n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                 and p.default is not inspect.Parameter.empty and n not in skip)


def _hyperparameters_from_config(config: AlgorithmConfig, fn: Callable, names: set[str], skip: set[str]) -> dict:
    """Values for the plugin's named parameters: those the user set (or that have no default)."""
    parameters = inspect.signature(fn).parameters
    found = {}
    for name in names - skip:
        # A plugin's own knob may be absent from the config: its default in the signature holds then.
        value = getattr(config, name, None)
        if value is None:
            continue
        has_default = parameters[name].default is not inspect.Parameter.empty
        if name in config.given_keys or not has_default:
            found[name] = value
    return found


def _padded_importance_weights(weights, lengths: list[int], masks) -> torch.Tensor:
    """(batch,) when every response's weight is constant over its loss tokens, else (batch, seq_len)."""
    padded = pad_trajectories([w.to(torch.float32) for w in weights])
    per_sequence = []
    for weight, mask in zip(weights, masks):
        kept = weight[mask != 0] if weight.numel() else weight
        if kept.numel() and not torch.all(kept == kept[0]):
            return padded
        per_sequence.append(kept[0] if kept.numel() else torch.ones((), dtype=weight.dtype))
    return torch.stack([w.to(torch.float32) for w in per_sequence]) if per_sequence else padded


def _metrics_to_sums(metrics, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    sums = {}
    for key, value in (metrics or {}).items():
        value = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=torch.float64)
        if value.numel() != 1:
            raise ValueError(f"padded plugin metric {key!r} must be a scalar, got shape {tuple(value.shape)}")
        sums[key] = value.reshape(()) * num_tokens
    return sums


def adapt_padded_policy_loss(fn: Callable, *, aggregation: str = "token-mean") -> Callable:
    """Wrap a padded-tensor policy loss as a Stacx policy loss (see the module docstring).

    aggregation: the mode the plugin uses when it returns a scalar loss.
    """
    if get_aggregation_mode(aggregation).needs_seq_norm_len:
        # The spread constant would depend on the run's seq_norm_len; such plugins must return
        # per-token losses instead.
        raise ValueError(
            f"adapt_padded_policy_loss: aggregation {aggregation!r} is not supported for padded plugins; "
            "return a (batch, seq_len) per-token loss and let Stacx aggregate"
        )
    names, var_kw, positional = _accepted(fn)
    if len(positional) < 4:
        raise ValueError(
            f"padded policy loss {fn.__qualname__} must take (old_log_prob, log_prob, advantages, response_mask, ...), "
            f"got parameters {positional}"
        )
    tensor_slots = set(positional[:4])

    def policy_loss(config: AlgorithmConfig, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
        config = as_algorithm_config(config, f"padded policy loss {fn.__qualname__}")
        lengths = check_trajectory_lists(
            "log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages, loss_masks=loss_masks
        )
        padded = [pad_trajectories(list(x)) for x in (old_log_prob, log_prob, advantages, loss_masks)]
        call_kwargs = _hyperparameters_from_config(config, fn, names, tensor_slots | set(_POLICY_TENSOR_KWARGS) | {"importance_weights"})
        weights = kwargs.get("importance_weights")
        if weights is not None and "importance_weights" in names:
            check_trajectory_lists("log_prob", log_prob, importance_weights=weights)
            call_kwargs["importance_weights"] = _padded_importance_weights(list(weights), lengths, loss_masks)
        for name in _POLICY_TENSOR_KWARGS:
            value = kwargs.get(name)
            if value is not None and (name in names or var_kw):
                check_trajectory_lists("log_prob", log_prob, **{name: value})
                call_kwargs[name] = pad_trajectories(list(value))
        loss, metrics = fn(*padded, **call_kwargs)
        num_tokens = count_normalizer(loss_masks, "token-mean")
        metric_sums = _metrics_to_sums(metrics, num_tokens)
        if loss.dim() == 2:
            if loss.shape != padded[1].shape:
                raise ValueError(
                    f"padded policy loss {fn.__qualname__} returned shape {tuple(loss.shape)}, expected "
                    f"{tuple(padded[1].shape)} or a scalar"
                )
            return unpad_trajectories(loss, lengths), metric_sums
        if loss.dim() != 0:
            raise ValueError(f"padded policy loss {fn.__qualname__} returned shape {tuple(loss.shape)}; expected (batch, seq_len) or a scalar")
        run_mode = config.loss_agg_mode
        if run_mode != aggregation:
            raise ValueError(
                f"padded policy loss {fn.__qualname__} aggregates with {aggregation!r} but loss_agg_mode is "
                f"{run_mode!r}; set loss_agg_mode to {aggregation!r} or adapt it with aggregation={run_mode!r}"
            )
        return _spread_scalar_loss(loss, loss_masks, aggregation), metric_sums

    policy_loss.__doc__ = f"Padded-plugin adapter around {fn.__module__}.{fn.__qualname__}.\n\n{fn.__doc__ or ''}"
    policy_loss.padded_plugin = fn
    policy_loss.__module__ = fn.__module__  # the plugin's home, for listings and error messages
    return policy_loss


def _spread_scalar_loss(loss: torch.Tensor, loss_masks, mode: str) -> list[torch.Tensor]:
    """Constant per-token losses c with aggregate_sum(c, masks, mode) = loss * count(masks, mode)."""
    ones = [torch.ones_like(m, dtype=torch.float64) for m in loss_masks]
    unit_sum = aggregate_sum(ones, [m.to(torch.float64) for m in loss_masks], mode)
    count = count_normalizer(loss_masks, mode)
    if float(unit_sum) == 0.0:
        return [loss * torch.zeros(m.shape, dtype=loss.dtype) for m in loss_masks]
    constant = loss * (count / unit_sum).to(loss.dtype)
    return [constant.expand(m.shape[0]) for m in loss_masks]


def register_padded_policy_loss(name: str, *, aggregation: str = "token-mean", aliases=()):
    """Decorator: register the adapted plugin under `name`; returns the plugin unchanged."""

    def decorator(fn):
        names, _, positional = _accepted(fn)
        knobs = _declared_knobs(fn, set(positional[:4]) | set(_POLICY_TENSOR_KWARGS) | {"importance_weights"})
        traits = KernelTraits(applies_entropy_bonus="entropy_coef" in names,
                              applies_importance_weights="importance_weights" in names, hyperparameters=knobs)
        register_policy_loss(name, aliases=aliases, traits=traits)(adapt_padded_policy_loss(fn, aggregation=aggregation))
        return fn

    return decorator


class AdvantageList(list):
    """Per-trajectory advantages; `.returns` holds the plugin's per-trajectory returns (or None)."""

    returns: list[torch.Tensor] | None = None


def adapt_padded_advantage(fn: Callable) -> Callable:
    """Wrap `fn(token_level_rewards, response_mask, **hp) -> advantages or (advantages, returns)`.

    token_level_rewards (B, T): token rewards plus the scalar reward on each last response token
    (and the KL-in-reward penalty when enabled), see `advantages_returns.token_level_rewards`.
    response_mask (B, T): `loss_masks` (all ones when absent), 0 on padding.
    """
    names, var_kw, positional = _accepted(fn)
    if len(positional) < 2:
        raise ValueError(
            f"padded advantage {fn.__qualname__} must take (token_level_rewards, response_mask, ...), got {positional}"
        )

    def advantage(config: AlgorithmConfig, rollout_data):
        config = as_algorithm_config(config, f"padded advantage {fn.__qualname__}")
        lengths = [int(n) for n in rollout_field(rollout_data, "response_lengths")]
        if not lengths:
            return []
        rewards = token_level_rewards(config, rollout_data)
        masks = rollout_field(rollout_data, "loss_masks", required=False)
        if masks is None:
            masks = [torch.ones(n) for n in lengths]
        check_trajectory_lists("token_level_rewards", rewards, loss_masks=masks)
        width = max(max(lengths), 1)
        padded_rewards = pad_trajectories([r.to(torch.float32) for r in rewards], length=width)
        padded_mask = pad_trajectories([m.to(torch.float32) for m in masks], length=width)
        call_kwargs = _hyperparameters_from_config(config, fn, names, set(positional[:2]) | {"index", "values"})
        if "index" in names or var_kw:
            call_kwargs["index"] = list(rollout_field(rollout_data, "prompt_id", required=False) or [])
        values = rollout_field(rollout_data, "values", required=False)
        if values is not None and ("values" in names or var_kw):
            call_kwargs["values"] = pad_trajectories([v.detach().to(torch.float32) for v in values], length=width)
        result = fn(padded_rewards, padded_mask, **call_kwargs)
        advantages = result[0] if isinstance(result, tuple) else result
        if advantages.shape != padded_rewards.shape:
            raise ValueError(
                f"padded advantage {fn.__qualname__} returned shape {tuple(advantages.shape)}, expected {tuple(padded_rewards.shape)}"
            )
        out = AdvantageList(a.detach().to(torch.float32).clone() for a in unpad_trajectories(advantages, lengths))
        if isinstance(result, tuple) and len(result) > 1 and result[1] is not None:
            if result[1].shape != padded_rewards.shape:
                raise ValueError(f"padded advantage {fn.__qualname__} returned returns of shape "
                                 f"{tuple(result[1].shape)}, expected {tuple(padded_rewards.shape)}")
            out.returns = [r.detach().to(torch.float32).clone() for r in unpad_trajectories(result[1], lengths)]
        return out

    advantage.__doc__ = f"Padded-plugin adapter around {fn.__module__}.{fn.__qualname__}.\n\n{fn.__doc__ or ''}"
    advantage.padded_plugin = fn
    advantage.__module__ = fn.__module__
    return advantage


def register_padded_advantage(name: str, *, aliases=()):
    """Decorator: register the adapted advantage plugin under `name`; returns it unchanged."""

    def decorator(fn):
        _, _, positional = _accepted(fn)
        knobs = _declared_knobs(fn, set(positional[:2]) | {"index", "values"})
        register_advantage(name, aliases=aliases, hyperparameters=knobs)(adapt_padded_advantage(fn))
        return fn

    return decorator
