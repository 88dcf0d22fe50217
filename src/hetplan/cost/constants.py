"""Every constant the cost model uses, with its source.

Nothing here is fitted to the calibration rows in ``tests/test_calibration.py``
(Korthikanti et al. 2022); those rows check the model, they do not set it.
"""

# --- compute ----------------------------------------------------------------
# Fraction of the datasheet tensor-core peak that large cuBLAS GEMMs sustain.
# NVIDIA "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023),
# §2.3/Fig. 5-6: large fp16 GEMMs on A100 reach ~250 of 312 TFLOP/s (~80%);
# Narayanan et al. 2021 (Megatron-LM, SC'21) report end-to-end 52% of peak on
# A100 for whole iterations, which includes everything below.
GEMM_EFFICIENCY = 0.80

# Fraction of datasheet DRAM bandwidth that streaming (elementwise) kernels
# reach. NVIDIA CUDA C++ Best Practices Guide §"Effective Bandwidth" and the
# BabelStream results (Deakin et al. 2018) show 80-90% on V100/A100.
MEMORY_BANDWIDTH_EFFICIENCY = 0.80

# Fixed cost of each kernel launch (CPU launch + GPU scheduling/tail); what
# makes small matrices run far below peak (AMP §3.4). NVIDIA CUDA C++ Best
# Practices Guide: launch overhead "on the order of 5 microseconds".
KERNEL_LAUNCH_S = 5e-6

# Memory-bound (non-GEMM) kernels per transformer block per pass: norms,
# dropouts, residual adds, bias/activation, softmax, scale/mask (counted in
# hetplan.model.layers); other layer kinds use their own gemm_count + 2.
ELEMENTWISE_KERNELS_PER_GEMM = 1.5

# Kernels and memory passes of the attention core that selective recomputation
# replays (Korthikanti et al. 2022 §5, Fig. 7): the QK^T matmul, softmax,
# dropout and the scores·V matmul are 4 kernels; the softmax and dropout read
# and write the stored s×s scores once each (2 passes over those bytes).
ATTENTION_CORE_KERNELS = 4
ATTENTION_CORE_PASSES = 2.0

# Backward/forward work ratio: the backward of a matmul is two matmuls of the
# same size (input and weight gradients) — Narayanan et al. 2021 §5.1,
# Kaplan et al. 2020 (6N FLOPs per token for training = 2N fwd + 4N bwd).
BACKWARD_FLOPS_RATIO = 2.0

# --- communication ------------------------------------------------------------
# Tensor-parallel all-reduce volumes per training step, in units of one forward
# pass's (LayerSpec.tp_comm_bytes): Megatron-LM's f/g operators all-reduce once
# in the forward and once in the backward pass (Shoeybi et al. 2019 §3, Fig. 4;
# Narayanan et al. 2021 §3.2); full recomputation replays the forward and its
# all-reduces once more (Korthikanti et al. 2022 §4.2, Table 2 "+1 forward");
# selective recomputation replays only the attention core, which needs none.
TP_COMM_PASSES = {"none": 2.0, "selective": 2.0, "full": 3.0}

# Activations cross each pipeline boundary twice per micro-batch: the forward
# output one way, its gradient back (Narayanan et al. 2021 §2.2; AMP eq. 5 counts
# the forward one). Galvatron-BMW's layout transformation R between layers of
# different TP degrees likewise runs once forward and once backward (§IV-A2).
P2P_PASSES = 2.0
TRANSFORM_PASSES = 2.0

# Galvatron-BMW §V: overlapping computation with communication slows each down
# by about 1.3x (measured on their RTX TITAN and A100 clusters).
OVERLAP_SLOWDOWN = 1.3

# Fraction of link bandwidth NCCL collectives achieve ("bus bandwidth" in
# nccl-tests: ~230 of 300 GB/s NVLink on A100, ~80% of InfiniBand line rate;
# NVIDIA nccl-tests PERFORMANCE.md and DGX A100 reference numbers).
COLLECTIVE_BANDWIDTH_EFFICIENCY = 0.77

# --- memory -------------------------------------------------------------------
# Bytes per parameter of model state for each optimizer (Rajbhandari et al.
# 2020, ZeRO §3.1): mixed-precision Adam keeps fp16 weights (2) and gradients
# (2) plus fp32 master weights, momentum and variance (4+4+4) = 16 bytes;
# fp32 Adam keeps fp32 weights, gradients, momentum, variance = 16 bytes;
# SGD with momentum in fp32: weights, gradients, momentum = 12 bytes.
OPTIMIZER_STATE_BYTES = {
    # name: (weight bytes, gradient bytes, optimizer-state bytes)
    "adam-mixed": (2, 2, 12),
    "adam-fp32": (4, 4, 8),
    "sgd-fp32": (4, 4, 4),
}

# Bytes the Adam update reads and writes per parameter (fp32 master, m, v read
# and written, gradient read, 16-bit weight written): a memory-bound kernel.
OPTIMIZER_STEP_BYTES_PER_PARAM = 32

# Memory no plan can use: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
# and allocator fragmentation. PyTorch's CUDA context alone is ~0.3-0.5 GiB
# (PyTorch "CUDA semantics" notes); Galvatron-BMW §III-C budgets the rest as
# "other memory"; measured with torch.cuda.mem_get_info after a first step in
# Megatron-style runs, the total is ~1 GiB. CPU processes use much less.
FRAMEWORK_OVERHEAD_BYTES = 1 << 30
CPU_FRAMEWORK_OVERHEAD_BYTES = 256 << 20

# ZeRO-3 keeps the gathered parameters of the running layer and the prefetched
# next one (FSDP2 default prefetch of 1; PyTorch FSDP docs).
ZERO3_GATHERED_LAYERS = 2
