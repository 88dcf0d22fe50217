"""Reading a file the user gave (JSON or YAML), with any problem as one HetplanError line.

Every input file goes through here, so each rule holds for all of them:

* a size limit checked before anything is read (``/dev/zero`` or a 10 GB
  file is refused at once, not after filling memory);
* bytes that are not UTF-8 are named, with the file;
* JSON: ``NaN`` / ``Infinity`` (Python writes them, JSON forbids them) and a
  key given twice in one object are refused;
* YAML: a key given twice in one mapping is refused (PyYAML keeps the last
  one silently), and aliases are bounded, so an "alias bomb" cannot expand a
  small file into gigabytes.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import yaml

from hetplan.errors import HetplanError

# A 405B-parameter ModelSpec JSON is ~100 KB and a ranked plan file for 4,096
# GPUs a few MB; a full GPU-to-GPU bandwidth matrix for 1,024 GPUs in YAML is
# ~6 MB. 64 MiB is far above every real input and still read in a second.
MAX_INPUT_FILE_BYTES = 64 * 2**20
# YAML is parsed far slower than JSON (PyYAML builds Python objects node by
# node: ~1 s per 100k nodes here). Cluster files are a few KB; a full
# bandwidth matrix for 256 GPUs is ~0.4 MB; bigger clusters give bandwidths
# per node, not per GPU pair.
MAX_YAML_FILE_BYTES = 2**20
# An alias repeats a whole subtree, so a few nested ones expand a small file
# exponentially ("billion laughs"). Bound what the aliases expand to, in nodes.
MAX_YAML_NODES = 500_000


def read_text(path: str | os.PathLike[str], what: str, limit: int = MAX_INPUT_FILE_BYTES) -> str:
    """The text of ``path``: a file of at most ``limit`` bytes, UTF-8."""
    path = os.fspath(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise HetplanError(f"cannot read {what} {path}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise HetplanError(f"{what} {path} is a directory; give the file's path")
    if not stat.S_ISREG(info.st_mode):  # opening a FIFO blocks until a writer comes; a device may never end
        raise HetplanError(f"{what} {path} is a {_file_kind(info.st_mode)}, not a regular file; "
                           "save the input to a file and give its path")
    if info.st_size > limit:
        raise _too_large(what, path, limit)
    try:
        with open(path, "rb") as f:  # the file may grow between stat and read: read at most limit + 1 bytes
            data = f.read(limit + 1)
    except OSError as exc:
        raise HetplanError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > limit:
        raise _too_large(what, path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise HetplanError(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                           "save it as UTF-8") from None


def _too_large(what: str, path: str, limit: int) -> HetplanError:
    return HetplanError(f"{what} {path} is larger than hetplan's limit of {limit / 2**20:g} MiB "
                        "for this kind of file; is it the right file?")


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words, for messages."""
    kinds = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number; write a finite number")


def _unique_object(where: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"key {key!r} is given twice in one object{where}")
            out[key] = value
        return out
    return hook


def read_json(path: str | os.PathLike[str], what: str, fix: str = "") -> Any:
    """Parsed JSON of ``path``; ``what`` names the file in messages ("plan file"),
    ``fix`` is appended to the invalid-JSON message ("fix the syntax")."""
    path = os.fspath(path)
    text = read_text(path, what)
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_object(""))
    except json.JSONDecodeError as exc:
        raise HetplanError(f"{what} {path} is not valid JSON (line {exc.lineno}){': ' + fix if fix else ''}") from None
    except ValueError as exc:  # from the hooks above
        raise HetplanError(f"{what} {path}: {exc}") from None
    except RecursionError:
        raise HetplanError(f"{what} {path} nests too deeply to be a hetplan input") from None


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's C parser when installed: 10x faster


class _StrictLoader(_SAFE_LOADER):  # type: ignore[misc,valid-type]  # yaml's loader class is dynamic
    """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.YAMLError(f"key {key!r} is given twice in one mapping (line "
                                         f"{key_node.start_mark.line + 1}); keep one")
                seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              lambda loader, node: loader.construct_mapping(node))


def read_yaml(path: str | os.PathLike[str], what: str) -> Any:
    """Parsed YAML of ``path`` under the rules above."""
    path = os.fspath(path)
    text = read_text(path, what, MAX_YAML_FILE_BYTES)
    try:
        _check_expansion(text)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise HetplanError(f"{what} {path} is not valid YAML: {_yaml_reason(exc)}") from None
    except RecursionError:
        raise HetplanError(f"{what} {path} nests too deeply to be a hetplan input") from None


def _check_expansion(text: str) -> None:
    """Count the nodes the document expands to, aliases included, on the
    parser's events, before anything is composed."""
    sizes: dict[str, int] = {}  # anchor -> nodes in its subtree, expanded
    stack: list[list[Any]] = [[None, 0]]  # open collections: [anchor, nodes so far]
    for event in yaml.parse(text, Loader=_SAFE_LOADER):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            stack.append([event.anchor, 1])
            continue
        if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, count = stack.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, count = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, count = None, sizes.get(event.anchor, 1)
        else:
            continue
        if anchor is not None:
            sizes[anchor] = count
        stack[-1][1] += count
        if stack[0][1] + sum(c for _, c in stack[1:]) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"it expands to more than {MAX_YAML_NODES:,} values (through aliases "
                                 "*name?); write it out plainly")


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def check_writable_file(flag: str, path: str) -> None:
    """An output file ``path`` can be written: checked before minutes of
    searching or measuring, not after them. A symbolic link is written through
    (the ``wrote`` line names its target: ``write_target``)."""
    example = os.path.join(path, "out.json")
    if os.path.isdir(path):
        raise HetplanError(f"{flag} {path} is a directory; give a file name (such as {example})")
    if path.endswith(os.sep):
        raise HetplanError(f"{flag} {path} ends in '{os.sep}', which names a directory; give a file name "
                           f"(such as {example})")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise HetplanError(f"{flag} {path}: no directory {parent} (it does not exist); create it or give another path")
    if os.path.exists(path) and not _regular_or_null(path):  # a FIFO would block the write until a reader comes
        raise HetplanError(f"{flag} {path} is a {_file_kind(os.stat(path).st_mode)}, not a regular file; "
                           "give a file name")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise HetplanError(f"{flag} {path}: not writable; give another path")


def _regular_or_null(path: str) -> bool:
    """A regular file, or the null device (writing there discards the output, as the user asked)."""
    return os.path.isfile(path) or os.path.realpath(path) == os.devnull


def write_target(path: str) -> str:
    """``path`` as the ``wrote`` line says it: a symbolic link names the file
    it overwrote, so writing through a link is never silent."""
    return f"{os.path.realpath(path)} (through the link {path})" if os.path.islink(path) else path
