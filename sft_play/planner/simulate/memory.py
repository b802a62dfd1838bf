"""The state a GPU holds whatever the batch: one pure function per term, in bytes.

Every function takes the exact model shape (:mod:`sft_play.planner.simulate.shapes`) and the run
(:class:`sft_play.run.Run`: what dtype each piece of state is in, and how it is split across
processes), read as it is: the bytes each dtype takes are :func:`trainable_bytes`,
:func:`stored_bytes` and :func:`gathered_bytes`. No torch calls:
the arithmetic runs in microseconds and is tested term by term. What depends on the batch
(activations, working sets, the loss head, the allocator's cache) comes from replaying the
step (:mod:`sft_play.planner.simulate.step`), which allocates these terms as the run does.
docs/PLANNER.md gives each formula's source.
"""

from __future__ import annotations

import dataclasses

from sft_play.planner.simulate.shapes import ModelShape
from sft_play.run import Run
from sft_play.units import MIB


NF4_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax constant per 64 weights
DOUBLE_QUANT_BLOCK = 256  # with double quantisation the absmax constants are quantised in blocks of 256
# Outside PyTorch's allocator, per process, where nothing was measured on the GPUs that train
# (a run measures it at its end and make gpu-info once: hardware.outside_allocator, which wins):
# the CUDA context with its lazily loaded kernels, set by hand for an H100 80GB HBM3 with CUDA 13
# and torch 2.11 (no figure of it was recorded; the rows of tests/fixtures/h100_measurements.json,
# whose measured peaks include it, agree with it, and +-100 MiB moves their worst error 2-7
# points), and NCCL's communicator buffers with more than one process, an estimate never measured
# here (docs/PLANNER.md, section 4, says how both were made)
CUDA_CONTEXT_BYTES = 512 * MIB
NCCL_BYTES = 320 * MIB

# Decoder layers whose whole parameters are on a GPU at once when they are sharded (ZeRO-3,
# FSDP2): the one computing and the one prefetched
LAYERS_IN_FLIGHT = 2


def trainable_bytes(run: Run) -> int:
    """Bytes per trainable parameter as held on the GPU (and per gradient element).

    DDP: the parameter's own dtype (fp32 full fine-tuning, fp32 LoRA adapters, bf16 QLoRA
    adapters). DeepSpeed casts the module to the 16-bit compute dtype and keeps fp32 masters
    in its optimizer instead. FSDP2 with mixed precision upcasts the trainable parameters to
    fp32 before sharding them (accelerate's ``fsdp2_prepare_model``; not QLoRA's), and
    computes on 16-bit gathered copies.
    """
    if run.parallel.deepspeed:
        return run.precision.compute_bytes
    if run.parallel.fsdp and run.precision.autocast and run.method != "qlora":
        return 4
    return run.precision.weight_bytes if run.method == "full" else run.adapter_bytes


def stored_bytes(run: Run) -> int:
    """Bytes per element of the frozen or full weights as stored on the GPU (or their shards)."""
    if run.parallel.deepspeed:
        return run.precision.compute_bytes
    if run.parallel.fsdp and run.method == "full":
        return trainable_bytes(run)
    return run.precision.weight_bytes


def gathered_bytes(run: Run) -> int:
    """Bytes per element of a layer's parameters while it computes: ZeRO-3 gathers the 16-bit
    copies it holds; FSDP2 all-gathers in its ``param_dtype`` (the compute dtype with mixed
    precision, the stored dtype without)."""
    if run.parallel.fsdp and run.precision.autocast:
        return run.precision.compute_bytes
    return stored_bytes(run)


# ---------------------------------------------------------------------------------------------
# Model states


def weights_bytes(shape: ModelShape, run: Run) -> int:
    """Parameters as stored on the GPU.

    full / lora: every parameter in the storage dtype (under DeepSpeed the 16-bit compute dtype,
    its fp32 masters being counted in :func:`master_weights_bytes`), LoRA adapters in theirs.
    qlora: the quantised linears at 4 bits (0.5 byte) plus their constants
    (:func:`quantization_constants_bytes`), everything else in the run's weights dtype (16-bit
    with mixed precision, fp32 without: the loader's ``dtype``).
    ZeRO-3 and FSDP2 keep 1/world of them (:func:`resting_adapter_bytes`), plus two layers gathered at a time (FSDP2 in its
    ``param_dtype``, through the forward and the layers' backward; without resharding after the
    forward, every layer); FSDP2 with a tied head also keeps the head, final norm and embedding
    gathered from the forward's start to the backward's end (:func:`fsdp_step_gathered_tensors`);
    with the parameters offloaded to the CPU, only the gathered parts. What a step's layers'
    backward holds: a lower bound of its peak (:func:`sft_play.planner.simulate.predict.static_lower_bound`).
    """
    stored = model_bytes(shape, run)
    gathered = layers_gathered(shape, run)
    if gathered:
        # QLoRA's constants are attributes of the packed weights, not parameters: never sharded
        constants = quantization_constants_bytes(shape, run)
        kept = constants if run.parallel.offload_parameters else (stored - constants) // run.parallel.weight_shards + constants
        stored = kept + gathered * gathered_layer_bytes(shape, run)
        # (an untied tail is resharded before the layers' backward gathers two: step._forward_backward)
        if run.parallel.fsdp and (shape.tie_word_embeddings or not run.parallel.reshard_after_forward):
            stored += sum(fsdp_step_gathered_tensors(shape)) * gathered_bytes(run)
    return stored + resting_adapter_bytes(shape, run)


def resting_adapter_bytes(shape: ModelShape, run: Run) -> int:
    """The trained adapters a GPU holds between their passes: sharded as the rest (DeepSpeed's 16-bit
    partition of them under ZeRO-3, FSDP2's shard; each gathered layer holds its own whole), in host
    memory with the parameters offloaded (:func:`offloaded_bytes` counts them there)."""
    if run.parallel.offload_parameters and run.parallel.strategy.shards_parameters:
        return 0
    return shape.lora_params * trainable_bytes(run) // run.parallel.weight_shards


def reference_bytes(shape: ModelShape, run: Run) -> int:
    """A preference run's frozen reference copy (``preference.reference: copy``), loaded in the
    compute dtype: whole on every GPU under DDP and ZeRO-1/2 (TRL prepares it at ZeRO stage 0),
    sharded under ZeRO-3 and FSDP2; none with the adapters switched off or precomputed log-probs."""
    if run.preference is None or run.preference.reference != "copy":
        return 0
    shards = run.parallel.world_size if run.parallel.strategy.shards_parameters else 1
    return -(-shape.total_params * run.precision.compute_bytes // shards)


def model_bytes(shape: ModelShape, run: Run) -> int:
    """Every parameter as stored, whole (before any sharding): QLoRA's quantised linears at half a
    byte plus their constants and the rest in the weights' dtype, else each in
    :func:`stored_bytes`'s; the adapters not included."""
    if run.method == "qlora":
        rest = shape.total_params - shape.quantized_params
        return (shape.quantized_params // 2 + quantization_constants_bytes(shape, run)
                + rest * run.precision.weight_bytes)
    return shape.total_params * stored_bytes(run)


def layers_gathered(shape: ModelShape, run: Run) -> int:
    """Decoder layers whose whole parameters a GPU holds at once where they are sharded or
    offloaded (ZeRO-3, FSDP2; 0 otherwise): the one computing and the one prefetched, or under
    FSDP2 without resharding after the forward every layer, each kept from its forward to its
    backward."""
    if run.parallel.weight_shards <= 1 and not run.parallel.offload_parameters:
        return 0
    if run.parallel.fsdp and not run.parallel.reshard_after_forward:
        return shape.num_layers
    return LAYERS_IN_FLIGHT


def zero3_kept_layers(shape: ModelShape, run: Run, checkpointing: bool) -> int:
    """How many of the top decoder layers ZeRO-3 keeps gathered from their forward to their
    backward, where it gathers layers at all (:func:`layers_gathered`). Once the first step has
    recorded the trace, a module's parameters are released after its pass only when they are not
    used again within ``stage3_max_reuse_distance`` parameters of the trace
    (``PartitionedParameterCoordinator.__params_to_release``; 1e9 by default; 0 releases each at
    once). A layer's next use is its backward: between them the rest of the layer passes (again
    in backward without checkpointing) and each layer above passes forward and back (and forward
    again under checkpointing). TRL's fused head gathers its weight outside the trace
    (``GatheredParameters``)."""
    if not run.parallel.strategy.zero3 or not layers_gathered(shape, run):
        return 0
    distance = _reuse_distance(run)
    layer = largest_layer_params(shape)
    own, between = (layer, 3 * layer) if checkpointing else (2 * layer, 2 * layer)
    if distance <= own:
        return 0
    return min(shape.num_layers, -(-(distance - own) // max(1, between)))


def zero3_kept_embedding(shape: ModelShape, run: Run, checkpointing: bool) -> bool:
    """Whether ZeRO-3 keeps a trained input embedding gathered from the forward's start to the
    backward's end: when the whole backbone's passes between them are within the reuse distance
    (:func:`zero3_kept_layers`)."""
    return (trains(run, "embed_tokens") and zero3_kept_layers(shape, run, checkpointing) == shape.num_layers
            and (3 if checkpointing else 2) * largest_layer_params(shape) * shape.num_layers < _reuse_distance(run))


def trains(run: Run, module: str) -> bool:
    """Whether the model's `module` (``lm_head``, ``embed_tokens``) trains: every weight does under
    full fine-tuning; under LoRA the trainable copy ``lora.modules_to_save`` names."""
    return run.method == "full" or (run.lora is not None and module in run.lora.modules_to_save)


def _reuse_distance(run: Run) -> int:
    distance = run.parallel.reuse_distance_elements
    return 10**9 if distance is None else distance  # (DeepSpeed's default)


def fsdp_step_gathered_tensors(shape: ModelShape) -> list[int]:
    """accelerate's tail unit under FSDP2 (``fsdp2_prepare_model``): the final norm and the head,
    one unit not resharded after its forward (with a tied embedding, the embedding in it), gathered
    from its first module's forward to the end of its backward. An untied input embedding is a
    unit of its own, gathered around its own passes only."""
    rest = list(shape.other_tensors)
    embeddings = shape.params_by_kind.get("embeddings", 0)
    if not shape.tie_word_embeddings and embeddings in rest:
        rest.remove(embeddings)
    return rest


def sharded_gathered_bytes(params: int, quantized: int, run: Run) -> int:
    """Bytes ZeRO-3 or FSDP2 gathers for `params` parameters of which `quantized` are QLoRA's
    packed 4-bit weights: those as they are stored (half a byte per weight, packed into the float
    ``quant_storage`` dtype that lets them be sharded), the rest as :func:`gathered_bytes` says."""
    quantized = quantized if run.method == "qlora" else 0
    return quantized // 2 + (params - quantized) * gathered_bytes(run)


def gathered_layer_bytes(shape: ModelShape, run: Run) -> int:
    """The largest decoder layer as it is gathered: ZeRO-3's 16-bit copies, FSDP2's all-gather in
    its ``param_dtype``, QLoRA's packed weights as stored (:func:`sharded_gathered_bytes`); with
    the layer's adapters, sharded and gathered with it (measured on two gloo processes)."""
    adapters = sum(shape.lora_layer_tensors) * gathered_bytes(run) if run.method != "full" else 0
    if run.method == "qlora" and shape.layer_tensors:
        return adapters + max(sharded_gathered_bytes(sum(n for n, _ in tensors),
                                                     sum(n for n, quantized in tensors if quantized), run)
                              for tensors in (shape.tensors_of_layer(i) for i in range(shape.num_layers)))
    return adapters + largest_layer_params(shape) * gathered_bytes(run)


def largest_layer_params(shape: ModelShape) -> int:
    """Parameters of the largest decoder layer (exact where the shape lists each layer's tensors;
    otherwise everything but the embeddings spread evenly over the layers)."""
    if shape.layer_tensors:
        return max(sum(n for n, _ in shape.tensors_of_layer(i)) for i in range(shape.num_layers))
    return (shape.total_params - shape.params_by_kind.get("embeddings", 0)) // max(1, shape.num_layers)


def quantization_constants_bytes(shape: ModelShape, run: Run) -> int:
    """NF4 absmax constants: one fp32 per 64-weight block; with double quantisation one byte per
    block plus one fp32 scale (and a shared offset) per 256 blocks (Dettmers et al. 2023, QLoRA §3;
    bitsandbytes ``quantize_4bit``)."""
    if run.method != "qlora":
        return 0
    return nf4_constants_bytes(shape.quantized_blocks, run.double_quant)


def nf4_constants_bytes(blocks: int, double_quant: bool) -> int:
    """The absmax constants of `blocks` NF4 blocks (of :data:`NF4_BLOCK` weights), quantised in
    one tensor: the formula of :func:`quantization_constants_bytes`, also applied per tensor."""
    if double_quant:
        return blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK)
    return 4 * blocks


def gradient_bytes(shape: ModelShape, run: Run) -> int:
    """Gradients of the trainable parameters, in their dtype; ZeRO-2/3 and FSDP2 keep only this
    rank's partition (plus the buckets of :func:`zero_buffer_bytes`, :func:`fsdp_buffer_bytes`),
    FSDP2 with offload in CPU memory. DeepSpeed with the optimizer offloaded keeps the partition
    in CPU memory too: ZeRO-3 allocates ``grad_partitions_flat_buffer`` on the offload device
    (``deepspeed/runtime/zero/stage3.py``); ZeRO-1/2 accumulate into ``accumulated_grads_in_cpu``
    through one GPU staging buffer the size of the largest trainable tensor in the 16-bit dtype
    (``temp_grad_buffer_for_gpu_offload``, ``stage_1_and_2.py``; for LoRA the adapters beyond the
    linears count as one tensor here, so the buffer is over- rather than underestimated)."""
    if run.parallel.fsdp and run.parallel.offload_parameters:
        return 0
    if run.parallel.deepspeed and run.parallel.offload_optimizer:
        if run.parallel.strategy.zero3:
            return 0
        return max(trainable_tensors(shape, run), default=0) * trainable_bytes(run)
    return shape.trainable_params * trainable_bytes(run) // run.parallel.state_shards


def linear_adapter_tensors(shape: ModelShape) -> list[int]:
    """The A and B matrices of the adapted linears of one decoder layer (element counts)."""
    rank = shape.lora_params and _lora_rank(shape)
    return [n for fan_in, fan_out in shape.lora_in_out for n in (rank * fan_in, rank * fan_out)] if rank else []


def adapter_tensors(shape: ModelShape) -> list[int]:
    """Every trainable tensor of a LoRA/QLoRA run, as peft makes them: each layer's (those of the
    first, counted by peft: the linears' A and B, DoRA's magnitudes, the factors of adapters on
    fused expert weights) and those outside the layers (``modules_to_save`` copies); where the
    layers differ (hybrid models) what the others train beyond the first's counts as one more
    tensor, so that they add up to the exact count. A shape built without peft's tensors takes
    the linears' adapters at the shape's rank, and the rest as one tensor."""
    if shape.lora_layer_tensors:
        tensors = list(shape.lora_layer_tensors) * shape.num_layers + list(shape.lora_outside_tensors)
        if sum(tensors) > shape.lora_params:  # the other layers train less than the first
            tensors = list(shape.lora_outside_tensors)
            per_layer = (shape.lora_params - sum(tensors)) // max(1, shape.num_layers)
            tensors += [per_layer] * shape.num_layers
    else:
        tensors = linear_adapter_tensors(shape) * shape.num_layers
    rest = shape.lora_params - sum(tensors)
    return tensors + [rest] if rest > 0 else tensors


def _lora_rank(shape: ModelShape) -> int:
    """The adapters' rank: the shape's, else (a shape built by hand) what the count implies when
    the linears' adapters are all it trains."""
    if shape.lora_rank:
        return shape.lora_rank
    per_layer = sum(i + o for i, o in shape.lora_in_out)
    return shape.lora_params // max(1, shape.num_layers * per_layer) if per_layer else 0


def loaded_tensors(shape: ModelShape, run: Run) -> list[tuple[float, str]]:
    """(bytes, kind) of each tensor as one process loads the whole model (before any sharding):
    the base (QLoRA's linears packed, four bits a weight, their constants beside them), then the
    adapters peft adds; a kind of ``trainable``, ``frozen`` or ``kept`` (QLoRA's constants, which
    FSDP2 leaves whole)."""
    base = "trainable" if run.method == "full" else "frozen"
    loaded = [(numel * run.precision.weight_bytes, base) for numel in shape.other_tensors]
    for index in range(shape.num_layers):
        for numel, quantizable in shape.tensors_of_layer(index):
            if run.method == "qlora" and quantizable:
                loaded += [(numel / 2, "frozen"),
                           (nf4_constants_bytes(-(-numel // NF4_BLOCK), run.double_quant), "kept")]
            else:
                loaded.append((numel * run.precision.weight_bytes, base))
    if run.method != "full":
        loaded += [(numel * run.adapter_bytes, "trainable") for numel in adapter_tensors(shape)]
    return loaded


def trainable_tensors(shape: ModelShape, run: Run, in_order: bool = False) -> list[int]:
    """The numel of every trainable tensor: each weight for full fine-tuning, else the adapters.
    `in_order`: as ``model.parameters()`` lists them, the embedding (the first tensor outside the
    layers) before the layers and the rest after."""
    if run.method == "full":
        layers = [n for i in range(shape.num_layers) for n, _ in shape.tensors_of_layer(i)]
        if in_order and shape.other_tensors:
            return shape.other_tensors[:1] + layers + list(shape.other_tensors[1:])
        return layers + list(shape.other_tensors)
    return adapter_tensors(shape)


def optimizer_state_bytes(shape: ModelShape, run: Run) -> int:
    """Optimizer states per trainable parameter.

    torch AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (2 x 4 bytes for fp32,
    2 x 2 for bf16 adapters); DeepSpeed keeps them in fp32. bitsandbytes 8-bit AdamW: one byte
    each plus an fp32 absmax per 256-value block (Dettmers et al. 2022, 8-bit optimizers).
    SGD without momentum: none. Adafactor: factored second moments, about 4 bytes x (rows +
    columns) per matrix, taken as 4 bytes x trainable / h. Offloaded to the CPU: none on the GPU.
    """
    if (run.parallel.offload_optimizer and run.parallel.deepspeed) or (run.parallel.fsdp and run.parallel.offload_parameters):
        return 0
    n = shape.trainable_params
    state = 4 if run.parallel.deepspeed else trainable_bytes(run)
    per_param = {
        "adamw_torch": 2 * state,
        "adamw_torch_fused": 2 * state,
        "adamw_8bit": 2 + 8 / 256,
        "paged_adamw_8bit": 2 + 8 / 256,
        "sgd": 0,
    }.get(run.optimizer)
    if per_param is None:  # adafactor
        return 4 * n // max(1, shape.hidden_size) // run.parallel.state_shards
    return int(n * per_param) // run.parallel.state_shards


def host_bytes_per_node(shape: ModelShape, run: Run, processes_per_node: int, micro_batch: int = 1) -> tuple[int, int]:
    """Host memory the processes of one node need on a GPU run: (while loading, while training).

    Loading: under ZeRO-3 the model loads inside DeepSpeed's ``zero.Init`` (sft_play.train builds
    the training arguments first), each process gathering a layer at a time as it partitions it:
    the largest layer in the dtype it loads in, per process (DeepSpeed's
    ``estimate_zero3_model_states_mem_needs`` with ``zero_init``); other strategies place the
    weights straight on each GPU (:func:`sft_play.model.load_model`). Training: this node's share
    of what offload keeps there (:func:`offloaded_bytes`). With ``train.offload_activations``, each
    process's checkpointed hidden states at `micro_batch` too (:func:`offloaded_hidden_bytes`)."""
    share = processes_per_node / max(1, run.parallel.world_size)  # of the partitions, on this node
    loading = (largest_layer_params(shape) * run.precision.weight_bytes * processes_per_node
               if run.parallel.strategy.zero3 else 0)
    hidden = offloaded_hidden_bytes(shape, run, micro_batch) * processes_per_node  # each process its own
    return int(loading), int(sum(offloaded_bytes(shape, run).values()) * share) + hidden


def offloaded_bytes(shape: ModelShape, run: Run) -> dict[str, int]:
    """What offload keeps in host memory for the whole run (all processes' partitions), by part.

    DeepSpeed with ``offload_optimizer``: the fp32 master weights, Adam's two fp32 states and an
    fp32 gradient partition of the trainable parameters (16 bytes each), and a 16-bit gradient
    partition (ZeRO-3's ``grad_partitions_flat_buffer`` on the offload device; ZeRO-1/2's
    ``accumulated_grads_in_cpu`` when accumulating, counted always); with ``offload_parameters``
    also the parameters as ZeRO-3 partitions them (16-bit; QLoRA's packed 4-bit weights as
    stored, half a byte each, their constants staying on the GPU). FSDP2 with
    ``offload_parameters`` (its ``CPUOffloadPolicy``): the parameter shards as stored (the frozen
    base as for DeepSpeed, the trainable ones in their dtype), their gradients and the
    optimizer's states. DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``,
    ``estimate_zero3_model_states_mem_needs``) add a buffer factor of 1.5 on top of such terms."""
    parts: dict[str, int] = {}
    frozen = model_bytes(shape, run) - quantization_constants_bytes(shape, run)
    if run.method == "full":
        frozen = 0  # every parameter trains: counted as a trainable one below
    trainable = shape.trainable_params
    if run.parallel.deepspeed and run.parallel.offload_optimizer:
        parts["optimizer (fp32 masters, Adam states, gradients)"] = 16 * trainable
        parts["16-bit gradients"] = run.precision.compute_bytes * trainable
        if run.parallel.offload_parameters:
            parts["parameters"] = frozen + run.precision.compute_bytes * trainable
    elif run.parallel.fsdp and run.parallel.offload_parameters:
        unsharded = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, offload_parameters=False))
        parts["parameters"] = frozen + trainable * trainable_bytes(run)
        parts["gradients"] = trainable * trainable_bytes(run)
        parts["optimizer states"] = optimizer_state_bytes(shape, unsharded) * unsharded.parallel.state_shards
    return {name: size for name, size in parts.items() if size}


def residual_bytes(run: Run) -> int:
    """Bytes per element of the residual stream (the hidden states between layers): the compute
    dtype where DeepSpeed casts the module, FSDP2's gathered dtype, else the embedding's: LoRA's
    trained copy of it (:func:`trains_embedding_copy`) in the adapters' dtype, else the weights'
    (QLoRA's too: its 4-bit linears return their input's dtype, and norms of the weights' dtype
    widen a narrower input to it)."""
    if run.parallel.deepspeed:
        return run.precision.compute_bytes
    if run.parallel.fsdp:
        return gathered_bytes(run)
    return run.adapter_bytes if trains_embedding_copy(run) else run.precision.weight_bytes


def embedding_bytes(run: Run) -> int:
    """Bytes per element of the embedding's output, the first layer's input (and the rotary tables
    and an eager mask, made in its dtype): QLoRA's trained copy of the embedding in bf16 (TRL casts
    what a quantized model trains to bf16), which the first layer's norm widens where the base is
    fp32; else the residual stream's."""
    if run.method == "qlora" and trains(run, "embed_tokens") and not run.parallel.computes_in_gathered_copies:
        return run.adapter_bytes
    return residual_bytes(run)


def trains_embedding_copy(run: Run) -> bool:
    """Whether the run trains an fp32 copy of a 16-bit input embedding (``lora.modules_to_save``,
    :attr:`Run.upcasts_whole_copies`): its output, and so the residual stream, is then fp32."""
    return run.upcasts_whole_copies and trains(run, "embed_tokens")


def offloaded_hidden_bytes(shape: ModelShape, run: Run, micro_batch: int) -> int:
    """Host memory of one process for ``train.offload_activations``: every checkpointed layer's
    input (:func:`checkpointed_inputs_bytes`), and what the final norm saves of its input, the fp32
    upcast RMSNorm and LayerNorm compute in (sft_play.long_rows)."""
    if not (run.offload_activations and run.gradient_checkpointing):
        return 0
    return checkpointed_inputs_bytes(shape, run, micro_batch) + micro_batch * run.local_tokens * shape.hidden_size * 4


def checkpointed_inputs_bytes(shape: ModelShape, run: Run, rows: int) -> int:
    """Every decoder layer's input that gradient checkpointing keeps from the layer's forward to its
    backward: ``[rows, seq, hidden]`` (its share of a split row) in the residual dtype."""
    return shape.num_layers * rows * run.local_tokens * shape.hidden_size * residual_bytes(run)


def master_weights_bytes(shape: ModelShape, run: Run) -> int:
    """fp32 master copy of the trainable parameters. Our DDP recipe has none (full fine-tuning
    trains fp32 weights directly; adapters are their own masters); DeepSpeed keeps one in its
    optimizer, partitioned across ranks (and in CPU memory with offload)."""
    if not run.parallel.deepspeed or (run.parallel.offload_optimizer and run.parallel.deepspeed):
        return 0
    return shape.trainable_params * 4 // run.parallel.state_shards


def optimizer_step_bytes(shape: ModelShape, run: Run) -> int:
    """Temporaries while the optimizer steps. torch's foreach AdamW (``_multi_tensor_adam``)
    builds one state-sized intermediate for a parameter group (``_foreach_sqrt`` of exp_avg_sq,
    then updated in place); the fused kernel works in place; DeepSpeed converts this rank's
    gradient partition to fp32 first."""
    n = shape.trainable_params // run.parallel.state_shards
    if run.parallel.deepspeed:
        return 0 if run.parallel.offload_optimizer else 4 * n
    if run.parallel.fsdp and run.parallel.offload_parameters:
        return 0
    if run.optimizer == "adamw_torch":
        return n * trainable_bytes(run)
    return 0


# ---------------------------------------------------------------------------------------------
# Communication and runtime


def ddp_bucket_bytes(shape: ModelShape, run: Run) -> int:
    """DDP's reducer keeps flat gradient buckets covering every trainable parameter (a second copy
    of the gradients, since transformers leaves ``gradient_as_bucket_view`` off); one process
    needs none (PyTorch ``DistributedDataParallel``, ``reducer.cpp``)."""
    if run.parallel.world_size <= 1 or run.parallel.strategy.shards_states:
        return 0
    return shape.trainable_params * trainable_bytes(run)


def fsdp_buffer_bytes(shape: ModelShape, run: Run) -> int:
    """FSDP2's reduce-scatter of one layer's gradients: the unsharded gradient in the reduce
    dtype (fp32: :func:`sft_play.training.fsdp_mixed_precision`) while the 16-bit one it came
    from is freed, plus the shard it produces; the all-gather input (the layer's shard in the
    ``param_dtype``). PyTorch ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``."""
    if not run.parallel.fsdp:
        return 0
    layer = largest_layer_params(shape)
    trainable_layer = layer if run.method == "full" else shape.lora_params // max(1, shape.num_layers)
    reduce_bytes = 4 if run.precision.autocast else trainable_bytes(run)
    world = max(1, run.parallel.world_size)
    return trainable_layer * reduce_bytes * (world + 1) // world + layer * gathered_bytes(run) // world


def zero_buffer_bytes(shape: ModelShape, run: Run) -> int:
    """DeepSpeed ZeRO's gradient-reduction bucket (``reduce_bucket_size`` elements as the run
    resolves it: transformers fills 'auto' with h^2; never more than the trainable parameters) in
    the gradients' dtype. ZeRO-1/2 double-buffer it (``overlap_comm``, as
    configs/deepspeed_z2.json sets) while backward runs only (``setup_buckets`` at the first
    gradient, ``_release_ipg_buffers`` after the last: :func:`sharded_gradients_in_backward`); ZeRO-3
    allocates one for the whole run (``stage3.py``). The updated parameters are gathered straight
    into the flat 16-bit groups (``all_gather_into_tensor_dp_groups``): ``allgather_bucket_size``
    allocates nothing (deepspeed/runtime/utils.py)."""
    if not run.parallel.deepspeed:
        return 0
    squared = shape.hidden_size * shape.hidden_size
    reduce_bucket = min(run.parallel.reduce_bucket_elements or squared, shape.trainable_params)
    return (1 if run.parallel.strategy.zero3 else 2) * reduce_bucket * trainable_bytes(run)


def sharded_gradients_in_backward(run: Run) -> bool:
    """Whether this rank's gradient shard and the buckets that reduce into it exist only from
    backward's first gradient to the optimizer step, as measured on two gloo processes
    (bench/cpu_ground_truth.py): ZeRO-1/2's ``grads_in_partition`` and reduction buckets (made as
    the first gradients are reduced, the buckets released as backward ends, the partition dropped
    by ``zero_grad``), FSDP2's sharded gradients and reduce-scatter buffers (made by each unit's
    post-backward, freed by ``zero_grad``). Not ZeRO-3's ``grad_partitions_flat_buffer``, made with
    its optimizer for the whole run, nor the staging buffer of DeepSpeed's optimizer offload (no
    step measured yet: counted for the whole run)."""
    if run.parallel.fsdp:
        return True
    return run.parallel.deepspeed and not run.parallel.strategy.zero3 and not run.parallel.offload_optimizer


def outside_allocator_bytes(run: Run, on_cuda: bool = True, measured: tuple | dict = ()) -> int:
    """What a process holds outside PyTorch's allocator (the CUDA context, NCCL's buffers), from
    what was measured on the GPUs that train (:func:`outside_allocator`)."""
    return outside_allocator(run.parallel.world_size, on_cuda, measured)[0]


def outside_allocator(world_size: int, on_cuda: bool, measured: tuple | dict = ()) -> tuple[int, str]:
    """What a process of a run of `world_size` processes holds outside PyTorch's allocator, and
    where the figure comes from. `measured`: bytes by the number of processes of the run that
    measured them on these GPUs, and make gpu-info's probe (``hardware.HardwareInfo.
    outside_allocator``). A run of the same size measured it: that figure. Otherwise the largest
    of what smaller runs measured and what the parts make: the context (measured by one process,
    at least the probe's and never below the constant until a run has measured) plus NCCL's
    buffers with several processes (measured by no run of this size: the estimate)."""
    if not on_cuda:
        return 0, "no GPU"
    measured = dict(measured)
    runs = {int(k): v for k, v in measured.items() if str(k).isdigit()}
    if world_size in runs:
        return runs[world_size], f"measured on these GPUs by a run of {world_size} process(es)"
    if 1 in runs:
        context, source = runs[1], "the context measured on these GPUs by a run"
    elif "probe" in measured:
        context = max(measured["probe"], CUDA_CONTEXT_BYTES)
        source = (f"the context as make gpu-info probed it, at least the H100's {CUDA_CONTEXT_BYTES / MIB:.0f} MiB "
                  "until a run has measured it")
    else:
        context, source = CUDA_CONTEXT_BYTES, (f"not measured on these GPUs yet (a finished run or make gpu-info "
                                               f"measures it): the CUDA context as on an H100 ({CUDA_CONTEXT_BYTES / MIB:.0f} MiB)")
    parts = context + (NCCL_BYTES if world_size > 1 else 0)
    if world_size > 1:
        source += f", plus NCCL's buffers ({NCCL_BYTES / MIB:.0f} MiB, an estimate)"
    smaller = max((v for w, v in runs.items() if 1 < w < world_size), default=0)
    if smaller > parts:
        return smaller, f"measured on these GPUs by a run of {max(w for w, v in runs.items() if v == smaller)} processes"
    return parts, source
