"""Count the kernels a ``torch.compile``d layer of hetplan's built-in models launches:
the source of ``COMPILED_BLOCK_KERNELS``, ``COMPILED_HEAD_KERNELS`` and
``COMPILED_EMBED_KERNELS`` in ``hetplan.model.runtime_time`` (docs/cost-model.md
"Compiled layers").

Each layer (a decoder block, the head, the embedding) of a tiny GPT and a tiny
Llama preset is compiled as ``hetplan train --compile`` compiles it
(``nn.Module.compile``, inductor) and run forward and backward once on the CPU
under bf16 autocast (weight cache off, as ``runtime/microbatch.py`` runs it);
inductor's generated code is read from its ``output_code`` log: each call of a
fused kernel, an extern matmul or an ATen fallback (SDPA) in a graph's ``call``
is one launch. With ``--show`` the kernels' names are printed (what the fused
traffic in ``runtime_time.compiled_block_traffic`` is read from).
Exits 1 when a count differs from ``runtime_time``'s. About a minute per layer
kind on two cores (the compile itself).

    python benchmarks/count_compiled_kernels.py [--show]
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

import torch

from hetplan.model.presets import get_model, gpt_decoder
from hetplan.model.runtime_time import COMPILED_BLOCK_KERNELS, COMPILED_EMBED_KERNELS, COMPILED_HEAD_KERNELS
from hetplan.model.spec import ModelSpec
from hetplan.runtime.models import build_preset_model, cross_entropy_loss

# where inductor logs a generated module: compiled now, or found in its cache
_CODE_LOGGERS = ("torch._inductor.graph.__output_code", "torch._inductor.codecache.__output_code")
BATCH = 3  # samples: tokens differ from every width, so no two shapes coincide in the generated code
_LAUNCH = re.compile(r"^\s+(?:(cpp_fused_\w+|triton_\w+)(?:\.run)?\(|extern_kernels\.(\w+)\(|"
                     r"(?:\w+ = )?torch\.ops\.aten\.(\w+)\.default\()")


class _Code(logging.Handler):
    """Collects inductor's generated modules (``TORCH_LOGS=output_code``)."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "def call(self, args)" in text or "def call(args)" in text:
            self.modules.append(text)


def launches(module: str) -> list[str]:
    """The kernels the ``call`` function of one generated module launches, in order."""
    body = module.split("def call(", 1)[1]
    found = []
    for line in body.splitlines()[1:]:
        if line and not line.startswith(" "):
            break
        if re.match(r"^\s{0,4}def ", line):
            break
        match = _LAUNCH.match(line)
        if match:
            found.append(next(group for group in match.groups() if group))
    return found


def count(spec: ModelSpec, index: int) -> tuple[list[str], list[str]]:
    """Forward and backward kernels of layer ``index`` of ``spec``'s built-in model, compiled."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_preset_model(spec)
    layer = spec.layers[index]
    module = model.get_submodule(layer.name)
    module.compile()
    ids = torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len))
    x = torch.randn(BATCH, spec.seq_len, spec.hidden_size, requires_grad=True)
    handler = _Code()
    loggers = [logging.getLogger(name) for name in _CODE_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    torch._logging.set_logs(output_code=True)
    for printer in logging.getLogger("torch").handlers:  # collect the code without printing it
        printer.setLevel(logging.CRITICAL)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            out = module(ids) if layer.kind == "embedding" else module(x)
            if layer.kind == "head":
                out = cross_entropy_loss(out, ids)
        out.float().sum().backward()
    finally:
        torch._logging.set_logs()
        for logger in loggers:
            logger.removeHandler(handler)
    unique = list(dict.fromkeys(handler.modules))  # each module is logged at two levels
    if len(unique) != 2:
        raise SystemExit(f"{spec.name} {layer.name}: expected a forward and a backward graph, got {len(unique)}")
    return launches(unique[0]), launches(unique[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print every kernel's name")
    args = parser.parse_args()
    specs = {"gpt": gpt_decoder("gpt-bf16", num_layers=2, hidden=64, heads=4, seq=24, vocab=520),
             "llama": get_model("tiny-llama-bf16")}
    tables = {"embedding": (0, COMPILED_EMBED_KERNELS), "decoder": (1, COMPILED_BLOCK_KERNELS),
              "head": (-1, COMPILED_HEAD_KERNELS)}
    failed = False
    for style, spec in specs.items():
        for kind, (index, table) in tables.items():
            forward, backward = count(spec, index)
            expected = table[style]
            ok = (len(forward), len(backward)) == expected
            failed |= not ok
            print(f"{style:6s} {kind:9s} forward {len(forward):3d} backward {len(backward):3d} "
                  f"(runtime_time: {expected[0]}, {expected[1]}){'' if ok else '  DIFFERS'}", flush=True)
            if args.show:
                print("  forward: " + ", ".join(forward) + "\n  backward: " + ", ".join(backward))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
