"""Plan a run before any weight loads: exact model sizes, the per-GPU memory breakdown, and the
micro-batch and accumulation that reach the global batch without running out of memory.

Without --gpus/--vram-gib the detected GPUs are used; on a machine without a GPU, the run
`make train` would take there (one CPU process, host memory), as training plans it. With a
tokenizer and readable data the real sequence lengths are used.

Usage: python scripts/plan.py --config PATH [key=value ...] [--gpus N] [--vram-gib G] [--json] [--plot PATH]
"""

from __future__ import annotations

import contextlib
import sys

from sft_play import cli, lean_imports


def read_data_stats(config):
    """The data's statistics, or None (with the reason) when there is no tokenizer or data to read."""
    from sft_play import data

    source = config.model.tokenizer_name_or_path or config.model.name_or_path
    remembered = data.remembered_stats_for_run(config, source)
    if remembered is not None:  # measured before (make train, make plan): no tokenizer to load
        return remembered, None
    with cli.importing():
        from sft_play import checks, model
    from sft_play.data.formats import InvalidRow
    from sft_play.errors import UserError

    try:
        checks.ensure_positions(config)  # before packing sizes its rows by data.max_seq_length
    except UserError as exc:
        return None, f"data not read: {exc}"
    try:
        tokenizer = model.load_tokenizer(config)
    except (OSError, ValueError, UserError) as exc:
        return None, f"no tokenizer at {source} ({exc})"
    try:
        processor = model.load_processor(config, tokenizer)  # a vision-language model's: images count as tokens
    except UserError as exc:
        return None, f"data not read: {exc}"
    try:
        return data.build_for_run(config, tokenizer, processor).stats, None
    except (InvalidRow, OSError, ValueError) as exc:
        return None, f"data not read: {exc}"


def main() -> int:
    parser = cli.config_parser(cli.summary(__doc__))
    parser.add_argument("--gpus", type=cli.number(int, "NUM_GPUS"),
                        help="GPUs to plan for, all nodes together (default: the visible ones)")
    parser.add_argument("--vram-gib", type=cli.number(float, "VRAM_GIB"), help="free memory per GPU to plan for, in GiB")
    parser.add_argument("--nodes", type=cli.number(int, "NNODES"), help="nodes of --gpus GPUs each (as make train-distributed reads "
                        "NNODES and NUM_GPUS); without it --gpus counts all GPUs, 8 to a node")
    parser.add_argument("--gpu-model", help="the GPU model to time the plan for (H100, A100, L40S...; default: "
                        "the detected GPU, or the one --vram-gib most often means); on a machine without a GPU, "
                        "without --vram-gib, the GPU planned for, with the memory it is sold with")
    parser.add_argument("--host-gib", type=cli.number(float, "HOST_GIB"),
                        help="host memory per node to plan offload against, in GiB (default: this machine's available "
                        "memory where its GPUs are planned; unchecked for hardware described)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--plot", help="write the per-GPU memory picture to this image file")
    parser.add_argument("--no-data", action="store_true", help="do not read the data; assume data.max_seq_length")
    parser.add_argument("--longest", action="store_true", help="answer instead: the longest rows that fit, and with "
                        "which settings (on one GPU and on the GPUs planned for)")
    args = parser.parse_args()
    cli.setup_logging(quiet=args.json)
    lean_imports.without_bitsandbytes()  # planning never runs its kernels

    with cli.importing():
        from sft_play import config as config_module
        from sft_play import hardware, planner
        from sft_play.planner import progress
        from sft_play.planner.present import report

    # Described hardware (--vram-gib) is not this machine: a setting that needs a package this
    # machine lacks (flash-attn, liger-kernel) still plans; training there checks for it
    config = config_module.load(args.config, args.overrides, check_packages=args.vram_gib is None)
    config, stand_in = config_module.as_built(config)
    if stand_in:
        print(f"note: {stand_in}", file=sys.stderr)
    facts = hardware.detect()
    # Nothing described and no GPU here: the CPU run make train takes on this machine
    on_this_cpu = not facts.gpus and args.gpus is None and args.vram_gib is None and args.gpu_model is None
    try:
        target = planner.target_for(facts, args.gpus, args.vram_gib, gpu_model=args.gpu_model, allow_cpu=on_this_cpu,
                                    nodes=args.nodes)
    except ValueError as exc:
        raise cli.UserError(str(exc)) from None
    if args.host_gib is not None:
        if args.host_gib <= 0:
            raise cli.UserError(f"HOST_GIB={args.host_gib:g}: the host memory must be positive")
        target.host_bytes = int(args.host_gib * (1 << 30))
    if args.plot:
        try:
            args.plot = report.plot_path(args.plot)
        except ValueError as exc:
            raise cli.UserError(str(exc)) from None
    # what a long plan is on, said on stderr as it goes (not under --json: one document)
    saying = contextlib.nullcontext() if args.json else progress.reporting()
    if args.longest:
        with saying:
            return longest(config, target, args)
    stats, why = (None, "--no-data") if args.no_data else read_data_stats(config)
    # The model's code is imported only where the planner has not kept what it learns from it
    # (sft_play.planner.simulate.cache): a model planned before plans without it
    with saying:
        plan = planner.make_plan(config, target, stats)
    if why:
        plan.notes.append(f"sequence length from the config: {why}")
    if on_this_cpu:
        plan.notes.append("no CUDA GPU here: this is the CPU run make train takes on this machine; "
                          "NUM_GPUS=8 VRAM_GIB=80 plans GPUs you do not have")
    if args.plot:
        try:
            plan.notes.append(f"picture written to {report.plot(plan, args.plot)}")
        except (OSError, RuntimeError) as exc:  # (the plan is still said)
            said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
            plan.notes.append(f"the picture could not be written to {args.plot}: {said}")
    print(report.to_json(plan, args.config, args.overrides, described(args)) if args.json
          else report.to_text(plan, args.config, args.overrides, described(args)))
    return 0 if plan.fits else 3


def described(args) -> str:
    """The make variables that described the hardware planned for, other than its GPUs' number
    (which a remedy may change): what a ``make plan`` beside a remedy needs to plan the same."""
    import shlex

    parts = [f"VRAM_GIB={args.vram_gib:g}" if args.vram_gib is not None else "",
             f"GPU_MODEL={shlex.quote(args.gpu_model)}" if args.gpu_model else "",
             f"HOST_GIB={args.host_gib:g}" if args.host_gib is not None else ""]
    return " ".join(part for part in parts if part)


def longest(config, target, args) -> int:
    """``make plan LONGEST=1``: the longest rows on one GPU and on the GPUs planned for (rows of one
    example filling each row, as packing makes them; the data is not read)."""
    import dataclasses
    import json

    from sft_play.planner import WITHOUT_REMEDIES, make_plan, model_shape, progress
    from sft_play.planner.choose import longest as question
    from sft_play.planner.plan import largest_split
    from sft_play.planner.simulate.predict import side_by_side

    shape = model_shape(config)
    targets = [target] if target.world_size == 1 else [dataclasses.replace(target, world_size=1), target]

    def answered(each):
        return question.longest_rows(config, each, lambda c, t: make_plan(c, t, None, options=WITHOUT_REMEDIES),
                                     shape.max_positions, args.config, tuple(args.overrides),
                                     split=largest_split(config, each, shape))

    report = []
    # (the targets planned side by side on a machine with the cores: the same answers)
    for each, answers in zip(targets, side_by_side([lambda each=each: answered(each) for each in targets])):
        report.append({"gpus": each.world_size, "device": each.device_name, "answers": answers})
        if not args.json:
            progress.clear()  # the progress line, written in place on a terminal
            print("\n".join(question.describe(answers, each, shape.max_positions, args.config, tuple(args.overrides),
                                              described(args))) + "\n")
    if args.json:
        print(json.dumps({"longest": report}, indent=2))
    return 0


if __name__ == "__main__":
    cli.run(main)
