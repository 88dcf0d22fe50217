"""What hetplan's runtime runs, where the planner side must know it too.

Torch-free facts that the cost model costs and the runtime obeys: one place, so a change to the
runtime's choice moves its predicted time and memory with it (tests hold the two together).
"""

from __future__ import annotations

# The optimizer implementation the runtime builds, by device type. On CUDA the fused AdamW/SGD of
# torch.optim (``fused=True``: one multi-tensor kernel per step, torch/optim/adamw.py
# ``_fused_adamw``), as users' own loops run it: on one H100 the plain gpt3-1.3b loop took 332.8 ms
# a step fused against 354.2 ms with the for-loop form (benchmarks/data/h100/h100-runs.json, "yardsticks"). On CPU
# the for-loop form, which ``--verify``'s bit-level reference (runtime/reference.py) also uses.
OPTIMIZER_IMPLEMENTATION: dict[str, str] = {"cuda": "fused", "cpu": "for-loop"}
IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
