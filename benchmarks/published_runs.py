"""Published training runs as hetplan workloads and plans.

Reads ``shared/calibration/published_runs.json`` (or any file of the same
schema: a list of runs with ``model``, ``cluster``, ``global_batch``,
``expert_config`` and ``measured``) and turns each run into what ``hetplan
estimate`` would be given for it: a ModelSpec of the run's architecture, a
cluster of its GPU type, node size and network, and the uniform plan of its
own settings (tp, pp, dp, micro-batch, ZeRO/FSDP, recomputation, sequence
parallelism, interleaving). A run that cannot be expressed faithfully is
returned with the reason, never approximated by guessing a setting.

The measured throughput is converted to tokens per second with each source's
own FLOP definition (``calibration/README.md``): MosaicML prints tokens/s;
Korthikanti et al. print iteration times; Narayanan et al. (SC21) print
TFLOP/s per GPU under their Eq. 3, which we invert.
"""

from __future__ import annotations

import copy

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetplan.cluster.catalog import get_gpu
from hetplan.cluster.presets import homogeneous_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.plan.workload import Workload
from hetplan.model.layers import BlockShape, embedding_layer, lm_head_layer, transformer_block
from hetplan.errors import HetplanError
from hetplan.model.families import llama_decoder
from hetplan.model.presets import gpt_decoder
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Plan
from hetplan.search.baselines.uniform import uniform_plan

# A copy of the team's shared/calibration/published_runs.json (each run cites its
# source), kept here so that tests and CI read the same runs.
DEFAULT_RUNS = Path(__file__).resolve().parent / "data" / "published_runs.json"

# GPU names in the runs -> hetplan catalog names.
GPU_NAMES = {
    "A100-SXM4-80GB": "A100-80GB",
    "A100-SXM4-40GB": "A100-40GB",
    "H100-80GB": "H100",
    "H100-SXM5-80GB": "H100",
    "V100-SXM3-32GB (DGX-2H)": "V100-32GB",
    "V100-SXM3-32GB": "V100-32GB",
}

# DGX-2H: 16 V100 on NVSwitch (300 GB/s per GPU) and "100 GB/s between servers
# (8 InfiniBand adapters per server)" (Shoeybi et al. 2019, §5).
DGX2H_INTRA_GBPS = 300 * 8.0
DGX2H_INTER_GBPS = 100 * 8.0


@dataclass(frozen=True)
class Case:
    """One published run as hetplan sees it (or why it cannot)."""

    run: dict[str, Any]
    workload: Workload | None = None
    plan: Plan | None = None
    measured_tokens_per_s: float = 0.0
    skip: str = ""

    @property
    def id(self) -> str:
        return str(self.run["id"])

    @property
    def group(self) -> str:
        """Source group, as in calibration/README.md."""
        for prefix in ("megatron_sc21", "korthikanti", "megatron_v1", "mosaic"):
            if self.id.startswith(prefix):
                return prefix
        return self.id.split("_")[0]

    @property
    def sweep(self) -> tuple[str, str, int]:
        """Runs of one model on one cluster: what a user ranks plans within."""
        m, c = self.run["model"], self.run["cluster"]
        return (str(m.get("name")), str(c.get("gpu_type")), int(c.get("count") or 0))


def load_runs(path: Path = DEFAULT_RUNS) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return list(json.load(f))


def _recompute(text: Any) -> str | None:
    words = str(text or "").lower()
    if words.startswith("full"):
        return "full"
    if words.startswith("selective"):
        return "selective"
    if words in ("none", "no", "false"):
        return "none"
    return None


def _interleaving(value: Any) -> int | None:
    """Virtual stages: an int, 1 when not interleaved, None when unknown."""
    if value is None:
        return 1
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _precision(text: Any) -> str | None:
    """"16-bit", "fp8" (16-bit model, FP8 matmuls: MosaicML's amp_fp8 with
    Transformer Engine) or None when not stated."""
    words = str(text or "").lower()
    if "fp8" in words:
        return "fp8"
    if any(k in words for k in ("bf16", "fp16", "mixed")):
        return "16-bit"
    return None


def _optimizer(ec: dict[str, Any]) -> str:
    """FSDP's DEFAULT mixed precision (llm-foundry's amp_bf16) reduces and keeps
    gradients in fp32; PURE bf16 and Megatron's fp16 runs keep 16-bit gradients."""
    fsdp, precision = str(ec.get("fsdp") or ""), str(ec.get("precision") or "")
    return "adam-mixed-fp32-grads" if "DEFAULT" in fsdp and precision.startswith("amp") else "adam-mixed"


def _zero_implementation(ec: dict[str, Any]) -> str:
    """The run's sharding framework, from its own words: DeepSpeed ZeRO, else
    the topology-aware NCCL rings of FSDP and Megatron (``ZERO_IMPLEMENTATIONS``)."""
    return "deepspeed" if "deepspeed" in str(ec.get("other") or "").lower() else "fsdp"


def _attention_kernel(run: dict[str, Any]) -> str:
    """The fused attention kernel the run's stack calls, from its own words:
    MosaicML's MPT trains with its Triton FlashAttention kernel (ALiBi);
    Transformer Engine stacks (NeMo, Megatron-Core) call cuDNN's; anything
    else PyTorch SDPA's FlashAttention-2. Runs without fused attention
    (Megatron-LM 2021-22) never reach the kernel."""
    words = json.dumps(run).lower()
    if "mosaicml" in words or "llm-foundry" in words or "triton" in words:
        return "triton"
    if any(k in words for k in ("transformer engine", "transformer-engine", "nemo", "megatron-core", "cudnn")):
        return "cudnn"
    return "flash2"


def _mpt_model(m: dict[str, Any], seq: int) -> ModelSpec:
    """MosaicML MPT: ALiBi (no position table), no biases, LayerNorm without
    bias, GELU MLP of ``ffn_hidden``, FlashAttention, tied LM head, no dropout."""
    hidden, heads, layers, vocab = int(m["hidden"]), int(m["heads"]), int(m["layers"]), int(m["vocab"])
    shape = BlockShape(hidden=hidden, heads=heads, ffn=int(m.get("ffn_hidden") or 4 * hidden), seq=seq,
                       bias=False, dropout=False, fused_attention=True)
    blocks = [transformer_block(f"layers.{i}", "decoder", shape, 2) for i in range(layers)]
    spec_layers = [embedding_layer("embed", vocab, hidden, seq, 2, dropout=False, tied_group="wte"),
                   *blocks, lm_head_layer("head", vocab, hidden, seq, 2, tied_group="wte", own_weight=False)]
    return ModelSpec(name=str(m["name"]), family="mpt", layers=tuple(spec_layers), seq_len=seq, dtype_bytes=2,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab)


# Words in a run's model name or architecture notes that mark a Llama-style
# decoder (RMSNorm, SwiGLU MLP, rotary positions, often grouped-query attention).
LLAMA_WORDS = ("llama", "mistral", "qwen", "swiglu", "rmsnorm", "rope", "gqa")


def _model(run: dict[str, Any]) -> ModelSpec | str:
    """The run's architecture: MPT (MosaicML), Llama-style (SwiGLU, RMSNorm,
    GQA: the named families, or any model with fewer KV heads than heads) or
    GPT-style (Megatron's GPT-2/3 models)."""
    m = run["model"]
    needed = ("layers", "hidden", "heads", "seq_len", "vocab")
    missing = [k for k in needed if not m.get(k)]
    if missing:
        return f"model {', '.join(missing)} not stated"
    seq, hidden, heads = int(m["seq_len"]), int(m["hidden"]), int(m["heads"])
    words = f"{m.get('name', '')} {m.get('arch_notes', '')}".lower()
    if run["id"].startswith("mosaic") or "mpt" in words:
        return _mpt_model(m, seq)
    if any(w in words for w in LLAMA_WORDS) or m.get("kv_heads") not in (None, heads):
        if not m.get("ffn_hidden"):
            return "Llama-style model without its MLP width (ffn_hidden)"
        return llama_decoder(str(m["name"]), int(m["layers"]), hidden, heads, int(m.get("kv_heads") or heads),
                             int(m["ffn_hidden"]), int(m["vocab"]), seq)
    return gpt_decoder(str(m["name"]), int(m["layers"]), hidden, heads, seq,
                       vocab=int(m["vocab"]), ffn=int(m.get("ffn_hidden") or 0))


def _gpu_name(raw: str) -> str | None:
    """The catalog name of a run's GPU: the table above, else the catalog's
    own names and aliases (H200, A100-80GB, ...)."""
    if raw in GPU_NAMES:
        return GPU_NAMES[raw]
    for candidate in (raw, raw.split(" ")[0], raw.replace("-SXM5", "").replace("-SXM4", "").replace("-SXM", "")):
        try:
            return get_gpu(candidate).name
        except HetplanError:
            continue
    return None


def _cluster(run: dict[str, Any]) -> ClusterSpec | str:
    c = run["cluster"]
    gpu = _gpu_name(str(c.get("gpu_type")))
    if gpu is None:
        return f"GPU {c.get('gpu_type')!r} not in the catalog"
    count, per_node = int(c["count"]), int(c.get("gpus_per_node") or 8)
    if gpu.startswith("V100"):
        per_node = min(per_node, count)
        nodes = tuple(NodeSpec(gpu, per_node, DGX2H_INTRA_GBPS, 0.0, 0, f"dgx2h-{i}")
                      for i in range(max(1, count // per_node)))
        return ClusterSpec(f"{count}xDGX-2H", nodes, DGX2H_INTER_GBPS, description="DGX-2H (Shoeybi et al. §5)")
    return homogeneous_cluster(count, gpu, per_node)


def _eq3_flops_per_token(m: dict[str, Any]) -> float:
    """Narayanan et al. 2021 Eq. 3 per token: 96·l·h²·(1 + s/6h + V/16lh)."""
    l, h, s, v = int(m["layers"]), int(m["hidden"]), int(m["seq_len"]), int(m["vocab"])
    return 96.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def measured_tokens_per_s(run: dict[str, Any]) -> float | str:
    """The run's measured throughput in tokens/s, by its source's definitions."""
    meas, gb = run.get("measured") or {}, run.get("global_batch") or {}
    if meas.get("tokens_per_s"):
        return float(meas["tokens_per_s"])
    tokens = (gb.get("tokens") or 0) or (gb.get("sequences") or 0) * (run["model"].get("seq_len") or 0)
    if meas.get("iteration_time_s") and tokens:
        return float(tokens) / float(meas["iteration_time_s"])
    definition = str(meas.get("tflops_definition", ""))
    if meas.get("tflops_per_gpu") and definition.startswith("Eq.3"):
        count = int(run["cluster"]["count"])
        return float(meas["tflops_per_gpu"]) * 1e12 * count / _eq3_flops_per_token(run["model"])
    return "no absolute throughput printed (only relative or derived numbers)"


def case_of(run: dict[str, Any]) -> Case:
    """The run as a Case: a workload and the plan of its own settings, or why not."""
    ec = run.get("expert_config") or {}
    gb = run.get("global_batch") or {}
    measured = measured_tokens_per_s(run)
    if isinstance(measured, str):
        return Case(run, skip=measured)
    if _precision(ec.get("precision")) is None:
        return Case(run, skip=f"precision {ec.get('precision')!r} not modelled")
    recompute, virtual = _recompute(ec.get("recompute")), _interleaving(ec.get("interleaving_v"))
    if recompute is None:
        return Case(run, skip="recomputation not stated")
    if virtual is None:
        return Case(run, skip="interleaving factor not stated")
    if not ec.get("micro_batch"):
        return Case(run, skip="micro-batch not stated")
    if ec.get("cp") not in (None, 1):
        return Case(run, skip="context parallelism")
    model, cluster = _model(run), _cluster(run)
    if isinstance(model, str) or isinstance(cluster, str):
        return Case(run, skip=str(model if isinstance(model, str) else cluster))
    tp, pp, dp, mbs = (int(ec[k]) for k in ("tp", "pp", "dp", "micro_batch"))
    zero = int(ec.get("zero_stage") or 0)
    if ec.get("zero_stage") is None and "FULL_SHARD" in str(ec.get("fsdp")):
        zero = 3
    workload = Workload(model, cluster, int(gb["sequences"]), optimizer=_optimizer(ec),
                        fp8=_precision(ec.get("precision")) == "fp8", zero_implementation=_zero_implementation(ec),
                        attention_kernel=_attention_kernel(run))
    schedule = "interleaved-1f1b" if virtual > 1 else "1f1b"
    try:
        plan = uniform_plan(workload, dp, tp, pp, mbs, zero, recompute, schedule,
                            bool(ec.get("sequence_parallel")), planner="published", virtual_stages=virtual)
    except Exception as exc:  # noqa: BLE001 - reported as the reason, per run
        return Case(run, skip=f"not expressible: {exc}")
    return Case(run, workload, plan, float(measured))


def load_cases(path: Path = DEFAULT_RUNS) -> list[Case]:
    return [case_of(run) for run in load_runs(path)]


# Out-of-memory outcomes a run's own notes state for a setting next to it:
# (run id, changed settings, the words). Each becomes a case labelled OOM.
DERIVED_OOM = (
    ("megatron_sc21_t2_zero3_529B_640gpu", {"count": 560, "dp": 560, "sequences": 2240},
     "560 GPUs with micro-batch 4 did not fit (OOM)"),
)


def derived_oom_cases(cases: list[Case]) -> list[Case]:
    """Cases for ``DERIVED_OOM`` whose run is among ``cases`` and whose note says so."""
    runs = {case.id: case.run for case in cases}
    cases = []
    for run_id, change, words in DERIVED_OOM:
        run = runs.get(run_id)
        if run is None or words not in str(run.get("notes", "")):
            continue
        run = copy.deepcopy(run)
        run["id"] = f"{run_id} at {change['count']} GPUs"
        run["cluster"]["count"] = change["count"]
        run["expert_config"]["dp"] = change["dp"]
        run["global_batch"] = {"sequences": change["sequences"]}
        run["measured"] = {**run["measured"], "oom": True}
        case = case_of(run)
        if not case.skip:
            cases.append(case)
    return cases


def interconnect_note(run: dict[str, Any]) -> str:
    """The run's inter-node network words, shortened for tables."""
    text = str(run["cluster"].get("interconnect_inter") or "")
    return re.sub(r"\s+", " ", text)[:40]
