"""How a command starts: its libraries are imported with Python's garbage collector paused, and
what they made is frozen (sft_play.cli.importing)."""

from __future__ import annotations

import gc
import subprocess
import sys

from sft_play import cli
from tests.conftest import REPO


def test_imports_are_made_without_collections_and_frozen_after():
    frozen, collections = gc.get_freeze_count(), []

    def count(phase, info):
        collections.append(info["generation"]) if phase == "start" else None

    gc.callbacks.append(count)
    try:
        with cli.importing():
            assert not gc.isenabled()
            made = [[index] for index in range(50_000)]  # ~70 young collections' worth, were it collecting
            with cli.importing():  # nested: the outermost freezes
                pass
            assert gc.get_freeze_count() == frozen and not gc.isenabled()
        assert collections == []
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.callbacks.remove(count)


def test_where_the_collector_was_off_it_stays_off_and_nothing_is_frozen():
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        with cli.importing():
            made = [[index] for index in range(1_000)]
        assert not gc.isenabled() and gc.get_freeze_count() == frozen and made
    finally:
        gc.enable()


def test_a_command_imports_torch_frozen_and_collects_after():
    # cli.run imports torch (quiet_libraries) before the command's main
    probe = ("import gc\nfrom sft_play import cli\n"
             "def main():\n    print(gc.isenabled(), gc.get_freeze_count())\n"
             "cli.run(main)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    enabled, frozen = result.stdout.split()
    assert enabled == "True" and int(frozen) > 100_000, result.stdout

