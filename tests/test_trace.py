"""The meta-device trace of a decoder layer: what autograd keeps, with CUDA's kernels and autocast
put in where the meta device would differ. Shapes: a tiny Llama (h 256, I 768, 4 heads of 64,
2 key-value heads: the embedded default's shape until it became 128 wide, kept as a fixture so
that these numbers stay the test's own) and Gemma-2-9B's config (logit soft-capping: eager attention)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_play.adapters import LoraSpec
from sft_play.planner.simulate import trace as tracing
from sft_play.planner.simulate.trace import INPUT, TraceSpec, layer_trace

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "tests" / "fixtures" / "model_configs" / "tiny-llama-256")
H, FFN, HEADS, KV, D = 256, 768, 4, 2, 64  # (FFN: the MLP width, I in the comments)
S = 128


def spec(**changes) -> TraceSpec:
    settings = dict(name_or_path=TINY, revision=None, trust_remote_code=False, method="lora",
                    weights_dtype="bfloat16", adapter_dtype="float32", compute_dtype="bfloat16", attention="sdpa",
                    masked=False, checkpointing=False, lora=LoraSpec(8, 16, 0.0, "all-linear"))
    return TraceSpec(**{**settings, **changes})


def kept_after_forward(events, micro: int, seq: int = S) -> int:
    """Bytes the layer's forward leaves alive for backward once the model's forward is over
    (autocast's cache released), less its output (the next layer's input)."""
    module = events
    alive: dict[int, int] = {}
    for kind, event_id, *_ in module.forward:
        if kind == "a":
            alive[event_id] = module.size((kind, event_id, *_), micro)
        else:
            alive.pop(event_id, None)
    for kind, event_id, *_ in module.after_forward + module.cache_release:
        alive.pop(event_id, None)
    alive.pop(module.output, None)
    return sum(alive.values())


def layer(trace_spec: TraceSpec, micro: int = 1, seq: int = S):
    return layer_trace(trace_spec, seq).at(micro)[0]


def test_checkpointing_keeps_only_the_layer_input():
    checkpointed = layer(spec(checkpointing=True))
    assert checkpointed.input_kept
    assert kept_after_forward(checkpointed, 1) == 0  # the input is the only thing left, and it is the caller's
    plain = layer(spec())
    assert kept_after_forward(plain, 1) > 10 * S * H  # a whole layer's activations


def test_the_run_precision_decides_what_adapters_keep():
    # fp32 LoRA adapters under bf16 autocast keep a 16-bit copy of each adapted input (q, k, v,
    # o, gate, up, down: 3h + q + 2h + I per token); bf16 QLoRA adapters read the inputs
    # themselves, shared: the normed input once for q, k, v, the attention output the kernel
    # keeps anyway, the normed input once for gate and up, the MLP product (2h + I)
    lora = kept_after_forward(layer(spec()), 1)
    qlora = kept_after_forward(layer(spec(method="qlora", adapter_dtype="bfloat16")), 1)
    assert lora - qlora >= 2 * S * (3 * H + HEADS * D)


def test_dropout_keeps_a_boolean_mask_not_float_noise():
    without = kept_after_forward(layer(spec(method="qlora", adapter_dtype="bfloat16")), 1)
    with_dropout = kept_after_forward(layer(spec(method="qlora", adapter_dtype="bfloat16", lora=LoraSpec(8, 16, 0.1, "all-linear"))), 1)
    adapted_inputs = 3 * H + HEADS * D + 2 * H + FFN
    extra = with_dropout - without
    # CUDA's dropout: a bf16 output and a 1-byte mask per adapted input; the meta device's own
    # dropout would keep 2-byte noise on top
    assert S * adapted_inputs <= extra <= 3 * S * adapted_inputs


def test_a_masked_batch_keeps_the_additive_mask_and_repeated_heads():
    unmasked = kept_after_forward(layer(spec()), 2)
    masked = kept_after_forward(layer(spec(masked=True)), 2)
    bias = 2 * S * S * 2  # [b, 1, s, s] in bf16, converted from the boolean mask in every layer
    repeated_kv = 2 * 2 * S * (HEADS - KV) * D * 2  # k and v repeated to the query heads (no GQA with a mask)
    assert masked - unmasked == bias + repeated_kv


def test_eager_attention_keeps_the_probabilities():
    # eager attention keeps the fp32 softmax and its 16-bit copy per head (s^2 x 6 bytes each); the
    # fused kernel keeps one [s, s] bf16 mask, its output and an fp32 log-sum-exp per row instead
    eager = kept_after_forward(layer(spec(attention="eager", masked=True)), 1)
    fused = kept_after_forward(layer(spec(masked=True)), 1)
    assert eager - fused == HEADS * S * S * 6 - S * S * 2 - S * HEADS * D * 2 - HEADS * S * 4
    gemma = str(REPO / "tests" / "fixtures" / "model_configs" / "gemma-2-9b")  # soft-capped: eager only
    assert kept_after_forward(layer(spec(name_or_path=gemma, attention="eager", masked=True)), 1) > 16 * S * S * 6


def test_events_scale_with_the_micro_batch_exactly():
    trace_spec = spec(masked=True)
    prepared = tracing._prepared_layer(trace_spec)
    direct = tracing._module_events(*(tracing._trace_module(trace_spec, prepared, 5, S, "layer") for _ in range(2)), 5)
    assert kept_after_forward(layer(trace_spec, 5), 5) == kept_after_forward(direct, 5)
    backward = layer(trace_spec, 5)
    total = sum(backward.size(e, 5) for e in backward.backward if e[0] == "a")
    assert total == sum(direct.size(e, 5) for e in direct.backward if e[0] == "a")


def test_the_layers_chain_through_their_input_and_gradient():
    events = layer(spec())
    assert events.output >= 0 and events.input_grad >= 0
    assert any(kind == "f" and event_id == INPUT for kind, event_id, *_ in events.after_forward)
    assert events.persistent  # the adapters' gradients, alive until the optimizer step


def test_ligers_rms_norm_keeps_no_fp32_copy_of_the_hidden_states():
    """The model's RMSNorm computes in fp32 ([tokens, hidden] fp32 temporaries, kept for backward
    and made again in it); Liger's fused kernel, traced as it allocates, keeps the input and an fp32
    value per row, and passes the incoming gradient on as the input's (written in place)."""
    seq = 96  # [96, 256] fp32: a size no other tensor of the layer has (bf16 adapters: no fp32 inputs either)
    fp32_rows = seq * H * 4

    def fp32_hidden(module) -> int:
        return sum(1 for kind, _, size, _ in module.forward + module.backward if kind == "a" and size == fp32_rows)

    own, liger = (layer(spec(adapter_dtype="bfloat16", liger=on), seq=seq) for on in (False, True))
    assert fp32_hidden(own) >= 4 and fp32_hidden(liger) == 0
    assert kept_after_forward(liger, 1) < kept_after_forward(own, 1)
    norm = layer_trace(spec(liger=True), S).at(1)[1]
    assert norm.input_grad == tracing.GRAD_IN  # the incoming gradient, overwritten: no new one
    assert {size for kind, _, size, _ in norm.backward if kind == "a"} == {tracing.SM_COUNT * H * 4}  # dW partials
    assert layer_trace(spec(), S).at(1)[1].input_grad != tracing.GRAD_IN


@pytest.mark.parametrize("changes", [
    dict(checkpointing=True, attention="flash_attention_2"),
    dict(checkpointing=False),
    dict(method="qlora", checkpointing=True, masked=True),
    dict(method="full", lora=None, checkpointing=True),
    # fp32 residual under bf16 autocast: each tile's input cast stays cached until the forward ends,
    # which a copy would not keep: every tile is traced
    dict(method="full", lora=None, weights_dtype="float32", checkpointing=True),
])
def test_a_tiled_mlps_later_tiles_are_recorded_as_copies_of_the_second_with_the_same_events(changes):
    """Ten and eleven tiles (the last shorter): the layer traced with tiles 3 onwards copied is the
    layer traced with every tile run, at micro-batch 1 and as a function of the micro-batch."""
    tiled = spec(tiled_mlp=True, **changes)
    for seq in (10 * H, 10 * H + 40):
        before = next(tracing._FRESH_KEYS)
        copied = tracing._traced(tiled, seq)
        made = next(tracing._FRESH_KEYS) - before - 1
        tracing._REPEAT_TILES[0] = False
        try:
            every = tracing._traced(tiled, seq)
        finally:
            tracing._REPEAT_TILES[0] = True
        assert copied == every
        assert (made == 0) == (changes.get("weights_dtype") == "float32"), made


@pytest.mark.parametrize("changes", [dict(masked=True), dict(attention="flash_attention_2", checkpointing=True),
                                     dict(attention="eager", method="full", lora=None)])
def test_a_trace_derived_from_four_lengths_is_the_trace_at_that_length(changes):
    """Sizes linear (activations) and quadratic (an s x s mask, eager attention's scores) in the
    length: a trace derived from four real ones is the real one, to the byte, between them,
    beyond and below, on the kernels' common grid (multiples of 128: FlashAttention-2 pads to
    128, the memory-efficient kernel's log-sum-exp to 32, eager's mask to 8); batched and at one row."""
    from sft_play.planner.simulate import lengths

    trace_spec = spec(**changes)
    for batched in (True, False):
        known = {s: tracing._traced(trace_spec, s, batched) for s in (1024, 2048, 4096, 8192)}
        for s in (128, 640, 1152, 3072, 16384, 40960 + 128):
            assert lengths.derived(known, s) == tracing._traced(trace_spec, s, batched), (changes, batched, s)


def test_a_trace_is_derived_only_where_every_trace_at_hand_agrees():
    import dataclasses

    from sft_play.planner.simulate import lengths

    known = {s: tracing._traced(spec(masked=True), s) for s in (1024, 2048, 4096, 8192)}
    assert lengths.derived(dict(list(known.items())[:3]), 16384) is None  # three: nothing checks the fit
    assert lengths.derived(known, 16384 + 64) is None  # off the grid the kernels' rounding may bend
    first = known[1024].single[0]
    bent = dataclasses.replace(first, forward=((first.forward[0][0], first.forward[0][1], first.forward[0][2] + 64,
                                                first.forward[0][3]), *first.forward[1:]))
    known[1024] = dataclasses.replace(known[1024], single=(bent, known[1024].single[1]))
    assert lengths.derived(known, 16384) is None  # one size off its polynomial by 64 bytes
    other = tracing._traced(spec(masked=False, attention="eager"), 16384)
    assert lengths.derived({**known, 16384: other}, 32768) is None  # other operations at one length: none


def test_a_plan_derives_the_lengths_it_can_and_traces_the_rest(monkeypatch):
    traced = []
    real = tracing._traced
    monkeypatch.setattr(tracing, "_traced", lambda s, n, b=True: traced.append(n) or real(s, n, b))
    monkeypatch.setattr(tracing, "_TRACES", {})
    monkeypatch.setattr(tracing, "_AT_LENGTHS", {})
    monkeypatch.setattr(tracing.cache, "remembered", lambda kind, key, make, keep=None: make())
    trace_spec = spec(checkpointing=True)
    for s in (1024, 2048, 4096, 8192, 16384, 32768, 12288, 1536, 1600):
        layer_trace(trace_spec, s)
    assert traced == [1024, 2048, 4096, 8192, 1600]  # (1600: off the grid)
    tiled = spec(checkpointing=True, tiled_mlp=True)
    for s in (1024, 2048, 4096, 8192, 16384):
        layer_trace(tiled, s)
    assert traced[5:] == [1024, 2048, 4096, 8192, 16384]  # the tiles' count moves with the length


@pytest.mark.parametrize("model, changes", [
    ("tiny-llama-256", dict(masked=True)),
    ("tiny-llama-256", dict(method="qlora", checkpointing=True, tiled_mlp=True)),
    ("tiny-llama-256", dict(attention="eager", method="full", lora=None, weights_dtype="float32")),
    ("tiny-qwen3-moe", dict()),
    ("tiny-lfm2", dict(masked=True)),
    ("tiny-bamba", dict(method="full", lora=None)),
])
def test_the_dispatchers_own_meta_kernels_record_the_trace_torchs_python_ones_do(monkeypatch, model, changes):
    """A trace runs on the C++ meta kernels where an op has one (sft_play.patches.native_meta_kernels):
    the same events, in the same order, as on the Python kernels torch registers over them. (Not so
    for Qwen3-Next's linear attention: ``softplus_backward``'s C++ kernel lays its output out as its
    gradient's, as the CPU and CUDA kernels it is the meta half of do, where Python's makes it
    contiguous; at two rows its backward copies once more, below the peak: the CPU ground truth's
    cells of it plan the same bytes either way.)"""
    import contextlib

    from sft_play import patches

    trace_spec = spec(name_or_path=str(REPO / "tests" / "fixtures" / "model_configs" / model), **changes)
    native = tracing._traced(trace_spec, 3 * H)
    monkeypatch.setattr(patches, "native_meta_kernels", contextlib.nullcontext)
    assert tracing._traced(trace_spec, 3 * H) == native
