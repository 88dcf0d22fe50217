"""Write megatron_lm_args.json: every command-line option of Megatron-LM's
``pretrain_gpt.py``, taken from Megatron-LM's own parser.

Megatron-LM's training code (``megatron/training/arguments.py``) is not on
PyPI (the ``megatron-core`` wheel holds ``megatron/core`` only) and imports
GPU-only packages (triton) and much of Megatron-LM, so the tests cannot run
its parser; they rebuild it from this dump (tests/test_export_tools.py). To
make the dump, check out Megatron-LM at the tag below next to megatron-core
of the same version and run::

    PYTHONPATH=/path/to/Megatron-LM python tests/data/make_megatron_args.py

(it also needs six, pandas and triton importable; no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TAG = "core_v0.16.1"


def _kind(action: argparse.Action) -> str:
    names = {argparse._StoreTrueAction: "store_true", argparse._StoreFalseAction: "store_false",
             argparse._StoreConstAction: "store_const", argparse._AppendAction: "append",
             argparse._StoreAction: "store", argparse._HelpAction: "help",
             argparse._CountAction: "count", argparse._AppendConstAction: "append_const"}
    for cls, name in names.items():
        if type(action) is cls:
            return name
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    return "store"  # custom actions take a value like store


def _plain(value: object) -> object:
    """A default as JSON: numbers, strings, lists of them; others by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return {"repr": repr(value)}


def main() -> None:
    from megatron.core import package_info
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = []
    for action in parser._actions:
        if not action.option_strings or _kind(action) == "help":
            continue
        typ = action.type
        options.append({
            "flags": list(action.option_strings),
            "dest": action.dest,
            "action": _kind(action),
            "nargs": action.nargs,
            "choices": [c if isinstance(c, (str, int, float)) else str(c) for c in action.choices]
            if action.choices else None,
            "type": typ.__name__ if typ in (int, float, str) else ("str" if typ is not None else None),
            "default": _plain(action.default),
        })
    out = {"comment": f"Command-line options of Megatron-LM {TAG} (megatron-core {package_info.__version__}): "
                      "megatron/training/arguments.py add_megatron_arguments, dumped by tests/data/"
                      "make_megatron_args.py",
           "tag": TAG, "options": options}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_args.json")
    with open(path, "w", encoding="utf-8") as f:  # one option a line
        head = json.dumps({k: v for k, v in out.items() if k != "options"})[:-1]
        f.write(head + ', "options": [\n' + ",\n".join(json.dumps(o) for o in options) + "\n]}\n")
    print(f"wrote {path}: {len(options)} options", file=sys.stderr)


if __name__ == "__main__":
    main()
