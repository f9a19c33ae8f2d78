from llmesh.engine.hardware import parse_cpu_model, parse_meminfo, probe, replica_gpus

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""
MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
"""


def test_cpu_model_and_memory_are_read_from_proc_formats():
    assert parse_cpu_model(CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert parse_cpu_model("") == "unknown"
    assert parse_meminfo(MEMINFO) == (24576000 * 1024, 20000000 * 1024)


def test_probe_describes_this_machine_without_a_gpu_library():
    hw = probe()
    assert hw.cpu_cores >= 1 and hw.memory_total_bytes > hw.memory_available_bytes > 0
    assert hw.gpus == ()  # nvidia-ml-py is not installed here (the `gpu` extra)


def test_only_vllm_on_gpus_fixes_the_gpus_a_replica_spans():
    assert replica_gpus("vllm", 4, gpus_here=8) == 4
    assert replica_gpus("vllm", 1, gpus_here=0) == 0  # vLLM's CPU build: the ask decides
    assert replica_gpus("llamacpp", 2, gpus_here=8) == 0 and replica_gpus("sim", 2, gpus_here=0) == 0
