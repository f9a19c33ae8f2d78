"""The scheduler keeps each engine's hardware profile and self-test as domain values
(llmesh.types), converted at the servicer; an unchanged profile is not converted again."""

from llmesh.convert import hardware_from_pb, hardware_to_pb, self_test_from_pb, self_test_to_pb
from llmesh.types import Gpu, Hardware, SelfTest
from llmesh.v1 import scheduler_pb2
from llmesh.scheduler.placement import node_of
from llmesh.scheduler.servicer import HardwareForms, state_from_report
from llmesh.scheduler.table import EndpointState, Load

GIB = 2**30
H100 = Gpu("H100", 80 * GIB, 30 * GIB, 2, 1, "550.54")
NODE = Hardware("EPYC", 64, 512 * GIB, 400 * GIB, (H100, H100))


def test_hardware_and_self_test_survive_the_round_trip():
    assert hardware_from_pb(hardware_to_pb(NODE)) == NODE
    pb = hardware_to_pb(NODE)
    assert pb.gpus[0].ecc_errors_corrected == 2 and pb.gpus[0].ecc_errors_uncorrected == 1
    test = SelfTest(ok=False, detail="NaN logits", checked_unix=1.5, latency_ms=20.0)
    assert self_test_from_pb(self_test_to_pb(test)) == test


def test_a_report_becomes_a_typed_state_and_a_placement_node():
    report = scheduler_pb2.EngineReport(endpoint_id="e1", address="a:1", backend="vllm", models=["m"],
                                        hardware=hardware_to_pb(NODE),
                                        self_test=scheduler_pb2.SelfTest(ok=True, checked_unix=1.0, latency_ms=9))
    report.load.running, report.load.waiting = 2, 1
    forms = HardwareForms()
    state = state_from_report(report, 10.0, forms.domain("e1", report.hardware))
    assert state.hardware == NODE and state.self_test == SelfTest(True, "", 1.0, 9.0)
    assert state.signals.ecc_errors == 6 and state.signals.latency_ms == 9
    assert node_of(state).gpu_free_bytes == (50 * GIB, 50 * GIB) and node_of(state).load == 3
    assert node_of(EndpointState("e2", "a:2", "sim", ("m",), Load())) is None  # no hardware reported yet


def test_an_unchanged_profile_is_converted_once_each_way():
    forms = HardwareForms()
    first = forms.domain("e1", hardware_to_pb(NODE))
    again = forms.domain("e1", hardware_to_pb(NODE))
    assert again is first and forms.pb("e1", first) == hardware_to_pb(NODE)
    assert forms.pb("e1", first) is forms.pb("e1", again)
    changed = Hardware("EPYC", 64, 512 * GIB, 300 * GIB, (H100,))
    assert forms.domain("e1", hardware_to_pb(changed)) == changed
    forms.forget("e1")
    assert forms.pb("e1", first) == hardware_to_pb(NODE)  # converted anew once forgotten
