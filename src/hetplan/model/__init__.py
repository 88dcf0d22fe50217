"""Models as ordered layer lists: ModelSpec and LayerSpec (spec), presets, HF config import (hf),
``pkg.mod:build`` models (source, trace), loading any of them by name or file (load), and the memory
of hetplan's runtime (runtime_memory)."""
