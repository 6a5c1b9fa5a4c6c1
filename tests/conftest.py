"""Fixtures shared by tests/unit and tests/integration; shared functions and constants are in helpers.py."""
import os
from pathlib import Path

import pytest

from helpers import ROOT, TEST_LANGS

# engine.precision=auto (the default) resolves to fp32 in tests, on every kind of CPU; subprocesses inherit it.
os.environ["SCALETRAIN_AUTO_PRECISION"] = "fp32"

# What a user's checkout holds after `./launch.sh` (the bundled corpus, runs, the MLflow store) and other
# generated files (.gitignore): the suite must neither depend on them nor change them.
USER_STATE = ("shards", "runs", "mlruns", "mlruns.db", "mlartifacts", "results", "wheels", "gpu_step_out")
CACHES = {".pytest_cache", "__pycache__", ".hypothesis"}

# Test files whose launched jobs take longest (measured on 2 cores, slowest first). ./test.sh hands whole files
# to two pytest-xdist workers in collection order: these go first so that no long file starts last and runs
# alone at the end. A file missing here only runs later; a name here that is no file is refused below.
LONGEST_FIRST = (
    "test_multi_host", "test_resume_any_layout", "test_elastic_restart", "test_slurm_script", "test_expert_parallel", "test_lost_peer",
    "test_compile_variants", "test_checkpoint_resume", "test_checkpoint_safe_loading",
    "test_gpu_check_cpu", "test_tracking_outage", "test_engine_equivalence", "test_compare_models", "test_system_metrics",
    "test_nonfinite_two_ranks", "test_compile_engines", "test_rank_crash", "test_learning",
    "test_lost_host", "test_launch_quiet_start", "test_bootstrap", "test_moe_ep_eval",
)


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration gets the ``integration`` mark (``./test.sh --quick`` leaves those
    out but the ``quick`` one); files are ordered LONGEST_FIRST, the rest in pytest's order."""
    names = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    unknown = sorted(set(LONGEST_FIRST) - names)
    assert not unknown, f"tests/conftest.py LONGEST_FIRST names no test file: {unknown}"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))  # stable: files stay whole


def _checkout_state() -> dict:
    """The repository's top-level names and every file under USER_STATE with its size and mtime."""
    state = {"top level": sorted(p.name for p in ROOT.iterdir() if p.name not in CACHES)}
    for name in USER_STATE:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for f in files:
            try:
                st = f.lstat()
            except OSError:
                continue
            state[str(f.relative_to(ROOT))] = (st.st_size, st.st_mtime_ns)
    return state


@pytest.fixture(scope="session", autouse=True)
def checkout_untouched(tmp_path_factory):
    """Every test works in temporary directories: the checkout the suite runs in (after `./launch.sh`, a
    clone of a clone, a second run) is the same at the end as at the start, and no test logs to the
    MLflow store of the user's environment (MLFLOW_TRACKING_URI: a store of this session instead; tests of
    the default store remove it)."""
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"
    before = _checkout_state()
    yield
    after = _checkout_state()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the suite changed the checkout it runs in ({ROOT}): {changed[:20]}"


@pytest.fixture(scope="session")
def django_shards(tmp_path_factory) -> Path:
    from scaletrain.prepare import prepare_gettext

    out = tmp_path_factory.mktemp("shards") / "django5"
    prepare_gettext(package="django", langs=TEST_LANGS, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def in_process_training():
    """For modules that run Trainers in the test process: they share one gloo group of one (DeepSpeed
    caches it); remove it, and DeepSpeed's cached backend, when the module is done so later tests start
    without a process group. Use as ``pytestmark = pytest.mark.usefixtures("in_process_training")``."""
    yield
    from scaletrain.engine.shutdown import release_process_groups

    # DeepSpeed's cached backend and groups belong to the old world. The dropped groups are freed now, in
    # this process: left to a later garbage collection, a gloo group's destructor can run in a forked child
    # (whose gloo threads do not exist) and hang it.
    release_process_groups()


@pytest.fixture
def isolated_env():
    """Training in this process sets the launcher's environment variables: restore them afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps one process-wide state (mixed precision, the DeepSpeed plugin) that a second Accelerator
    with other settings refuses: a test training through Accelerate in this process starts and ends without it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def netns_hosts():
    """A factory of namespace hosts (tests/netns_hosts.py) for this module: ``netns_hosts(n)`` makes ``n``
    hosts joined by a bridge, once per module and ``n`` (later calls return the same set); everything is
    removed when the module ends. Where namespaces cannot be made (not root), the test skips with the
    reason, except under CI (``CI=true``), where it fails: CI runs as root and must run these tests."""
    import netns_hosts as nh

    reason = nh.unavailable_reason()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    sets: dict[int, "nh.HostSet"] = {}

    def make(n: int = 2):
        if n not in sets:
            sets[n] = nh.make_hosts(n)
        return sets[n]

    yield make
    for s in sets.values():
        s.close()
