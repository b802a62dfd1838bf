"""The peak of one GPU at a micro-batch: trace the model's decoder layer for the run
(:mod:`sft_play.planner.simulate.trace`), replay training steps through the caching allocator
(:mod:`sft_play.planner.simulate.step`), add what lives outside the allocator.

``predict`` answers two questions: what the GPU holds at its peak (``peak_bytes``, comparable
with ``torch.cuda.max_memory_reserved()`` plus the CUDA context, or with NVML's used memory), and
whether the step runs within a budget (``fits``): replayed with the budget as the allocator's
limit, as the real allocator would release its cache and retry before running out of memory.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from sft_play import hardware, patches
from sft_play.architecture import config_identity
from sft_play.planner.simulate import cache, memory
from sft_play.planner.simulate.encoder import EncoderTrace, encoder_trace
from sft_play.planner.simulate.loading import replay_start
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.planner.simulate.step import StepSpec, replay, replay_reference_pass
from sft_play.planner.simulate.trace import TraceSpec, layer_trace
from sft_play.run import Run

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """One micro-batch's predicted peak; ``breakdown`` sums to ``peak_bytes``."""

    micro_batch: int
    peak_bytes: int
    allocated_bytes: int  # live tensors at their peak (plus what lives outside the allocator)
    breakdown: dict[str, int]
    fits: bool | None  # None: no budget given
    # Why the model's layers were replayed as a Llama-shaped stand-in ("": its own layers were traced)
    stand_in: str = ""
    # Why the vision encoder's activations are left out ("": traced, or nothing to encode)
    encoder_untraced: str = ""


def static_lower_bound(shape: ModelShape, run: Run) -> int:
    """What the GPU holds before any activation: parameters, optimizer states, fp32 masters,
    communication buckets and what lives outside the allocator. A micro-batch cannot fit where
    this alone does not (checked before any replay)."""
    return (memory.weights_bytes(shape, run) + memory.reference_bytes(shape, run) + memory.optimizer_state_bytes(shape, run)
            + memory.master_weights_bytes(shape, run) + memory.ddp_bucket_bytes(shape, run)
            + memory.zero_buffer_bytes(shape, run) + memory.fsdp_buffer_bytes(shape, run)
            + (memory.gradient_bytes(shape, run) if run.parallel.fsdp else 0)
            + memory.outside_allocator_bytes(run, run.on_cuda, run.outside_allocator_measured))


def checkpointed_lower_bound(shape: ModelShape, run: Run, micro_batch: int) -> int:
    """:func:`static_lower_bound` and, under gradient checkpointing with the hidden states on the
    GPU, every decoder layer's kept input (:func:`memory.checkpointed_inputs_bytes`), all of them
    alive as the forward ends. A micro-batch cannot fit where this alone does not (checked before a
    trace)."""
    bound = static_lower_bound(shape, run)
    if run.gradient_checkpointing and not run.offload_activations:
        bound += memory.checkpointed_inputs_bytes(shape, run, micro_batch * run.rows_per_example)
    return bound


def trace_spec(run: Run, micro_batch: int) -> TraceSpec:
    precision = run.precision
    residual = precision.weights_dtype
    if run.parallel.computes_in_gathered_copies:  # DeepSpeed casts the module to the compute dtype, FSDP2 gathers in it
        residual = precision.compute_dtype
    # (the hidden states come from the embedding: a trained copy of it in the adapters' dtype)
    embedding = run.adapter_dtype if memory.trains_embedding_copy(run) else residual
    return TraceSpec(
        name_or_path=run.model,
        revision=run.revision,
        trust_remote_code=run.trust_remote_code,
        method=run.method,
        weights_dtype=residual,
        adapter_dtype=(precision.compute_dtype if run.parallel.computes_in_gathered_copies and run.method != "full"
                       else run.adapter_dtype),
        compute_dtype=precision.compute_dtype if precision.mixed != "no" else None,
        attention=run.kernels.attention,
        masked=run.masked(micro_batch),
        checkpointing=run.gradient_checkpointing,
        lora=run.lora,
        tiled_mlp=run.kernels.tiled_mlp,
        sequence_parallel=run.parallel.sequence_parallel,
        context_parallel=run.parallel.context_parallel,
        liger=run.kernels.liger,
        residual_dtype=embedding if embedding != residual else None,
    )


def predict(shape: ModelShape, run: Run, micro_batch: int, budget: int | None = None,
            accumulating: bool = False) -> Prediction:
    """The peak of one GPU training `run` at `micro_batch`.

    Args:
        shape: the exact model shape for the run's method.
        run: the resolved run.
        micro_batch: sequences per GPU per forward pass.
        budget: bytes the process may hold on its GPU; None predicts without deciding the fit.
        accumulating: gradients accumulate over micro-batches (the next forward runs with them).
    """
    key = _key(shape, run, micro_batch, budget, accumulating)
    known = _known(key)
    if known is None:
        with patches.meta_kernels_kept():  # (one switch of torch's meta kernels for its layers', encoder's traces)
            known = _predict(shape, run, micro_batch, budget, accumulating)
        _remember(key, known)
    return known


# Forking a pool costs 0.1-0.15 s (measured on 2 cores from a 1.2 GB process); a layer's replay
# about a tenth of a millisecond compiled (ten times that through the reference allocator, where
# forking would pay sooner): below this many layer replays, one after another is as fast
FORK_LAYER_REPLAYS = 4000


def predict_many(shape: ModelShape, requests: list[tuple[Run, int, int | None, bool]]) -> list[Prediction]:
    """:func:`predict` for each (run, micro-batch, budget, accumulating) in `requests`, those not
    predicted before replayed side by side on this machine's cores (each replay is independent
    Python work). The traces are made here first; the replays run in forked processes, which
    inherit them, leave Ctrl-C to the planning process, end on SIGTERM and with their parent
    (:func:`_replay_worker_started`), and touch neither CUDA nor OpenMP. Where fork is unsafe or
    unavailable (macOS, Windows), with one core per
    process (the ranks of a node share its cores), with less to do than a fork costs
    (:data:`FORK_LAYER_REPLAYS`), or when the pool cannot start, they run here, one after another:
    the same predictions either way."""
    todo = list(dict.fromkeys(r for r in requests if _known(_key(shape, *r)) is None))
    workers = min(len(todo), _cores_per_process())
    if workers >= 2 and len(todo) * shape.num_layers >= FORK_LAYER_REPLAYS \
            and "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin":
        for run, micro, _, _ in todo:  # traced here: a fork inherits them (and the disk keeps them)
            rows = micro * run.rows_per_example
            traced_layers(trace_spec(run, rows), run.local_tokens, rows > 1)
            traced_encoder(run, micro > 1)
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                     initializer=_replay_worker_started, initargs=(os.getpid(),)) as pool:
                chunk = -(-len(todo) // workers)
                done = list(pool.map(_predict_counted, todo, [shape] * len(todo), chunksize=chunk))
        except (OSError, BrokenProcessPool) as error:  # no fork, no semaphores, a worker killed: here then
            logger.debug("replays run one after another: %s", error)
        else:
            for request, (prediction, replays) in zip(todo, done):
                _remember(_key(shape, *request), prediction)
                REPLAYS[0] += replays
    return [predict(shape, *request) for request in requests]


def side_by_side(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, in order, the calls taken one at a time, as each is free, by this
    process and by forked processes beside it, one per other core (the remedy search's plans,
    ``make plan LONGEST=1``'s targets), as :func:`predict_many`'s replays; one after another where
    this process cannot fork or has one core. The same results either way; what a forked process
    predicts reaches this one through the disk's cache only, and its replays are counted here.
    Replays within share the cores out (:func:`_cores_per_process`)."""
    workers = min(len(calls) - 1, _cores_per_process() - 1)
    if workers < 1 or "fork" not in multiprocessing.get_all_start_methods() or sys.platform == "darwin":
        return [call() for call in calls]
    results: dict[int, Any] = {}
    context = multiprocessing.get_context("fork")
    sharing = _SHARING[0]
    try:
        _SHARED[:] = [calls, context.Value("i", 0)]
        _SHARING[0] = sharing * (workers + 1)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_side_worker_started,
                                 initargs=(os.getpid(),)) as pool:
            others = [pool.submit(_taking_turns) for _ in range(workers)]
            try:
                results.update(_taking_turns()[0])
                for other in others:
                    done, replays = other.result()
                    results.update(done)
                    REPLAYS[0] += replays
            except BrokenProcessPool as error:  # a worker killed: what it took, here
                logger.debug("planned here instead: %s", error)
            except BaseException:  # an error, Ctrl-C: the others take no more, and it is raised here
                _exhausted()
                raise
    except OSError as error:  # no fork, no semaphores (the calls' own errors are raised above)
        logger.debug("planned one after another: %s", error)
    finally:
        _SHARED.clear()
        _SHARING[0] = sharing
    return [results[index] if index in results else call() for index, call in enumerate(calls)]


_SHARED: list[Any] = []  # side_by_side's calls and the index of the next one to take, inherited by the fork
_SHARING = [1]  # the processes planning side by side on this process's cores (and its forks')


def _exhausted() -> None:
    """No process takes another of :data:`_SHARED`'s calls."""
    calls, following = _SHARED
    with following.get_lock():
        following.value = len(calls)


def _taking_turns() -> tuple[dict[int, Any], int]:
    """The calls this process took from :data:`_SHARED`, by index, and the replays they made."""
    calls, following = _SHARED
    done, before = {}, REPLAYS[0]
    while True:
        with following.get_lock():
            index = following.value
            following.value += 1
        if index >= len(calls):
            return done, REPLAYS[0] - before
        try:
            done[index] = calls[index]()
        except BaseException:  # (an error, Ctrl-C here): the others take no more
            _exhausted()
            raise


def _side_worker_started(parent: int) -> None:
    from sft_play.planner import progress

    _replay_worker_started(parent)
    progress.silenced()  # the planning process says what it is on


def _replay_worker_started(parent: int) -> None:
    """A replay worker: Ctrl-C (sent to the whole foreground group) is the planning process's to
    handle; SIGTERM ends the worker (the handler the parent may have installed is not inherited);
    and the worker ends with its parent, however the parent ends (the kernel's SIGKILL on Linux,
    prctl(PR_SET_PDEATHSIG); a worker forked after its parent died ends at once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no libc to ask: the pool's own shutdown still ends it
            pass
    if os.getppid() != parent:
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _predict_counted(request: tuple, shape: ModelShape) -> tuple[Prediction, int]:
    before = REPLAYS[0]
    prediction = _predict(shape, *request)
    return prediction, REPLAYS[0] - before


def _key(shape: ModelShape, run: Run, micro_batch: int, budget: int | None, accumulating: bool) -> tuple:
    return (shape.key(), run, micro_batch, budget, accumulating)


def _known(key: tuple) -> Prediction | None:
    """What was predicted for `key` before: in this process, or kept on disk by an earlier one
    (:func:`sft_play.planner.simulate.cache.kept`; a model with remote code is never kept)."""
    known = _CACHE.get(key)
    if known is None and _CACHE is _PROCESS_CACHE and _keeps(key):
        document = cache.kept("prediction", _disk_key(key))
        try:
            known = _CACHE[key] = Prediction(**document) if document is not None else None
        except TypeError:  # not a prediction's fields: counts as none
            known = None
    return known


def _remember(key: tuple, prediction: Prediction) -> None:
    if len(_CACHE) > 1024:
        _CACHE.clear()
    _CACHE[key] = prediction
    # (a prediction made with a stand-in is not kept: what made the trace fail, a package or the
    # machine, is not in the key, and the next process tries the real trace again)
    if _CACHE is _PROCESS_CACHE and _keeps(key) and not (prediction.stand_in or prediction.encoder_untraced):
        cache.keep("prediction", _disk_key(key), dataclasses.asdict(prediction))


def _keeps(key: tuple) -> bool:
    run = key[1]
    return cache.keeps(run.model, run.trust_remote_code)


def _disk_key(key: tuple) -> tuple:
    """`key` with what the run's model name stands for: the text of its config."""
    run = key[1]
    return (config_identity(run.model, run.revision, run.trust_remote_code), *key)


def _cores_per_process() -> int:
    """This process's share of the cores: the ranks a launcher starts on one node share them, and
    the processes planning side by side (:func:`side_by_side`)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, hardware.usable_cores() // ranks // _SHARING[0])


# This process's predictions, backed by the disk (:func:`_known`), and its unlimited replays
# (:func:`_unlimited_replay`, never kept on disk); a test that puts a dict of its own here plans without the disk
_PROCESS_CACHE: dict = {}
_CACHE: dict = _PROCESS_CACHE
# Traces that failed in this process, and why (not tried again): (model, method) -> the reason its
# layers are planned with a stand-in; what was traced of an encoder -> why its activations are left out
_UNTRACEABLE: dict[tuple[str, str], str] = {}
_UNTRACED_ENCODERS: dict[tuple, str] = {}
REPLAYS = [0]  # allocator replays so far in this process: what planning costs, counted (Plan.replays)


def _predict(shape: ModelShape, run: Run, micro_batch: int, budget: int | None, accumulating: bool) -> Prediction:
    outside = memory.outside_allocator_bytes(run, run.on_cuda, run.outside_allocator_measured)
    unlimited = _unlimited_replay(shape, run, micro_batch, accumulating)
    fits = None
    result = unlimited
    if budget is not None:
        fits = unlimited.peak_reserved + outside <= budget
        if not fits and unlimited.peak_allocated + outside <= budget:
            # The live tensors fit but the cache does not: the real allocator releases its cache
            # before it gives up, so replay with the budget as the limit
            limited = replay_step(shape, run, micro_batch, accumulating, max(0, budget - outside))
            fits = not limited.out_of_memory
            if fits:
                result = limited
    # The terms as the GPU holds them at its fullest: the step's tensors by kind when they are the
    # most (the allocated peak), and what the allocator's cache keeps on top of that
    # (max_memory_reserved - max_memory_allocated), which is how a GPU reports the same peak
    breakdown = dict(result.at_peak_allocated)
    if run.on_cuda:
        peak = result.peak_reserved + outside
        breakdown["allocator_cache"] = result.peak_reserved - result.peak_allocated
    else:  # host memory: malloc returns what is freed; no caching allocator, no CUDA context
        peak = result.peak_allocated
    capacity = None if budget is None else max(0, budget - outside)
    for before in (_start(shape, run, capacity), reference_pass(shape, run, micro_batch, capacity)):
        if before is None or (before.peak_reserved if run.on_cuda else before.peak_allocated) + outside <= peak:
            continue
        # (a phase before training is the run's peak: its tensors are the plan's terms)
        breakdown = dict(before.at_peak_allocated)
        peak = (before.peak_reserved if run.on_cuda else before.peak_allocated) + outside
        if run.on_cuda:
            breakdown["allocator_cache"] = before.peak_reserved - before.peak_allocated
        if budget is not None:
            fits = bool(fits) and not before.out_of_memory and peak <= budget
        result = dataclasses.replace(result, peak_allocated=max(result.peak_allocated, before.peak_allocated))
    breakdown["cuda_runtime"] = breakdown.get("cuda_runtime", 0) + outside
    breakdown = {k: v for k, v in breakdown.items() if v}
    breakdown[max(breakdown, key=breakdown.get)] += peak - sum(breakdown.values())  # rounding
    spec = trace_spec(run, micro_batch)
    return Prediction(micro_batch, peak, result.peak_allocated + outside, breakdown, fits,
                      stand_in=_UNTRACEABLE.get((spec.name_or_path, spec.method), ""),
                      encoder_untraced=encoder_untraced(run) or "")


def _start(shape: ModelShape, run: Run, capacity: int | None):
    """:func:`replay_start` without a limit, once per process for the run's model, strategy and
    precision (it does not depend on the batch); where only the allocator's cache would exceed
    `capacity`, replayed against it, as :func:`_predict` does the step."""
    key = ("start", shape.key(), run.method, run.precision, run.adapter_dtype, run.parallel, run.double_quant,
           run.preference, run.on_cuda)
    if key not in _CACHE:
        _CACHE[key] = replay_start(shape, run, run.on_cuda)
    unlimited = _CACHE[key]
    if (unlimited is None or capacity is None or not run.on_cuda or unlimited.peak_reserved <= capacity
            or unlimited.peak_allocated > capacity):
        return unlimited
    limited = replay_start(shape, run, run.on_cuda, capacity)
    return unlimited if limited.out_of_memory else limited


def _unlimited_replay(shape: ModelShape, run: Run, micro_batch: int, accumulating: bool):
    """:func:`replay_step` without a limit, which no budget changes: once per process for the
    budgets a plan's questions try (kept beside the predictions, and cleared with them)."""
    key = ("unlimited", shape.key(), run, micro_batch, accumulating)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = replay_step(shape, run, micro_batch, accumulating, None)
    return found


def replay_step(shape: ModelShape, run: Run, micro_batch: int, accumulating: bool, capacity: int | None,
                log: list | None = None):
    """One training step of `run` at `micro_batch` replayed through the simulated allocator
    (`capacity` bytes, None: unlimited); `log` collects its allocation events when given."""
    REPLAYS[0] += 1
    rows = micro_batch * run.rows_per_example  # a preference pair is two rows, chosen and rejected
    trace = traced_layers(trace_spec(run, rows), run.local_tokens, rows > 1)
    spec = StepSpec(
        run=run,
        micro_batch=rows,
        seq_len=run.local_tokens,  # a split row's share: all but attention's all-to-all holds only it
        checkpointing=run.gradient_checkpointing,
        masked=run.masked(rows),
        eager_mask=run.kernels.attention == "eager",
        sliding_mask=run.sliding_mask(rows, shape.sliding_window),
        loss_token_share=run.sequence.loss_token_share,  # TRL's head projects the labelled positions only
        accumulating=accumulating,
        on_cuda=run.on_cuda,
        cublas_workspace=run.cublas_workspace_bytes,
        neftune=run.neftune,
        offload_hidden=run.offload_activations and run.gradient_checkpointing,
        encoder=traced_encoder(run, micro_batch > 1),
        reference_forward=run.preference is not None and run.preference.reference_forward,
        kl_forward=run.preference is not None and run.preference.kl,
    )
    return replay(shape, trace, spec, capacity, log)


def reference_pass(shape: ModelShape, run: Run, micro_batch: int, capacity: int | None):
    """TRL's reference pass before training (``preference.reference: precomputed``) replayed where
    it takes more pairs a forward than the step (``preference.precompute_batch_size``): the weights
    and that forward without gradients, before any optimizer state exists. None where there is
    none, or where it cannot be the larger (the step's forward keeps more at the same batch)."""
    pairs = run.preference.precompute_batch_size if run.preference is not None else None
    if run.preference is None or run.preference.reference != "precomputed" or not pairs or pairs <= micro_batch:
        return None
    REPLAYS[0] += 1
    rows = pairs * run.rows_per_example
    spec = StepSpec(run=run, micro_batch=rows, seq_len=run.local_tokens, checkpointing=False, masked=run.masked(rows),
                    eager_mask=run.kernels.attention == "eager", sliding_mask=run.sliding_mask(rows, shape.sliding_window),
                    loss_token_share=run.sequence.loss_token_share, on_cuda=run.on_cuda,
                    cublas_workspace=run.cublas_workspace_bytes)
    return replay_reference_pass(shape, traced_layers(trace_spec(run, rows), run.local_tokens, rows > 1), spec,
                                 capacity)


def traced_encoder(run: Run, batched: bool = True) -> EncoderTrace | None:
    """The vision encoder on the run's images (:attr:`Run.encoder_inputs`) traced (`batched`: at
    every micro-batch, else at 1 only), or None where
    the run encodes none, or where the tracer cannot follow the encoder (:func:`encoder_untraced`
    says why, for the plan to say)."""
    if not run.encoder_inputs:
        return None
    key = _encoder_key(run)
    if key in _UNTRACED_ENCODERS:
        return None
    try:
        return encoder_trace(*key, batched)
    except Exception as error:  # noqa: BLE001 - the plan goes on without the encoder's activations
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        _UNTRACED_ENCODERS[key] = f"{type(error).__name__}: {reason}"
        return None


def encoder_untraced(run: Run) -> str | None:
    """Why the run's vision encoder could not be traced, once its plan has tried; None otherwise."""
    return _UNTRACED_ENCODERS.get(_encoder_key(run)) if run.encoder_inputs else None


def _encoder_key(run: Run) -> tuple:
    return trace_spec(run, 1), run.encoder_inputs, run.train_vision_tower, run.train_projector


def traced_layers(spec, seq_len: int, batched: bool = True):
    """The model's layers traced (`batched`: at every micro-batch, else at 1 only); where the
    tracer cannot follow them (an architecture whose ops it does not know), a Llama-shaped layer
    of the model's widths instead, the reason recorded for the prediction to carry
    (:attr:`Prediction.stand_in`) and the plan to say. Planning never ends a run: training goes
    ahead, with the out-of-memory backoff as its safety net."""
    failed = (spec.name_or_path, spec.method)
    if failed not in _UNTRACEABLE:
        try:
            return layer_trace(spec, seq_len, batched)
        except Exception as error:  # noqa: BLE001 - any failure of the trace falls back
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            _UNTRACEABLE[failed] = f"{type(error).__name__}: {reason}"
    return layer_trace(dataclasses.replace(spec, stand_in=True), seq_len, batched)
