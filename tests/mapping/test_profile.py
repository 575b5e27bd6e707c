"""Device profiles: built-ins, files written by calibrate, and clear errors."""

from __future__ import annotations

import json

import pytest

from spmd_rlhf.mapping.calibrate import calibrate, measure_link
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES, DeviceProfile, load_profile


def test_builtin_profiles_by_name():
    assert load_profile("H100") is BUILTIN_PROFILES["h100"]
    assert BUILTIN_PROFILES["a100"].flops < BUILTIN_PROFILES["h100"].flops


def test_a_saved_profile_loads_back(tmp_path):
    path = tmp_path / "profile.json"
    BUILTIN_PROFILES["a100"].save(path)
    assert load_profile(path) == BUILTIN_PROFILES["a100"]
    fields = json.loads(path.read_text())
    fields["peak_tflops"] = 1
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="unknown keys \\['peak_tflops'\\]"):
        load_profile(path)


def test_missing_profiles_and_bad_numbers_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="spmd-rlhf calibrate"):
        load_profile(tmp_path / "none.json")
    with pytest.raises(ValueError, match="peak_flops=0 must be > 0"):
        DeviceProfile(
            name="x",
            peak_flops=0,
            memory_bandwidth=1,
            intra_node_bandwidth=1,
            inter_node_bandwidth=1,
            device_memory=1,
            collective_latency=0,
            op_latency=0,
        )


def test_calibrate_measures_this_machine():
    profile = calibrate(quick=True)
    assert profile.name == "cpu" and profile.source.startswith("calibrated on")
    assert 1e8 < profile.peak_flops < 1e13 and profile.memory_bandwidth > 1e8
    assert profile.intra_node_bandwidth > 1e6 and 0 < profile.collective_latency < 0.1 and 0 < profile.op_latency < 1e-3
    assert profile.compute_efficiency == profile.bandwidth_efficiency == 1.0


def test_link_measurement_moves_real_bytes():
    bandwidth, latency = measure_link(backend="gloo", num_bytes=2**20)
    assert bandwidth > 1e6 and latency > 0
