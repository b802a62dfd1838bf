"""Training throughput: SFT-Play against the baseline a user would otherwise write.

For each shape, on one device, with random weights built from a public model config (no
downloads) and a synthetic chat-like dataset of varied lengths (log-normal, a prompt share
masked out of the loss):

  A  TRL's SFTTrainer with its defaults for the method (LoRA/QLoRA through its peft_config /
     quantization_config), micro-batch 4, no packing, the same sequence cap;
  T  TRL tuned as a competent user would: bf16, its BFD packing with padding-free rows, fused
     AdamW, FlashAttention-2 where installed, at its fastest micro-batch (one process tries them
     in increasing order, doubling until one runs out of memory); T+liger the same at T's micro-batch with TRL's
     Liger kernels where liger-kernel is installed;
  B  SFT-Play: its planner's micro-batch, packing with per-example position ids, its collator
     and precision recipe, through the same functions the training entry uses;
  B+lever  B with one kernel switch on (--levers; by default on a GPU every one that can run
     there): flex (model.attn_implementation=flex_attention), compile (train.torch_compile),
     liger (train.liger_kernels, where liger-kernel is installed), expandable
     (train.expandable_segments). What pays becomes a default; the report is where that is read.

Each side runs in its own process; after warm-up steps, a fixed number of steps is timed. The
report gives real (non-pad) tokens per second, peak memory, MFU (model FLOPs per token x
tokens/s over the GPU's dense bf16 peak: 6N for full fine-tuning, 4N + 6N_lora for adapters,
whose frozen base needs no weight gradients), B/A, and the mean loss of the last timed steps
of each (speed must not come from training on less), B over the best tuned baseline, and the
planner's predicted seconds per step beside the measured. It writes docs/benchmarks.md.

Without a GPU the CPU path runs a tiny shape with the same code, so the script cannot rot;
the report says which rows await a GPU.

Usage: python bench/throughput.py [--cases ...] [--levers flex compile liger expandable] [--steps 20] [--warmup 5]
                                  [--output docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _common import CONFIGS, REPO, lean, process_gpu_bytes, run_worker, versions  # bench/ is the script's folder
from transformers import TrainerCallback

# Dense bf16 peak of the GPUs we know, FLOP/s (vendor data sheets, without sparsity)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12,
             "A10G": 125e12, "L4": 121e12}


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
    "liger"), as a competent user tunes it: bf16, TRL's own packing (BFD, padding-free rows),
    fused AdamW, FlashAttention-2 where installed, the given micro-batch (one try of run_tuned_search),
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
        import importlib.util

        flash = on_cuda and importlib.util.find_spec("flash_attn") is not None
        settings.update(packing=True, packing_strategy="bfd", optim="adamw_torch_fused" if on_cuda else "adamw_torch",
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
    trainer = SFTTrainer(model=weights, args=args, train_dataset=_dataset(case, vocab, micro * (warmup + steps) * 2),
                         processing_class=tokenizer, peft_config=peft_config, quantization_config=quantization,
                         callbacks=[timer])
    return _finish(trainer, timer, micro)


# The kernel switches, as config overrides (sft_play.config: model.attn_implementation, train.*)
LEVERS = {
    "flex": ["model.attn_implementation=flex_attention"],
    "compile": ["train.torch_compile=true"],
    "liger": ["train.liger_kernels=true"],
    "expandable": ["train.expandable_segments=true"],
}


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
    config = config_module.load(None, [
        f"model.name_or_path={case.model}", f"finetune.method={case.method}", f"data.max_seq_length={case.seq_cap}",
        "train.micro_batch_size=auto", f"train.global_batch_size={global_batch}", f"train.max_steps={warmup + steps}",
        "train.logging_steps=1", "train.tensorboard=false", f"train.output_dir={output_dir}", "lora.r=16",
        "lora.dropout=0", f"train.learning_rate={2e-4 if case.method != 'full' else 2e-5}",
        *LEVERS.get(lever, []),
    ], check_paths=False)
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
    collator = collate.make_collator(0, run.collator)
    timer = StepTimer(warmup)
    make = training.trainer_factory(config, run, Path(output_dir), base, tokenizer, packed, None, collator, [timer])
    trainer = make(run.with_changes(batch=split))
    result = _finish(trainer, timer, split.micro_batch_size)
    result.update(accumulation=split.gradient_accumulation_steps, predicted_peak=plan.peak_bytes_per_gpu,
                  global_batch=split.global_batch_size,
                  predicted_step_seconds=plan.time["seconds_per_step"] if plan.time else None,
                  measured_step_seconds=timer.seconds / max(1, steps))
    return result


def _finish(trainer, timer, micro: int) -> dict:
    import torch

    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = {"tokens_per_second": timer.tokens / timer.seconds if timer.seconds else 0.0, "tokens": timer.tokens,
              "seconds": timer.seconds, "peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else None,
              "micro_batch": micro, "last_loss": sum(timer.losses[-5:]) / max(1, len(timer.losses[-5:])),
              "steps": len(timer.losses)}
    if on_cuda:  # what the planner predicts: the allocator's peak reservation plus what lives outside it
        result["reserved_bytes"] = torch.cuda.max_memory_reserved() + max(
            0, process_gpu_bytes() - torch.cuda.memory_reserved())
    return result


def run_tuned_search(case: Case, steps: int, warmup: int, output_dir: str, start: int, tuned: str = "tuned",
                     emit=None) -> dict:
    """T in one process: micro-batches in increasing order, doubling from `start`, each try on
    freshly loaded weights with its own warm-up and timed steps, until one runs out of memory
    (when `start` itself does not fit, halving down to the first that does); T is the fastest
    try. One process saves the imports and the start of a process per try, and measures the same
    thing: each try's model, optimizer and cache are freed (``empty_cache``) before the next.
    Without a GPU nothing runs out of memory: one try at `start`. `emit` sees each try's result."""
    import gc

    import torch

    on_cuda = torch.cuda.is_available()
    tries: list[dict] = []

    def attempt(micro: int) -> dict:
        try:
            result = run_baseline(case, steps, warmup, os.path.join(output_dir, f"micro{micro}"), tuned=tuned,
                                  micro=micro)
        except torch.OutOfMemoryError:
            result = {"ok": False, "error": "out of memory", "micro_batch": micro}
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
        tries.append(result)
        if emit:
            emit(result)
        return result

    micro = max(1, start)
    if attempt(micro).get("ok", True) is False:  # the start does not fit: halve to the first that does
        while micro > 1 and attempt(micro := micro // 2).get("ok", True) is False:
            pass
    elif on_cuda:
        while micro < 1024 and attempt(micro := micro * 2).get("ok", True) is not False:
            pass
    good = [t for t in tries if t.get("ok", True) is not False]
    best = max(good, key=lambda t: t["tokens_per_second"]) if good else {"ok": False, "error": "no micro-batch trains"}
    summary = [{"micro_batch": t.get("micro_batch"), "tokens_per_second": t.get("tokens_per_second"),
                "peak_bytes": t.get("peak_bytes"), "error": t.get("error")} for t in tries]
    return {**best, "searched": on_cuda, "tries": summary}


def measure(side: str, case: Case, steps: int, warmup: int, timeout: int, **extra) -> dict:
    with tempfile.TemporaryDirectory() as output_dir:
        spec = {"side": side, "case": asdict(case), "steps": steps, "warmup": warmup, "dir": output_dir, **extra}
        return run_worker(__file__, spec, timeout)


def measure_tuned(case: Case, steps: int, warmup: int, timeout: int, tuned: str = "tuned", start: int = 2) -> dict:
    """The tuned baseline at its fastest micro-batch, searched in one process (run_tuned_search),
    starting from `start` (half side B's micro-batch, when known)."""
    return measure("T-search", case, steps, warmup, timeout, tuned=tuned, start=start)


def flops_per_token(case: Case) -> float:
    from sft_play import config as config_module
    from sft_play.planner import model_shape

    config = config_module.load(None, [f"model.name_or_path={case.model}", f"finetune.method={case.method}",
                                       "lora.r=16"], check_paths=False)
    shape = model_shape(config)
    if case.method == "full":
        return 6.0 * shape.total_params
    return 4.0 * shape.total_params + 6.0 * shape.lora_params


def peak_flops(device_name: str) -> float | None:
    for name, flops in PEAK_BF16.items():
        if name in device_name:
            return flops
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="case names (default: the GPU cases on a GPU, else the CPU case)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 on a GPU, 4 on the CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5 / 1)")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--levers", nargs="*", choices=sorted(LEVERS), default=None,
                        help="B rows with one kernel switch on (default: every one that runs here on a GPU, none on "
                             "the CPU)")
    parser.add_argument("--sides", nargs="*", choices=["A", "T", "B"], default=["A", "T", "B"],
                        help="which sides to run (levers ride on B)")
    parser.add_argument("--rows", help="also write the raw rows as JSON here, after every case")
    parser.add_argument("--from-rows", nargs="*", help="render the report from rows JSON files written by --rows "
                                                       "(several partial runs into one report); runs nothing")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        case = Case(**spec["case"])
        lean(case.method)
        if spec["side"] == "B":
            result = run_sft_play(case, spec["steps"], spec["warmup"], spec["dir"], spec.get("lever", ""))
        elif spec["side"] == "T-search":
            result = run_tuned_search(case, spec["steps"], spec["warmup"], spec["dir"], spec["start"],
                                      tuned=spec.get("tuned", "tuned"))
        else:
            result = run_baseline(case, spec["steps"], spec["warmup"], spec["dir"], tuned=spec.get("tuned", ""),
                                  micro=spec.get("micro", 4))
        print(json.dumps(result))
        return 0
    lean()  # the sides run in workers; this process only plans and reports
    if args.from_rows:
        docs = [json.loads(Path(path).read_text()) for path in args.from_rows]
        rows = [(Case(**case), sides, flops) for doc in docs for case, sides, flops in doc["rows"]]
        meta = docs[0]
        same = len({(doc["steps"], doc["warmup"]) for doc in docs}) == 1
        commands = [doc["command"] + ("" if same else f" ({doc['warmup']} warm-up, {doc['steps']} timed steps)")
                    for doc in docs]
        Path(args.output).write_text(render(rows, meta["device"], meta["peak"], meta["on_cuda"],
                                            meta["steps"] if same else None, meta["warmup"] if same else None,
                                            sum(doc["seconds"] for doc in docs), commands=commands,
                                            versions_line=meta["versions"]))
        print(f"wrote {args.output}")
        return 0

    import torch

    on_cuda = torch.cuda.is_available()
    known = {c.name: c for c in GPU_CASES + CPU_CASES}
    cases = [known[n] for n in args.cases] if args.cases else (GPU_CASES if on_cuda else CPU_CASES)
    steps = args.steps or (20 if on_cuda else 4)
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)
    device = torch.cuda.get_device_name(0) if on_cuda else f"CPU ({os.cpu_count()} cores)"
    peak = peak_flops(device) if on_cuda else None
    rows = []
    started = time.time()
    import importlib.util

    liger = importlib.util.find_spec("liger_kernel") is not None and on_cuda
    levers = args.levers if args.levers is not None else (
        [lever for lever in LEVERS if lever != "liger" or liger] if on_cuda else [])
    for case in cases:
        sides = {}
        if "A" in args.sides:
            sides["A"] = measure("A", case, steps, warmup, args.timeout)
        if "B" in args.sides:
            sides["B"] = measure("B", case, steps, warmup, args.timeout)
        if "T" in args.sides:  # the search starts from half B's micro-batch: fewer tries
            start = max(1, (sides.get("B", {}).get("micro_batch") or 4) // 2) if on_cuda else 8
            sides["T"] = measure_tuned(case, steps, warmup, args.timeout, start=start)
            if liger:  # at T's micro-batch: Liger's kernels only lower the memory a micro-batch takes
                sides["T+liger"] = measure("T", case, steps, warmup, args.timeout, tuned="liger",
                                           micro=sides["T"].get("micro_batch") or start)
        for lever in levers if "B" in args.sides else []:
            sides[f"B+{lever}"] = measure("B", case, steps, warmup, args.timeout, lever=lever)
        rows.append((case, sides, flops_per_token(case)))
        print(f"{case.name}: " + ", ".join(f"{k} {v.get('tokens_per_second', 0):.0f} tok/s" for k, v in sides.items()),
              flush=True)
        if args.rows:  # after every case: a run cut short keeps what it measured
            command = "python bench/throughput.py " + " ".join(sys.argv[1:])
            Path(args.rows).write_text(json.dumps({
                "device": device, "peak": peak, "on_cuda": on_cuda, "steps": steps, "warmup": warmup,
                "seconds": time.time() - started, "command": command, "versions": versions(),
                "rows": [(asdict(c), s, f) for c, s, f in rows]}, indent=1) + "\n")
    Path(args.output).write_text(render(rows, device, peak, on_cuda, steps, warmup, time.time() - started))
    print(f"wrote {args.output}")
    return 0


def render(rows, device, peak, on_cuda, steps, warmup, seconds, commands=None, versions_line=None) -> str:
    commands = commands or ["python bench/throughput.py " + " ".join(sys.argv[1:])]
    lines = ["# Throughput benchmark", ""]
    if not on_cuda:
        lines += [
            "**These rows await a GPU:** " + ", ".join(c.name for c in GPU_CASES) + ". This report was produced on a",
            "machine without one, by the CPU path (a tiny shape, the same code), which shows the benchmark runs, not",
            "how fast SFT-Play is on a GPU. Run the command below on one (an H100 is the reference).",
            "",
        ]
    lines += [
        f"- device: {device}" + (f"; dense bf16 peak used for MFU: {peak / 1e12:.0f} TFLOP/s" if peak else ""),
        f"- versions: {versions_line or versions()}",
        *[f"- command: `{command.strip()}`" for command in commands],
        (f"- {warmup} warm-up step(s), {steps} timed step(s) per side; wall time {seconds:.0f} s" if steps else
         f"- warm-up and timed steps per side as each command says; wall time {seconds:.0f} s"),
        "- A: TRL SFTTrainer with its defaults for the method, micro-batch 4, no packing; T: TRL tuned (bf16, its BFD",
        "  packing with padding-free rows, fused AdamW, FlashAttention-2 where installed, its fastest micro-batch:",
        "  one process tries them doubling from half B's until one runs out of memory); T+liger: T with TRL's Liger kernels at T's micro-batch (when installed);",
        "  B: SFT-Play, planned, packed; B+lever: B with one kernel switch on (flex attention, compiled layers, Liger",
        "  kernels, expandable segments). Tokens are real (non-pad) tokens. MFU: model FLOPs per token (6N full,",
        "  4N + 6N_lora adapters) x tokens/s over the GPU's dense bf16 peak",
        "",
        "| case | side | micro | tokens/s | peak GiB | MFU | loss (last steps) | B over best tuned | s/step: predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, sides, flops in rows:
        tuned = [v.get("tokens_per_second", 0) for k, v in sides.items() if k.startswith("T") and "error" not in v]
        best = max(tuned) if tuned else 0
        for side, result in sides.items():
            if "error" in result or result.get("ok") is False:
                lines.append(f"| {case.name} | {side} | - | failed: {result.get('error')} | | | | | |")
                continue
            tps = result["tokens_per_second"]
            mfu = f"{100 * flops * tps / peak:.1f}%" if peak else "n/a"
            memory = f"{result['peak_bytes'] / 1024**3:.1f}" if result.get("peak_bytes") else "n/a"
            ours = side.startswith("B")
            shown_ratio = f"{tps / best:.2f}x" if ours and best else ""
            predicted = result.get("predicted_step_seconds")
            timing = (f"{predicted:.3f} / {result['measured_step_seconds']:.3f}" if predicted
                      else ("n/a (no GPU peak)" if ours else ""))
            lines.append(f"| {case.name} | {side} | {result['micro_batch']} | {tps:,.0f} | {memory} | {mfu} | "
                         f"{result['last_loss']:.3f} | {shown_ratio} | {timing} |")
    lines += ["", "Targets (issue 14, H100): B >= 1.3x the best tuned TRL baseline on every row with matching losses;",
              "MFU >= 45% for 8B LoRA and >= 40% for 0.5B full; predicted step time within 15%; no OOM at the planned",
              "batch."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
