"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under any plan.

Every rank saves the parameters and optimizer states it holds under the
*full model's* names (``layers.3.attn.q.weight``; optimizer states flattened
as ``state.<name>.exp_avg``), as DTensor shards where sharded. DCP records the
global shape and offset of each shard, so a checkpoint written with one
(dp, tp, pp, ZeRO) loads into any other plan of the same model, or into one
process: each rank reads exactly the slices it needs.

Weights tied across pipeline stages (embedding / LM head) are saved by both
stages under their own names; with one stage only the first name may exist.
On load a name missing from the checkpoint is read from its tied twin.

A checkpoint directory is complete when DCP has written its ``.metadata``
(after every rank's data): :func:`latest_checkpoint` ignores incomplete ones,
so a run killed while saving resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import HetplanError

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
EXTRA_PREFIX = "extra."


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def _model_sd(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _optim_sd(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(flatten_optimizer_state_dict=True))


def save(ctx: Any, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         extra: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in _model_sd(model).items()}
    if optimizer is not None:
        state.update({OPTIM_PREFIX + k: v for k, v in _optim_sd(model, optimizer).items()})
    for k, v in extra.items():
        state[EXTRA_PREFIX + k] = torch.tensor(v) if isinstance(v, (int, float)) else v
    os.makedirs(path, exist_ok=True)
    dcp.save(state, checkpoint_id=path, no_dist=not ctx.distributed)


def _tied_twin(key: str, prefix: str, aliases: dict[str, str], available: set[str]) -> str | None:
    """For ``prefix + name + rest``, the same key under the tied twin of ``name``, if saved."""
    body = key[len(prefix):]
    for name, canon in aliases.items():
        if name == canon:
            continue
        for a, b in ((name, canon), (canon, name)):
            for sep in (".",):
                for head in ("", "state.", "param_groups."):
                    if body.startswith(head + a + sep) or body == head + a:
                        cand = prefix + head + b + body[len(head + a):]
                        if cand in available:
                            return cand
    return None


def load(ctx: Any, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not os.path.exists(os.path.join(path, ".metadata")):
        raise HetplanError(f"{path} is not a complete checkpoint (no .metadata); pick another or retrain")
    reader = dcp.FileSystemReader(path)
    available = set(reader.read_metadata().state_dict_metadata)
    info = ctx._models.get(id(model))  # noqa: SLF001 - same package
    aliases = info.aliases if info is not None else {}
    model_sd = _model_sd(model)
    state: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    for k, v in model_sd.items():
        state[MODEL_PREFIX + k] = v
    optim_sd: dict[str, Any] = {}
    if optimizer is not None:
        optim_sd = _optim_sd(model, optimizer)
        for k, v in optim_sd.items():
            state[OPTIM_PREFIX + k] = v
    extras = [k for k in available if k.startswith(EXTRA_PREFIX)]
    to_load: dict[str, Any] = {}
    for key, value in state.items():
        if key in available:
            to_load[key] = value
            continue
        prefix = MODEL_PREFIX if key.startswith(MODEL_PREFIX) else OPTIM_PREFIX
        twin = _tied_twin(key, prefix, aliases, available)
        if twin is None:
            what = "optimizer state" if prefix == OPTIM_PREFIX else "parameter"
            raise HetplanError(
                f"checkpoint {path} has no {what} {key[len(prefix):]!r}: it was saved for a different model"
                + ("" if prefix == MODEL_PREFIX else " or without this optimizer")
            )
        to_load[twin] = value
        renamed[twin] = key
    extra_state: dict[str, Any] = {}
    for k in extras:
        md = reader.read_metadata().state_dict_metadata[k]
        if hasattr(md, "size"):
            extra_state[k] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            extra_state[k] = None
    to_load.update(extra_state)
    dcp.load(to_load, checkpoint_id=path, no_dist=not ctx.distributed)
    loaded = {renamed.get(k, k): v for k, v in to_load.items()}
    set_model_state_dict(model, {k[len(MODEL_PREFIX):]: loaded[k] for k in state if k.startswith(MODEL_PREFIX)})
    if optimizer is not None:
        set_optimizer_state_dict(
            model, optimizer, {k[len(OPTIM_PREFIX):]: loaded[k] for k in state if k.startswith(OPTIM_PREFIX)},
            options=_options(flatten_optimizer_state_dict=True),
        )
    out = {}
    for k in extras:
        v = loaded[k]
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            v = v.item()
        out[k[len(EXTRA_PREFIX):]] = v
    return out


def full_state_dict(ctx: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the whole model as plain tensors on rank 0 ({} on other ranks).

    Inside a stage, DTensor shards are all-gathered (every rank of the stage
    takes part); stages then send their parts to rank 0. Tied names are all
    present, as in the single-process model's ``state_dict()``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_options(full_state_dict=True))
    sd = {k: v.detach().cpu() for k, v in sd.items()}
    if ctx.distributed:
        mine = sd if (ctx.position.dp_index == 0 and ctx.position.tp_index == 0) else {}
        gathered: list[Any] = [None] * ctx.world_size if ctx.rank == 0 else []
        dist.gather_object(mine, gathered if ctx.rank == 0 else None, dst=0)
        if ctx.rank != 0:
            return {}
        sd = {}
        for part in gathered:
            sd.update(part or {})
    info = ctx._models.get(id(model))  # noqa: SLF001
    for name, canon in (info.aliases if info else {}).items():
        if name not in sd and canon in sd:
            sd[name] = sd[canon]
        elif canon not in sd and name in sd:
            sd[canon] = sd[name]
    return sd


_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def latest_checkpoint(root: str) -> tuple[str, int] | None:
    """The newest complete ``root/step_N`` checkpoint and its step, or None."""
    if not os.path.isdir(root):
        return None
    best = None
    for entry in os.listdir(root):
        m = _STEP_DIR.match(entry)
        if m and os.path.exists(os.path.join(root, entry, ".metadata")):
            step = int(m.group(1))
            if best is None or step > best[1]:
                best = (os.path.join(root, entry), step)
    return best
