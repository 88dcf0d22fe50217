"""Context parallelism (CP) and expert parallelism (EP): the formulas the cost kernel applies.

**CP** splits every sample's sequence over ``cp`` ranks (the ``cp`` TP groups
of a replica, ``plan.Stage``). Each rank runs 1/cp of the tokens through every
linear layer and, with causal attention split into 2·cp zigzag chunks
(``CP_CAUSAL_ZIGZAG``), 1/cp of the attention score matrix: its compute,
elementwise traffic, TP traffic and activations are 1/cp of the replica's. Its
attention needs every earlier token's keys and values: Llama 3 (§3.3.2)
all-gathers K and V over the CP group (forward) and reduce-scatters dK/dV
(backward), ``CP_KV_PASSES`` per step; a rank receives (cp−1)/cp of the
sample's K/V per pass (a sliding window of w tokens needs only w of them).
Ring attention moves the same bytes in cp−1 steps of one K/V block each,
hidden behind the attention of the previous block (``cp_exposed_time``). The
gathered K/V are kept for backward, so a rank's activations are
``(act − kv)/cp + kv`` per sample (``cp_activation_bytes``). Dense layers'
gradients are reduced over the dp·cp ranks that hold the same shard, and ZeRO
shards over them (torchtitan's ``dp_shard_cp`` mesh; Megatron-Core's
``dp_cp`` group).

**EP** splits a MoE layer's routed experts over ``ep`` of those dp·cp ranks
(Megatron-Core and torchtitan borrow EP from the data/context ranks). Every
MoE layer runs two all-to-alls forward (dispatch, combine) and two backward
(``EP_ALLTOALL_PASSES``); each sends ``tokens × top_k × capacity × hidden ×
dtype`` bytes (``LayerSpec.dispatch_bytes``), (ep−1)/ep of which leave the
rank (``comm.alltoall_time`` over the link classes the group crosses). The
busiest rank gets ``expert_imbalance`` times the average tokens
(``EXPERT_LOAD_IMBALANCE``): its expert matmuls and all-to-all bytes grow by
that factor. A device holds 1/ep of the routed experts' weights, gradients and
optimizer states, and the experts' gradients are reduced over the dp·cp/ep
ranks that hold the same experts (expert data parallelism).
"""

from __future__ import annotations

import numpy as np

from hetplan.cost.constants import CP_CAUSAL_ZIGZAG, CP_KV_METHODS, OVERLAP_SLOWDOWN
from hetplan.cost.pipeline import overlapped_exposure
from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec


def causal_cp_work_fraction(cp: int, zigzag: bool = True) -> float:
    """Share of a causal score matrix the busiest of ``cp`` ranks computes.
    Zigzag (chunks i and 2cp−1−i): every rank 1/cp. Contiguous chunks: the
    last rank's queries see the whole sequence before them, (2cp−1)/cp² of
    the s²/2 triangle."""
    if cp <= 1:
        return 1.0
    return 1.0 / cp if zigzag else (2.0 * cp - 1.0) / cp ** 2


def cp_attention_scale(cp: int, causal: np.ndarray, zigzag: bool = True) -> np.ndarray:
    """Per layer: the busiest rank's attention work over an even 1/cp share
    (1 with zigzag or full attention; (2cp−1)/cp for contiguous causal chunks)."""
    return np.where(causal, cp * causal_cp_work_fraction(cp, zigzag), 1.0)


def cp_received_fraction(cp: int, window: np.ndarray | float, seq_len: int) -> np.ndarray | float:
    """Fraction of a sample's K/V one rank receives per pass: (cp−1)/cp of
    it, or the ``window`` tokens before its chunk when that is less."""
    full = (cp - 1) / cp
    if seq_len <= 0:
        return np.full_like(np.asarray(window, dtype=float), full)
    return np.where(np.asarray(window) > 0, np.minimum(full, np.asarray(window, dtype=float) / seq_len), full)


def cp_gather_bytes(kv_bytes: np.ndarray, cp: int, window: np.ndarray, seq_len: int) -> np.ndarray:
    """Per sample and layer: the all-gather size ``M`` (bytes on every rank
    after it) whose (cp−1)/cp·M received bytes are the K/V a rank needs, so
    that ``comm.allgather_time(M)`` costs exactly those."""
    if cp <= 1:
        return np.zeros_like(kv_bytes)
    return kv_bytes * cp_received_fraction(cp, window, seq_len) * cp / (cp - 1)


def ring_kv_bytes(kv_bytes: float, cp: int) -> float:
    """Bytes a rank receives in ring attention's forward: cp−1 steps, one
    K/V block of ``kv_bytes / cp`` each (Liu et al. 2023, §3): the all-gather's volume."""
    return (cp - 1) * kv_bytes / cp


def cp_exposed_time(comm_s: np.ndarray, attention_s: np.ndarray, method: str,
                    slowdown: float = OVERLAP_SLOWDOWN) -> np.ndarray:
    """The part of the K/V exchange on the critical path: all of Llama 3's
    all-gather; of ring attention, what the attention compute it overlaps
    does not hide (``pipeline.overlapped_exposure``)."""
    if method not in CP_KV_METHODS:
        raise HetplanError(f"unknown CP K/V method {method!r}; use one of {', '.join(CP_KV_METHODS)}")
    if method == "allgather":
        return comm_s
    return np.asarray(overlapped_exposure(comm_s, attention_s, slowdown))


def cp_activation_bytes(act: np.ndarray, kv_kept: np.ndarray, cp: int) -> np.ndarray:
    """Per sample and layer, what one CP rank keeps for backward: its 1/cp of
    the activations plus the gathered K/V of the whole sequence."""
    if cp <= 1:
        return act
    kept = np.minimum(kv_kept, act)
    return (act - kept) / cp + kept


def expert_groups(column: np.ndarray, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """The EP groups (rows: ``ep`` consecutive ranks of the dp·cp devices
    sharing a TP rank) and the expert-data-parallel groups (rows: the dp·cp/ep
    ranks holding the same experts, strided by ep) of one TP rank's devices."""
    grid = np.asarray(column).reshape(-1, ep)
    return grid, grid.T


def degree_problem(model: ModelSpec, dp: int, cp: int, ep: int) -> str | None:
    """Why ``(dp, cp, ep)`` cannot run ``model`` (one line saying what to
    change), or None. CP splits every sample's sequence into 2·cp zigzag
    chunks for causal attention (cp chunks otherwise), so they must divide it;
    EP needs MoE layers whose experts split evenly, over ranks borrowed from dp·cp."""
    if cp < 1 or ep < 1:
        return f"cp and ep must be positive, got cp={cp}, ep={ep}"
    if cp > 1:
        chunks = 2 * cp if CP_CAUSAL_ZIGZAG and any(layer.attention == "causal" for layer in model.layers) else cp
        if not any(layer.kv_bytes > 0 for layer in model.layers):
            return f"cp={cp}: model {model.name!r} has no self-attention layer to split the sequence of; use cp=1"
        if model.seq_len % chunks:
            return (f"cp={cp} splits each sequence into {chunks} chunks, which must divide the sequence length "
                    f"{model.seq_len}; choose a cp for which {chunks // cp}·cp divides it")
    if ep > 1:
        experts = {layer.num_experts for layer in model.layers if layer.is_moe}
        if not experts:
            return f"ep={ep}: model {model.name!r} has no mixture-of-experts layer; use ep=1"
        uneven = sorted(n for n in experts if n % ep)
        if uneven:
            return f"ep={ep} must divide the {uneven[0]} experts of each MoE layer; choose a divisor of {uneven[0]}"
        if (dp * cp) % ep:
            return f"ep={ep} must divide dp x cp = {dp * cp} (expert parallelism uses the data- and context-parallel ranks)"
    return None
