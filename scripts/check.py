"""Pre-flight check: the config, Python and packages (and the libraries' patches), CUDA/NCCL, the data, the output folder and
the disk, as a pass/fail list. Exits 1 when anything fails.

Usage: python scripts/check.py [--config PATH] [key=value ...]
"""

from __future__ import annotations


from sft_play import cli


def main() -> int:
    args = cli.config_parser(cli.summary(__doc__)).parse_args()

    with cli.importing():
        from sft_play import checks, hardware

    config, config_check = checks.check_config(args.config, args.overrides)
    results = [config_check, checks.check_python(), *checks.check_packages(config), *checks.check_patches()]
    facts = hardware.detect()
    results.append(checks.check_accelerator(facts))
    if config is not None:
        results.append(checks.check_precision(config, facts))
        results += checks.check_model(config)
        results += checks.check_data(config)
        results.append(checks.check_output_dir(config))
        results += checks.run_checks(config, facts)
    for result in results:
        print(result.line())
    failed = [r for r in results if not r.ok]
    warned = [r for r in results if r.ok and r.warning]
    print(f"\n{len(results) - len(failed) - len(warned)} passed, " + (f"{len(warned)} warning(s), " if warned else "")
          + f"{len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
