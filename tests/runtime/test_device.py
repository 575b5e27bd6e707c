"""Device choice and thread binding: trainer.device picks the device and backend; a thread whose current CUDA
device is not its rank's fails loudly, naming itself (the query is injected, so this runs without a GPU)."""

import threading

import pytest
import torch

from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.device import check_thread, select_device, steady_attention_kernels, thread_device_mismatch
from spmd_rlhf.runtime.worker import RoleContext, Worker


@pytest.mark.parametrize(
    "setting, cuda_devices, expected",
    [
        ("cpu", 8, ("cpu", "gloo")),  # cpu on a GPU machine stays on the host
        ("cpu", 0, ("cpu", "gloo")),
        ("auto", 0, ("cpu", "gloo")),
        ("auto", 8, ("cuda:3", "cpu:gloo,cuda:nccl")),
        ("cuda", 8, ("cuda:3", "cpu:gloo,cuda:nccl")),
    ],
)
def test_select_device(setting, cuda_devices, expected):
    device, backend = select_device(setting, local_rank=3, cuda_devices=cuda_devices)
    assert (str(device), backend) == expected


def test_cuda_without_cuda_and_too_few_gpus_are_clear_errors():
    with pytest.raises(
        ValueError, match="trainer.device=cuda but this machine has no usable CUDA device.*trainer.device=cpu"
    ):
        select_device("cuda", local_rank=0, cuda_devices=0)
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but only 4 CUDA devices.*--nproc-per-node 4"):
        select_device("auto", local_rank=4, cuda_devices=4)
    with pytest.raises(ValueError, match="trainer.device=gpu"):
        select_device("gpu", local_rank=0, cuda_devices=1)


def test_mismatch_names_the_thread_and_the_devices():
    assert thread_device_mismatch(torch.device("cuda", 2), 2, "t") is None
    assert thread_device_mismatch(torch.device("cpu"), 0, "t") is None
    message = thread_device_mismatch(torch.device("cuda", 2), 0, "spmd-executor-rank2")
    assert "'spmd-executor-rank2' is on cuda:0 but this rank works on cuda:2" in message
    assert "bind_thread('cuda:2')" in message


def test_check_thread_raises_on_an_unbound_thread():
    check_thread(torch.device("cuda", 1), current_index=lambda: 1)
    check_thread(torch.device("cpu"), current_index=lambda: 5)  # a CPU rank never queries CUDA
    errors = []

    def unbound():
        try:
            check_thread(torch.device("cuda", 1), current_index=lambda: 0)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=unbound, name="reward-scorer")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "thread 'reward-scorer' is on cuda:0 but this rank works on cuda:1" in errors[0]


def test_role_code_checks_its_thread(monkeypatch):
    """Every role (Worker.__init__) checks the thread it is built on; the check queries CUDA's current device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    context = RoleContext("actor", ParallelDims(), (0,), 0, mesh=None, device=torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="is on cuda:0 but this rank works on cuda:1"):
        Worker(context)
    Worker(RoleContext("actor", ParallelDims(), (0,), 0, mesh=None, device=torch.device("cpu")))


def test_cuda_ranks_keep_sdpa_off_cudnn_which_plans_every_new_shape():
    """A CUDA rank turns cuDNN's SDPA off (a plan built for every new packed shape); a CPU rank leaves it."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        steady_attention_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        steady_attention_kernels(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
