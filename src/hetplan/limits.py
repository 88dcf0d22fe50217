"""Size limits on what hetplan accepts, checked before anything is built.

Each is far above every real training job, so none stops a real user, yet
finite: a typo (``10000000000xH100``), a wrong file or a fuzzer's input gets a
one-line error at once instead of minutes of work or gigabytes of memory. The
limits on files are in ``hetplan.io.userfiles``; those on models in
``hetplan.model.spec``.
"""

from __future__ import annotations

from hetplan.errors import HetplanError

# The largest announced training clusters hold about 100k GPUs (xAI Colossus,
# 2024: 100,000 H100; Meta's Llama 3 ran on 16,384 H100, arXiv:2407.21783).
MAX_GPUS = 131_072
# 131,072 GPUs in nodes of one GPU each.
MAX_NODES = MAX_GPUS
# One "node" that is one NVLink domain: GB200 NVL72 has 72 GPUs; NVIDIA's
# NVL576 design 576. A node of 4,096 GPUs is a typo.
MAX_GPUS_PER_NODE = 4096
# Processes of local-cpu-N run on this machine.
MAX_LOCAL_PROCESSES = 1024
# Samples per step: Llama 3 405B trained with 16M tokens a step = 2,048 samples
# of 8k; the GPT-3 paper's largest batch is 3.2M tokens. 2^24 samples is 8,000x that.
MAX_GLOBAL_BATCH = 2**24
# Host memory of one node, GiB: a GB200 NVL72 rack (one "node") has 17 TB of
# LPDDR5X (NVIDIA GB200 NVL72 specifications); 1 PiB is 60x that.
MAX_HOST_MEMORY_GIB = 2**20

# One GPU's memory, GiB: the largest today hold 192-288 GB (B200: 192 GB, AMD
# MI325X: 256 GB, MI355X: 288 GB, vendors' datasheets); 1 PiB is 4,000x that,
# and in bytes (2^50) leaves a factor 2^13 below int64 (2^63) for the planners'
# integer memory arrays.
MAX_GPU_MEMORY_GIB = 2**20
# The smallest memory a GPU (or --memory-limit) may be given: 1 MiB, the same
# floor as --memory-limit (hetplan.io.argtypes); below it a value such as
# 1e-10 GiB would round to 0 bytes, which means "no override".
MIN_GPU_MEMORY_GIB = 2**-10
# Bytes one step keeps in all (every layer's per-sample activation and
# working-memory bytes x the global batch): Llama 3 405B at 128k tokens keeps
# about 7e10 bytes per sample per layer (Korthikanti et al. 2022's 34sbh with
# s = 131,072, h = 16,384) x 126 layers x 128 samples (16M tokens) = 1.1e15,
# about 2^50. 2^60 is 1,000x that, and what one GPU holds (a share of it, times
# at most a few in-flight factors, plus < 2^51 of weight and optimizer bytes
# for 10^14 parameters) stays below int64's 2^63.
MAX_STEP_BYTES = 2**60


def check_at_most(what: str, value: int | float, limit: int, fix: str) -> None:
    """One line naming the value, the limit and what to change."""
    if value > limit:
        value = int(value) if float(value).is_integer() else value
        raise HetplanError(f"{what} = {value:,} is above hetplan's limit of {limit:,}; {fix}")
# The busiest expert-parallel rank's tokens over the average: it cannot take
# more than every token copy of its group, so an imbalance above the number of
# experts (a few hundred at most) is a typo; 64 leaves room.
MAX_EXPERT_IMBALANCE = 64.0
