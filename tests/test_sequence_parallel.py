"""Sequence parallelism (``distributed.sequence_parallel``, DeepSpeed Ulysses under ZeRO): two
CPU processes splitting each row train to the losses and gradient norms of one process with the
whole rows (LoRA and full fine-tuning, packed rows), a run stopped under it resumes to the
uninterrupted run's weights, and what it cannot run is refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sft_play import config as config_module
from sft_play import long_rows
from sft_play.data import collate
from tests.conftest import FORKED, LORA

REPO = Path(__file__).resolve().parents[1]
# Packed rows of the embedded default (256 tokens, several examples each), two rows a step without
# accumulation: one process and two that split the rows see the same rows in the same order
COMMON = ("train.max_steps=4", "train.logging_steps=1", "train.global_batch_size=2", "train.mixed_precision=no",
          "train.tensorboard=false")
ROWS = ("train.micro_batch_size=2", "train.gradient_accumulation_steps=1")  # two rows at once
ACCUMULATED = ("train.micro_batch_size=1", "train.gradient_accumulation_steps=2")  # one row, twice
SPLIT = ("distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=2")
FULL = ("finetune.method=full", "train.learning_rate=1e-3")
STEP = re.compile(r"step (\d+)/\d+ +loss ([\d.]+) +grad_norm ([\d.]+)")
SLOW_S = 8  # the stopped run's step 3: the stop arrives during it (test_distributed times torchrun's grace)


def _command(root: Path, name: str, split: bool, extra: tuple[str, ...], save_steps: int = 0) -> list[str]:
    args = [*COMMON, *extra, *(SPLIT if split else ()), f"train.save_steps={save_steps}",
            f"train.output_dir={root}", f"train.run_name={name}"]
    target = ["train-deepspeed", "CPU=1", "NUM_GPUS=2"] if split else ["train"]
    return ["make", "--no-print-directory", *target, f"ARGS={' '.join(args)}"]


def _steps(output: str) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm), from the printed log lines."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in STEP.finditer(output.replace("\r", "\n"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Started together: LoRA (one row a micro-batch, two accumulated) and full fine-tuning (two rows
    a micro-batch), each in one process and split across two; and the full fine-tuning run split
    across two, stopped by SIGTERM during step 3, then resumed."""
    root = tmp_path_factory.mktemp("split")
    lora, full = (*LORA, *ACCUMULATED), (*FULL, *ROWS)
    plan = {"lora_one": (False, lora), "lora_split": (True, lora), "full_one": (False, full),
            "full_split": (True, full)}
    stopped_command = _command(root, "stopped", True, full, save_steps=2)
    stopped = subprocess.Popen(stopped_command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True,
                               env={**os.environ, "SFT_PLAY_FAULTS": f"slow_step=3:{SLOW_S}"})
    lines: list[str] = []

    def stop_in_step_3() -> None:
        for line in stopped.stdout:
            lines.append(line)
            if "fault injection (slow_step)" in line and not any("SIGTERM sent" in x for x in lines):
                os.killpg(stopped.pid, signal.SIGTERM)
                lines.append("SIGTERM sent\n")

    reader = threading.Thread(target=stop_in_step_3, daemon=True)
    reader.start()
    # (the runs no signal reaches: their training process, or launcher, forked from the suite's zygote)
    forked = {**os.environ, **FORKED}
    started = {name: subprocess.Popen(_command(root, name, split, extra), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=forked)
               for name, (split, extra) in plan.items()}
    done = {name: (process.communicate(timeout=600)[0], process.returncode) for name, process in started.items()}
    reader.join(600)
    stopped.wait(60)
    resumed = subprocess.run(stopped_command + ["RESUME=auto"], cwd=REPO, capture_output=True, text=True, timeout=600,
                             env=forked)
    done["stopped"] = ("".join(lines), stopped.returncode)
    done["resumed"] = (resumed.stdout + resumed.stderr, resumed.returncode)
    return root, done


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_processes_splitting_each_row_train_like_one_process_with_whole_rows(runs, method):
    root, done = runs
    one, split = done[f"{method}_one"], done[f"{method}_split"]
    assert one[1] == 0 and split[1] == 0, (one[0][-3000:], split[0][-3000:])
    # two processes, one data-parallel group
    split_line = {"lora": "global 2 = micro 1 x accum 2 x world 1", "full": "global 2 = micro 2 x accum 1 x world 1"}
    assert f"{split_line[method]} (2 processes, each row split across 2: sequence parallel)" in split[0]
    ours, theirs = _steps(split[0]), _steps(one[0])
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    for step, (loss, norm) in theirs.items():
        # the same loss (each example attending only to itself; accumulated micro-batches weighed
        # by their tokens) and the same gradient (not twice it)
        assert ours[step][0] == pytest.approx(loss, abs=2e-3), (step, ours, theirs)
        assert ours[step][1] == pytest.approx(norm, rel=2e-3), (step, ours, theirs)
    assert theirs[4][0] < theirs[1][0]  # it learns
    summary = json.loads((root / f"{method}_split" / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["weights_fingerprints"])) == 1


@pytest.mark.slow
def test_a_split_run_stopped_mid_epoch_resumes_to_the_uninterrupted_runs_weights(runs):
    root, done = runs
    output, status = done["stopped"]
    assert "SIGTERM sent" in output, output[-3000:]
    # the launcher's exit status (make, signalled with it, dies by the signal)
    assert "train-deepspeed] Error 75" in output, (status, output[-3000:])
    assert "Stopped by SIGTERM at step 3; checkpoint saved" in output
    output, status = done["resumed"]
    assert status == 0, output[-3000:]
    assert "from checkpoint-3" in output
    # step 3 of micro-batches split in two: the loader resumes one batch and one half in
    assert sorted(_steps(output)) == [4]
    ours = json.loads((root / "stopped" / "summary.json").read_text())
    theirs = json.loads((root / "full_split" / "summary.json").read_text())
    assert ours["global_step"] == theirs["global_step"] == 4
    assert ours["weights_fingerprints"] == theirs["weights_fingerprints"]


def _block_diagonal(position_ids: torch.Tensor) -> torch.Tensor:
    """[rows, 1, s, s]: causal within each example (position ids restarting at 0), nothing across."""
    example = (position_ids == 0).cumsum(-1)
    same = example[:, :, None] == example[:, None, :]
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


def test_packed_examples_attend_only_to_themselves_without_a_mask():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    query, key, value = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    attend = long_rows.attend_by_example(sdpa_attention_forward)
    ours, _ = attend(module, query, key, value, None, position_ids=positions)
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                              attn_mask=_block_diagonal(positions)).transpose(1, 2)
    torch.testing.assert_close(ours, expected)
    # the whole row as one example: what SDPA alone gives; it differs where examples are packed
    plain, _ = sdpa_attention_forward(module, query, key, value, None, position_ids=positions)
    torch.testing.assert_close(ours[1], plain[1])
    assert not torch.allclose(ours[0], plain[0])
    # a mask given (outside a split sequence) is used as it is
    masked, _ = attend(module, query, key, value, _block_diagonal(positions), position_ids=positions)
    torch.testing.assert_close(masked, expected)


def test_split_batches_are_padded_to_the_split_and_to_one_length():
    inner = collate.PackedRowsCollator(pad_token_id=0)
    examples = [{"input_ids": [5] * 7, "labels": [5] * 7, "seq_lengths": [4, 3]},
                {"input_ids": [6] * 5, "labels": [6] * 5, "seq_lengths": [5]}]
    batch = collate.make_collator(0, "packed_rows", split=4)(examples)
    assert batch["input_ids"].shape == (2, 8)  # 7 tokens, padded to a multiple of 4
    # the packed rows' own padding (row 2) is one example of its own; the split's counts on
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch["labels"][1, 5:].tolist() == [-100] * 3 and batch["input_ids"][1, 5:].tolist() == [0] * 3
    fixed = collate.make_collator(0, "packed_rows", split=4, length=10)(examples)
    assert fixed["input_ids"].shape == (2, 12)  # gloo: every batch at the longest, rounded to the split
    assert fixed["position_ids"][0, 7:].tolist() == [3, 4, 5, 6, 7]
    assert inner(examples)["input_ids"].shape == (2, 7)  # unsplit: as before
    free = collate.make_collator(0, "padding_free", split=2)(examples)
    assert set(free) == {"input_ids", "labels", "position_ids"}  # no cumulative lengths to split
    padded = collate.make_collator(0, "padded", split=2)([{"input_ids": [5] * 3, "labels": [5] * 3}])
    assert padded["position_ids"].tolist() == [[0, 1, 2, 3]]


def test_the_launcher_refuses_a_split_the_processes_cannot_form_before_any_rank_starts():
    # (the embedded default says ddp: make train-deepspeed switches it to ZeRO-2, which splits rows;
    # OVERSUBSCRIBE=1: three CPU processes on two cores would be refused first, and none starts here)
    result = subprocess.run(["make", "--no-print-directory", "train-deepspeed", "CPU=1", "NUM_GPUS=3", "OVERSUBSCRIBE=1",
                             "ARGS=distributed.sequence_parallel=2"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**os.environ, **FORKED})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "distributed.strategy ddp -> deepspeed_zero2" in output
    assert "3 process(es) cannot be grouped so" in output and "Traceback" not in output
    assert "launching" not in output


def test_the_traced_all_to_alls_allocate_what_ulysses_copies_and_exchanges():
    """The planner's stand-in for DeepSpeed's Ulysses attention (traced on the meta device): per
    process, q, k and v of its share of the tokens are copied for the exchange, exchanged and laid
    out again (three tensors of their size each; key/value heads fewer than the split are first
    repeated up to it), and so is the output; the kernel sees the whole row with 1/split of the
    heads."""
    from sft_play.planner.simulate import trace

    b, heads, kv, local, d, split = 2, 8, 2, 64, 16, 4
    seen = {}

    def core(module, q, k, v, mask, **kwargs):
        seen.update(q=tuple(q.shape), k=tuple(k.shape), mask=mask)
        return torch.empty(b, q.shape[2], q.shape[1], d, dtype=q.dtype, device="meta"), None

    query = torch.empty(b, heads, local, d, dtype=torch.bfloat16, device="meta")
    key, value = (torch.empty(b, kv, local, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    mask = torch.ones(1, 1, local, local, dtype=torch.bool, device="meta")  # built for the share, dropped
    recorder = trace._Recorder({t.untyped_storage()._cdata for t in (query, key, value, mask)})
    module = SimpleNamespace(num_key_value_groups=heads // kv)
    with recorder:
        out, _ = trace._ulysses(core, split)(module, query, key, value, mask)
    assert seen == {"q": (b, heads // split, local * split, d), "k": (b, 1, local * split, d), "mask": None}
    assert tuple(out.shape) == (b, local, heads * d) and module.num_key_value_groups == 2
    allocated = sum(size for kind, _, size in recorder.events if kind == "a")
    q_bytes = b * local * heads * d * 2
    kv_repeated = b * local * split * d * 2  # 2 heads repeated to 4, one per process
    expected = (3 * q_bytes + 2 * 4 * kv_repeated  # q; k and v: repeated, copied, exchanged, laid out
                + q_bytes  # the kernel's output (the stand-in core's)
                + 3 * q_bytes)  # the output: copied, exchanged, laid out
    assert allocated == expected


def test_a_split_rows_trace_wraps_transformers_attention_not_what_replaced_it_in_the_registry(monkeypatch):
    """DeepSpeed's Ulysses puts its wrapper in transformers' shared registry in the place of the
    core attention (``register_with_transformers``). A plan made after a split run has trained in
    the same process (a re-plan, bench/cpu_ground_truth.py's cells) traces transformers' own
    function, not DeepSpeed's, which would exchange real tensors between processes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from sft_play.planner.simulate import trace

    wrapped = []
    # (the registration this makes is undone with the test, so that it wraps again when run again)
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))

    def split_across(core, shards):
        wrapped.append(core)
        return core

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", lambda *args, **kwargs: pytest.fail("DeepSpeed's wrapper"))
    trace._register_split("sdpa", split_across, 3)
    assert wrapped == [sdpa_attention_forward]


def test_a_split_row_is_planned_by_its_share_with_the_exchanges_on_top():
    """Split across 4 processes, a row of 4s tokens keeps what a row of s keeps between layers (the
    checkpointed inputs, 1/4 of the tokens each), and its peak adds the exchanges' buffers (and the
    whole row's attention, with 1/4 of the heads); the split's time adds the all-to-alls."""
    from sft_play.planner import Target
    from sft_play.planner.plan import resolve_for
    from sft_play.planner.simulate import timing
    from sft_play.planner.simulate.predict import replay_step, trace_spec, traced_layers
    from sft_play.planner.simulate.shapes import model_shape
    from sft_play.units import GIB
    def run_at(tokens: int, split: int):
        config = config_module.load(None, [f"model.name_or_path={REPO / 'tests/fixtures/model_configs/llama-3.2-3b'}","finetune.method=lora", "lora.modules_to_save=[]",
                             "train.gradient_checkpointing=true", "model.attn_implementation=flash_attention_2",
                             "distributed.strategy=deepspeed_zero2", f"distributed.sequence_parallel={split}",
                             f"data.max_seq_length={tokens}"], check_paths=False,
                                    check_packages=False)
        shape = model_shape(config)
        return shape, resolve_for(config, Target(4, 80 * GIB, "4 x H100", gpu_model="H100"), None, shape)

    shape, whole = run_at(16384, 1)
    _, split = run_at(65536, 4)
    assert split.local_tokens == whole.sequence.tokens and not split.masked(1)
    one, four = (replay_step(shape, run, 1, False, None) for run in (whole, split))
    assert four.at_peak_allocated["activations"] == one.at_peak_allocated["activations"]
    assert four.peak_allocated >= one.peak_allocated
    # a layer's forward allocates the exchanges' buffers on top: what each all-to-all receives for q,
    # k, v and the output at least, and the copies around them at most (three of each, and the
    # output laid out once more by the layer; how many copies are needed depends on the layouts the
    # projections leave, which the trace follows: the exact count is the test above)
    layer = {run.parallel.sequence_parallel: traced_layers(trace_spec(run, 1), run.local_tokens).at(1)[0]
             for run in (whole, split)}
    forward = {n: sum(layer[n].size(e, 1) for e in layer[n].forward if e[0] == "a") for n in layer}
    q = 16384 * shape.num_attention_heads * shape.head_dim * 2
    kv = 16384 * shape.num_key_value_heads * shape.head_dim * 2
    assert 2 * q + 2 * kv <= forward[4] - forward[1] <= 3 * (2 * q + 2 * kv) + q
    # q, k, v (8 key/value heads: none repeated for 4) and the output, (4 - 1) / 4 of each process's
    # share, in forward, backward and the recomputed forward
    exchanged = timing.split_sequence_traffic_bytes(shape, split, 65536 * 4)
    per_token = (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim * 2
    assert exchanged == 3 * shape.num_layers * 65536 * per_token * 3 / 4
    assert timing.split_sequence_traffic_bytes(shape, whole, 16384) == 0


def test_under_a_split_sdpa_gets_no_mask_and_attends_by_example(monkeypatch):
    """What the training process sets up before Ulysses wraps SDPA: the model builds no mask for a
    packed row (a split would drop it, and it is [tokens / split]^2 per row), and SDPA then runs
    each example on its own, as the mask would have it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from sft_play import patches
    from sft_play.long_rows import attend_by_example

    # the process-wide registries, restored after the test
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa", AttentionMaskInterface._global_mapping["sdpa"])
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "configs" / "tiny_model")
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 512, (1, 24))
    positions = torch.tensor([list(range(10)) + list(range(14))])
    with torch.no_grad():
        # (without a cache, as in training: transformers then builds the block-diagonal mask)
        masked = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        patches.sdpa_by_example(attend_by_example)
        masks = []
        inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa",
                            lambda module, q, k, v, mask, *a, **kw: (masks.append(mask), inner(module, q, k, v, mask, *a, **kw))[1])
        split = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert masks and all(mask is None for mask in masks)
    torch.testing.assert_close(split, masked)


# --- context parallelism (torch's ring attention under FSDP2): GPUs only, its plumbing tested here ---

RING = ("distributed.strategy=fsdp2", "distributed.context_parallel=2", "data.packing=false")


def test_make_refuses_context_parallelism_on_cpu_processes_before_launching():
    # (what context parallelism cannot run, and the words: tests/test_refusals.py)
    result = subprocess.run(["make", "--no-print-directory", "train-distributed", "CPU=1", "NUM_GPUS=2",
                             f"ARGS={' '.join(RING)}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **FORKED})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "runs on CUDA GPUs only" in output and "Traceback" not in output
    assert "launching" not in output


def test_a_ring_run_gets_accelerates_context_parallel_config_and_is_planned_by_its_share():
    from sft_play.planner import Target
    from sft_play.planner.plan import Plan, resolve_for
    from sft_play.planner.simulate import timing
    from sft_play.planner.simulate.predict import trace_spec, traced_layers
    from sft_play.planner.simulate.shapes import model_shape
    from sft_play.run import BatchSplit
    from sft_play.training.arguments import context_parallelism
    from sft_play.units import GIB

    def load(*overrides):
        return config_module.load(None, [f"model.name_or_path={REPO / 'tests/fixtures/model_configs/llama-3.2-3b'}",
                                         "finetune.method=lora", "lora.modules_to_save=[]", "data.max_seq_length=65536",
                                         "train.gradient_checkpointing=true", *overrides],
                                  check_paths=False, check_packages=False)

    target = Target(4, 80 * GIB, "4 x H100", gpu_model="H100")
    config = load("distributed.strategy=fsdp2", "distributed.context_parallel=4", "data.packing=false")
    shape = model_shape(config)
    run = resolve_for(config, target, None, shape)
    assert run.kernels.attention == "sdpa" and run.local_tokens == 16384 and not run.masked(1)
    assert run.parallel.data_parallel == 1 and run.parallel.row_multiple == 8  # two chunks each for the balance
    ring = context_parallelism(run.with_changes(batch=BatchSplit(1, 1, 1, 1)))
    assert (ring.cp_size, ring.cp_backend, ring.dp_shard_size) == (4, "torch", 1)
    assert ring.cp_handler.cp_comm_strategy == "allgather"
    described = Plan.describe(SimpleNamespace(split=BatchSplit(1, 1, 1, 1), sequence_parallel=1, context_parallel=4,
                                              world_size=4, peak_bytes_per_gpu=GIB, budget_bytes_per_gpu=2 * GIB))
    assert "world 1 (4 processes, each row split across 4: context parallel)" in described
    # the layer traced at its share of the tokens, the whole row's keys and values gathered for attention
    layer = traced_layers(trace_spec(run, 1), run.local_tokens).at(1)[0]
    gathered = 65536 * shape.num_key_value_heads * shape.head_dim * 2
    assert sum(1 for kind, _, size, _ in layer.forward if kind == "a" and size == gathered) >= 2
    # each process receives the three others' keys and values, per layer, in three passes
    kv = 2 * shape.num_key_value_heads * shape.head_dim * 2
    assert timing.split_sequence_traffic_bytes(shape, run, 65536) == 3 * shape.num_layers * 16384 * kv * 3
