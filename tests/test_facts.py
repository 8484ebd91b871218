"""What the lessons say about PyTorch, checked against the installed torch, and the wrong wording kept out.

Each test states one fact a notebook, the README or a docstring teaches, with the source it comes from,
and checks it against this torch (on real ranks where the fact is about ranks). If a torch release
changes the fact, the test fails and the sentence must be revisited. The last tests grep the kit's
text for sentences that were wrong, so they cannot come back.
"""

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit import checkpoint, launch

REPO = Path(__file__).resolve().parents[1]


def _sampler_defaults(ctx):
    sampler = DistributedSampler(range(10))
    return sampler.num_replicas, sampler.rank


def test_distributed_sampler_reads_world_size_and_rank_from_the_group():
    """02: left at their defaults, num_replicas and rank come from the process group."""
    assert launch(_sampler_defaults, world_size=2, output="none") == [(2, 0), (2, 1)]


def test_drop_last_false_pads_with_repeated_samples():
    """02: an evaluation sampler hands out more ids than samples; the extra ones are repeats."""
    ids = [i for rank in range(2) for i in DistributedSampler(range(11), num_replicas=2, rank=rank)]
    assert len(ids) == 12 and set(ids) == set(range(11))
    dropped = [i for rank in range(2) for i in DistributedSampler(range(11), num_replicas=2, rank=rank, drop_last=True)]
    assert len(dropped) == 10 and len(set(dropped)) == 10  # the negative control: no padding, no repeats


def test_the_dataloader_never_calls_set_epoch():
    """02: iterating a DataLoader leaves the sampler's epoch alone; only the loop advances it."""
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    loader = DataLoader(range(8), batch_size=None, sampler=sampler)
    orders = [list(loader) for _ in range(2)]
    assert sampler.epoch == 0 and orders[0] == orders[1]
    sampler.set_epoch(1)
    assert list(loader) != orders[0]


def _ddp_buffer_warning(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(torch.nn.BatchNorm1d(2), broadcast_buffers=True)
    return [str(w.category.__name__) + ": " + str(w.message) for w in caught]


def test_broadcast_buffers_is_deprecated_where_forward_sync_buffers_exists():
    """03: torch 2.13 renames the switch; the old name warns."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    has_new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    caught = launch(_ddp_buffer_warning, world_size=1, output="none")[0]
    assert has_new_name == any("FutureWarning" in w and "forward_sync_buffers" in w for w in caught)


def test_autocast_keeps_weights_and_gradients_in_fp32():
    """03, 05: autocast casts per matmul; the parameters, their gradients and Adam's state stay fp32."""
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 8))
    out.float().sum().backward()
    optimizer.step()
    assert out.dtype == torch.bfloat16
    held = [*model.parameters(), *(p.grad for p in model.parameters()),
            *(t for s in optimizer.state.values() for k, t in s.items() if k != "step")]
    assert {t.dtype for t in held} == {torch.float32}


def test_fp16_rounds_to_zero_at_half_the_smallest_subnormal():
    """05: 2^-24 is fp16's smallest subnormal, 2^-14 its smallest normal; 2^-25 rounds (to even) to 0."""
    as_fp16 = lambda v: torch.tensor(v).to(torch.float16).item()
    assert as_fp16(2.0**-24) == 2.0**-24 and as_fp16(2.0**-25) == 0.0 and as_fp16(1.01 * 2.0**-25) == 2.0**-24
    assert torch.finfo(torch.float16).tiny == 2.0**-14


def test_ddp_divides_before_it_sums():
    """04: DDP's reference hook divides by the world size first, and says why."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    source = inspect.getsource(default_hooks._allreduce_fut)
    assert "avoid overflow" in source and source.index("div_") < source.index("all_reduce(")


def test_torchrun_sets_one_omp_thread_only_for_several_processes_per_node():
    """04, README: torchrun sets OMP_NUM_THREADS=1 only when it is unset and nproc-per-node > 1."""
    import torch.distributed.run as run

    assert re.search(r'"OMP_NUM_THREADS" not in os\.environ and nproc_per_node > 1', inspect.getsource(run))


def test_torchrun_workers_are_clients_of_the_agents_store():
    """04: under TORCHELASTIC_USE_AGENT_STORE=True every rank, rank 0 included, is a TCPStore client (newer
    torch adds: when the store asked for is the agent's own MASTER_ADDR:MASTER_PORT, as under torchrun)."""
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package re-exports a function of that name
    source = inspect.getsource(rendezvous._create_c10d_store)
    condition = next(c for c in ("if _torchelastic_use_agent_store()", "if _agent_store_serves(") if c in source)
    agent_branch = source[source.index(condition):source.index("else:")]
    # is_master by name, or (older torch) as TCPStore's fourth positional argument
    assert "is_master=False" in agent_branch or re.search(r"TCPStore\(\s*\w+,\s*\w+,\s*\w+,\s*False,", agent_branch)
    if "_agent_store_serves" in condition:
        serves = inspect.getsource(rendezvous._agent_store_serves)
        assert "_torchelastic_use_agent_store()" in serves and '"MASTER_PORT"' in serves


def test_default_collective_timeouts_are_10_minutes_on_nccl_and_30_elsewhere():
    """04, 08, README: the defaults a hang waits for."""
    from datetime import timedelta

    from torch.distributed import constants

    assert constants.default_pg_timeout == timedelta(minutes=30)
    assert "Default value is 10 minutes for NCCL and 30 minutes for other backends" in inspect.getdoc(dist.init_process_group)


def test_bf16_below_compute_capability_8_counts_as_emulated():
    """05: is_bf16_supported(including_emulation=False) checks the capability's major number against 8."""
    source = inspect.getsource(torch.cuda.is_bf16_supported)
    assert "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    assert ".major >= 8" in source


def test_tf32_is_off_by_default_and_one_switch_with_allow_tf32():
    """05: 'highest' (the default) forbids TF32 on CUDA; 'high' allows it."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert torch.backends.cuda.matmul.allow_tf32
        torch.set_float32_matmul_precision("highest")
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)
    assert before == "highest"


@pytest.mark.parametrize("version, expected", [("2.4.1", 2), ("2.5.1+cu121", 2), ("2.6.0", 1), ("2.9.1", 1),
                                               ("2.10.0", 0), ("2.13.0+cpu", 0)])
def test_weights_only_advisories_cover_the_supported_range(version, expected):
    """checkpoint.py: GHSA-53q9-r3pm-6pq6 (torch <= 2.5.1) and GHSA-63cw-57p8-fm3p (torch < 2.10)."""
    assert len(checkpoint.weights_only_advisories(version)) == expected


def test_loading_under_a_torch_with_an_advisory_warns_once_in_one_line(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {"w": torch.ones(2)})
    path = checkpoint.latest_good(tmp_path)
    for version, warns in (("2.13.0", False), ("2.5.1", True)):  # the negative control first: no advisory, no warning
        monkeypatch.setattr(torch, "__version__", version)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(checkpoint.load(path)["w"], torch.ones(2))
        lines = [str(w.message) for w in caught if "advisor" in str(w.message)]
        assert bool(lines) == warns and all("\n" not in line for line in lines)


# ------------------------------------------------------------------ wording that was wrong, kept out

WRONG = {  # a phrase that was written, and why it is wrong
    "a classic slip: `num_replicas` left at its default": "DistributedSampler defaults to the group's world size",
    "at the start of every forward": "buffers sync only after a syncing training forward",
    "rank 0's buffers again at every forward": "buffers sync only after a syncing training forward",
    "2 + 2 + 12 with the fp32 master copy": "autocast keeps fp32 weights: 4 + 4 + 8, no master copy",
    "until torch 2.7 added it": "gloo's ReduceOp.AVG came after the 2.7 branch cut (torch 2.8)",
    "so it works on every backend": "torch divides first to avoid fp16 overflow",
    "a small key-value server run by rank 0": "under torchrun the agent hosts the store",
    "a rank that has not chosen one uses `cuda:0`": "collectives use the tensor's device, barrier device_id",
    "unless you set `OMP_NUM_THREADS`, as torchrun does": "torchrun sets it only for nproc-per-node > 1",
    "or torchrun, which does the same": "torchrun sets it only for nproc-per-node > 1",
    "the update shrinks by the scale factor": "true for SGD, not for AdamW",
    "values below about 6e-8 flush to zero": "fp16 rounds to nearest: at or below 2^-25 becomes 0",
    "A T4 runs bf16 autocast without them": "below capability 8.0 bf16 is emulated",
    "no copy in or out": "with set_to_none=True each gradient is copied into its bucket every step",
    "waiting for a peer that no longer exists": "on gloo the survivor fails at once",
    "not PyTorch's 30 minutes": "NCCL's default is 10 minutes",
    "so a malicious checkpoint cannot run code": "weights_only=True had code-execution advisories",
    "PyTorch's default is 30 minutes": "NCCL's default is 10 minutes",
    "or torchrun, which sets 1 too": "torchrun sets it only for nproc-per-node > 1",
    # lessons 09-16 and their library code, against the ZeRO, Megatron and GPipe papers, NCCL's and torch's docs
    "the summed gradients, then divided by N": "DDP divides each bucket by N before the all-reduce",
    "barely grows from 8 to 64": "past one node a flat ring runs at the inter-node link's pace",
    "(compute time and gradient bytes, measured below": "that compute was synthetic; say what is measured",
    "ZeRO-1 from 3 GPUs": "the calculator: 14 + 14 + 84/2 = 70 GB fits on 2 GPUs of 80 GB",
    "the ZeRO paper's accounting)": "the paper's K = 12 is for fp16 mixed precision; bf16 has the same sizes",
    "bf16 mixed, fp32 master (ZeRO paper)": "the paper's K = 12 is for fp16 mixed precision; bf16 has the same sizes",
    "**bitwise** DDP's: the tests prove it": "bitwise only with gradient clipping off",
    "At 2 ranks they are bitwise equal here": "bitwise only with gradient clipping off",
    "only one block's full parameters are alive at a time": "the root stays unsharded after forward; prefetch unshards the next block",
    "nothing to overlap with": "Megatron overlaps the input-gradient all-reduce with the weight-gradient GEMM",
    "GPipe keeps all m micro-batches' activations": "GPipe as published re-materialises: it keeps boundary activations",
    "GPipe runs all m forwards before any backward, so every stage holds the activations of all m":
        "GPipe as published re-materialises: it keeps boundary activations",
    "NCCL's asynchronous P2P keeps": "NCCL send/recv is asynchronous to the host only; on the GPU it is a rendezvous",
    "about 1.1 nats": "the chain's entropy is measured at 1.418 nats",
    "block in the next collective until the timeout": "on gloo the peers fail at once with a closed connection",
    "on the critical path: the next matmul needs the result": "Megatron hides the input-gradient all-reduce",
    "gloo's large sends": "a gloo send of any size waits for its posted receive",
    "10-100x slower than NVLink": "per GPU on DGX-class nodes the inter-node link is about 6-12x slower",
    "a ring sends one way": "a ring rank sends and receives at once; its send rate bounds it",
    "and none in forward": "FSDP2 prefetches implicitly in forward (the next gather issued after the current kernels)",
    "in forward it prefetches nothing": "FSDP2 prefetches implicitly in forward (the next gather issued after the current kernels)",
    "rounds of at most": "torch's rounds are max(1, m // p), each of at least p micro-batches",
    "Kubernetes signal every process": "Kubernetes signals each container's main process only",
}


def _kit_text() -> dict[str, str]:
    import nbformat

    texts = {"README.md": (REPO / "README.md").read_text()}
    for path in sorted([*(REPO / "notebooks").glob("*.ipynb"), *(REPO / "exercises").rglob("*.ipynb")]):
        texts[str(path.relative_to(REPO))] = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    texts["exercises/README.md"] = (REPO / "exercises" / "README.md").read_text()
    for path in sorted((REPO / "ddpkit").rglob("*.py")):
        texts[str(path.relative_to(REPO))] = path.read_text()
    return texts


def test_corrected_wording_does_not_come_back():
    found = [(name, phrase, why) for name, text in _kit_text().items() for phrase, why in WRONG.items() if phrase in text]
    assert not found, found


def test_torchruns_agent_logs_the_failed_worker_it_noticed():
    """14, recovery.py: torchrun's detection time is read from its agent's log: the survivors' SIGTERM or the
    failure it reports, both logged by the code that polls the workers every monitor_interval (0.1 s)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import api

    from ddpkit import recovery

    source = inspect.getsource(api)
    assert '"Sending process %s closing signal %s"' in source and '"failed (exitcode: %s)' in source
    assert inspect.signature(WorkerSpec).parameters["monitor_interval"].default == 0.1
    line = "W1128 20:10:14.882000 9806 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 10012 closing signal SIGTERM"
    import time as clock

    fault = clock.mktime(clock.strptime(f"{clock.localtime().tm_year}1128 20:10:14", "%Y%m%d %H:%M:%S")) + 0.8
    assert abs(recovery.agent_detection_time("noise\n" + line, fault) - (fault + 0.0825)) < 1e-6
    assert recovery.agent_detection_time(line, fault + 1.0) is None  # a line from before the fault is not its detection
    # torch writes the file relative to a sys.path entry: from a folder that holds the venv, with its prefix
    prefixed = line.replace(" torch/", " .venv/lib/python3.11/site-packages/torch/")
    assert abs(recovery.agent_detection_time(prefixed, fault) - (fault + 0.0825)) < 1e-6
    assert recovery.agent_detection_time(prefixed.replace("elastic", "elastik"), fault) is None


def test_each_notebooks_stated_run_time_is_its_soaks():
    """Each notebook's "the cells run in about N s" is the longest run of its soak (benchmarks/notebook_soak.py,
    beside busy processes), rounded up to 5 s: neither a hope nor a stale number."""
    import json
    import math

    soak = json.loads((REPO / "benchmarks" / "results" / "notebook_soak.json").read_text())["summary"]
    stated = {}
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        intro = "".join(json.loads(path.read_text())["cells"][0]["source"])
        found = re.search(r"the cells run in about (\d+) s on 2 CPU cores kept busy by other work", intro)
        if found:
            stated[path.stem] = int(found.group(1))
    assert len(stated) >= 20, sorted(stated)  # 22 says "under a minute" in words of its own
    for name, seconds in stated.items():
        assert seconds == 5 * math.ceil(soak[name]["max_wall_s"] / 5), (name, seconds, soak[name]["max_wall_s"])
