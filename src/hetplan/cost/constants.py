"""Every constant the cost model uses, with its source.

Most are taken from a paper, a datasheet or a library's own cost model. A few
physical quantities no source gives are fitted on whole published runs
(``shared/calibration/published_runs.json``, by ``benchmarks/fit_cost_model.py``)
and say so beside them; nothing is a per-run correction.
"""

# --- compute ----------------------------------------------------------------
# Fraction of the datasheet tensor-core peak that large cuBLAS GEMMs sustain,
# for GPUs without a measured rate in the catalog (GPUSpec.matmul_efficiency).
# NVIDIA "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023),
# §2.3/Fig. 5-6: large fp16 GEMMs on A100 reach ~250 of 312 TFLOP/s (~80%);
# Narayanan et al. 2021 (Megatron-LM, SC'21) report end-to-end 52% of peak on
# A100 for whole iterations, which includes everything below.
GEMM_EFFICIENCY = 0.80

# Smaller matmuls run further below a GPU's best-shape rate: efficiency falls
# as d / (d + half) with the per-rank weight-matrix side d (NVIDIA "Matrix
# Multiplication Background User's Guide", §2-4: tile and wave quantisation,
# arithmetic intensity). Fitted (least squares on log throughput) on
# shared/calibration/published_runs.json by benchmarks/fit_cost_model.py, like
# every constant below marked "fitted"; the others are taken from a source.
GEMM_HALF_DIM = 256.0
# Fraction of the best-shape (short benchmark) matmul rate a GPU sustains
# through a training run (clocks under sustained load, the mix of shapes and
# fused epilogues of real layers): a 700 W H100 SXM loses more than a 400 W
# A100. Fitted like GEMM_HALF_DIM; H200 is the same GH100 die and power.
SUSTAINED_MATMUL_FRACTION = {"A100-40GB": 0.85, "A100-80GB": 0.85, "H100": 0.7, "H200": 0.7}
# A GPU with a measured best-shape rate but no published run to fit its own
# fraction (B200, MI300X, Gaudi ...) sustains the mean of the fitted ones: the
# benchmark-to-training loss is physical (clocks under sustained load, shape
# mix), so taking the benchmark rate whole would rank those GPUs above every
# fitted one by that loss alone. GPUs with no measured rate keep
# GEMM_EFFICIENCY, a large-GEMM rate in training (NVIDIA guide above).
DEFAULT_SUSTAINED_MATMUL_FRACTION = sum(SUSTAINED_MATMUL_FRACTION.values()) / len(SUSTAINED_MATMUL_FRACTION)

# Fused attention: fraction of the dense 16-bit peak its forward+backward
# reaches at long sequences, with FLOPs counted for the lower triangle of a
# causal mask only, per kernel implementation (``Workload.attention_kernel``):
# the kernel a run calls is software the user chose, and on one GPU the
# implementations differ by up to 3x.
#  - "flash2": FlashAttention-2, what PyTorch SDPA runs (hetplan's runtime,
#    torchtitan, HF). A100: ~190-200 of 312 TFLOP/s forward+backward (Dao
#    2023, Fig. 4-6); H100 SXM: 370 forward / 320 backward of 989 at 8-16k
#    tokens, head dim 128 (Shah et al. 2024, "FlashAttention-3", Fig. 5-6),
#    i.e. 3.5 / (1/370 + 2.5/320) = 333 TFLOP/s over the 1 + 2.5 FLOPs.
#  - "cudnn": cuDNN's fused attention, what Transformer Engine runs
#    (Megatron-LM / NeMo): 600 forward / 517 backward on H100 (same figures):
#    538 TFLOP/s. Before Hopper its kernels are FlashAttention-2's design.
#  - "triton": the Triton FlashAttention kernel with an ALiBi bias that
#    MosaicML's MPT models train with, fitted (like GEMM_HALF_DIM) on the
#    MosaicML runs of shared/calibration: about half of FlashAttention-2's
#    own kernel benchmark on both GPUs.
# Other GPUs (no kernel benchmark): ATTENTION_TO_GEMM_DEFAULT below, scaled by
# the kernel's ratio to FlashAttention-2 on the GPUs it was measured on.
AMPERE_GPUS, HOPPER_GPUS = ("A100-40GB", "A100-80GB"), ("H100", "H200")  # one die each: the same kernel rates


def per_die(ampere: float, hopper: float) -> dict[str, float]:
    """A value per catalog GPU of each die (``AMPERE_GPUS``, ``HOPPER_GPUS``)."""
    return {**dict.fromkeys(AMPERE_GPUS, ampere), **dict.fromkeys(HOPPER_GPUS, hopper)}


_FA2_AMPERE = 195 / 312
ATTENTION_KERNEL_EFFICIENCY = {
    "flash2": per_die(_FA2_AMPERE, 3.5 / (1 / 370 + 2.5 / 320) / 989),
    "cudnn": per_die(_FA2_AMPERE, 3.5 / (1 / 600 + 2.5 / 517) / 989),
    "triton": per_die(0.3, 0.2),
}
ATTENTION_KERNELS = tuple(ATTENTION_KERNEL_EFFICIENCY)
# What a run calls unless told otherwise: PyTorch SDPA's FlashAttention-2;
# planning for a tool (``--target``) assumes the kernel that tool calls:
# Megatron-LM trains through Transformer Engine (cuDNN attention), torchtitan
# and DeepSpeed's HF models through SDPA.
DEFAULT_ATTENTION_KERNEL = "flash2"
TOOL_ATTENTION_KERNEL = {"megatron": "cudnn", "torchtitan": "flash2", "deepspeed": "flash2"}
# Other GPUs: this fraction of their matmul efficiency, the ratio of
# FlashAttention-2's kernel benchmark to the matmul rate on A100 (0.62 / 0.87).
ATTENTION_TO_GEMM_DEFAULT = 0.7
# Sequence length at which fused attention runs at half its long-sequence rate
# (Dao 2023, Fig. 4: A100 causal head dim 128 reaches ~105 TFLOP/s at 512
# tokens and ~160 at 2k against ~195 at 16k, i.e. s / (s + ~450)).
ATTENTION_HALF_SEQ = 450.0
# A causal kernel computes only the blocks on or below the diagonal (Dao 2023,
# §3.1.1): half the score matrix for long sequences.
CAUSAL_EXECUTED_FRACTION = 0.5
# FlashAttention's backward runs five matmuls to the forward's two (it
# recomputes the scores: Dao 2023, §3.2), 2.5x the forward's FLOPs.
ATTENTION_BACKWARD_RATIO = 2.5

# FP8 matmuls reach a smaller fraction of their (twice as high) peak than
# 16-bit ones: H100 SXM's measured best-shape rates are 1,402.6 of 1,979 FP8
# TFLOP/s (0.709) against 794.5 of 989 bf16 (0.803), a ratio of 0.88
# (stas00/ml-engineering MAMF table, via shared/calibration/hardware_specs.json).
FP8_MATMUL_RELATIVE_EFFICIENCY = (1402.6 / 1979) / (794.5 / 989)

# Fraction of datasheet DRAM bandwidth that streaming (elementwise) kernels
# reach. NVIDIA CUDA C++ Best Practices Guide §"Effective Bandwidth" and the
# BabelStream results (Deakin et al. 2018) show 80-90% on V100/A100.
MEMORY_BANDWIDTH_EFFICIENCY = 0.80

# Fixed cost of each kernel launch (CPU launch + GPU scheduling/tail); what
# makes small matrices run far below peak (AMP §3.4). NVIDIA CUDA C++ Best
# Practices Guide: launch overhead "on the order of 5 microseconds".
KERNEL_LAUNCH_S = 5e-6

# Host time to dispatch one ATen operator in eager PyTorch under autocast and
# autograd (Python call, dispatcher, autocast and autograd keys, CUDA launch),
# on the training host: what a micro-batch costs when its kernels are shorter
# than their dispatch (hetplan.model.runtime_time counts each layer's
# operators). Fitted: no source gives it for this stack; least squares (1 us grid) on the
# five recorded hetplan train runs on one H100 (benchmarks/data/h100/
# h100-runs.json); only the micro-batch-2 run is host-bound, so it alone sets it
# (refit by hand on that file's runs; tests/test_h100_time.py holds the result).
HOST_OP_S = 17e-6

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

# Memory traffic of an elementwise kernel's backward over its forward's: a
# forward reads its input and writes its output (2 passes); its backward reads
# the saved input and the output gradient and writes the input gradient (3
# passes): GELU, LayerNorm, dropout, scale/mask (derivatives in Hendrycks &
# Gimpel 2016; Ba et al. 2016). Residual adds pass gradients through.
ELEMENTWISE_BACKWARD_RATIO = 1.5

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
# CPU processes (gloo) run their collectives on the cores that compute, one
# process per core in hetplan's local runs: nothing overlaps, a collective
# and the computation it would hide behind take their sum. Measured here
# (benchmarks/bench_prediction_cpu.py): FSDP2 ZeRO-3 on local-cpu-2 is slower
# than plain data parallelism by its gathers and reduce-scatters whole.
CPU_OVERLAP_SLOWDOWN = 2.0

# Fraction of link bandwidth NCCL collectives achieve ("bus bandwidth" in
# nccl-tests: ~230 of 300 GB/s NVLink on A100, ~80% of InfiniBand line rate;
# NVIDIA nccl-tests PERFORMANCE.md and DGX A100 reference numbers).
COLLECTIVE_BANDWIDTH_EFFICIENCY = 0.77

# How an implementation of sharded data parallelism moves its all-gathers and
# reduce-scatters between nodes (``Workload.zero_implementation``):
# - "fsdp": one NCCL ring per collective over the whole group, topology-aware,
#   so a node's data crosses the network once through all of its NICs
#   (``comm._hierarchical``). PyTorch FSDP/FSDP2 (per-block flat parameters),
#   Megatron's distributed optimizer and hetplan's runtime. Checked on MosaicML
#   llm-foundry's FSDP runs on 16-512 A100/H100 (docs/cost-model.md).
# - "deepspeed": every GPU's share of the traffic crosses its own NIC, the
#   per-GPU volume model of the ZeRO paper (Rajbhandari et al. 2020 §7: 3Ψ per
#   GPU for stage 3) that ZeRO++ (Wang et al. 2023 §1-3) and MiCS (Zhang et al.
#   2022 §2) build on. Measured: DeepSpeed ZeRO-3 of GPT-3 175B / 530B on
#   384-2240 A100 (Narayanan et al. 2021, Table 2) keeps a constant step time
#   from 768 to 1536 GPUs at one micro-batch per GPU, i.e. bandwidth-bound on
#   each GPU's 25 GB/s NIC, about 8x slower than a topology-aware ring.
ZERO_IMPLEMENTATIONS = ("fsdp", "deepspeed")

# Training precision -> bytes per weight/activation element the cost model
# counts (IEEE 754 binary32 = 4; bfloat16 and binary16 = 2). bf16 and fp16
# cost the same here; they differ in the runtime (fp16 needs loss scaling:
# Micikevicius et al. 2018, "Mixed Precision Training", §3.2).
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Latency of one NCCL collective (Simple protocol), from NCCL's own tuning
# model (NVIDIA/nccl src/graph/tuning.cc, baseLat and hwLat): a base cost plus
# one hop latency per ring step, NVLink / PCIe inside a node and the network
# across nodes; trees pay 2·log2(nodes) network hops.
NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_RING_HOP_LATENCY_S = {"nvlink": 3.4e-6, "pci": 5.7e-6, "net": 9.6e-6}
NCCL_TREE_HOP_LATENCY_S = {"nvlink": 28e-6, "pci": 28e-6, "net": 50e-6}
# In-node links at least this fast (Gb/s per direction) are NVLink / NVSwitch;
# PCIe 5.0 x16 is ~504 Gb/s (PCI-SIG), NVLink 2 on V100 1,200.
NVLINK_MIN_GBPS = 600.0
# Gradients are all-reduced in buckets of this size (PyTorch DDP's default
# bucket_cap_mb = 25; Megatron-LM's DDP buckets are of the same order), so a
# sync of G bytes runs G / bucket collectives. Sharded data parallelism (ZeRO-3
# / FSDP) gathers and reduce-scatters once per layer (one FSDP unit per block).
ALLREDUCE_BUCKET_BYTES = 25 * 2**20

# --- memory -------------------------------------------------------------------
# Bytes per parameter of model state for each optimizer (Rajbhandari et al.
# 2020, ZeRO §3.1): mixed-precision Adam keeps fp16 weights (2) and gradients
# (2) plus fp32 master weights, momentum and variance (4+4+4) = 16 bytes;
# fp32 Adam keeps fp32 weights, gradients, momentum, variance = 16 bytes;
# SGD with momentum in fp32: weights, gradients, momentum = 12 bytes.
# "adam-mixed-fp32-grads": mixed-precision Adam whose gradients are kept,
# accumulated and reduced in fp32 (4 bytes): Megatron-LM's bf16 training
# (--accumulate-allreduce-grads-in-fp32, which its arguments.py turns on for
# bf16: the "main_grad" buffer) and PyTorch FSDP's
# MixedPrecision(reduce_dtype=float32) (MosaicML Composer's DEFAULT / amp_bf16
# setting). Data-parallel collectives then move 4-byte gradients too.
# "adam-bf16-deepspeed": DeepSpeed's BF16_Optimizer (Megatron-DeepSpeed bf16,
# BLOOM): the bf16 gradients (2) plus an fp32 gradient accumulation buffer for
# every parameter (4; deepspeed/runtime/bf16_optimizer.py
# fp32_groups_gradients), both whole on every rank (it supports ZeRO stage 0/1).
OPTIMIZER_STATE_BYTES = {
    # name: (weight bytes, gradient bytes, optimizer-state bytes)
    "adam-mixed": (2, 2, 12),
    "adam-mixed-fp32-grads": (2, 4, 12),
    "adam-bf16-deepspeed": (2, 6, 12),
    "adam-fp32": (4, 4, 8),
    "sgd-fp32": (4, 4, 4),
}

# What hetplan's runtime holds per parameter, (weight, gradient, optimizer
# state) bytes, in every precision: fp32 master weights and gradients
# (runtime/precision.py: autocast over fp32 parameters; FSDP2 reduces fp32
# gradients) and the optimizer's fp32 states: AdamW's exp_avg and exp_avg_sq
# (torch/optim/adam.py, Adam._init_group: torch.zeros_like(p) twice), SGD's
# momentum buffer (torch/optim/sgd.py, _single_tensor_sgd: grad.clone()).
# ``hetplan train --optimizer adamw|sgd`` (runtime/reference.make_optimizer).
RUNTIME_STATE_BYTES = {"adamw": (4, 4, 8), "sgd": (4, 4, 4)}
# The runtime's optimizer a Workload.optimizer name stands for under target
# "hetplan": every Adam variant is its AdamW, SGD its SGD with momentum.
RUNTIME_OPTIMIZER = {"adam-mixed": "adamw", "adam-mixed-fp32-grads": "adamw", "adam-bf16-deepspeed": "adamw",
                     "adam-fp32": "adamw", "sgd-fp32": "sgd"}
# Temporaries of one parameter's update, in tensors of that parameter's size:
# the for-loop AdamW the runtime makes (foreach=False) computes
# ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: the sqrt
# and the quotient both live (torch/optim/adam.py, _single_tensor_adam, line
# 544 in torch 2.13); SGD with momentum updates in place (torch/optim/sgd.py,
# _single_tensor_sgd: buf.mul_().add_(), param.add_()).
OPTIMIZER_STEP_TEMPORARIES = {"adamw": 2, "sgd": 0}
# The runtime's ZeRO-1 optimizer (runtime/zero1.py) steps an fp32 copy of this
# rank's 1/dp slice of each parameter (_Slice.shard, a view into its bucket's
# send buffer, kept: counted with the optimizer states), and after the step
# gathers every rank's slices into one fp32 buffer of the stage's parameters
# (_Bucket.gather: ``gathered``, copied straight into the weights): fp32 bytes
# per ZeRO-1 parameter.
ZERO1_SLICE_COPY_BYTES = 4
ZERO1_GATHER_BYTES = 4
# FSDP2 reduces one layer's gradients at a time: it copies the layer's fp32
# gradients into a flat buffer of their size, frees them, and keeps the
# buffer until its reduce-scatter (or replicate's all-reduce) has run
# (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce:
# reduce_scatter_input, lines 597-606 in torch 2.13): one layer's gradients
# beyond the (sharded) ones kept, during the backward pass.
FSDP_REDUCE_BUFFER_LAYERS = 1
# Memory a GPU reports to CUDA programs, over what the catalog lists: an H100
# 80GB HBM3 reported 79.18 GiB total (torch.cuda.get_device_properties(0).
# total_memory = 79.1787109375 GiB: benchmarks/data/h100/runtime-runs.json;
# the rest is the driver's). Plans for hetplan's runtime must fit in this;
# other GPUs are taken to keep the same share (no measurement of theirs here).
DEVICE_REPORTED_FRACTION = 79.1787109375 / 80

# Bytes the Adam update reads and writes per parameter (fp32 master, m, v read
# and written, gradient read, 16-bit weight written): a memory-bound kernel.
OPTIMIZER_STEP_BYTES_PER_PARAM = 32
# hetplan's runtime steps AdamW as plan/runtime_facts.OPTIMIZER_IMPLEMENTATION says
# (fused on CUDA, for-loop on CPU). The fused kernel passes over each tensor once
# (OPTIMIZER_STEP_BYTES_PER_PARAM). The for-loop and foreach forms run one pass per
# elementwise op of torch/optim/adamw.py ``_single_tensor_adamw`` /
# ``_multi_tensor_adamw`` (torch 2.13): decay param.mul_ (r4 w4), exp_avg.lerp_
# (r8 w4), exp_avg_sq.mul_ (r4 w4) and .addcmul_ (r8 w4), sqrt, division and
# add_(eps) of the denominator (3 x r4 w4), param.addcdiv_ (r12 w4): 80 bytes.
# Against the H100 yardstick (h100-runs.json: plain gpt3-1.3b loop, 332.8 ms fused,
# 354.2 ms for-loop) this gives 23.5 ms more for 1.32e9 parameters, 21.4 measured.
OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION = {"fused": OPTIMIZER_STEP_BYTES_PER_PARAM, "foreach": 80, "for-loop": 80}

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

# --- activation offloading ---------------------------------------------------------
# An offloaded layer's saved activations stay on the GPU only while it runs
# and while they are fetched back one layer ahead of its backward (the
# runtime's prefetch horizon of one layer; SageMaker's "activation loading
# horizon", Karakus et al. 2021, App. H.3 and I.1): two layers' worth, of one
# micro-batch (only one micro-batch computes at a time on a GPU).
OFFLOAD_RESIDENT_LAYERS = 2
# Host link bandwidth per direction, bytes/s, by link kind: PCI Express x16 at
# 8, 16 and 32 GT/s with 128b/130b coding (PCI-SIG, PCI Express Base
# Specification 3.0, 4.0 and 5.0: 15.75, 31.5 and 63 GB/s per direction) and
# NVLink-C2C between Grace and Blackwell (NVIDIA GB200 NVL72 specifications:
# 900 GB/s bidirectional, 450 GB/s each way). Datasheet rates: pinned-memory
# copies reach most, not all, of them (not modelled).
HOST_LINK_BYTES_PER_S = {"pcie3": 15.75e9, "pcie4": 31.5e9, "pcie5": 63.0e9, "nvlink-c2c": 450e9}
# The host interface of each catalog GPU (each one's datasheet, as cited in
# cluster/catalog.py: "PCIe Gen3/Gen4/Gen5 x16"); SXM/OAM modules connect to
# the host by the same PCIe generation as their PCIe cards. A GPU not listed
# (a cluster file's own type) gets DEFAULT_HOST_LINK. "CPU" processes copy
# within host memory: their link is their memory bandwidth (cost/kernel.py).
GPU_HOST_LINK = {
    "P100": "pcie3", "V100-16GB": "pcie3", "V100-32GB": "pcie3", "T4": "pcie3", "RTX-TITAN": "pcie3",
    "A100-40GB": "pcie4", "A100-80GB": "pcie4", "A10": "pcie4", "L4": "pcie4", "RTX-3090": "pcie4",
    "RTX-4090": "pcie4", "L40S": "pcie4", "RTX-A6000": "pcie4", "RTX-6000-Ada": "pcie4", "MI250X": "pcie4",
    "Gaudi2": "pcie4", "H100": "pcie5", "H100-PCIe": "pcie5", "H100-NVL": "pcie5", "H800": "pcie5",
    "H20": "pcie5", "H200": "pcie5", "B200": "pcie5", "MI300X": "pcie5", "MI325X": "pcie5", "Gaudi3": "pcie5",
    "GB200": "nvlink-c2c",
}
DEFAULT_HOST_LINK = "pcie4"
# Host memory an offloading GPU can fill: its node's host memory (a cluster
# file's ``host_memory_gb``, else its GPU type's reference server below) over
# the node's GPUs, less HOST_MEMORY_RESERVE_FRACTION. Reference servers, GiB of
# system memory per 8 GPUs (NVIDIA datasheets: DGX-1 with V100 "512 GB DDR4";
# DGX A100 320GB "1TB", DGX A100 640GB "2TB"; DGX H100 "2TB"; DGX H200 "2TB";
# DGX B200 "2TB, configurable to 4TB"; DIMMs are sold in binary sizes).
HOST_MEMORY_GIB_PER_SERVER = {
    "V100-16GB": 512, "V100-32GB": 512, "A100-40GB": 1024, "A100-80GB": 2048, "H100": 2048, "H200": 2048,
    "B200": 2048,
}
GPUS_PER_REFERENCE_SERVER = 8
# A GPU no reference server lists gets host memory equal to its own memory: the
# servers above hold 1.8x (DGX H200: 2048 GiB over 8 x 141 GB) to 4x (DGX-1
# V100-16GB) their GPUs' memory, so 1x is below every one of them — an
# offloaded plan that fits such a GPU fits any server built like them.
DEFAULT_HOST_MEMORY_PER_GPU_MEMORY = 1.0
# Share of each GPU's part of host memory left to everything but offloaded
# activations: the OS and page cache, the rank's own process (a CPU copy of
# the model while loading, CUDA's pinned staging buffers) and its dataloader
# workers (each a fork of the rank). No source gives a number: a conservative
# quarter, stated, not fitted. A CPU "device" (local-cpu-N) offloads within
# the memory it already counts as its own, so no host limit applies to it.
HOST_MEMORY_RESERVE_FRACTION = 0.25

# --- context and expert parallelism (cost/cp_ep.py) ---------------------------------------
# How context parallelism (CP) exchanges keys and values. "allgather": Llama 3
# (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2) all-gathers K and V
# over the CP group before the attention of the local query chunk and
# reduce-scatters their gradients in the backward pass; the all-gather is
# exposed on the critical path ("the exposed all-gather latency is small as
# the communicated K and V tensors are much smaller than Q ... due to GQA").
# torchtitan's default rotation (``context_parallel_rotate_method =
# "allgather"``) does the same. "ring": Ring Attention (Liu et al. 2023, §3)
# passes K/V blocks around the CP ring in cp - 1 steps, each hidden behind the
# attention of the block before it: the same bytes, overlapped
# (``cp_ep.cp_exposed_time``).
CP_KV_METHODS = ("allgather", "ring")
CP_KV_METHOD = "allgather"
# K/V exchanges per training step in units of one forward all-gather: forward
# all-gather, backward reduce-scatter of dK/dV (Llama 3 §3.3.2); full
# recomputation gathers again when it replays the forward. The gathered K/V
# are kept for the backward pass (counted in the activations), so selective
# recomputation of the attention core needs no second gather.
CP_KV_PASSES = {"none": 2.0, "selective": 2.0, "full": 3.0}
# Causal attention split into 2·cp chunks, rank i taking chunks i and
# 2·cp - 1 - i (the "zigzag" / load-balanced layout of Megatron-Core's CP and
# torchtitan's ``_load_balancer``; Llama 3 §3.3.2 splits the sequence the same
# way "for better load balancing"): every rank computes the same share of the
# causal score matrix. False: contiguous chunks, where the last rank computes
# (2·cp - 1)/cp² of it (``cp_ep.causal_cp_work_fraction``).
CP_CAUSAL_ZIGZAG = True

# All-to-all exchanges per MoE layer and training step: token dispatch and
# combine in the forward pass, and their two transposes in the backward pass
# (GShard, Lepikhin et al. 2020, §2.2 and Fig. 3; Megatron-Core MoE
# "token_dispatcher" alltoall; torchtitan's ``expert_parallel`` all-to-all
# dispatch/combine). Full recomputation replays the forward's two.
EP_ALLTOALL_PASSES = {"none": 4.0, "selective": 4.0, "full": 6.0}
# Expert load imbalance: tokens the busiest expert-parallel rank processes
# over the average. 1.25 is a buffer size, not a measurement: Switch
# Transformer's capacity factor (Fedus et al. 2022, §2.2 and Table 1: 1.0-1.25
# best), the slack a capacity-based router gives each expert before it drops
# tokens — so the most the busiest expert processes there; GShard uses 2.0
# for top-2 (1.0 per routed copy; Lepikhin et al. 2020 §2.2). Dropless
# routers (MegaBlocks, Gale et al. 2023; Megatron-Core's default) process
# whatever arrives, and we found no published per-micro-batch maximum-over-mean
# for dropless training of a Mixtral-style model to cite instead (DeepSeek-V3,
# arXiv:2412.19437 §2.1.2, and Wang et al. 2024, arXiv:2408.15664, report
# balance over whole batches or validation sets, not the busiest rank of one
# micro-batch). So the capacity buffer stays as the default, read as "what a
# capacity-limited run would allow"; a measured value goes in
# ``Workload.expert_imbalance``. The busiest rank's
# expert matmuls and all-to-all bytes are scaled by it when ep > 1. Without EP
# a rank runs every expert on its own tokens and pays none of it, but each
# expert's matmuls then see only top_k / num_experts of the rank's tokens
# (``compute.expert_token_efficiency``): for Mixtral-8x7B on 64 H100 at 4k
# tokens that makes auto take EP at an imbalance of 1.1 but not at 1.15,
# where EP loses by a few percent (tests/test_cp_ep_cost.py).
EXPERT_LOAD_IMBALANCE = 1.25
