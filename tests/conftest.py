"""Shared fixtures (the tiny offline model, the default model when it can be set up) and the
suite's tiers: a test that starts the pipeline's processes is marked `live`, one that compiles
or runs for long `slow` (`./scripts/test --fast` runs neither). The marks are checked, not
trusted: a test without `live` that starts a stage, a server or a script fails, naming it."""

from __future__ import annotations

import atexit
import collections
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tiny_model.py

from tiny_model import build_tiny_llama  # (imports torch only when called)


def _set_up_worker() -> None:
    """Under pytest-xdist (./scripts/test runs a worker per core), a worker and every process
    it starts share one core of their own: a stage sizes its threads by its affinity, so two
    workers' torch threads never contend for the same cores (unpinned, each would run as many
    threads as the machine has cores, and the pair ran up to 10x slower). Before torch is
    imported: OpenMP counts its threads once, from the affinity it starts with. Its runs'
    directories go to a temporary folder of its own, so that a test that checks what its run
    left behind sees no other worker's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
    own = Path(tempfile.gettempdir()) / f"pipeline-tests-{os.getuid()}-{worker}"
    own.mkdir(mode=0o700, exist_ok=True)
    os.environ["TMPDIR"] = os.environ["XDG_RUNTIME_DIR"] = str(own)
    tempfile.tempdir = None  # (gettempdir() reads TMPDIR again)
    atexit.register(_remove_unless_a_run_is_left, own)


def _remove_unless_a_run_is_left(folder: Path) -> None:
    """The worker's temporary folder goes at its exit (Inductor's scratch files included);
    one that still holds a run directory stays, to be seen."""
    if not any(folder.glob("llm-pipeline-*")):
        shutil.rmtree(folder, ignore_errors=True)


_set_up_worker()


@pytest.fixture(scope="session", autouse=True)
def inductor_cache() -> None:
    """Compiled graphs go to the tests' own folder of the pipeline's cache (its stages
    inherit it), never to the user's `inductor/`: the first run compiles each shape cold,
    later runs (and later tests) load it warm. What a compile is asserted to do stays
    honest warm: dynamo traces and calls the backend per graph either way (CompileStats
    counts those); only Inductor's code generation is skipped. Another folder, or a cold
    run, by setting TORCHINDUCTOR_CACHE_DIR."""
    from ipc.cache import cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor-tests"))


# A cold build of the CPU kernels: ~100 s on the idle 2-core test machine. A worker pinned to
# one core compiles the eight sources on it (146 s of compiling one after another, measured),
# close to the executor's BUILD_TIMEOUT_S, past it on a slower or busier machine.
KERNEL_BUILD_TIMEOUT_S = 1200.0
_KERNELS = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The CPU kernels are built once, before any test, by the process that runs the session
    (under pytest-xdist, the controller, on every core, before its workers start): no
    pipeline's start-up in a test pays for the compile, and a slow machine's build is not cut
    short. The workers load the build from the cache. What came of it heads the report."""
    if hasattr(config, "workerinput"):
        return
    from stages.executor import kernels

    why = kernels.load(build_timeout_s=KERNEL_BUILD_TIMEOUT_S)
    arch = os.environ.get(kernels.ARCH_ENV, "native")
    config.stash[_KERNELS] = (f"CPU kernels: built for -march={arch}" if why is None
                              else f"CPU kernels NOT available, their tests skip: {why}")


def pytest_report_header(config: pytest.Config) -> str | None:
    return config.stash.get(_KERNELS, None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gguf_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Path]:
    """The tiny model as a Q8_0 GGUF file (its v projections Q4_0); the folder that
    `--model FILE.gguf` makes of it is removed from the cache afterwards."""
    import shutil

    from pipeline.tools.gguf_export import export
    from pipeline.tools.model_source import gguf_folder_path

    file = export(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0",
                  {"attn_v": "Q4_0"})
    yield file
    shutil.rmtree(gguf_folder_path(file).parent, ignore_errors=True)


@pytest.fixture(scope="session")
def default_q8_0_file(default_model_dir: Path) -> Path:
    """The default model (float32 folder) as a Q8_0 GGUF file by our exporter, kept in the
    cache (`tests/`) per version of its weights and of the exporter: made once (~4 s) and its
    folder once (~12 s: transformers parses the metadata), not in every run."""
    import hashlib
    import os

    import pipeline.tools.gguf_export as gguf_export
    from ipc.cache import cache_dir
    from pipeline.tools.model_source import files_key

    weights = sorted(default_model_dir.glob("*.safetensors"))
    exporter = hashlib.sha256(Path(gguf_export.__file__).read_bytes()).hexdigest()[:12]
    file = (cache_dir() / "tests" /
            f"{default_model_dir.name}-{files_key(weights)[:12]}-{exporter}.Q8_0.gguf")
    if not file.is_file():
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}")
        gguf_export.export(default_model_dir, tmp, "Q8_0")
        tmp.rename(file)
    return file


@pytest.fixture(scope="session")
def tiny_gguf_dir(tiny_gguf_file: Path) -> Path:
    """The folder `--model FILE.gguf` makes of the tiny GGUF file."""
    from pipeline.tools.model_source import resolve_model

    return resolve_model(tiny_gguf_file)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pipeline.tools.model_cache import ModelSetupError, ensure_default_model

    try:
        return ensure_default_model()
    except ModelSetupError as exc:
        pytest.skip(f"default model unavailable: {exc}")


# What the running test started (checked in pytest_runtest_call).
_started: list[str] = []
ROOT = Path(__file__).resolve().parents[1]
_real_mp_start = multiprocessing.process.BaseProcess.start
_real_popen_init = subprocess.Popen.__init__


def _mp_start(self: multiprocessing.process.BaseProcess) -> None:
    _started.append(f"process {self.name}")
    _real_mp_start(self)


def _popen_init(self: subprocess.Popen, args, *rest, **kwargs) -> None:  # noqa: ANN001
    if _ours(args):
        _started.append("command " + " ".join(str(a) for a in _argv(args)[:3]))
    _real_popen_init(self, args, *rest, **kwargs)


def _argv(args: object) -> list[str]:
    return ([str(args)] if isinstance(args, (str, bytes, os.PathLike))
            else [str(a) for a in args])  # type: ignore[union-attr]


OUR_PACKAGES = {"pipeline", "stages", "ipc", "tests"}
INSTALLED = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib")}


def _ours(args: object) -> bool:
    """A command of this project's (a script, or Python running a file or module of ours),
    not a tool (a compiler, openssl, pip, Inductor's compile workers) or a `python -c`
    one-liner."""
    argv = _argv(args)
    if not argv:
        return False
    if argv[0].startswith(str(ROOT / "scripts")):
        return True
    if not Path(argv[0]).name.startswith("python") or len(argv) < 2:
        return False
    if argv[1] == "-m":
        return len(argv) > 2 and argv[2].split(".")[0] in OUR_PACKAGES
    if argv[1].startswith("-m"):
        return argv[1][2:].split(".")[0] in OUR_PACKAGES
    if argv[1].startswith("-"):
        return False
    # A script of a test's own (README examples, workers) is ours; one of an installed
    # package (Inductor's compile workers under torch) is a tool's.
    script = Path(argv[1]).resolve()
    return not any(script.is_relative_to(p) for p in INSTALLED)


multiprocessing.process.BaseProcess.start = _mp_start  # type: ignore[method-assign]
subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]


# The suite's fixtures that start a pipeline or a server: a test that uses one is live.
LIVE_FIXTURES = {"pipe", "pipeline", "server", "namespaces"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
    # The files with the most slow or live tests first (stable otherwise): pytest-xdist hands
    # out whole files in this order, so the longest are not left to run alone at the end.
    heavy: collections.Counter[str] = collections.Counter()
    for item in items:
        heavy[item.path] += (bool(item.get_closest_marker("slow"))
                             + bool(item.get_closest_marker("live")))
    items.sort(key=lambda item: -heavy[item.path])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test (or a fixture of its own, set up just before) that started a process while not
    marked `live` fails: the fast tier must not start the pipeline."""
    result = yield  # (raises if the test failed: then that is its report)
    if _started and item.get_closest_marker("live") is None:
        what = sorted(set(_started))
        pytest.fail(f"started {', '.join(what[:3])} but is not marked live "
                    "(pytest.mark.live: the tier of tests that start processes)",
                    pytrace=False)
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started.clear()


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair (10.213.7.1 and .2), made by this test
    and deleted after it: (namespace A, namespace B, A's address)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    tag = os.getpid() % 100000
    names, made = (f"llmt-a-{tag}", f"llmt-b-{tag}"), []

    def ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if done.returncode:
            if not made[1:]:  # the first steps: this machine does not allow it
                pytest.skip(f"cannot make network namespaces here: {done.stderr.strip()}")
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    try:
        for name in names:
            ip("netns", "add", name)
            made.append(name)
        ip("link", "add", f"lva{tag}", "netns", names[0], "type", "veth", "peer", "name",
           f"lvb{tag}", "netns", names[1])
        for name, dev, address in ((names[0], f"lva{tag}", "10.213.7.1"),
                                   (names[1], f"lvb{tag}", "10.213.7.2")):
            ip("-n", name, "addr", "add", f"{address}/30", "dev", dev)
            ip("-n", name, "link", "set", dev, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield names[0], names[1], "10.213.7.1"
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=20)
