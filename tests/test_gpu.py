"""The GPU path, on a real GPU (skipped where there is none: CI and this kit's CPU machines).

Each test that needs a clean parent (CUDA untouched) runs its parent in a fresh interpreter: a
monkeypatched predicate cannot catch the bugs these guard against.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, cli_env
from ddpkit import runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(runtime.gpu_count() == 0, reason="needs a CUDA GPU")]


def python(code: str, tmp_path, timeout: float = 180) -> subprocess.CompletedProcess:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=cli_env(PYTHONPATH=f"{tmp_path}:{REPO}"))


def test_counting_gpus_leaves_cuda_untouched_so_notebook_ranks_can_fork(tmp_path):
    proc = python("""
        import torch, ddpkit
        from ddpkit import runtime
        from ddpkit.notebook import pick_runtime

        def on_the_gpu(ctx):  # defined in __main__, like a notebook cell: needs fork
            return float(torch.ones(1, device="cuda").sum())

        if __name__ == "__main__":
            print("gpus", pick_runtime()["gpus"])
            assert not runtime.cuda_touched() and not torch.cuda.is_initialized()
            print("result", ddpkit.launch(on_the_gpu, world_size=1, backend="gloo", output="none"))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "result [1.0]" in proc.stdout


def test_fork_is_refused_once_is_available_has_run_and_an_importable_function_is_spawned(tmp_path):
    (tmp_path / "gpu_worker.py").write_text(textwrap.dedent("""
        import torch

        def on_the_gpu(ctx):
            return float(torch.ones(1, device="cuda").sum())
    """))
    proc = python("""
        import torch, ddpkit
        from ddpkit import runtime
        from gpu_worker import on_the_gpu

        def in_main(ctx):
            return 1.0

        if __name__ == "__main__":
            torch.cuda.is_available()  # initialises the CUDA driver here, although is_initialized() stays False
            print("touched", runtime.cuda_touched(), "initialized", torch.cuda.is_initialized())
            try:
                ddpkit.launch(in_main, world_size=1, output="none")
            except ValueError as exc:
                print("refused:", exc)
            print("spawned", ddpkit.launch(on_the_gpu, world_size=1, backend="gloo", output="none"))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "touched True" in proc.stdout
    assert "refused: cannot start ranks for in_main: CUDA is already initialised here" in proc.stdout
    assert "spawned [1.0]" in proc.stdout


def test_a_cuda_tensor_returned_by_a_rank_arrives_on_the_cpu_and_cuda_stays_untouched(tmp_path):
    proc = python("""
        import collections, torch, ddpkit
        from ddpkit import runtime

        Pair = collections.namedtuple("Pair", "a b")

        def returns_cuda(ctx):
            return {"pair": Pair(torch.ones(2, device="cuda"), [torch.zeros(1, device="cuda", requires_grad=True)])}

        if __name__ == "__main__":
            out = ddpkit.launch(returns_cuda, world_size=1, backend="gloo", output="none")[0]
            print("devices", out["pair"].a.device.type, out["pair"].b[0].device.type)
            print("touched", runtime.cuda_touched())
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "devices cpu cpu" in proc.stdout and "touched False" in proc.stdout


def comm_on_nccl(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.metrics import CommTimer
    from ddpkit.models import MLP
    from ddpkit.state import rng_state

    model = DDP(MLP(1024, 4096, 8).to(ctx.device), device_ids=[ctx.device.index])
    timer = CommTimer(ctx.device).register(model)
    x = torch.randn(256, 1024, device=ctx.device)
    for _ in range(3):
        timer.reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(x).sum().backward()
        end.record()
        end.synchronize()
    return {"comm_s": timer.seconds, "backward_s": start.elapsed_time(end) / 1e3, "calls": timer.calls,
            "cuda_rng_states": len(rng_state(ctx.device)["cuda"])}


def test_nccl_comm_time_is_measured_on_the_gpu_not_at_enqueue():
    from ddpkit.launch import launch

    out = launch(comm_on_nccl, world_size=1, backend="nccl", start_method="spawn", output="none")[0]
    assert out["calls"] >= 1 and 0 < out["comm_s"] <= out["backward_s"], out
    assert out["cuda_rng_states"] == 1  # this rank's device only


def test_nccl_training_smoke(tmp_path):
    path = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--world-size", "1", "--backend", "nccl",
                           "--steps", "20", "--summary-json", str(path)], capture_output=True, text=True,
                          timeout=180, cwd=REPO, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(nccl, cuda" in proc.stdout


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero1-torch", "fsdp2"])
def test_every_strategy_trains_and_resumes_exactly_on_the_gpu(tmp_path, strategy):
    """The sharded strategies and the dcp writer with CUDA tensors: a resumed run equals a whole one."""
    def train(name, *extra):
        path = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--world-size", "1", "--backend", "nccl",
                               "--model", "gpt", "--strategy", strategy, "--summary-json", str(path), *extra],
                              capture_output=True, text=True, timeout=300, cwd=REPO, env=cli_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(path.read_text())

    whole = train("whole", "--steps", "6")
    ckpt = str(tmp_path / "ckpt")
    train("first", "--steps", "3", "--checkpoint-dir", ckpt, "--checkpoint-format", "dcp")
    resumed = train("resumed", "--steps", "6", "--checkpoint-dir", ckpt, "--resume")
    assert resumed["resumed_from_step"] == 3 and resumed["param_sha256"] == whole["param_sha256"]


@pytest.mark.skipif(runtime.gpu_count() < 2, reason="needs 2 GPUs: one per rank")
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")])
def test_model_parallel_layouts_train_like_one_gpu_on_nccl(tmp_path, layout):
    """Tensor and pipeline parallelism with NCCL (point-to-point sends and receives of CUDA tensors, norms
    reduced on the GPU): the same samples and losses as one GPU."""
    def train(name, world, *extra):
        path = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--world-size", str(world), "--backend", "nccl",
                               "--model", "gpt", "--grad-accum", "2", "--steps", "6", "--summary-json", str(path), *extra],
                              capture_output=True, text=True, timeout=300, cwd=REPO, env=cli_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(path.read_text())

    one, split = train("one", 1), train("split", 2, *layout)
    assert split["dp"] == 1 and split["data_sha256"] == one["data_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(split["losses"], one["losses"])) <= 1e-4


# --------------------------------------------------------------------------- the NCCL paths the CPU tests prove by replay

NEEDS_TWO = pytest.mark.skipif(runtime.gpu_count() < 2, reason="needs 2 GPUs: one per rank")


def _nccl(fn, *args, world=2):
    from ddpkit.launch import launch

    return launch(fn, *args, world_size=world, backend="nccl", start_method="spawn", output="none", timeout=120)


@NEEDS_TWO
def test_the_pipeline_passes_activations_larger_than_nccls_buffers():
    """8 MiB activations (NCCL_BUFFSIZE is 4 MiB by default): sent one at a time, 1F1B hangs here."""
    from ddpkit import train
    from ddpkit.config import TrainConfig

    common = dict(model="gpt", d_model=1024, n_heads=8, seq_len=64, micro_batch_size=32, grad_accum=4, steps=2,
                  dataset_size=512)
    one = _nccl(train.run, TrainConfig(world_size=1, **common), world=1)[0]
    split = _nccl(train.run, TrainConfig(world_size=2, pp=2, **common))[0]
    assert split["data_sha256"] == one["data_sha256"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(split["losses"], one["losses"])) <= 1e-3


@NEEDS_TWO
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(strategy="zero1"), dict(strategy="fsdp2")])
def test_fp16_agrees_on_overflow_over_nccl_and_resumes_sharded_state_exactly(tmp_path, layout):
    from ddpkit import train
    from ddpkit.config import TrainConfig

    common = dict(model="gpt", amp="fp16", checkpoint_format="dcp", steps=6, dataset_size=512, **layout)
    whole = _nccl(train.run, TrainConfig(world_size=2, **common))[0]
    _nccl(train.run, TrainConfig(world_size=2, checkpoint_dir=str(tmp_path), **{**common, "steps": 3}))
    resumed = _nccl(train.run, TrainConfig(world_size=2, checkpoint_dir=str(tmp_path), resume=True, **common))[0]
    assert resumed["resumed_from_step"] == 3 and resumed["param_sha256"] == whole["param_sha256"]


def _helpers_on_the_gpu(ctx):
    from ddpkit.parallel import comm
    from tests.test_helper_devices import HELPERS, audited

    out = {name: audited(ctx, helper, *args) for name, (helper, *args) in HELPERS.items()}
    out["ring_max_diff"] = max(row["max_diff"] for row in comm.check_ring(ctx, [5, 4096]))
    out["collectives"] = comm.show_collectives(ctx, 6)
    return out


@NEEDS_TWO
def test_the_notebooks_helpers_run_on_nccl_with_every_tensor_on_the_gpu():
    for rank in _nccl(_helpers_on_the_gpu):
        assert all(rank[name] == [] for name in ("show_collectives", "check_ring", "split_linear_demo",
                                                  "check_against_unsplit", "check_against_dtensor", "run_pipeline"))
        assert rank["ring_max_diff"] <= 1e-3 and rank["collectives"]["all_reduce"] == [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]


def _snapshot_on_the_gpu(ctx):
    import torch

    from ddpkit import sharded_checkpoint
    from ddpkit.config import TrainConfig
    from ddpkit.parallel.chunks import Chunked
    from ddpkit.train import Trainer

    trainer = Trainer(ctx, TrainConfig(world_size=2, strategy="fsdp2", steps=1))
    trainer.prepare()
    trainer.run_step()
    model_state, _ = trainer.strategy.sharded_state_dicts(trainer.model, trainer.optimizer)
    snap = sharded_checkpoint._snapshot(model_state)
    torch.cuda.synchronize()
    return [(type(v) is Chunked, [(p.device.type, p.is_pinned()) for _, p in v.pieces]) for v in snap.values()]


@NEEDS_TWO
def test_the_async_snapshot_of_gpu_state_is_a_copy_to_page_locked_host_memory():
    for rank in _nccl(_snapshot_on_the_gpu):
        assert all(chunked and pieces == [("cpu", True)] for chunked, pieces in rank)
