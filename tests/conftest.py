"""Test set-up: no network, no writes to the home cache, and helpers to run the real scripts."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# pytest imports this file as "conftest" and the test modules import their helpers from
# "tests.conftest": one module, not two copies with two of everything below (a session folder,
# a zygote)
sys.modules.setdefault("tests.conftest", sys.modules[__name__])

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Set before anything imports transformers, and inherited by every subprocess the tests start. The
# pytest-xdist workers of one run share it (the caches in it are written atomically): data prepared or
# a model planned in one worker is not prepared or planned again in the other.
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    _SESSION_DIR = Path(tempfile.gettempdir()) / f"sft-play-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    _SESSION_DIR.mkdir(exist_ok=True)
else:
    _SESSION_DIR = Path(tempfile.mkdtemp(prefix="sft-play-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(_SESSION_DIR / "hf"),
        "SFT_PLAY_CACHE": str(_SESSION_DIR / "sft_play"),
        "TORCH_EXTENSIONS_DIR": str(_SESSION_DIR / "torch_extensions"),
        # compiled kernels of this run only: a cache left by a run under another vector ISA (the
        # suite under ATEN_CPU_CAPABILITY=avx2 after one without) gave wrong logits and NaN losses
        "TORCHINDUCTOR_CACHE_DIR": str(_SESSION_DIR / "torchinductor"),
        "TOKENIZERS_PARALLELISM": "false",
        # the launchers' ranks are forked from the zygote (tests/shim/sitecustomize.py)
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "shim"),
                                                  os.environ.get("PYTHONPATH", "")) if p),
        "SFT_PLAY_TESTS_ZYGOTE": str(_SESSION_DIR / "zygote-ranks.sock"),
    }
)
# `make test ARGS="tests/test_makefile.py"` exports its command-line variables to every process
# below it (as ARGS=... in the environment and in MAKEFLAGS): the tests' own `make gpu-info` then
# ran with ARGS=tests/test_makefile.py and failed. The targets a test runs take only the variables
# it gives them: none of the Makefile's (`NAME ?= default`) comes from outside.
for _name in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL", "SFT_PLAY_ARGS", "SFT_PLAY_USER_COMMAND",
              *re.findall(r"^([A-Z_]+) \?=", (REPO / "Makefile").read_text(), flags=re.MULTILINE)):
    os.environ.pop(_name, None)
sys.path.insert(0, str(REPO))

from tests import zygote as zygote_module  # noqa: E402 (the repo is importable from here on)

# make test runs the suite in pytest-xdist workers (pyproject's addopts, -n auto --dist loadfile; how
# many: pytest_xdist_auto_num_workers below): a test module runs in one worker, in order, while other
# modules run in the others, so every core is busy when a test is planning in-process or waiting for
# one training process. Each worker computes on its share of the cores, one at least: OpenMP threads of
# several processes spinning on the same cores run several times slower than one thread each (see
# run_scripts_together).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, len(os.sched_getaffinity(0)) // WORKERS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(CORES)  # read by torch here and by every process the tests start
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(CORES)
_BASE_ENV = dict(os.environ)  # what every test starts with (tests/zygote.py is started with it)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """(pytest-xdist, for -n auto) One worker more than the cores, three at most: part of the suite's
    time its tests wait (processes starting, a stopped run's deliberately slow step, ranks meeting),
    and the extra worker computes meanwhile (docs/reports/test_suite.md); each worker holds the
    libraries in memory. PYTEST_XDIST_AUTO_NUM_WORKERS decides where set (pytest-xdist's own)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return min(len(os.sched_getaffinity(0)) + 1, 3)


_SESSION_DIRS = [_SESSION_DIR]  # in the process that ran pytest: its own, and its workers' (added below)
_KEPT: list[str] = []  # those kept after a failure, named in the summary


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, in the controller) The folder a worker shares with the others, named by the run's
    id; and this process, which the session's zygote ends with."""
    _SESSION_DIRS.append(Path(tempfile.gettempdir()) / f"sft-play-tests-{node.workerinput['testrunuid']}")
    node.workerinput["sft_play_session_pid"] = os.getpid()


def pytest_sessionfinish(session, exitstatus):
    """The session's caches, zygote logs and scratch runs (a hundred MB) are removed when every test
    passed; kept, and named in the summary, when one did not."""
    if hasattr(session.config, "workerinput"):
        return
    passed = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    for folder in dict.fromkeys(_SESSION_DIRS):
        if passed or not folder.is_dir() or not any(folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            _KEPT.append(str(folder))


def pytest_terminal_summary(terminalreporter):
    if _KEPT:
        terminalreporter.write_line(f"the session's caches and zygote logs are kept in {', '.join(_KEPT)}")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collect (import the test modules, and with them torch, transformers...) as every command
    imports its libraries (:func:`sft_play.cli.importing`): the collector paused, what was made
    frozen after."""
    from sft_play import cli

    with cli.importing():
        result = yield
    # From here this process runs commands in itself (cli.run through runpy): a freeze there would
    # keep whatever garbage the tests before had left
    cli.FREEZE_IMPORTS = False
    return result


# Modules of few, long tests (real training steps, processes behind one module-wide fixture), which
# pytest-xdist's order (the modules of most tests first) hands out last, where one worker ran them alone
# while the other had finished: first instead (pyproject's --no-loadscope-reorder keeps this order).
# test_distributed's stopped runs sleep half a minute in a step, a core idle unless the other worker
# computes meanwhile: it starts beside the CPU ground truth's profiled steps
LONG_MODULES_FIRST = ("test_distributed.py", "test_cpu_ground_truth.py", "test_preference_distributed.py")


def pytest_collection_modifyitems(config, items):
    """:data:`LONG_MODULES_FIRST` first, then the modules of most tests (pytest-xdist's own order)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def module_rank(item) -> tuple:
        name = item.path.name
        return (LONG_MODULES_FIRST.index(name) if name in LONG_MODULES_FIRST else len(LONG_MODULES_FIRST),
                -counts[name], name)

    items.sort(key=module_rank)  # (stable: a module's tests keep their order)


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test sets in this process's environment (a script run in-process: cli.run sets
    DS_ACCELERATOR and HF_DATASETS_DISABLE_PROGRESS_BARS) ends with it: the next test, and the
    scripts it starts, begin from the same environment."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "configs" / "tiny_model")


class _Forked:
    """A script forked by the zygote (tests/zygote.py), as much of ``subprocess.Popen`` as the
    helpers below use: pid, args, returncode, poll, wait, send_signal, kill."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str]):
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.read(0)
            self.returncode = self._zygote.ended.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote.read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid the system may have given to another process since
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class _Zygote:
    """tests/zygote.py, one for the session: the first pytest process of the session starts it as it
    is configured (its imports, a few CPU-seconds, overlap the collection of the tests), the
    pytest-xdist workers share it, and it ends with the process pytest runs in. Scripts forked from
    it start with torch, transformers, accelerate, peft, TRL and sft_play imported (see there what it
    does and does not share with a fresh interpreter)."""

    SCRIPTS = _SESSION_DIR / "zygote.sock"
    STARTED = _SESSION_DIR / "zygote.pid"

    @classmethod
    def begin(cls) -> None:
        """Start it, unless another process of the session has, without waiting for its imports."""
        import fcntl

        with open(_SESSION_DIR / "zygote.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if cls.STARTED.exists():
                return
            with open(_SESSION_DIR / "zygote.log", "a") as log:
                process = subprocess.Popen([sys.executable, str(REPO / "tests" / "zygote.py"), str(cls.SCRIPTS),
                                            str(_SESSION_PID[0])], cwd=REPO, env=_BASE_ENV, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=log)
            cls.STARTED.write_text(str(process.pid))
            _ZYGOTE_PROCESS.append(process)

    def __init__(self):
        import json

        self._json = json
        # not what a test has set at the moment it is started; the zygote's is another worker's where
        # it started it, which differs only in the worker's name (tests.zygote.READ_AT_RUN_TIME)
        self.env = _BASE_ENV
        self.ended: dict[int, int] = {}
        self._messages: list[dict] = []
        self._buffer = b""
        self.begin()  # (where the session's configuration did not)
        self.connection = self._connected()

    def _connected(self):
        """A connection to it, once it listens (after its imports)."""
        import socket
        import time

        import psutil

        pid = int(self.STARTED.read_text())
        deadline = time.monotonic() + 300
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(str(self.SCRIPTS))
                return connection
            except OSError:
                connection.close()
            try:
                ended = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                ended = True
            if ended:
                raise RuntimeError(f"the test zygote ended before it was ready (see {_SESSION_DIR}/zygote.log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote was not ready in 5 minutes (see {_SESSION_DIR}/zygote.log)")
            time.sleep(0.05)

    def read(self, timeout: float | None) -> None:
        """Take what the zygote has said (waiting up to `timeout` seconds for something)."""
        import select

        readable, _, _ = select.select([self.connection], [], [], timeout)
        if not readable:
            return
        chunk = self.connection.recv(65536)
        if not chunk:
            raise RuntimeError(f"the test zygote ended (see {_SESSION_DIR}/zygote.log)")
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = self._json.loads(line)
            if "ended" in message:
                self.ended[message["ended"]] = message["returncode"]
            else:
                # a pid given again (after a script that was killed, never waited for, had it): its
                # ended record is the earlier script's
                self.ended.pop(message.get("pid"), None)
                self._messages.append(message)

    def _next(self, timeout: float) -> dict:
        import time

        deadline = time.monotonic() + timeout
        while not self._messages:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the test zygote did not answer")
            self.read(left)
        return self._messages.pop(0)

    def close(self) -> None:
        """This process's connection (the zygote serves the others; a fork of this process's that is
        still running goes on)."""
        self.connection.close()

    def differing(self, env: dict) -> list[str]:
        """What `env` sets otherwise than the zygote's environment, beyond what the libraries read
        when a script runs (:data:`tests.zygote.READ_AT_RUN_TIME`): a script with it is not forked from here."""
        return zygote_module.differing(env, self.env)

    def start(self, args: list[str], env: dict, stdout: str, stderr: str) -> _Forked:
        request = {"argv": args[1:], "env": env, "cwd": str(REPO), "stdout": stdout, "stderr": stderr}
        self.connection.sendall((self._json.dumps(request) + "\n").encode())
        answer = self._next(60)
        if "pid" not in answer:
            raise RuntimeError(f"the test zygote could not fork: {answer.get('error')}")
        return _Forked(self, answer["pid"], args)


_ZYGOTE: list = []  # [the zygote] once connected, [None] where it could not start or is not wanted
# (kept, never waited for, where it was started: an ended zygote stays a zombie, its pid not given to
# another process while this one lives, and _Zygote._connected sees it ended)
_ZYGOTE_PROCESS: list = []
# the process pytest runs in, which the zygote ends with: pytest-xdist's controller (tells its workers,
# pytest_configure_node) or, without workers, this one
_SESSION_PID = [os.getpid()]
# fork after importing torch: Linux only (macOS's system libraries are not fork-safe)
ZYGOTE_WANTED = os.environ.get("SFT_PLAY_TESTS_FRESH") != "1" and sys.platform.startswith("linux")


def _zygote() -> _Zygote | None:
    if not _ZYGOTE:
        _ZYGOTE.append(None)
        if ZYGOTE_WANTED:
            try:
                zygote = _Zygote()
                _ZYGOTE[0] = zygote
                import atexit

                atexit.register(zygote.close)
            except (OSError, RuntimeError, ValueError) as exc:
                import warnings

                warnings.warn(f"scripts start as fresh interpreters: the test zygote did not start ({exc})")
    return _ZYGOTE[0]


def pytest_configure(config):
    """The zygote starts while the tests are collected, in a process that runs them: a pytest-xdist
    worker, or pytest's own where it distributes none (as pytest-xdist decides: a distribution mode
    and workers to run it)."""
    if hasattr(config, "workerinput"):
        _SESSION_PID[0] = config.workerinput.get("sft_play_session_pid", os.getppid())
    elif config.getoption("dist", "no") != "no" and config.getoption("tx", None):
        return
    if ZYGOTE_WANTED and not config.option.collectonly:
        try:
            _Zygote.begin()
        except OSError:  # (said, and the scripts started fresh, where a test first asks for it: _zygote)
            pass


@pytest.fixture(scope="session", autouse=True)
def _zygote_started():
    """Waited for with the session, not on first use: the ranks of a make target a test starts ask
    it for their forks too (tests/shim/sitecustomize.py)."""
    _zygote()


def start_script(args: list[str], env: dict, stdout, stderr):
    """Start ``python SCRIPT ARGS`` (`args`, from the repo root, output to the open files `stdout`
    and `stderr`): forked from the zygote where its environment allows (tests/zygote.py), else a
    fresh interpreter. ``SFT_PLAY_TESTS_FRESH=1`` starts every one fresh."""
    zygote = _zygote()
    if zygote is not None and not zygote.differing(env):
        try:
            return zygote.start(args, env, stdout.name, stderr.name)
        except (OSError, RuntimeError, TimeoutError) as exc:  # it ended or stopped answering: fresh from now on
            import warnings

            warnings.warn(f"scripts start as fresh interpreters from here: the test zygote failed ({exc})")
            _ZYGOTE[0] = None
            zygote.close()
            zygote = None
    if zygote is not None:  # which scripts start fresh, and why: the session folder's fresh.log
        with open(_SESSION_DIR / "fresh.log", "a") as log:
            log.write(f"{' '.join(args[1:3])}: {zygote.differing(env)}\n")
    return subprocess.Popen(args, cwd=REPO, stdout=stdout, stderr=stderr, text=True, env=env)


# In the environment of a script a test starts itself: forked from the zygote, its stand-in the
# process the test holds (tests/shim/sitecustomize.py says for which tests)
FORKED = {"SFT_PLAY_TESTS_FORK": "1"}


def with_forks(processes: list) -> list:
    """`processes` (``psutil.Process``) and, for each stand-in among them, its fork from the zygote
    (tests/shim/sitecustomize.py) with the fork's own descendants, and theirs in turn (a forked
    launcher's ranks are stand-ins too): the process tree a launch would have, `processes` first,
    then what was found, level by level."""
    import psutil

    found, seen, waiting = list(processes), {p.pid for p in processes}, list(processes)
    while waiting:
        process = waiting.pop(0)
        try:
            fork = psutil.Process(int((_SESSION_DIR / "stand-ins" / str(process.pid)).read_text()))
            more = [fork, *fork.children(recursive=True)]
        except (OSError, ValueError, psutil.Error):
            continue
        more = [p for p in more if p.pid not in seen]
        seen.update(p.pid for p in more)
        found += more
        waiting += more
    return found


def run_script(script: str, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run one of scripts/ with this interpreter from the repo root; output captured as text."""
    return run_scripts_together((script, *args, env or {}), timeout=timeout)[0]


def run_scripts_together(*commands: tuple, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Run several of scripts/ (or ``bench/x.py``) at once, each ``(script, *args)`` or ``(script, *args, {env})``,
    and return their finished processes in order, output captured as text.

    Independent processes of a test module overlap their start-up (imports, single-threaded) on
    the machine's cores; each is forked from the zygote where it can be (:func:`start_script`).
    Each computes on its share of the cores
    (``OMP_NUM_THREADS``): OpenMP threads of several processes spinning on the same two cores
    run several times slower than the same work one process after another (measured: two tiny
    trainings at once took 69 s with two threads each, 8 s with one, 15 s one after the other).
    No more of them compute at once than this worker's cores and one more (a launch counts its
    ranks), the next started as one ends: eleven processes of one module at once on two cores
    starved the other worker's test and cost more CPU in all (docs/reports/test_suite.md).
    Output goes to files, not pipes: a process blocked on a full pipe while it holds the data
    cache's lock would stall the others."""
    import contextlib
    import time

    at_once = max(2, CORES + 1)  # (one more: a process starting or writing while the others compute)
    threads = str(max(1, CORES // min(len(commands), at_once)))
    folder = Path(tempfile.mkdtemp(prefix="together-", dir=_SESSION_DIR))
    deadline = time.monotonic() + timeout  # one deadline for them all
    with contextlib.ExitStack() as stack:
        started: list = [None] * len(commands)
        running: dict[int, int] = {}  # command's index: the processes it computes in
        for i, command in enumerate(commands):
            env = command[-1] if isinstance(command[-1], dict) else {}
            script, *args = command[:-1] if isinstance(command[-1], dict) else command
            weight = int(args[args.index("--num-gpus") + 1]) if "--num-gpus" in args else 1
            while running and sum(running.values()) + weight > at_once:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(script, timeout)
                for j in [j for j in running if started[j][0].poll() is not None]:
                    del running[j]
                time.sleep(0.05)
            out, err = (stack.enter_context(open(folder / f"{i}.{kind}", "w+")) for kind in ("out", "err"))
            path = REPO / script if "/" in script else REPO / "scripts" / script  # bench/x.py, or one of scripts/
            environment = {**os.environ, "OMP_NUM_THREADS": threads, **env}
            process = start_script([sys.executable, str(path), *args], environment, out, err)
            stack.callback(lambda p=process: p.poll() is None and p.kill())  # none outlives a failure or a timeout
            started[i] = (process, [sys.executable, script, *args], out, err)
            running[i] = weight
        finished = []
        for process, args, out, err in started:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
            out.seek(0), err.seek(0)
            finished.append(subprocess.CompletedProcess(args, process.returncode, out.read(), err.read()))
    return finished


def printed_answers(stdout: str) -> list[str]:
    """The trained model's answers, as generate.py prints them (``after:     'answer'``)."""
    import ast

    return [ast.literal_eval(line.split(":", 1)[1].strip()) for line in stdout.splitlines() if line.startswith("after:")]


# What the tests' runs pin, so that a test means the same on every machine: the global batch of 8
# their splits are written for (make train's recipe uses more rows a step), and fp32, where
# train.mixed_precision=auto would train in bf16 on a CPU with native bf16 and in fp32 elsewhere.
# And LoRA at lr 3e-3, what they were written for: the embedded default was LoRA until make train
# became full fine-tuning (configs/run_tiny.yaml), and most of what they check (adapters saved,
# resumed, merged, poisoned) is the path most users take.
# Rows of 64 tokens, a quarter of the recipe's: a step's cost is its tokens, what the tests check (resumes,
# ranks, saves, losses falling) does not depend on the row's length, and the longest example of the tiny
# data is 62 tokens, so none is cut (make data-stats ARGS=data.max_seq_length=64).
# A test that needs another precision or method says so in its own overrides (later overrides win).
LORA = ("finetune.method=lora", "train.learning_rate=3e-3")
ROW_TOKENS = 64
# One tokenising process: the suite's workers already share the cores, and a pool per
# preparation only competes with them (tests/test_data_golden.py pins that any number gives the same rows)
PINNED = ("train.global_batch_size=8", "train.mixed_precision=no", "data.num_proc=1", f"data.max_seq_length={ROW_TOKENS}",
          *LORA)


# Real runs of the embedded default through the entry script, shared by the tests that look at
# what a run writes: (run folder, the finished process). The three start together on first use
# (run_scripts_together).
SHARED_RUNS = {
    # ACCELERATE_MIXED_PRECISION=bf16 is what `accelerate launch` exports from a config that says bf16:
    # the run still trains as planned, in fp32 (tests/test_one_decision.py)
    "lora": (("train.max_steps=24", "train.logging_steps=4",
              "train.micro_batch_size=8"),  # not the CPU plan's choice, which follows the RAM free
             {"ACCELERATE_MIXED_PRECISION": "bf16"}),
    # the shared full fine-tuning run's settings (with PINNED): test_fsdp2 trains them under FSDP2 too
    "full": (("finetune.method=full", "train.max_steps=3", "train.logging_steps=1", "train.learning_rate=1e-3",
              "planner.calibrate=true"), {}),
    "qlora": (("finetune.method=qlora", "train.max_steps=3", "train.logging_steps=1"), {}),
}
TINY_FULL = SHARED_RUNS["full"][0]


def built_once(tmp_path_factory, name: str, build) -> tuple[list[subprocess.CompletedProcess], Path]:
    """The processes `build(folder)` ran for a session fixture, and the folder, run once for all pytest-xdist workers:
    the first worker to ask runs them in a folder of the session's shared base directory, under a
    lock; the others wait for the lock and read the same folder and the same finished processes."""
    if WORKERS == 1:
        folder = tmp_path_factory.mktemp(name)
        return build(folder), folder
    import json

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp().parent
    folder, record = base / name, base / f"{name}.json"
    with FileLock(str(base / f"{name}.lock")):
        if not record.exists():
            folder.mkdir(exist_ok=True)
            results = build(folder)
            record.write_text(json.dumps([[r.args, r.returncode, r.stdout, r.stderr] for r in results]))
        return [subprocess.CompletedProcess(*row) for row in json.loads(record.read_text())], folder


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Path]:
    """The tiny vision-language models of tests/vlm_models.py (Gemma-3's, LLaVA's and Idefics3's
    shapes), built once."""
    from tests import vlm_models

    root = tmp_path_factory.mktemp("vlms")
    return {name: build(root / name) for name, build in vlm_models.BUILDERS.items()}


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    def build(root):
        return run_scripts_together(*[
            ("train_distributed.py", "--config", "configs/run_tiny.yaml", f"train.output_dir={root}",
             f"train.run_name={name}", *PINNED, *overrides, env) for name, (overrides, env) in SHARED_RUNS.items()])

    results, root = built_once(tmp_path_factory, "shared", build)
    runs = {}
    for name, result in zip(SHARED_RUNS, results):
        assert result.returncode == 0, f"{name}:\n" + result.stdout[-3000:] + result.stderr[-5000:]
        runs[name] = (root / name, result)
    return runs


@pytest.fixture(scope="session")
def tiny_lora_run(shared_runs):
    return shared_runs["lora"]


@pytest.fixture(scope="session")
def tiny_full_run(shared_runs):
    return shared_runs["full"]


@pytest.fixture(scope="session")
def tiny_qlora_run(shared_runs):
    return shared_runs["qlora"]


def tiny_trainer_factory(tmp_path: Path, callbacks, *overrides: str):
    """The trainer factory the entry script builds, for the tiny default on the CPU, with extra
    `callbacks`: for tests that drive training in this process (injected faults)."""
    from sft_play import config as config_module
    from sft_play import data, model, training
    from sft_play.data import collate
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        "train.max_steps=4", "train.logging_steps=1", f"train.output_dir={tmp_path}", "train.tensorboard=false", *PINNED,
        *overrides,
    ])
    tokenizer = model.load_tokenizer(config)
    bundle = data.build(config.data, tokenizer, seed=config.train.seed)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1, data_stats=bundle.stats)
    base = model.load_model(config, run, device="cpu")
    collator = collate.make_collator(tokenizer.pad_token_id, run.kernels.collator)
    make = training.trainer_factory(config, run, tmp_path, base, tokenizer, bundle.train, None, collator, callbacks)
    make.run = run  # the resolved run; tests train it at a batch split: train_with_backoff(make, split)
    return make


def with_parallel(run, strategy: str | None = None, **changes):
    """`run` with its parallelism changed: ``strategy`` by name."""
    from sft_play.parallelism import Strategy

    if strategy is not None:
        changes["strategy"] = Strategy(strategy)
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, **changes))


def with_kernels(run, **changes):
    """`run` with its kernels changed."""
    return dataclasses.replace(run, kernels=dataclasses.replace(run.kernels, **changes))


def bare_run(method: str, weights_dtype: str = "float32", mixed: str = "bf16", optimizer: str = "adamw_torch",
             adapter_dtype: str = "float32", **fields):
    """A run with only what the planner's memory terms read, for terms worked out by hand."""
    from sft_play.parallelism import Parallelism
    from sft_play.precision import Precision
    from sft_play.run import Kernels, Run, SequenceLength

    return Run(method=method, precision=Precision(mixed, weights_dtype), adapter_dtype=adapter_dtype,
               optimizer=optimizer, kernels=Kernels("sdpa", "padded"), uniform_rows=False, parallel=Parallelism(),
               on_cuda=True, gradient_checkpointing=False, sequence=SequenceLength(1, "by hand"), model="by hand",
               **fields)
