"""Training throughput's sides: SFT-Play against the baseline a user would otherwise write.

For each shape (a Case), on one device, with random weights built from a public model config (no
downloads) and a synthetic chat-like dataset of varied lengths (log-normal, a prompt share
masked out of the loss):

  A  TRL's SFTTrainer with its defaults for the method (LoRA/QLoRA through its peft_config /
     quantization_config), micro-batch 4, no packing, the same sequence cap (run_baseline);
  T  TRL tuned as a competent user would: bf16, its BFD packing with padding-free rows on
     FlashAttention-2 where installed (else its wrapped packing on SDPA: TRL supports padding-free
     rows with FlashAttention only), fused AdamW, at its fastest micro-batch: one process tries them
     in increasing order, doubling until one runs out of memory (run_tuned_search); T+liger the
     same at T's micro-batch with TRL's Liger kernels where liger-kernel is installed;
  B  SFT-Play: its planner's micro-batch, packing with per-example position ids, its collator
     and precision recipe, through the same functions the training entry uses (run_sft_play);
  B+lever  B with one kernel switch on (LEVERS): flex (model.attn_implementation=flex_attention),
     compile (train.torch_compile), liger (train.liger_kernels, where liger-kernel is
     installed), expandable (train.expandable_segments). What pays becomes a default.

After warm-up steps a fixed number of steps is timed: real (non-pad) tokens per second, peak
memory, the mean loss of the last timed steps (speed must not come from training on less), and
for B the planner's predicted peak and seconds per step. MFU: model FLOPs per token
(flops_per_token: 6N full, 4N + 6N_lora for adapters, whose frozen base needs no weight
gradients) x tokens/s over the GPU's dense bf16 peak (peak_flops).

`make bench-gpu` (bench/lease.py) runs these sides, each in a fresh process, most telling first,
and writes the report (docs/reports/gpu_lease.md); without a GPU the same code runs a tiny shape.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from _common import CONFIGS, REPO, process_gpu_bytes  # bench/ is the script's folder
from transformers import TrainerCallback



@dataclass(frozen=True)
class Case:
    name: str
    model: str
    method: str
    seq_cap: int
    mean_tokens: int  # mean example length of the synthetic data


GPU_CASES = [
    Case("qwen2.5-0.5b-full", str(CONFIGS / "qwen2.5-0.5b"), "full", 2048, 600),
    Case("llama-3.1-8b-lora", str(CONFIGS / "llama-3.1-8b"), "lora", 2048, 600),
    Case("llama-3.1-8b-qlora", str(CONFIGS / "llama-3.1-8b"), "qlora", 2048, 600),
    Case("llama-3.1-8b-lora-8k", str(CONFIGS / "llama-3.1-8b"), "lora", 8192, 2400),
]
CPU_CASES = [Case("tiny-lora", str(REPO / "configs" / "tiny_model"), "lora", 128, 40)]


def synthetic_examples(case: Case, vocab: int, count: int, seed: int = 0) -> list[dict]:
    """Token ids of varied length (log-normal around the case's mean, within the cap) whose
    first ~30% (the prompt) carry no loss."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(case.mean_tokens), 0.7, count).astype(int), 16, case.seq_cap)
    examples = []
    for length in lengths:
        ids = rng.integers(3, vocab, int(length)).tolist()
        prompt = int(0.3 * length)
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return examples


class StepTimer(TrainerCallback):
    """Times the steps after `warmup` and counts the real (non-pad) tokens they saw."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.tokens0, self.seconds, self.tokens = warmup, None, 0, 0.0, 0
        self.losses: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            _sync()
            self.start, self.tokens0 = time.perf_counter(), state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            _sync()
            self.seconds = time.perf_counter() - self.start
            self.tokens = state.num_input_tokens_seen - self.tokens0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.global_step > self.warmup:
            self.losses.append(float(logs["loss"]))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _dataset(case: Case, vocab: int, count: int):
    import datasets

    return datasets.Dataset.from_list(synthetic_examples(case, vocab, count))


def run_baseline(case: Case, steps: int, warmup: int, output_dir: str, tuned: str = "", micro: int = 4) -> dict:
    """A: TRL's SFTTrainer as a user would write it with its defaults; with `tuned` ("tuned" or
    "liger"), as a competent user tunes it: bf16, TRL's own packing (BFD with padding-free rows on
    FlashAttention-2 where installed, else wrapped rows on SDPA), fused AdamW, the given micro-batch
    (one try of run_tuned_search),
    and for "liger" TRL's Liger kernels."""
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from sft_play import config as config_module
    from sft_play.model import weights_location

    on_cuda = torch.cuda.is_available()
    # The same random weights as side B: the same method decides their dtype
    config = config_module.load(None, [f"model.name_or_path={case.model}", f"finetune.method={case.method}"],
                                check_paths=False)
    weights = weights_location(config)
    vocab = AutoConfig.from_pretrained(weights).vocab_size
    timer = StepTimer(warmup)
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=micro, max_steps=warmup + steps, max_length=case.seq_cap,
        logging_steps=1, report_to="none", save_strategy="no", bf16=on_cuda, use_cpu=not on_cuda,
        include_num_input_tokens_seen="non_padding", learning_rate=2e-4 if case.method != "full" else 2e-5,
        model_init_kwargs={"dtype": torch.bfloat16 if on_cuda else torch.float32},
        dataloader_pin_memory=on_cuda,
    )
    if tuned:
        strategy = tuned_strategy(on_cuda)
        flash = strategy == "bfd"
        settings.update(packing=True, packing_strategy=strategy, optim="adamw_torch_fused" if on_cuda else "adamw_torch",
                        model_init_kwargs={**settings["model_init_kwargs"],
                                           "attn_implementation": "flash_attention_2" if flash else "sdpa"})
        if tuned == "liger":
            settings["use_liger_kernel"] = True
    args = SFTConfig(**settings)
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM") \
        if case.method != "full" else None
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16 if on_cuda else torch.float32) \
        if case.method == "qlora" else None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "tiny_model")  # pad id only; data is tokenised
    tokenizer.pad_token_id = 0
    # Sized as B's: packing folds about seq_cap / mean_tokens examples into a row, and every timed step must be full
    count = micro * (warmup + steps) * max(1, case.seq_cap // case.mean_tokens) * 2
    trainer = SFTTrainer(model=weights, args=args, train_dataset=_dataset(case, vocab, count),
                         processing_class=tokenizer, peft_config=peft_config, quantization_config=quantization,
                         callbacks=[timer])
    result = _finish(trainer, timer, micro)
    if tuned:
        result["setup"] = TUNED_SETUP[strategy]
    return result


# What T ran, as its rows say it (rows without one ran BFD padding-free on SDPA: LEGACY_SETUP)
TUNED_SETUP = {"bfd": "BFD padding-free, FlashAttention-2", "wrapped": "wrapped rows, SDPA"}
LEGACY_SETUP = "BFD padding-free on SDPA"


def tuned_strategy(on_cuda: bool) -> str:
    """T's packing: BFD packing makes TRL padding-free (the micro-batch flattened into one
    sequence), which TRL supports with FlashAttention only; on SDPA it attends over micro x seq
    tokens at once, slower with every micro-batch (seen on an H200, 2026-11-26). Without
    FlashAttention-2, TRL's wrapped packing."""
    import importlib.util

    return "bfd" if on_cuda and importlib.util.find_spec("flash_attn") is not None else "wrapped"


# The kernel switches, as config overrides (sft_play.config: model.attn_implementation, train.*)
LEVERS = {
    "flex": ["model.attn_implementation=flex_attention"],
    "compile": ["train.torch_compile=true"],
    "liger": ["train.liger_kernels=true"],
    "expandable": ["train.expandable_segments=true"],
}


def sft_play_overrides(case: Case, output_dir: str, steps: int, global_batch: int, lever: str = "") -> list[str]:
    """B's run config, as overrides of the defaults."""
    return [
        f"model.name_or_path={case.model}", f"finetune.method={case.method}", f"data.max_seq_length={case.seq_cap}",
        "train.micro_batch_size=auto", f"train.global_batch_size={global_batch}", f"train.max_steps={steps}",
        "train.logging_steps=1", "train.tensorboard=false", f"train.output_dir={output_dir}", "lora.r=16",
        "lora.dropout=0", f"train.learning_rate={2e-4 if case.method != 'full' else 2e-5}",
        *LEVERS.get(lever, []),
    ]


def run_sft_play(case: Case, steps: int, warmup: int, output_dir: str, lever: str = "", global_batch: int = 64) -> dict:
    """B: SFT-Play's own path, planned for `global_batch` rows a step; with `lever`, one kernel
    switch on (LEVERS)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from trl.data_utils import pack_dataset

    from sft_play import config as config_module
    from sft_play import hardware, model, planner, training
    from sft_play.data import collate
    from sft_play.model import weights_location

    on_cuda = torch.cuda.is_available()
    config = config_module.load(None, sft_play_overrides(case, output_dir, warmup + steps, global_batch, lever),
                                check_paths=False)
    vocab = AutoConfig.from_pretrained(weights_location(config)).vocab_size
    facts = hardware.detect()
    target = planner.target_for(facts, gpus=1, allow_cpu=True)
    run = planner.resolve_for(config, target)
    plan = planner.make_plan(config, target, run=run)
    split = plan.split
    rows_needed = split.micro_batch_size * split.gradient_accumulation_steps * (warmup + steps)
    examples = _dataset(case, vocab, rows_needed * max(1, case.seq_cap // case.mean_tokens) * 2)
    packed = pack_dataset(examples, case.seq_cap, "bfd")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "tiny_model")
    tokenizer.pad_token_id = 0
    base = model.load_model(config, run, device="cuda:0" if on_cuda else "cpu")
    collator = collate.make_collator(0, run.kernels.collator)
    timer = StepTimer(warmup)
    make = training.trainer_factory(config, run, Path(output_dir), base, tokenizer, packed, None, collator, [timer])
    trainer = make(split)
    predicted = {  # the plan's peak covers smaller batches too; the measurement is of this one
        "predicted_peak": plan.peak_bytes_per_gpu - plan.breakdown.get("smaller_batch", 0),
        "predicted_peak_plan": plan.peak_bytes_per_gpu}
    try:
        result = _finish(trainer, timer, split.micro_batch_size)
    except Exception as exc:  # noqa: BLE001 - out of memory above all: the row keeps what was predicted
        return {"ok": False, "error": out_of_memory(exc) or f"{type(exc).__name__}: {exc}"[:300],
                "micro_batch": split.micro_batch_size, **predicted}
    result.update(accumulation=split.gradient_accumulation_steps, **predicted, global_batch=split.global_batch_size,
                  predicted_step_seconds=plan.time["seconds_per_step"] if plan.time else None,
                  measured_step_seconds=timer.seconds / max(1, steps))
    return result


def _finish(trainer, timer, micro: int) -> dict:
    import torch

    on_cuda = torch.cuda.is_available()
    outside = 0
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
        outside = outside_allocator_bytes()
    trainer.train()
    result = {"tokens_per_second": timer.tokens / timer.seconds if timer.seconds else 0.0, "tokens": timer.tokens,
              "seconds": timer.seconds, "peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
              "micro_batch": micro, "last_loss": sum(timer.losses[-5:]) / max(1, len(timer.losses[-5:])),
              "steps": len(timer.losses)}
    if on_cuda:  # what the planner predicts: the allocator's peak reservation plus what lives outside it
        outside = max(outside, outside_allocator_bytes())  # kernels load lazily during the first steps
        result["reserved_bytes"] = torch.cuda.max_memory_reserved() + outside if outside else None
    return result


def outside_allocator_bytes() -> int:
    """What NVML sees this process hold beside torch's allocator (the CUDA context, kernels,
    cuBLAS's workspace); 0 where NVML cannot say (then no comparable peak is reported)."""
    import torch

    try:
        return max(0, process_gpu_bytes() - torch.cuda.memory_reserved())
    except Exception:  # noqa: BLE001 - NVML unsupported, a device given by UUID or MIG id
        return 0


def out_of_memory(exc: BaseException) -> str | None:
    """'out of memory' for every form a GPU's runs out in (torch's allocator, cuBLAS, a raw CUDA
    allocation), else None."""
    import torch

    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text:
        return "out of memory"
    return None


def run_tuned_search(case: Case, steps: int, warmup: int, output_dir: str, start: int, tuned: str = "tuned",
                     emit=None, deadline: float | None = None) -> dict:
    """T in one process: micro-batches in increasing order, doubling from `start`, each try on
    freshly loaded weights with its own warm-up and timed steps, until one runs out of memory
    (when `start` itself does not fit, halving down to the first that does); T is the fastest
    try. One process saves the imports and the start of a process per try, and measures the same
    thing: each try's model, optimizer and cache are freed (``empty_cache``) before the next.
    Without a GPU nothing runs out of memory: one try at `start`. `emit` sees each try's result.
    With a `deadline` (time.time()), no try starts that the last one's pace says cannot end in
    time: the search stops with the tries it has (``"stopped": "deadline"``). A try slower than the
    fastest before it ends the doubling too (``"stopped": "slower"``): a larger micro-batch has
    stopped paying, and each further try costs more than the last."""
    import gc

    import torch

    on_cuda = torch.cuda.is_available()
    tries: list[dict] = []
    stopped = ""

    def attempt(micro: int) -> dict:
        began = time.time()
        try:
            result = run_baseline(case, steps, warmup, os.path.join(output_dir, f"micro{micro}"), tuned=tuned,
                                  micro=micro)
        except Exception as exc:  # noqa: BLE001 - out of memory ends the doubling; anything else is said
            result = {"ok": False, "micro_batch": micro, "setup": TUNED_SETUP[tuned_strategy(on_cuda)],
                      "error": out_of_memory(exc) or f"{type(exc).__name__}: {exc}"[:300]}
        result["try_seconds"] = time.time() - began
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
            result["allocated_after"] = torch.cuda.memory_allocated()  # 0 when the try freed everything
        tries.append(result)
        if emit:
            emit(result)
        return result

    def time_for(micro: int) -> bool:
        nonlocal stopped
        if deadline is None or not tries:
            return True
        needed = 2.5 * tries[-1]["try_seconds"] * (2 if micro > (tries[-1].get("micro_batch") or 0) else 1)
        if time.time() + needed > deadline:
            stopped = "deadline"
        return not stopped

    micro = max(1, start)
    first = attempt(micro)
    if first.get("ok", True) is False:  # the start does not fit: halve to the first that does
        while micro > 1 and time_for(micro // 2) and attempt(micro := micro // 2).get("ok", True) is False:
            pass
    elif on_cuda:
        while micro < 1024 and time_for(micro * 2) and attempt(micro := micro * 2).get("ok", True) is not False:
            if slower_than_before(tries):
                stopped = "slower"
                break
    good = [t for t in tries if t.get("ok", True) is not False]
    best = max(good, key=lambda t: t["tokens_per_second"]) if good else {
        "ok": False, "error": tries[-1].get("error") if tries else "no micro-batch trains"}
    summary = [{"micro_batch": t.get("micro_batch"), "tokens_per_second": t.get("tokens_per_second"),
                "peak_bytes": t.get("peak_bytes"), "error": t.get("error")} for t in tries]
    return {**best, "searched": on_cuda, "tries": summary, **({"stopped": stopped} if stopped else {})}


def slower_than_before(tries: list[dict], margin: float = 0.05) -> bool:
    """Whether the last try ran more than `margin` slower than the fastest try before it."""
    speeds = [t.get("tokens_per_second") or 0.0 for t in tries if t.get("ok", True) is not False]
    return len(speeds) >= 2 and speeds[-1] < (1 - margin) * max(speeds[:-1])


def flops_per_token(case: Case) -> float:
    from sft_play import config as config_module
    from sft_play.planner import model_shape

    config = config_module.load(None, [f"model.name_or_path={case.model}", f"finetune.method={case.method}",
                                       "lora.r=16"], check_paths=False)
    shape = model_shape(config)  # the parameters a token passes through (a mixture's active ones)
    if case.method == "full":
        return 6.0 * shape.active_params
    return 4.0 * shape.active_params + 6.0 * shape.lora_params


def peak_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak: the planner's table (sft_play.planner.simulate.timing.PEAK_BF16)."""
    from sft_play.planner.simulate import timing

    return timing.peak_flops(device_name)
