"""How long a plan takes: tokens per second, seconds per optimizer step, the run's wall time and
GPU-hours, predicted before anything runs.

Compute time is the model's FLOPs per token over the GPU's dense 16-bit peak times an efficiency
(MFU) that ``bench/throughput.py`` measures; communication is the gradient traffic of DDP or
ZeRO over the interconnect. Each number says where it comes from (:class:`StepTime.sources`).

FLOPs per token follow the benchmark's definition so that the measured MFUs apply unchanged:
6 N for full fine-tuning (forward 2 N, backward 4 N), 4 N + 6 N_lora for adapters (a frozen
base needs no weight gradients); checkpointing adds a second forward (2 N). Attention's own
FLOPs grow with the keys each token attends to, not with N: the measured efficiencies include
them at the measured rows' length (:data:`MEASURED_KEYS_PER_TOKEN`), and a plan adds the
difference at its own length (:func:`attention_flops_per_token`), at the same efficiency.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from sft_play.planner.simulate import memory
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.run import Run

# Dense 16-bit peak of the GPUs we know, FLOP/s (vendor data sheets, without sparsity)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835.5e12, "H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12,
             "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12, "RTX 4090": 165e12, "A6000": 155e12}

# Model FLOPs utilisation measured by bench/throughput.py (SFT-Play's side, packed rows, SDPA),
# by GPU model and method. A GPU model not measured is predicted at the reference's (the H100's),
# and the source says so. The H200 keeps the H100's compute peak but has 1.4x its memory
# bandwidth and 1.75x its memory (larger micro-batches): predicted at the H100's MFU, its steps
# came out 17 % (full) and 21 % (LoRA) longer than measured (docs/reports/gpu_lease.md).
MEASURED_MFU = {
    "H100": {
        "full": (0.207, "H100, Qwen2.5-0.5B full, seq 2048, micro 16 (bench/throughput.py, 2026-11-23)"),
        "lora": (0.272, "H100, Llama-3.1-8B LoRA, seq 2048, micro 2 (bench/throughput.py, 2026-11-23)"),
    },
    "H200": {
        "full": (0.241, "H200, Qwen2.5-0.5B full, seq 2048, micro 32 (bench/lease.py, 2026-11-26)"),
        "lora": (0.329, "H200, Llama-3.1-8B LoRA, seq 2048, micro 4 (bench/lease.py, 2026-11-26)"),
    },
}
REFERENCE_GPU = "H100"
# The measured rows: packed 2048-token rows under SDPA with a mask, whose kernel computes every
# tile of the 2048 x 2048 square
MEASURED_KEYS_PER_TOKEN = 2048
SHORTER_ROWS_CREDIT = 0.1
# QLoRA has not been measured: its 4-bit weights are de-quantised for every matmul, forward and
# backward (bitsandbytes' dequantize_4bit + F.linear for many rows). Taken as LoRA's MFU times
# this factor until bench/throughput.py measures it on a GPU.
QLORA_FACTOR = 0.75

# Sustained all-reduce bus bandwidth, bytes/s (NCCL tests, order of magnitude): NVLink within a
# node (H100 SXM), PCIe within a node, and 400 Gb/s InfiniBand or Ethernet between nodes
BANDWIDTH = {"nvlink": 350e9, "pcie": 20e9, "network": 40e9}
GPUS_PER_NODE = 8  # assumed for hardware described with --gpus/--vram-gib
HOST_LINK = 25e9  # bytes/s between a GPU and pinned host memory (PCIe 5.0 x16 sustains about this one way)


@dataclass
class StepTime:
    """Predicted time of one optimizer step and of the whole run."""

    tokens_per_second: float  # all GPUs together, real tokens
    seconds_per_step: float
    compute_seconds: float
    communication_seconds: float
    efficiency: float
    peak_flops: float
    steps: int | None = None
    wall_seconds: float | None = None
    gpu_hours: float | None = None
    sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flops_per_token(shape: ModelShape, run: Run) -> float:
    """Training FLOPs per token (the benchmark's definition; module docstring), on the parameters
    a token passes through: a mixture-of-experts model's active ones (its router sends each token
    to top-k of the experts)."""
    n = shape.active_params
    if run.method == "full":
        flops = 6.0 * n
        recompute = 2.0 * n
    else:
        flops = 4.0 * n + 6.0 * shape.lora_params
        recompute = 2.0 * n
    # tiled MLPs run their forward again, tile by tile, inside backward (sft_play.long_rows): the
    # MLP's active parameters, those of the experts a token is not routed to being all MLP
    active_mlp = shape.params_by_kind.get("mlp", 0) - (shape.total_params - n)
    tiles_again = 2.0 * active_mlp if run.kernels.tiled_mlp else 0.0
    # preference tuning: the reference's forward over the same rows (KTO's KL estimate: the
    # reference's and the policy's over as many mismatched rows besides)
    pref = run.preference
    reference = 2.0 * n * (pref.reference_forwards + pref.kl) if pref is not None else 0.0
    return flops + (recompute if run.gradient_checkpointing else 0.0) + tiles_again + reference


def keys_per_token(run: Run, masked: bool) -> float:
    """The keys a token's query meets on average, as the attention kernel computes them: with a
    4-D mask, the whole row (the kernel computes every tile of the square and masks it); without
    one, the tokens before it in its own example (causal), half the token-weighted mean example
    length (a row of one example when the data was not read)."""
    s = run.sequence.tokens
    if masked:
        return float(s)
    return min(run.sequence.example_tokens or s, s) / 2


def attention_flops_per_token(shape: ModelShape, run: Run, keys: float) -> float:
    """Training FLOPs per token of the attention products (Q K^T and the weights times V, 2 x
    keys x heads x head_dim each) in every layer: forward, backward (twice the forward) and, with
    checkpointing, the forward again. Layers with linear or sliding-window attention are counted
    as full ones (an overestimate for hybrid and sliding-window models)."""
    forward = 4.0 * keys * shape.num_attention_heads * shape.head_dim * shape.num_layers
    return forward * (4.0 if run.gradient_checkpointing else 3.0)


def gpu_model(device_name: str) -> str | None:
    """The known GPU model a device name is (the longest known name it contains, in any case and
    with or without spaces and hyphens: "NVIDIA H100 80GB HBM3", "h100", "RTX4090", "H100-PCIe"),
    not followed by another digit (an L40 is no L4)."""
    for name in sorted(PEAK_BF16, key=len, reverse=True):
        spelled = r"[\s_-]*".join(re.escape(c) for c in name.upper() if c.isalnum())
        if re.search(rf"(?<![A-Z0-9]){spelled}(?![0-9])", device_name.upper()):
            return name
    return None


def peak_flops(device_name: str) -> float | None:
    """The dense 16-bit peak of a GPU by its name."""
    model = gpu_model(device_name)
    return PEAK_BF16[model] if model else None


def efficiency(run: Run, device_name: str = "") -> tuple[float, str]:
    """The MFU the run is predicted at on `device_name`'s GPU model, and where it comes from:
    that model's measurement, else the reference GPU's (said). The measured MFUs are of the
    default kernels (SDPA, no Liger, no compiled layers); the kernel switches have not been
    measured yet, so they are predicted at the same efficiency and the source says so."""
    model = gpu_model(device_name)
    measured = MEASURED_MFU.get(model or "", MEASURED_MFU[REFERENCE_GPU])
    elsewhere = f"; not yet measured on {model}" if model and model not in MEASURED_MFU else ""
    if run.method == "qlora":
        mfu, source = measured["lora"]
        mfu, text = mfu * QLORA_FACTOR, (f"LoRA's measured {100 * mfu:.1f} % ({source}) x {QLORA_FACTOR} for 4-bit "
                                         "de-quantisation (an estimate: QLoRA awaits a GPU measurement)")
    else:
        mfu, source = measured[run.method]
        text = f"measured {100 * mfu:.1f} % ({source})"
    text += elsewhere
    switched = [name for name, on in (("Liger kernels", run.kernels.liger), ("compiled layers", run.kernels.compile_layers),
                                      (run.kernels.attention, run.kernels.attention not in ("sdpa", "eager"))) if on]
    if switched:
        text += f"; {', '.join(switched)}: not yet measured, taken at the same efficiency"
    return mfu, text


def gradient_traffic(shape: ModelShape, run: Run, micro_batches: int = 1) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step, by what they carry; ring collectives, each GPU
    sending (W - 1) / W of what is reduced or gathered (twice that for an all-reduce).

    - DDP: one all-reduce of the gradients per step, in their dtype.
    - ZeRO-2: a reduce-scatter of the 16-bit gradients after every micro-batch's backward (each
      rank keeps its partition only), and one all-gather of the updated 16-bit parameters.
    - ZeRO-3: the same reduce-scatters, and the parameters gathered for every micro-batch's
      forward and again for its backward instead (16-bit; QLoRA's packed 4-bit weights as stored,
      half a byte each: :func:`sft_play.planner.simulate.memory.sharded_gathered_bytes`).
    - FSDP2 (it reduce-scatters every micro-batch: ``sync_each_batch``): the parameters all-gathered
      for the forward and again for the backward (once with ``reshard_after_forward`` off) in its
      ``param_dtype`` (QLoRA's packed weights as stored), and the gradients reduce-scattered in
      fp32.

    ZeRO-3 and FSDP2 move the same parameters: where one reports several times the other's bytes,
    the dtypes differ (full fine-tuning's gathers are 16-bit under both) or the micro-batches do."""
    world = run.parallel.world_size
    if world <= 1:
        return {}
    share = (world - 1) / world
    micro = max(1, micro_batches)
    if run.parallel.fsdp:
        gathers = 2 if run.parallel.reshard_after_forward else 1
        reduce_bytes = 4 if run.precision.autocast else memory.trainable_bytes(run)
        gathered = memory.sharded_gathered_bytes(shape.total_params, shape.quantized_params, run)
        return {"parameter all-gathers": share * gathers * gathered * micro,
                "gradient reduce-scatters": share * shape.trainable_params * reduce_bytes * micro}
    grad_bytes = memory.trainable_bytes(run)  # DDP: the gradients' dtype; ZeRO: 16-bit
    if run.parallel.deepspeed:
        reduced = share * shape.trainable_params * grad_bytes * micro
        if run.parallel.strategy.zero3:
            gathered = memory.sharded_gathered_bytes(shape.total_params, shape.quantized_params, run)
            return {"parameter all-gathers": share * 2 * gathered * micro, "gradient reduce-scatters": reduced}
        return {"gradient reduce-scatters": reduced,
                "updated-parameter all-gather": share * shape.trainable_params * grad_bytes}
    return {"gradient all-reduce": 2.0 * share * shape.trainable_params * grad_bytes}


def gradient_traffic_bytes(shape: ModelShape, run: Run, micro_batches: int = 1) -> float:
    """Bytes each GPU sends per optimizer step (:func:`gradient_traffic`, summed)."""
    return sum(gradient_traffic(shape, run, micro_batches).values())


def offload_transfer_bytes(shape: ModelShape, run: Run, micro_batches: int = 1) -> float:
    """Bytes each GPU moves to or from host memory per optimizer step for parameter or optimizer
    offload (its partition of each). DeepSpeed with the optimizer offloaded: every micro-batch's
    16-bit gradient partition out, the updated 16-bit parameters back once a step; with the
    parameters offloaded too, its parameter partition in for every micro-batch's forward and
    again for its backward. FSDP2 with offload: the parameter shards in for the forward and the
    backward of every micro-batch, the gradient shards out in fp32, every micro-batch."""
    world, micro = max(1, run.parallel.world_size), max(1, micro_batches)
    trainable = shape.trainable_params / world
    parameters = memory.sharded_gathered_bytes(shape.total_params, shape.quantized_params, run) / world
    if run.parallel.deepspeed and run.parallel.offload_optimizer:
        moved = trainable * run.precision.compute_bytes * (micro + 1)
        if run.parallel.offload_parameters:
            moved += 2 * parameters * micro
        return moved
    if run.parallel.fsdp and run.parallel.offload_parameters:
        return (2 * parameters + 4 * trainable) * micro
    return 0.0


def split_sequence_traffic_bytes(shape: ModelShape, run: Run, tokens_per_step: int) -> float:
    """Bytes each GPU receives per optimizer step where rows are split across processes, in every
    layer, in forward, in backward (the gradients) and in the recomputed forward under
    checkpointing. DeepSpeed's Ulysses all-to-alls q, k and v (key/value heads repeated up to the
    split where they are fewer) and the attention output: (split - 1) / split of each process's
    share of each. Torch's ring, all-gathering, brings each process the other processes' keys and
    values. 0 for whole rows."""
    ulysses, ring = run.parallel.sequence_parallel, run.parallel.context_parallel
    if ulysses > 1:
        per_token = ((2 * shape.num_attention_heads + 2 * max(shape.num_key_value_heads, ulysses))
                     * shape.head_dim * (ulysses - 1) / ulysses)
    elif ring > 1:
        per_token = 2 * shape.num_key_value_heads * shape.head_dim * (ring - 1)
    else:
        return 0.0
    passes = 3 if run.gradient_checkpointing else 2
    tokens = tokens_per_step / run.parallel.world_size  # each process's share of the step's tokens
    return passes * shape.num_layers * tokens * per_token * run.precision.compute_bytes


def predict_time(shape: ModelShape, run: Run, tokens_per_step: int, device_name: str, interconnect: str,
                 gpus_per_node: int, total_steps: int | None, micro_batches: int = 1,
                 masked: bool = True) -> StepTime | None:
    """The step time of `run` on the named GPU (None when its peak is unknown, e.g. on a CPU).

    Args:
        shape: the model shape for the run's method.
        run: the resolved run.
        tokens_per_step: tokens of one optimizer step across all GPUs (global batch x sequence).
        device_name: the GPU's name (its peak is looked up).
        interconnect: "nvlink" or "pcie" within a node.
        gpus_per_node: GPUs per node (more processes than that cross the network).
        total_steps: optimizer steps of the run, if known.
        micro_batches: forward/backward passes per optimizer step (FSDP2 communicates in each).
        masked: attention gets a 4-D mask (:meth:`sft_play.run.Run.masked`).
    """
    peak = peak_flops(device_name)
    if peak is None or not run.on_cuda:
        return None
    mfu, source = efficiency(run, device_name)
    keys = keys_per_token(run, masked)
    attention = attention_flops_per_token(shape, run, keys)
    measured = attention_flops_per_token(shape, run, MEASURED_KEYS_PER_TOKEN)
    weights = flops_per_token(shape, run)
    # What rows shorter than the measured ones save is at most the measured rows' attention share
    # of their FLOPs (Llama-3.1-8B at 2,048 tokens: 7 % full, 10 % LoRA); a tiny model's own
    # attention at 2,048 keys would otherwise outweigh its weights and the time turn negative
    flops = weights + attention - min(measured, attention + SHORTER_ROWS_CREDIT * weights)
    compute = tokens_per_step * flops / (run.parallel.world_size * peak * mfu)
    communication, offload_seconds, transfers = _transfer_seconds(shape, run, tokens_per_step, interconnect,
                                                                  gpus_per_node, micro_batches)
    seconds = compute + communication + offload_seconds
    sources = [f"efficiency: {source}", f"peak: {peak / 1e12:.0f} TFLOP/s dense bf16 ({device_name})",
               f"attention: {keys:,.0f} keys per token ({'a mask: the whole row' if masked else 'causal, within its example'})"
               f", {attention / 1e9:.1f} GFLOP per token against {measured / 1e9:.1f} in the measured rows; the "
               f"weights' {flops_per_token(shape, run) / 1e9:.1f}", *transfers]
    if shape.num_experts:
        sources.append("mixture of experts: timed at the efficiency measured on dense models (a routed model's "
                       "has not been measured)")
    wall = seconds * total_steps if total_steps else None
    return StepTime(
        tokens_per_second=tokens_per_step / seconds,
        seconds_per_step=seconds,
        compute_seconds=compute,
        communication_seconds=communication,
        efficiency=mfu,
        peak_flops=peak,
        steps=total_steps,
        wall_seconds=wall,
        gpu_hours=wall * run.parallel.world_size / 3600 if wall else None,
        sources=sources,
    )


def _transfer_seconds(shape: ModelShape, run: Run, tokens_per_step: int, interconnect: str, gpus_per_node: int,
                      micro_batches: int) -> tuple[float, float, list[str]]:
    """What a step spends moving data that its compute does not hide: (communication seconds, the
    gradients' reduction and a split row's exchanges; offload seconds, hidden states, parameters and
    optimizer states to host memory and back; the plan's lines saying so)."""
    link = "network" if run.parallel.world_size > gpus_per_node else interconnect
    traffic = gradient_traffic_bytes(shape, run, micro_batches)
    # Gradient buckets are reduced while backward goes on; only the last bucket's share waits
    communication = traffic / BANDWIDTH[link] * (0.25 if run.parallel.world_size > 1 else 0.0)
    # Offloaded hidden states cross PCIe twice per row (out in forward, back in backward), counted unhidden
    offloaded = 2.0 * memory.offloaded_hidden_bytes(shape, run, 1) * tokens_per_step / max(1, run.local_tokens)
    offload_seconds = offloaded / run.parallel.world_size / HOST_LINK
    # Offloaded parameters and optimizer states cross it too, counted unhidden (a lower bound: the
    # optimizer's step on the CPU is not counted)
    states_moved = offload_transfer_bytes(shape, run, micro_batches)
    offload_seconds += states_moved / HOST_LINK
    # A split sequence's all-to-alls sit between a layer's projections and its attention: not hidden
    split = split_sequence_traffic_bytes(shape, run, tokens_per_step)
    split_link = "network" if run.parallel.row_shards > gpus_per_node else interconnect
    split_seconds = split / BANDWIDTH[split_link]
    communication += split_seconds
    lines = []
    if traffic:
        parts = ", ".join(f"{name} {size / 1e9:.2f}" for name, size in gradient_traffic(shape, run, micro_batches).items())
        when = ("once a step" if not run.parallel.strategy.shards_states
                else f"in each of the step's {max(1, micro_batches)} micro-batch(es)")
        lines.append(f"communication: {traffic / 1e9:.2f} GB per step per GPU ({parts}; {when}) over {link} at "
                     f"{BANDWIDTH[link] / 1e9:.0f} GB/s, three quarters hidden behind backward")
    if split_seconds:
        exchange = "all-to-alls" if run.parallel.splits_sequence else "key and value all-gathers"
        lines.append(f"rows split across {run.parallel.row_shards} processes: {split / 1e9:.1f} GB per step per GPU "
                     f"in attention's {exchange} over {split_link} at {BANDWIDTH[split_link] / 1e9:.0f} GB/s, not hidden")
    if offloaded:
        lines.append(f"activation offload: {offloaded / run.parallel.world_size / 1e9:.1f} GB per step per GPU "
                     f"to host memory and back at {HOST_LINK / 1e9:.0f} GB/s, counted as not hidden behind compute")
    if states_moved:
        lines.append(f"parameter/optimizer offload: {states_moved / 1e9:.1f} GB per step per GPU to host memory and "
                     f"back at {HOST_LINK / 1e9:.0f} GB/s, counted as not hidden; not counted: the optimizer's step "
                     "on the CPU (not yet measured), so expect longer")
    return communication, offload_seconds, lines


def total_steps(max_steps: int, num_epochs: float, rows: int | None, global_batch: int) -> int | None:
    """Optimizer steps of the run: ``train.max_steps``, or epochs over the (packed) rows."""
    if max_steps > 0:
        return max_steps
    if not rows:
        return None
    return max(1, math.ceil(num_epochs * rows / global_batch))
