"""Pinning the CPU engine's OpenMP threads (stacx.serving.cpu_threads)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stacx.serving.cpu_threads import parse_core_list

# Run in a child process: a bound thread passes its core to every thread and process it starts later, which
# must not happen to the test session's own process.
BIND_IN_A_THREAD = r"""
import json, os, threading, torch
from stacx.serving.cpu_threads import OpenMpBinding

binding = OpenMpBinding(CORES)
result = {}

def serve_like_a_worker_thread():  # `stacx serve` generates in worker threads, not the main one
    binding.ensure_bound()
    binding.ensure_bound()  # a second call changes nothing
    x = torch.randn(256, 256)
    result["matmul_ok"] = bool(torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3))
    result["threads"] = torch.get_num_threads()
    result["team"] = {str(i): sorted(os.sched_getaffinity(tid)) for i, tid in binding.thread_ids.items()}

worker = threading.Thread(target=serve_like_a_worker_thread)
worker.start()
worker.join()
result["main_thread"] = sorted(os.sched_getaffinity(0))
print(json.dumps(result))
"""


def test_core_lists_parse_in_order_and_bad_ones_name_the_text():
    assert parse_core_list("0-1") == (0, 1)
    assert parse_core_list("3,0,4-5") == (3, 0, 4, 5)
    for bad in ("", "a-b", "1,1", "2-1", "-1"):
        with pytest.raises(ValueError, match="core list"):
            parse_core_list(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two threads needs two cores")
def test_each_openmp_thread_of_the_calling_thread_runs_on_its_own_core():
    cores = sorted(os.sched_getaffinity(0))[:2][::-1]  # reversed: thread 0 on the second core
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", BIND_IN_A_THREAD.replace("CORES", repr(cores))], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["team"] == {"0": [cores[0]], "1": [cores[1]]}
    assert result["threads"] == 2 and result["matmul_ok"]
    assert result["main_thread"] == sorted(os.sched_getaffinity(0))  # only the calling thread's team is bound


def test_cores_outside_the_process_are_refused():
    from stacx.serving.cpu_threads import OpenMpBinding

    with pytest.raises(ValueError, match="not among this process's cores"):
        OpenMpBinding([max(os.sched_getaffinity(0)) + 1])


def test_serve_flag_names_itself_when_the_cores_are_wrong():
    from stacx.launch.commands.serve import parse_bind_cores

    assert parse_bind_cores(None) is None  # the default: not pinned
    assert parse_bind_cores(str(min(os.sched_getaffinity(0)))) == (min(os.sched_getaffinity(0)),)
    with pytest.raises(SystemExit, match="--bind-cores: core list 'zero'"):
        parse_bind_cores("zero")
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit, match=rf"--bind-cores {outside}: cores \[{outside}\] are not among"):
        parse_bind_cores(str(outside))
