import pytest
import torch

from spmd_rlhf.runtime import Dispatch, PayloadError, Worker, data_parallel, dispatch_mode, one_to_all, rank_zero
from spmd_rlhf.runtime.payload import MAX_TENSOR_BYTES, dumps


class Role(Worker):
    @one_to_all
    def load(self):
        return "loaded"

    @data_parallel
    def compute(self, batch):
        return batch

    @rank_zero
    def save(self):
        return None

    def helper(self):
        return None


def test_decorators_record_the_mode_and_leave_the_function_alone():
    assert dispatch_mode(Role, "load") is Dispatch.ONE_TO_ALL
    assert dispatch_mode(Role, "compute") is Dispatch.DATA_PARALLEL
    assert dispatch_mode(Role, "save") is Dispatch.RANK_ZERO
    assert Role.load(None) == "loaded"
    assert Role.__dict__["compute"].__name__ == "compute"


def test_undecorated_or_missing_methods_name_the_fix():
    with pytest.raises(AttributeError, match="decorate it with @one_to_all"):
        dispatch_mode(Role, "helper")
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        dispatch_mode(Role, "nope")


def test_control_messages_refuse_large_tensors():
    small = torch.zeros(MAX_TENSOR_BYTES // 4)
    assert len(dumps({"x": small}, what="a call")) > MAX_TENSOR_BYTES
    with pytest.raises(PayloadError, match=r"a call carries a tensor of shape \[2000\]"):
        dumps({"nested": [torch.zeros(2000)]}, what="a call")
