"""Multi-host on one machine: two processes on loopback (2 CPU devices each, gloo collectives) run
the documented CLI launch; process 0's output equals a single-process, single-device run, and a
checkpoint saved by the two processes loads on one device and generates the same."""
import os
import socket
import subprocess
import sys

import pytest

from tests.server_util import tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
PROMPTS = ["The capital of France is", "One two three four five six seven eight nine ten eleven twelve"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=ROOT, **extra)
    return env


def _without_gloo_lines(stdout: str) -> str:
    """gloo (CPU collectives) prints its connection log ("[Gloo] Rank 0 is connected to 1 peer ranks...")
    to stdout from C++, where its pieces can land on separate lines."""
    return "".join(line for line in stdout.splitlines(keepends=True)
                   if not (line.startswith("[Gloo]") or "peer ranks" in line))


def _atlasjax(command, model, *extra, env):
    tail = ["--max-tokens", "12", *PROMPTS] if command == "generate" else []
    return subprocess.Popen([sys.executable, "-m", "atlasjax", command, "--model", model, *ENGINE_ARGS, *extra, *tail],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _generate(model, *extra, env):
    return _atlasjax("generate", model, *extra, env=env)


def _two_processes(command, model, *extra):
    """The same command on two processes of one loopback coordinator; their (stdout, stderr)."""
    port = _free_port()
    procs = [_atlasjax(command, model, "--tensor-parallel-size", "4", *extra,
                       env=_env(2, ATLASJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ATLASJAX_NUM_PROCESSES="2",
                                ATLASJAX_PROCESS_ID=str(i)))
             for i in range(2)]
    results = []
    for p in procs:
        try:
            results.append(p.communicate(timeout=400))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a multi-host process hung")
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def single_device_output(model_dir):
    single = _generate(model_dir, env=_env(1))
    want, err = single.communicate(timeout=300)
    assert single.returncode == 0, err[-2000:]
    assert want.strip()
    return want


def test_two_processes_tensor_parallel_equal_one_device(model_dir, single_device_output):
    results = _two_processes("generate", model_dir)
    leader_out, follower_out = (_without_gloo_lines(r[0]) for r in results)
    # gloo's C++ connection log shares stdout and can split into stray fragments (a lone "3"), so the
    # answer is looked for as one block rather than as the whole output.
    assert single_device_output in leader_out
    answer_lines = [line for line in single_device_output.splitlines() if line.strip()]
    assert not any(line in follower_out for line in answer_lines)   # only process 0 answers
    assert "steps published" in results[0][1]   # process 0 reports what driving the others cost


def test_two_processes_multi_step_decoding_equal_one_device(model_dir, single_device_output):
    # followers replay the multi-step launches, whose last tokens the next launch gathers
    results = _two_processes("generate", model_dir, "--num-scheduler-steps", "4")
    assert single_device_output in _without_gloo_lines(results[0][0])


def test_two_processes_save_a_checkpoint_that_loads_on_one_device(model_dir, single_device_output, tmp_path):
    # `save` under TP=4 over two processes: both join the gather of the shards, process 0 writes.
    out = str(tmp_path / "saved")
    _two_processes("save", model_dir, out)
    loaded = _generate(out, env=_env(1))
    got, err = loaded.communicate(timeout=300)
    assert loaded.returncode == 0, err[-2000:]
    assert got == single_device_output


def test_process_id_without_count_is_a_clear_error(model_dir):
    p = _generate(model_dir, env=_env(1, ATLASJAX_COORDINATOR_ADDRESS="127.0.0.1:1", ATLASJAX_PROCESS_ID="0"))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "number of processes" in err


def test_follower_exits_when_process_0_dies(model_dir):
    # A follower must not hang when process 0 (which hosts the coordinator) goes away: jax.distributed's
    # agent aborts it as soon as its connection drops, so an orchestrator sees the whole group fail.
    import time
    http = _free_port()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "atlasjax", "serve", "--model", model_dir, *ENGINE_ARGS,
                               "--tensor-parallel-size", "4", "--port", str(http)],
                              env=_env(2, ATLASJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ATLASJAX_NUM_PROCESSES="2",
                                       ATLASJAX_PROCESS_ID=str(i)),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(2)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline:   # process 0 listens once both processes built and warmed the engine
            try:
                socket.create_connection(("127.0.0.1", http), timeout=1).close()
                break
            except OSError:
                assert procs[0].poll() is None and procs[1].poll() is None, "a process exited before serving"
                time.sleep(1)
        else:
            pytest.fail("process 0 never served")
        procs[0].kill()
        t0 = time.time()
        rc = procs[1].wait(timeout=60)
        assert rc != 0 and time.time() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
