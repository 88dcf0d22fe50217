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

A checkpoint directory is complete when it has a manifest,
``hetplan-manifest.json`` (the directories alone: hetplan.runtime.checkpoint_dirs, torch-free): once DCP has written every rank's data and its
``.metadata`` (and every rank has passed a barrier), the files are hashed
(each rank hashes its own ``__<rank>_*.distcp`` files, rank 0 the rest) and
rank 0 writes the manifest LAST and atomically (temporary file in the same
directory, fsync, ``os.replace``). It lists every file of the checkpoint
(hidden files other than ``.metadata`` aside) with its size in bytes and
sha256, and the format version. Saving into a directory first removes its old
manifest, so a directory without one is a save that did not finish.

Every load verifies the manifest before reading anything: no manifest
(incomplete), a listed file missing, of another size (truncated) or with
another checksum (corrupted), or a data file the manifest does not list, is a
:class:`~hetplan.errors.HetplanError` naming the file. The ranks share the
hashing and agree on the verdict (an all-gather), so every rank fails with the
same message and none is left waiting. ``latest_checkpoint`` picks the
newest checkpoint with a manifest and notes, on stderr, newer ones it skipped
as incomplete, so a run killed while saving resumes from the previous
checkpoint; ``resume_checkpoint`` (``hetplan train --resume``) refuses a
directory with none (``--resume-or-start`` starts from step 0 then), and
``hetplan train`` runs :func:`verify_here` on the checkpoint it starts from
before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import HetplanError
from hetplan.runtime.checkpoint_dirs import MANIFEST
from hetplan.runtime.faults import KILL_SAVE_ENV, fault_kills

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
EXTRA_PREFIX = "extra."

MANIFEST_FORMAT = "hetplan-checkpoint"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20  # hash in 1 MiB reads
_RANK_FILE = re.compile(r"^__(\d+)_")  # DCP's per-rank data files: __<rank>_<n>.distcp
_WHAT_TO_DO = "resume from an earlier checkpoint or delete this one"


# --- the manifest ------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return h.hexdigest()
            h.update(view[:n])


def _listed(name: str) -> bool:
    """Whether a file belongs in the manifest: all but the manifest itself (and
    its temporary file) and hidden files other than DCP's ``.metadata``
    (editor, NFS or Finder droppings)."""
    base = name.rsplit("/", 1)[-1]
    return base != MANIFEST and (not base.startswith(".") or base == ".metadata")


def _files(path: str) -> list[str]:
    """The checkpoint's files, relative to ``path`` ('/'-separated), sorted."""
    out = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for n in names:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            if _listed(rel) and os.path.isfile(full):
                out.append(rel)
    return sorted(out)


def _hasher(name: str, world: int) -> int:
    """The rank that hashes a file: ``__<r>_*.distcp`` rank r (modulo the world), the rest rank 0."""
    m = _RANK_FILE.match(name.rsplit("/", 1)[-1])
    return int(m.group(1)) % world if m else 0


def _rank_world(ctx: Any) -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if ctx.distributed else (0, 1)


def _all_gather(ctx: Any, value: Any) -> list[Any]:
    if not ctx.distributed:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _agree(ctx: Any, error: str | None) -> None:
    """Raise the first rank's error on every rank. An all-gather, not a
    broadcast from a rank that may have failed: every rank reaches it, so none
    is left waiting, and every rank fails with the same message."""
    error = next((e for e in _all_gather(ctx, error) if e), None)
    if error:
        raise HetplanError(error)


def _write_manifest(ctx: Any, path: str) -> None:
    """After every rank's DCP save: hash the files (each rank its own shards),
    then rank 0 writes the manifest, atomically and last."""
    rank, world = _rank_world(ctx)
    mine: dict[str, dict[str, Any]] = {}
    error = None
    try:
        for name in _files(path):
            if _hasher(name, world) == rank:
                full = os.path.join(path, name)
                mine[name] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
    except OSError as exc:
        error = f"cannot hash checkpoint {path} for its manifest: {exc}"
    parts = _all_gather(ctx, (mine, error))
    _agree(ctx, next((e for _, e in parts if e), None))
    error = None
    if rank == 0:
        files: dict[str, dict[str, Any]] = {}
        for part, _ in parts:
            files.update(part)
        data = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "files": {k: files[k] for k in sorted(files)}}
        try:
            _write_atomic(os.path.join(path, MANIFEST), json.dumps(data, indent=1).encode())
        except OSError as exc:
            error = f"cannot write the manifest of checkpoint {path}: {exc}"
    _agree(ctx, error)  # also the barrier: on return the manifest is there for every rank


def _write_atomic(target: str, data: bytes) -> None:
    """Write a temporary file beside ``target``, fsync it, rename it over ``target``, fsync the directory."""
    directory = os.path.dirname(target) or "."
    tmp = os.path.join(directory, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory
    finally:
        os.close(fd)


def _check(path: str, rank: int, world: int) -> None:
    """The checks of :func:`verify` on this rank (it hashes only its share of the files)."""
    if not os.path.isdir(path):
        raise HetplanError(f"checkpoint {path} does not exist or is not a directory; check the path")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise HetplanError(f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save did not finish, or "
                           f"hetplan did not write it); {_WHAT_TO_DO}")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        fmt, version, files = manifest.get("format"), manifest.get("version"), manifest["files"]
        if fmt == MANIFEST_FORMAT and version == MANIFEST_VERSION:
            for name, entry in files.items():
                if (not _listed(name) or name.startswith("/") or ".." in name.split("/")
                        or not isinstance(entry["bytes"], int) or len(str(entry["sha256"])) != 64):
                    raise ValueError(f"bad entry {name!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HetplanError(f"checkpoint {path}: its {MANIFEST} is unreadable ({exc}); {_WHAT_TO_DO}") from None
    if fmt != MANIFEST_FORMAT or version != MANIFEST_VERSION:
        raise HetplanError(f"checkpoint {path}: its {MANIFEST} is format {fmt!r} version {version!r}, this hetplan "
                           f"reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}; load it with the hetplan that "
                           f"wrote it, or {_WHAT_TO_DO}")
    for name in sorted(files):
        full = os.path.join(path, *name.split("/"))
        if not os.path.isfile(full):
            raise HetplanError(f"checkpoint {path}: file {name} is missing (the manifest lists it); {_WHAT_TO_DO}")
        size, want = os.path.getsize(full), files[name]["bytes"]
        if size != want:
            how = "truncated" if size < want else "longer than saved: overwritten or appended to"
            raise HetplanError(f"checkpoint {path}: file {name} is {size} bytes, the manifest says {want} ({how}); "
                               f"{_WHAT_TO_DO}")
    extra = [n for n in _files(path) if n not in files]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise HetplanError(f"checkpoint {path}: file {extra[0]}{more} is not in the manifest (added after the save); "
                           f"remove it, or {_WHAT_TO_DO}")
    for name in sorted(files):
        if _hasher(name, world) != rank:
            continue
        got, want = _sha256(os.path.join(path, *name.split("/"))), str(files[name]["sha256"])
        if got != want:
            raise HetplanError(f"checkpoint {path}: file {name} has sha256 {got[:16]}..., the manifest says "
                               f"{want[:16]}... (corrupted); {_WHAT_TO_DO}")


def verify(ctx: Any, path: str) -> None:
    """Refuse a checkpoint that is incomplete (no manifest), has a file missing,
    truncated or corrupted, or a data file its manifest does not list: a
    HetplanError naming the file, the same on every rank (they share the
    hashing and agree on the verdict). ``ctx``: a RuntimeContext, or anything
    with ``distributed = False`` for one process."""
    rank, world = _rank_world(ctx)
    error = None
    try:
        _check(path, rank, world)
    except HetplanError as exc:
        error = str(exc)
    except OSError as exc:
        error = f"checkpoint {path}: cannot read it ({exc}); {_WHAT_TO_DO}"
    _agree(ctx, error)


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
    if _copy_of_another_replica(ctx):
        state = {}
    for k, v in extra.items():
        state[EXTRA_PREFIX + k] = torch.tensor(v) if isinstance(v, (int, float)) else v
    state = {k: _contiguous(v) if _strided(v) else v for k, v in state.items()}
    error = None
    if _rank_world(ctx)[0] == 0:  # an old manifest must not vouch for files being rewritten
        try:
            os.makedirs(path, exist_ok=True)
            if os.path.lexists(os.path.join(path, MANIFEST)):
                os.remove(os.path.join(path, MANIFEST))
        except OSError as exc:
            error = f"cannot write checkpoint {path}: {exc}"
    _agree(ctx, error)
    os.makedirs(path, exist_ok=True)
    dcp.save(state, checkpoint_id=path, no_dist=not ctx.distributed)
    ctx.barrier()  # every rank's data and DCP's .metadata are written
    _fault_before_manifest(ctx, extra.get("step"))
    _write_manifest(ctx, path)


def _copy_of_another_replica(ctx: Any) -> bool:
    """A rank of a later replica of a stage whose replicas run different TP
    degrees (hetplan.runtime.mixed): it holds the first replica's values,
    sharded otherwise, and DCP cannot merge one tensor saved in two layouts
    (torch 2.13: "item.index.fqn not in md"), so only the first replica saves
    the stage's weights and optimizer states; any plan loads them."""
    if not ctx.distributed:
        return False
    return ctx.layout.plan.stages[ctx.position.pp_index].replica_tp is not None and ctx.position.dp_index > 0


def _fault_before_manifest(ctx: Any, step: Any) -> None:
    """Fault injection for the tests of ``--elastic`` (``HETPLAN_FAULT_KILL_SAVE``, hetplan.runtime.faults):
    the rank named for this step dies with every rank's data written and no manifest yet, a save cut short."""
    rank, world = _rank_world(ctx)
    if isinstance(step, int) and fault_kills(world, KILL_SAVE_ENV).get(rank) == step:
        os.kill(os.getpid(), signal.SIGKILL)


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

    verify(ctx, path)  # before reading anything: incomplete, truncated, corrupted or extra files
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise HetplanError(f"{path} is not a complete checkpoint (no .metadata); pick another or retrain")
    reader = dcp.FileSystemReader(path)
    available = set(reader.read_metadata().state_dict_metadata)
    info = ctx.model_info(model)
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
    strided = {k: v for k, v in to_load.items() if _strided(v)}
    to_load.update({k: _contiguous(v) for k, v in strided.items()})
    dcp.load(to_load, checkpoint_id=path, no_dist=not ctx.distributed)
    with torch.no_grad():
        for k, v in strided.items():  # back into the tensors the model and optimizer hold
            v.to_local().copy_(to_load[k].redistribute(v.device_mesh, v.placements).to_local())
            to_load[k] = v
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


def _strided(value: Any) -> bool:
    """A DTensor split group by group (``_StridedShard``: GPT-2's fused q|k|v under
    TP, hetplan.runtime.hf_tp): a rank's part is several blocks of the global
    tensor, and DCP describes a rank's part of a DTensor as one block."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def _contiguous(value: Any) -> Any:
    """The same DTensor laid out in plain ``Shard`` blocks, which DCP can write and read."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]
    return value.redistribute(value.device_mesh, placements)


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
    info = ctx.model_info(model)
    for name, canon in (info.aliases if info else {}).items():
        if name not in sd and canon in sd:
            sd[name] = sd[canon]
        elif canon not in sd and name in sd:
            sd[canon] = sd[name]
    return sd


def verify_here(path: str) -> None:
    """:func:`verify` in this process alone (no process group): what ``hetplan
    train`` checks before it starts any process, so a damaged checkpoint is one
    line, not a failure inside every rank."""
    verify(_ONE_PROCESS, path)


class _OneProcess:
    distributed = False


_ONE_PROCESS = _OneProcess()
