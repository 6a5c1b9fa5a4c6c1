"""The README's multi-node commands, verbatim, on two hosts made of network namespaces (tests/netns_hosts.py:
each host its own network stack, address, hostname and /etc/hosts; one filesystem, as a cluster's shared
run directory).

Each multi-host run is 2 hosts x 1 rank and must end with weights bitwise equal to one reference run of
the same job on one host with 2 ranks (``./launch.sh --nproc 2``), shared by every case of the module:
the same global batches, the same reductions, only the transport differs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPLAY_DRIVER, ROOT, free_port, launch_checkout, launcher_env, run_launch_sh, tiny_model

pytestmark = pytest.mark.slow
STEPS = 4


def _overrides(shards: Path) -> list[str]:
    return [f"data.shards={shards}", *tiny_model(), "data.max_tokens=400", "data.max_bytes=40",
            f"train.max_steps={STEPS}", "train.log_every=2", "train.valid_every=0", f"train.save_every={STEPS}",
            "optim.warmup_steps=2", "tracking.enabled=false", "engine.precision=fp32",
            "engine.ds_config=zero1.json"]


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    # one thread per rank everywhere: the reference (2 ranks on one host) and the hosts (1 rank each) then
    # run the same kernels, so the weights can be compared bitwise
    env.update(OMP_NUM_THREADS="1", MPLCONFIGDIR=str(tmp / "mpl"), PYTHONUNBUFFERED="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlruns.db")
    return env


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from scaletrain.checkpoint.inference import load_model_weights

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return load_model_weights(ckpt, quiet=True)


def _assert_same_weights(run: Path, ref: dict[str, torch.Tensor]) -> None:
    got = _weights(run)
    assert sorted(got) == sorted(ref)
    differ = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not differ, f"{len(differ)} tensors differ from the 1-host 2-rank run, e.g. {differ[:3]}"


def _run_on_hosts(hosts, cmds: list[list[str]], cwd: Path, env: dict, timeout: float = 300,
                  codes: list[int] | None = None) -> list[str]:
    """Start cmds[i] on hosts[i]; wait for all; return their outputs (all must exit 0, or ``codes[i]``)."""
    procs = [h.popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     start_new_session=True) for h, c in zip(hosts, cmds)]
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outs)):
        want = codes[i] if codes else 0
        assert p.returncode == want, f"host{i} exited {p.returncode}, not {want}:\n{out[-5000:]}"
    return outs


def _reference(shards: Path, tmp: Path, *args: str) -> dict[str, torch.Tensor]:
    out = tmp / "run"
    p = run_launch_sh(["--nproc", "2", "--no-eval", "--out", str(out), "--master_port", str(free_port()), *args,
                       *_overrides(shards)], launch_checkout(tmp), env=_env(tmp), timeout=300)
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-5000:]
    return _weights(out)


@pytest.fixture(scope="module")
def reference(django_shards, tmp_path_factory):
    """The same job on one host with 2 ranks (DeepSpeed engine): its final weights."""
    return _reference(django_shards, tmp_path_factory.mktemp("reference"))




def test_launch_sh_no_ssh_one_launcher_per_host(netns_hosts, reference, django_shards, tmp_path):
    """README: ``./launch.sh ... --hostfile hosts --num_nodes N --no_ssh --node_rank K --master_addr A`` on each
    node (DeepSpeed's launcher); the hostfile names the hosts by name, which each host resolves itself. One
    voice per job: only node 0 prints the end-of-job summary and the commands to try next."""
    hosts = netns_hosts(2)
    checkout = launch_checkout(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h.hostname} slots=1\n" for h in hosts))
    out = tmp_path / "run"
    cmds = [["bash", "./launch.sh", "--nproc", "1", "--no-eval", "--out", str(out), "--no_ssh",
             "--hostfile", str(hostfile), "--num_nodes", "2", "--node_rank", str(k), "--master_addr", hosts[0].addr,
             *_overrides(django_shards)] for k in (0, 1)]
    t0 = time.monotonic()
    outs = _run_on_hosts(list(hosts), cmds, checkout, _env(tmp_path))
    print(f"2 hosts x 1 rank, deepspeed launcher: {time.monotonic() - t0:.1f}s")
    _assert_same_weights(out, reference)
    # one voice per job: host 0 prints the end-of-job summary and the commands to try next, host 1 one line
    node0, node1 = outs
    assert f"trained {STEPS} steps" in node0 and "== next: try these on this run" in node0, node0[-3000:]
    assert "== training took" in node0, node0[-3000:]
    assert "== next" not in node1 and "trained " not in node1 and "== training took" not in node1, node1[-3000:]
    done = [ln for ln in node1.splitlines() if "training done" in ln]
    assert done == [f"== {hosts[1].hostname} (node 1): training done; the summary and the commands to try next "
                    "are on node 0"], node1[-3000:]


def test_torchrun_c10d_rendezvous(netns_hosts, reference, django_shards, tmp_path):
    """README: ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:PORT
    -m scaletrain train ...`` on each node."""
    hosts = netns_hosts(2)
    out = tmp_path / "run"
    torchrun = str(ROOT / ".venv" / "bin" / "torchrun")
    endpoint = f"{hosts[0].addr}:29511"
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "job1", "-m", "scaletrain", "train", "--config", "small", f"train.out_dir={out}",
           *_overrides(django_shards)]
    t0 = time.monotonic()
    _run_on_hosts(list(hosts), [cmd, cmd], ROOT, _env(tmp_path))
    print(f"2 hosts x 1 rank, torchrun c10d: {time.monotonic() - t0:.1f}s")
    _assert_same_weights(out, reference)



def test_launch_sh_engine_accelerate_on_two_hosts(netns_hosts, django_shards, tmp_path_factory):
    """README: ``./launch.sh --engine accelerate`` with ``--num_nodes 2 --node_rank K --master_addr HOST0`` on
    each node (``accelerate launch --num_machines 2 --machine_rank K --main_process_ip HOST0``, plain DDP):
    the final weights are bitwise those of the same job with 2 ranks on one host (``--engine accelerate
    --nproc 2``)."""
    hosts = netns_hosts(2)
    ref = _reference(django_shards, tmp_path_factory.mktemp("reference_accelerate"), "--engine", "accelerate")
    tmp_path = tmp_path_factory.mktemp("accelerate_hosts")
    checkout = launch_checkout(tmp_path)
    out = tmp_path / "run"
    cmds = [["bash", "./launch.sh", "--engine", "accelerate", "--nproc", "1", "--no-eval", "--out", str(out),
             "--num_nodes", "2", "--node_rank", str(k), "--master_addr", hosts[0].addr, "--master_port", "29517",
             *_overrides(django_shards)] for k in (0, 1)]
    t0 = time.monotonic()
    outs = _run_on_hosts(list(hosts), cmds, checkout, _env(tmp_path))
    print(f"2 hosts x 1 rank, accelerate launch: {time.monotonic() - t0:.1f}s")
    assert f"trained {STEPS} steps" in outs[0] and "2 ranks on cpu" in outs[0], outs[0][-3000:]
    _assert_same_weights(out, ref)


def test_own_name_on_127_0_1_1_still_trains(netns_hosts, django_shards, tmp_path):
    """Each host's own name resolves to 127.0.1.1 (Debian's and Ubuntu's default /etc/hosts): without a
    chosen interface gloo advertises 127.0.1.1, the peer is refused and the other host waits for ever. Each
    rank picks the interface that routes to MASTER_ADDR (scaletrain/engine/netif.py) and the job trains."""
    hosts = netns_hosts(2)
    hosts.write_hosts_files(own_name="loopback")
    try:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{h.hostname} slots=1\n" for h in hosts))
        job = [{"name": "lb", "replay": False, "record": False, "overrides": ["train.max_steps=2"]}]
        exe = str(Path(sys.executable).with_name("deepspeed"))
        cmds = [[exe, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k), "--master_addr", hosts[0].addr,
                 "--master_port", "29516", "--no_local_rank", REPLAY_DRIVER, str(tmp_path), str(django_shards),
                 json.dumps(job)] for k in (0, 1)]
        env = launcher_env(tmp_path)
        for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(v, None)
        t0 = time.monotonic()
        _run_on_hosts(list(hosts), cmds, ROOT, env, timeout=120)
        print(f"127.0.1.1 hosts: trained in {time.monotonic() - t0:.1f}s")
        res = [json.loads((tmp_path / "lb" / f"result_rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["world_size"] for r in res] == [2, 2] and res[0]["steps"] == res[1]["steps"] == 2
    finally:
        hosts.write_hosts_files(own_name="self")


def test_a_wrong_interface_stops_both_hosts_within_the_rendezvous_bound(netns_hosts, django_shards, tmp_path):
    """GLOO_SOCKET_IFNAME=lo set by the user on both hosts (an interface the peers cannot reach): without a
    bound host 0 waits in gloo's connect for the whole collective timeout with no line. With
    ``engine.rendezvous_timeout_s`` both hosts stop within it, each with one line naming the host, the
    address it advertised and the variable to set; exit 2 (fix the setting)."""
    hosts = netns_hosts(2)
    checkout = launch_checkout(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h.hostname} slots=1\n" for h in hosts))
    out = tmp_path / "run"
    bound = 10
    cmds = [["bash", "./launch.sh", "--nproc", "1", "--no-eval", "--out", str(out), "--no_ssh",
             "--hostfile", str(hostfile), "--num_nodes", "2", "--node_rank", str(k), "--master_addr", hosts[0].addr,
             *_overrides(django_shards), f"engine.rendezvous_timeout_s={bound}"] for k in (0, 1)]
    env = {**_env(tmp_path), "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    t0 = time.monotonic()
    outs = _run_on_hosts(list(hosts), cmds, checkout, env, timeout=150, codes=[2, 2])
    took = time.monotonic() - t0
    print(f"GLOO_SOCKET_IFNAME=lo on 2 hosts, engine.rendezvous_timeout_s={bound}: both stopped after {took:.1f}s")
    assert took < bound + 60, took  # the launch itself (imports, launcher) takes seconds; the default wait is 10 min
    for h, text in zip(hosts, outs):
        lines = [ln for ln in text.splitlines() if ln.startswith("scaletrain: error:")]
        assert len(lines) == 1, text[-3000:]
        line = lines[0]
        print(line)
        assert f"scaletrain: error: {h.hostname} (rank " in line, line
        assert "it advertises 127.0.0.1 (interface lo, from GLOO_SOCKET_IFNAME)" in line, line
        assert f"the rendezvous at {hosts[0].addr}:" in line and "set GLOO_SOCKET_IFNAME" in line, line
        assert "(here eth0, which routes to MASTER_ADDR)" in line and "Traceback" not in text, line
    assert not (out / "checkpoints").exists()
