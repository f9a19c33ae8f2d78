"""The autoscaler on plain inputs: queue depth and waiting time scale up, idle time
scales to zero, cooldowns hold scale-downs back, bounds always hold; the demand book
adds up what gateways hold and forgets gateways that went quiet."""

import pytest
from pydantic import ValidationError

from llmesh.liveconfig.schema import Autoscale, MeshConfig
from llmesh.scheduler.autoscale import Autoscaler, DemandBook, ModelLoad, model_loads
from llmesh.scheduler.table import EndpointState, Load

POLICY = Autoscale(min_replicas=0, max_replicas=4, waiting_per_replica=5, max_wait_s=10, idle_s=60, cooldown_s=30)


def test_seed_defaults_are_the_issue_s():
    p = Autoscale()
    assert (p.waiting_per_replica, p.idle_s, p.cooldown_s, p.min_replicas) == (5, 600, 300, 0)
    assert MeshConfig().autoscaling.models == {}


def test_bad_bounds_are_refused():
    with pytest.raises(ValidationError, match="above max_replicas"):
        Autoscale(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError):
        Autoscale(waiting_per_replica=0)


def test_one_held_request_scales_from_zero_at_once():
    a = Autoscaler()
    assert a.decide("m", POLICY, ModelLoad(), 0).desired == 0
    d = a.decide("m", POLICY, ModelLoad(waiting=1, oldest_wait_s=0.1), 1)
    assert (d.desired, d.reason) == (1, "up")


def test_more_than_five_waiting_per_replica_scales_up_to_the_queue_s_need():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(ready=1, running=2), 0)
    assert a.decide("m", POLICY, ModelLoad(ready=1, running=2, waiting=5), 1).desired == 1   # 5 is not more than 5
    assert a.decide("m", POLICY, ModelLoad(ready=1, running=2, waiting=6), 2).desired == 2
    # replicas still starting count: the same queue asks for no more
    assert a.decide("m", POLICY, ModelLoad(ready=1, running=2, waiting=8), 3).desired == 2
    assert a.decide("m", POLICY, ModelLoad(ready=1, running=2, waiting=16), 4).desired == 4   # ceil(16/5)
    d = a.decide("m", POLICY, ModelLoad(ready=1, running=2, waiting=100), 5)
    assert d.desired == 4                                                                    # max_replicas


def test_a_request_held_too_long_adds_one_replica_per_max_wait():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(waiting=1), 0)                                  # 1, starting
    assert a.decide("m", POLICY, ModelLoad(waiting=1, oldest_wait_s=9), 9).desired == 1
    d = a.decide("m", POLICY, ModelLoad(waiting=1, oldest_wait_s=11), 11)
    assert (d.desired, d.reason) == (2, "waiting_time")
    assert a.decide("m", POLICY, ModelLoad(waiting=1, oldest_wait_s=15), 15).desired == 2    # paced
    assert a.decide("m", POLICY, ModelLoad(waiting=1, oldest_wait_s=22), 22).desired == 3


def test_idle_time_scales_to_zero_only_after_idle_and_cooldown():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(waiting=1), 0)                     # up to 1 at t=0
    a.decide("m", POLICY, ModelLoad(ready=1, running=1), 5)            # busy until t=5
    assert a.decide("m", POLICY, ModelLoad(ready=1), 64).desired == 1  # idle 59 s
    d = a.decide("m", POLICY, ModelLoad(ready=1), 66)
    assert (d.desired, d.reason) == (0, "idle")
    # and a new request brings it back without waiting for any cooldown
    assert a.decide("m", POLICY, ModelLoad(waiting=1), 67).desired == 1


def test_cooldown_holds_a_scale_down_back():
    p = POLICY.model_copy(update={"idle_s": 1, "cooldown_s": 30})
    a = Autoscaler()
    a.decide("m", p, ModelLoad(waiting=1), 0)
    assert a.decide("m", p, ModelLoad(ready=1), 10).desired == 1       # idle 10 s, but 10 s after a change
    assert a.decide("m", p, ModelLoad(ready=1), 30).desired == 0


def test_spare_replicas_go_after_the_cooldown_but_not_while_others_start():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(ready=1, running=1, waiting=20), 0)           # -> 4
    assert a.decide("m", POLICY, ModelLoad(ready=2, busy=1, running=1), 40).desired == 4  # 2 still starting
    d = a.decide("m", POLICY, ModelLoad(ready=4, busy=2, running=3, waiting=1), 41)
    assert (d.desired, d.reason) == (2, "spare")
    assert a.decide("m", POLICY, ModelLoad(ready=2, busy=1, running=1), 42).desired == 2  # cooldown again


def test_bounds_follow_the_live_policy():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(ready=3, running=3), 0)
    d = a.decide("m", POLICY.model_copy(update={"max_replicas": 2}), ModelLoad(ready=3, running=3), 1)
    assert (d.desired, d.reason) == (2, "bounds")
    d = a.decide("m", POLICY.model_copy(update={"min_replicas": 3}), ModelLoad(ready=2), 2)
    assert d.desired == 3
    a.forget(set())
    assert a.decide("m", POLICY, ModelLoad(ready=1), 3).desired == 1  # forgotten: starts from what runs


def test_demand_book_sums_gateways_and_forgets_quiet_ones():
    book = DemandBook(ttl_s=3)
    book.report("gw-a", {"m": (2, 1.0)}, 10)
    book.report("gw-b", {"m": (1, 4.0), "n": (0, 0.0)}, 11)
    assert book.held(12) == {"m": (3, 5.0)}        # gw-b's oldest has waited 4 s + 1 s since
    book.report("gw-a", {}, 13)                     # gw-a's requests got answered
    assert book.held(13) == {"m": (1, 6.0)}
    assert book.held(15) == {}                      # gw-b said nothing for 4 s


def test_model_loads_count_healthy_replicas_and_add_held_requests():
    eps = [EndpointState("e1", "a:1", "sim", ("m",), Load(running=2, waiting=3)),
           EndpointState("e2", "a:2", "sim", ("m", "x"), Load()),
           EndpointState("e3", "a:3", "sim", ("m",), Load(running=1), healthy=False),
           EndpointState("e4", "a:4", "sim", ("m",), Load(), degraded="self-test failed")]
    loads = model_loads(eps, {"m": (4, 2.5), "z": (1, 1.0)}, {"m", "z"})
    assert loads["m"] == ModelLoad(ready=2, busy=1, running=2, waiting=7, oldest_wait_s=2.5)
    assert loads["z"] == ModelLoad(waiting=1, oldest_wait_s=1.0)


def test_a_lull_shorter_than_the_cooldown_removes_nothing():
    a = Autoscaler()
    a.decide("m", POLICY, ModelLoad(ready=1, running=1, waiting=20), 0)                    # -> 4
    a.decide("m", POLICY, ModelLoad(ready=4, busy=4, running=8), 20)                       # needs all 4
    assert a.decide("m", POLICY, ModelLoad(ready=4, busy=1, running=1), 31).desired == 4   # 11 s of lull
    d = a.decide("m", POLICY, ModelLoad(ready=4, busy=1, running=1), 51)                   # 31 s of it
    assert (d.desired, d.reason) == (1, "spare")


def test_llmesh_up_autoscale_flag(capsys, tmp_path):
    from llmesh.cli.main import main, parse_autoscale

    assert parse_autoscale(["sim-small=sim", "smollm2-135m-instruct=llamacpp"]) == {
        "sim-small": "sim", "smollm2-135m-instruct": "llamacpp"}
    for bad, why in (("sim-small", "MODEL=BACKEND"), ("sim-small=vllm", "MODEL=BACKEND"),
                     ("=sim", "MODEL=BACKEND"), ("qwen=sim", "starts with 'sim'")):
        with pytest.raises(ValueError, match=why):
            parse_autoscale([bad])
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--engines", "", "--autoscale", "qwen=sim", "--log-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "starts with 'sim'" in capsys.readouterr().err
