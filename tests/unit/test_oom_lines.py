"""The one line of an out-of-memory error (``scaletrain.oom``): what counts as one (torch's, CUDA's and the CPU
allocator's errors, ``MemoryError``), the line's parts and memory numbers, the guard, the CLI's last catch
(exit 71 for an error no stage named, a traceback for anything else) and the failed run's ``failure`` tag.
The stages themselves: tests/integration/test_oom_anywhere.py and test_oom_step.py."""
from __future__ import annotations

import io
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from scaletrain.oom import OOM_EXIT, OutOfMemory, is_oom, memory_summary, oom_guard

CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "3.00 MiB is free.\nOf the allocated memory 77.1 GiB is allocated by PyTorch")


def test_allocation_failures_are_recognised_and_nothing_else():
    try:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator's own error (a RuntimeError)
    except RuntimeError as e:
        cpu = e
    for e in (torch.OutOfMemoryError(CUDA_OOM), RuntimeError("CUDA error: out of memory"), cpu, MemoryError(),
              RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")):
        assert is_oom(e), e
    for e in (RuntimeError("size mismatch"), ValueError("out of memory"), KeyError("x")):
        assert not is_oom(e), e


def test_the_line_is_one_line_in_order_and_an_outer_layer_completes_it():
    e = OutOfMemory("validation at step 4, batch 2", "a batch of 8x30 source\n-> 8x20 target", "lower data.max_tokens",
                    "cuda:0: 1.00 GiB allocated by torch")
    assert str(e) == ("out of memory in validation at step 4, batch 2, a batch of 8x30 source -> 8x20 target: lower "
                      "data.max_tokens [cuda:0: 1.00 GiB allocated by torch]")
    e.after = "the last checkpoint is intact"
    assert str(e).endswith("lower data.max_tokens; the last checkpoint is intact [cuda:0: 1.00 GiB allocated by torch]")
    assert e.exit_code == OOM_EXIT == 71


def test_memory_numbers_on_the_cpu_are_the_process_and_the_machine():
    m = re.fullmatch(r"host: this process holds ([\d.]+) GiB of ([\d.]+) GiB RAM", memory_summary("cpu"))
    assert m and 0 < float(m[1]) < float(m[2]), memory_summary("cpu")
    assert memory_summary().startswith("host: this process holds")  # CUDA not in use: the host's numbers


def test_memory_numbers_on_cuda_are_torchs_and_the_devices(monkeypatch):
    gib = 2**30
    for name, value in (("is_available", True), ("is_initialized", True), ("current_device", 1),
                        ("mem_get_info", (0.5 * gib, 80 * gib)), ("memory_allocated", 70 * gib),
                        ("memory_reserved", 75.25 * gib)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    want = "cuda:1: 70.00 GiB allocated by torch, 75.25 GiB reserved, 0.50 GiB free of 80.00 GiB"
    assert memory_summary("cuda:1") == memory_summary(None) == memory_summary(torch.device("cuda", 1)) == want
    assert memory_summary("cpu").startswith("host: ")  # a CPU stage on a CUDA machine: the host's numbers


def test_the_guard_names_the_stage_and_lets_everything_else_through():
    asked = []

    def what():
        asked.append(1)
        return "a batch of 3 lines"

    with oom_guard("decoding", what, "lower --batch-tokens"):
        pass
    assert not asked  # the description is made only when it is needed
    with pytest.raises(OutOfMemory) as e:
        with oom_guard("decoding", what, "lower --batch-tokens", device="cpu"):
            raise torch.OutOfMemoryError(CUDA_OOM)
    assert str(e.value).startswith("out of memory in decoding, a batch of 3 lines: lower --batch-tokens [host: ")
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)  # --debug shows where
    inner = OutOfMemory("the optimizer step")
    with pytest.raises(OutOfMemory) as e:
        with oom_guard("training"):
            raise inner
    assert e.value is inner  # the innermost guard knows most
    with pytest.raises(RuntimeError, match="size mismatch"):
        with oom_guard("decoding"):
            raise RuntimeError("size mismatch")


def test_cli_prints_an_unnamed_oom_as_one_line_and_other_errors_as_tracebacks(monkeypatch, capsys):
    import scaletrain.checkpoint as ck
    from scaletrain.cli import main

    def load(*a, **kw):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(ck, "load_for_inference", load)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Save changes\n"))
    argv = ["translate", "--checkpoint", "x", "--src-lang", "en", "--tgt-lang", "de", "--threads", "1"]
    assert main(argv) == OOM_EXIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("scaletrain: error: out of memory in scaletrain translate, OutOfMemoryError: CUDA out of "
                          "memory: use a smaller batch setting"), err
    monkeypatch.setattr(ck, "load_for_inference", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(argv)


class TrackerSpy:
    run_id = "r1"

    def __init__(self):
        self.calls = []

    def set_tags(self, tags):
        self.calls.append(("tags", dict(tags)))

    def end(self, status):
        self.calls.append(("end", status))


def test_a_failed_run_ends_failed_with_its_line_as_the_failure_tag(tmp_path):
    from scaletrain.config import load_config
    from scaletrain.train.recorder import RunRecorder

    cfg = load_config("small", ["tracking.enabled=false", f"train.out_dir={tmp_path}"])
    rec = RunRecorder(cfg, SimpleNamespace(is_main=True, world_size=1, rank=0), tmp_path)
    rec.enabled, rec.tracker = True, TrackerSpy()
    rec.close("FAILED", "out of memory in the optimizer step\n after 2 micro-batch(es)")
    assert rec.tracker.calls == [("tags", {"failure": "out of memory in the optimizer step after 2 micro-batch(es)"}),
                                 ("end", "FAILED")]
    rec.tracker = TrackerSpy()
    rec.close("FINISHED")
    assert rec.tracker.calls == [("end", "FINISHED")]
